"""Score mode: an action is one of a list of candidate replies, trained as one choice among them.

Its input is the prompt with every candidate (whichever was chosen), packed into one sequence and scored in one
pass (`Policy.score`, `rollout.ScoreBatch`); its log-prob is the chosen candidate's under the softmax over the
candidates, and the KL to the batch's policy is exact over them: natural steps and the trust region run by default.
"""

from __future__ import annotations

import math

import torch

from ..rollout import ScoreBatch, Turn, UpdateBatch, collate_scored
from ..trust_region import categorical_kl
from . import ActionMode, Evaluation


class ScoreMode(ActionMode):
    name = "score"
    exact_kl = True

    def acted(self, turn: Turn) -> bool:
        return turn.candidates is not None

    @staticmethod
    def key(prompt_ids: list[int], candidates: list[list[int]]) -> tuple:
        """The input of a prompt with its candidates (also the key of the acting side's score cache)."""
        return tuple(prompt_ids), tuple(map(tuple, candidates))

    def input_key(self, turn: Turn) -> tuple:
        """The prompt and every candidate, whichever was chosen."""
        return self.key(turn.prompt_ids, turn.candidates)

    def collate(self, turns: list[Turn], pad_token_id: int, device: torch.device | str = "cpu") -> ScoreBatch:
        prompts, candidates, choices = (
            [t.prompt_ids for t in turns],
            [t.candidates for t in turns],
            [t.choice for t in turns],
        )
        return collate_scored(prompts, candidates, choices, pad_token_id, device)

    def action_mask(self, batch: ScoreBatch) -> torch.Tensor:
        """One slot per turn: its choice."""
        return torch.ones((batch.input_ids.shape[0], 1), device=batch.input_ids.device)

    def evaluate(self, policy, batch, part, first, inverse, with_entropy=False, watch=None, reference=False):
        """The chosen candidates' log-probs (P, 1); the distributions are every candidate's (P, C), and the
        entropy is over the candidates (always computed: it is cheap)."""
        rows = ScoreBatch(*(t[part[first]] for t in batch))
        out = policy.score(rows, reference=reference)
        if watch is not None:
            watch(out.logprobs)
        logprobs = out.logprobs[inverse]
        chosen = logprobs.gather(1, batch.choice[part][:, None])
        probs = logprobs.exp()
        entropy = -(probs * logprobs.masked_fill(probs == 0, 0.0)).sum(-1, keepdim=True)
        return Evaluation(chosen, torch.ones_like(chosen), out.values[inverse], entropy, logprobs)

    def empty_distributions(self, batch: ScoreBatch) -> torch.Tensor:
        """As wide as the batch's most candidates (a micro-batch may have fewer), -inf (probability 0) elsewhere."""
        width = int(batch.num_candidates.max())
        return torch.full((batch.input_ids.shape[0], width), -math.inf, device=batch.input_ids.device)

    def kl(self, data: UpdateBatch, part: torch.Tensor, now: Evaluation) -> torch.Tensor:
        """Exact over the candidates."""
        return categorical_kl(data.old_dists[part, : now.dists.shape[1]], now.dists)
