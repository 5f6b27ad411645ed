"""Generate mode: an action is a sampled reply, trained token by token.

Its input is the prompt and the reply; its log-probs are the reply's tokens' (`Policy.forward`), and the KL to
the batch's policy is the k3 estimate summed over the sampled reply, which is noisy: natural steps and the trust
region run here only when `PPOConfig` asks for them.
"""

from __future__ import annotations

import torch

from ..rollout import Turn, TurnBatch, UpdateBatch, collate, select
from . import ActionMode, Evaluation


class GenerateMode(ActionMode):
    name = "generate"
    exact_kl = False

    def acted(self, turn: Turn) -> bool:
        return turn.candidates is None

    def input_key(self, turn: Turn) -> tuple:
        """The prompt and the reply."""
        return tuple(turn.prompt_ids), tuple(turn.response_ids)

    def collate(self, turns: list[Turn], pad_token_id: int, device: torch.device | str = "cpu") -> TurnBatch:
        return collate(turns, pad_token_id, device)

    def action_mask(self, batch: TurnBatch) -> torch.Tensor:
        """The response tokens."""
        return batch.response_mask

    def evaluate(self, policy, batch, part, first, inverse, with_entropy=False, watch=None, reference=False):
        rows = select(batch, part[first])
        out = policy(*rows, reference=reference, with_entropy=with_entropy)
        if watch is not None:
            watch(out.logprobs)
        entropy = out.entropy[inverse] if out.entropy is not None else None
        return Evaluation(out.logprobs[inverse], rows.response_mask[inverse], out.values[inverse], entropy, None)

    def kl(self, data: UpdateBatch, part: torch.Tensor, now: Evaluation) -> torch.Tensor:
        """The k3 estimate of KL(old || now), summed over the reply's tokens."""
        old = data.old_logprobs[part, : now.logprobs.shape[1]]
        log_ratio = torch.where(now.mask.bool(), now.logprobs - old, 0.0)
        return ((torch.expm1(log_ratio) - log_ratio) * now.mask).sum(-1)
