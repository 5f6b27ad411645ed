"""Generate mode: an action is a sampled reply, trained token by token.

It chooses by batched sampling from softmax(logits / temperature) (no top-k or top-p: PPO must score the
distribution it samples from), cutting each reply after its first end-of-turn token. Its input is the prompt and
the reply; its log-probs are the reply's tokens' (`Policy.forward`), and the KL to the batch's policy is the k3
estimate summed over the sampled reply, which is noisy: natural steps and the trust region run here only when
`PPOConfig` asks for them.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from ..rollout import Turn, TurnBatch, UpdateBatch, collate, left_pad, select
from . import ActionMode, Choice, Evaluation


class GenerateMode(ActionMode):
    name = "generate"
    exact_kl = False
    takes_candidates = False

    def choose(self, actor, prompts, candidates=None, greedy=False) -> list[Choice]:
        """One reply per prompt, sampled (or greedy) in one `generate` call, cut after the first end-of-turn token
        (`actor.generation`: max_new_tokens, temperature). With `actor.reuse_prefix` the prompts' tokens are run
        once per distinct prompt, their shared first tokens once for all (`Policy.prefill`)."""
        if actor.reuse_prefix:
            input_ids, attention_mask, cache = actor.policy.prefill(prompts, actor.pad_token_id)
        else:
            (input_ids, attention_mask), cache = left_pad(prompts, actor.pad_token_id, actor.policy.device), None
        config = sampling_config(
            actor.generation["max_new_tokens"],
            actor.generation["temperature"],
            greedy,
            actor.pad_token_id,
            actor.eos_ids,
        )
        output = actor.policy.generate(input_ids, attention_mask, generation_config=config, past_key_values=cache)
        rows = output[:, input_ids.shape[1] :].tolist()
        return [Choice(row[: reply_length(row, actor.eos_ids)]) for row in rows]

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


def sampling_config(
    max_new_tokens: int, temperature: float, greedy: bool, pad_token_id: int, eos_ids: set[int]
) -> GenerationConfig:
    """Plain sampling from softmax(logits / temperature) (no top-k, no top-p), or greedy decoding."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else float(temperature),
        top_k=None if greedy else 0,
        top_p=None if greedy else 1.0,
        pad_token_id=pad_token_id,
        eos_token_id=sorted(eos_ids),
    )


def reply_length(tokens: list[int], eos_ids: set[int]) -> int:
    """How many of the generated `tokens` are the reply: up to and including the first end token (else all)."""
    return next((i + 1 for i, token in enumerate(tokens) if token in eos_ids), len(tokens))
