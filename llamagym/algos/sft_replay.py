"""The SFT warm-start replay buffer: the best episodes by return, plus demonstrations, to imitate after updates.

Self-imitation (Oh et al. 2018) in its simplest form: after each PPO update the trainer takes a few supervised
steps on assistant tokens sampled from here. Demonstrations (JSONL or a scripted expert) are kept apart and
never evicted.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from ..config import ReplayConfig
from .ppo import masked_mean
from .rollout import Episode, Turn


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the masked (assistant) tokens: cross-entropy on the reply only.

    Args:
        logprobs: (B, L) log-probs of the actual tokens.
        mask: (B, L) 1 on assistant tokens, 0 on system/user/template/padding tokens.
    """
    return -masked_mean(logprobs, mask)


class SFTReplayBuffer:
    """Keeps the top `top_fraction` of each batch's episodes (FIFO up to `capacity`) and all demonstrations."""

    def __init__(self, config: ReplayConfig | None = None):
        self.config = config or ReplayConfig()
        self.episodes: deque[Episode] = deque(maxlen=self.config.capacity)
        self.demos: list[Episode] = []

    def __len__(self) -> int:
        return len(self.episodes) + len(self.demos)

    def add_batch(self, episodes: list[Episode]) -> int:
        """Add the best episodes of a batch; returns how many entered."""
        ranked = sorted((e for e in episodes if e.turns), key=lambda e: e.env_return, reverse=True)
        keep = ranked[: max(1, math.ceil(self.config.top_fraction * len(ranked)))] if ranked else []
        if self.config.min_return is not None:
            keep = [e for e in keep if e.env_return >= self.config.min_return]
        self.episodes.extend(keep)
        return len(keep)

    def add_demo(self, episode: Episode) -> None:
        """Add a demonstration episode (kept for the whole run)."""
        if not episode.turns:
            raise ValueError("A demonstration episode needs at least one assistant turn.")
        episode.is_demo = True
        self.demos.append(episode)

    def sample_turns(self, n: int, generator: torch.Generator, skip_cut: bool = True) -> list[Turn]:
        """`n` assistant turns drawn uniformly with replacement; `demo_fraction` of them from demonstrations.

        The agent's own turns whose reply named no valid action are never drawn: a good episode may hold one (its
        fallback action happened to pay), and imitating it teaches the model to reply in a form that cannot be read.
        Nor, with `skip_cut`, are generated replies cut at `max_new_tokens` (`Turn.finished`): imitating one teaches
        the model to go on past its answer, never to end the reply.
        """
        own = [t for episode in self.episodes for t in episode.turns if t.valid and (t.finished or not skip_cut)]
        demos = [turn for episode in self.demos for turn in episode.turns]
        if not own and not demos:
            return []
        n_demo = n if not own else (round(self.config.demo_fraction * n) if demos else 0)
        picks = []
        for pool, count in ((demos, n_demo), (own, n - n_demo)):
            if count:
                picks += [pool[i] for i in torch.randint(len(pool), (count,), generator=generator).tolist()]
        return picks

    def state_dict(self) -> dict:
        return {"episodes": list(self.episodes), "demos": list(self.demos)}

    def load_state_dict(self, state: dict) -> None:
        self.episodes = deque(state["episodes"], maxlen=self.config.capacity)
        self.demos = list(state["demos"])
