"""Turns and episodes, and their padded tensors: the seam between the agent (prompts) and the trainer (losses).

The agent records a `Turn` per action with the exact token ids the model saw and produced; the trainer never
sees a prompt string. `collate` right-pads turns into one batch whose response mask covers exactly the reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .modes import ActionMode


@dataclass
class Turn:
    """One action: the prompt the model saw, the reply it produced and the reward that followed.

    In scoring mode `candidates` holds the token ids of every valid reply, `choice` the sampled one, and
    `response_ids` is `candidates[choice]` (so supervised replay trains the chosen reply like any other). `mode`
    names the action mode that took the turn, which the trainer asks to collate and evaluate it.
    """

    prompt_ids: list[int]  # chat-template token ids ending with the assistant header
    response_ids: list[int]  # the sampled reply tokens (including the end-of-turn token when produced)
    reward: float = 0.0  # env reward summed over assign_reward calls (plus any format penalty)
    valid: bool = True  # False when the reply could not be parsed and the fallback action was used
    candidates: list[list[int]] | None = None  # scoring mode: token ids of each candidate reply
    choice: int | None = None  # scoring mode: index of the chosen candidate
    mode: str | None = None  # the action mode that took it (`modes.MODES`); None: told apart by `candidates`
    finished: bool = True  # False when a generated reply was cut at `max_new_tokens`, before its end-of-turn token


@dataclass
class Episode:
    """A finished episode. `truncated` episodes bootstrap from V(next state), terminated ones never do."""

    turns: list[Turn] = field(default_factory=list)
    truncated: bool = False
    bootstrap_prompt_ids: list[int] | None = None  # the prompt of the state after the last turn (truncation only)
    is_demo: bool = False  # a demonstration (JSONL or scripted expert), not the policy's own play
    group: int | str | None = None  # the episode's group for group-relative advantages (grpo, rloo, gigpo); None =
    # the episodes whose first prompt is the same form one group

    @property
    def env_return(self) -> float:
        return float(sum(turn.reward for turn in self.turns))


class TurnBatch(NamedTuple):
    input_ids: torch.Tensor  # (N, L) prompt + response, right-padded
    attention_mask: torch.Tensor  # (N, L) 1 on real tokens
    response_mask: torch.Tensor  # (N, L) float, 1 exactly on the response tokens
    value_index: torch.Tensor  # (N,) position of the last prompt token, where V(s) is read


class ScoreBatch(NamedTuple):
    """Prompts with all their candidate replies packed into one sequence each (scoring mode).

    Row i is `prompt + c_0 + c_1 + ...`; a block attention mask lets every candidate see the prompt and itself
    only, and position ids restart after the prompt for each candidate, so one forward pass scores them all
    exactly as if each followed the prompt alone.
    """

    input_ids: torch.Tensor  # (N, L) packed ids, right-padded
    attention_mask: torch.Tensor  # (N, 1, L, L) bool: which position each position may attend to
    position_ids: torch.Tensor  # (N, L)
    value_index: torch.Tensor  # (N,) last prompt position, where V(s) is read
    source: torch.Tensor  # (N, K) position whose output predicts candidate token k (0 where padded)
    target: torch.Tensor  # (N, K) candidate token k's id
    owner: torch.Tensor  # (N, K) which candidate token k belongs to, -1 where padded
    num_candidates: torch.Tensor  # (N,)
    choice: torch.Tensor  # (N,) index of the chosen candidate (0 when not chosen yet)


class UpdateBatch(NamedTuple):
    """One update's batch and everything the trainer computed for it, travelling as one bundle.

    Built in stages by `PPOTrainer.step` (`_replace` fills the rest): first the turns' action mode, the collated
    turns, their input ids and action mask, then the old policy's outputs, then the advantages and returns.
    """

    mode: ActionMode  # the turns' action mode (`modes.mode_of`): it collated them and evaluates them
    batch: TurnBatch | ScoreBatch  # the collated turns
    groups: torch.Tensor  # (N,) id of each turn's model input: equal ids, equal outputs (`mode.distinct_inputs`)
    mask: torch.Tensor  # (N, T) float mask of the action log-probs (response tokens, or one slot per scored turn)
    old_logprobs: torch.Tensor | None = None  # (N, T) the batch's policy's log-probs of the actions
    old_values: torch.Tensor | None = None  # (N,) its values
    old_dists: torch.Tensor | None = None  # (N, C) its log-probs of every candidate (scoring; else None)
    ref_dists: torch.Tensor | None = None  # (N, C) the reference policy's, when the barrier's floor is relative to them
    advantages: torch.Tensor | None = None  # (N,)
    returns: torch.Tensor | None = None  # (N,)


def collate_scored(
    prompts: list[list[int]],
    candidates: list[list[list[int]]],
    choices: list[int] | None = None,
    pad_token_id: int = 0,
    device: torch.device | str = "cpu",
) -> ScoreBatch:
    """Pack each prompt with its candidate replies for one-pass scoring (see `ScoreBatch`)."""
    rows = [p + [t for c in cands for t in c] for p, cands in zip(prompts, candidates, strict=True)]
    n, length = len(rows), max(len(r) for r in rows)
    width = max(sum(len(c) for c in cands) for cands in candidates)
    input_ids = torch.full((n, length), pad_token_id, dtype=torch.long)
    allowed = torch.zeros((n, length, length), dtype=torch.bool)
    position_ids = torch.zeros((n, length), dtype=torch.long)
    source, target = torch.zeros((n, width), dtype=torch.long), torch.zeros((n, width), dtype=torch.long)
    owner = torch.full((n, width), -1, dtype=torch.long)
    for i, (prompt, cands) in enumerate(zip(prompts, candidates, strict=True)):
        p = len(prompt)
        input_ids[i, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
        allowed[i, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        position_ids[i, :p] = torch.arange(p)
        start, k = p, 0
        for c, cand in enumerate(cands):
            m = len(cand)
            allowed[i, start : start + m, :p] = True
            allowed[i, start : start + m, start : start + m] = torch.ones(m, m, dtype=torch.bool).tril()
            position_ids[i, start : start + m] = torch.arange(p, p + m)
            source[i, k : k + m] = torch.tensor([p - 1, *range(start, start + m - 1)])
            target[i, k : k + m] = torch.tensor(cand)
            owner[i, k : k + m] = c
            start, k = start + m, k + m
        pads = torch.arange(len(rows[i]), length)
        allowed[i, pads, pads] = True  # padding attends to itself only: no fully masked (NaN) rows
    value_index = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)
    num_candidates = torch.tensor([len(c) for c in candidates], dtype=torch.long)
    choice = torch.tensor(choices if choices is not None else [0] * n, dtype=torch.long)
    tensors = (input_ids, allowed[:, None], position_ids, value_index, source, target, owner, num_candidates, choice)
    return ScoreBatch(*(t.to(device) for t in tensors))


def _pad(rows: list[list[int]], pad_token_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token rows padded to the longest, on the right (or the left)."""
    length = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(length - len(row), length) if left else slice(0, len(row))
        input_ids[i, span] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, span] = 1
    return input_ids, attention_mask


def collate(turns: list[Turn], pad_token_id: int, device: torch.device | str = "cpu") -> TurnBatch:
    """Right-pad `turns` into tensors; the response mask is placed by token counts, never by string search.

    Raises:
        ValueError: a turn with an empty prompt or response (nothing to predict from or to train on).
    """
    if not turns:
        raise ValueError("collate() needs at least one turn.")
    for i, turn in enumerate(turns):
        if not turn.prompt_ids or not turn.response_ids:
            raise ValueError(f"turn {i} has an empty prompt or response; every turn needs both.")
    input_ids, attention_mask = _pad([t.prompt_ids + t.response_ids for t in turns], pad_token_id)
    response_mask = torch.zeros_like(input_ids, dtype=torch.float32)
    for i, turn in enumerate(turns):
        response_mask[i, len(turn.prompt_ids) : len(turn.prompt_ids) + len(turn.response_ids)] = 1.0
    value_index = torch.tensor([len(t.prompt_ids) - 1 for t in turns], dtype=torch.long)
    return TurnBatch(*(t.to(device) for t in (input_ids, attention_mask, response_mask, value_index)))


def prompt_batch(prompts: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu") -> TurnBatch:
    """Right-padded prompts alone (no response), for reading V(s) at their last token."""
    input_ids, attention_mask = _pad(prompts, pad_token_id)
    value_index = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)
    response_mask = torch.zeros_like(input_ids, dtype=torch.float32)
    return TurnBatch(*(t.to(device) for t in (input_ids, attention_mask, response_mask, value_index)))


def left_pad(prompts: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu"):
    """Left-padded (input_ids, attention_mask) for batched generation."""
    input_ids, attention_mask = _pad(prompts, pad_token_id, left=True)
    return input_ids.to(device), attention_mask.to(device)


def select(batch: TurnBatch, index: torch.Tensor) -> TurnBatch:
    """Rows `index` of a `TurnBatch`, trimmed to their longest sequence."""
    rows = TurnBatch(*(t[index] for t in batch))
    length = int(rows.attention_mask.sum(dim=1).max())
    return TurnBatch(
        rows.input_ids[:, :length], rows.attention_mask[:, :length], rows.response_mask[:, :length], rows.value_index
    )


def numbered(keys: list) -> torch.Tensor:
    """(len(keys),) long: each key's number by first appearance (equal keys, equal numbers)."""
    ids: dict = {}
    return torch.tensor([ids.setdefault(key, len(ids)) for key in keys], dtype=torch.long)


def minibatch_indices(n: int, size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A shuffled partition of range(n) into chunks of at most `size` (every index exactly once)."""
    order = torch.randperm(n, generator=generator)
    return list(order.split(size))
