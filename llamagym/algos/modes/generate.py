"""Generate mode: an action is a sampled reply, trained token by token.

It chooses by batched sampling from softmax(logits / temperature) (no top-k or top-p: PPO must score the
distribution it samples from; one uniform number per row against the cumulative probabilities, `InverseCdfDraw`),
cutting each reply after its first end-of-turn token. Its input is the prompt and the reply; its log-probs are the
reply's tokens' (`Policy.forward`), and the KL to the batch's policy is the k3 estimate summed over the sampled
reply, which is noisy: the trust region runs here only when `PPOConfig` asks for it (`max_kl_generate`); natural
steps run as in scoring mode. In fp32, sampling keeps what it computed for each reply (its tokens' log-probs, the
value at the last prompt token) until the weights change, and the update takes its old outputs from there
(`recall`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..rollout import Turn, TurnBatch, UpdateBatch, collate, left_pad, select
from . import ActionMode, Choice, Evaluation, Recalled

REMEMBERED_REPLIES = 4096  # sampled replies kept between weight updates (beyond that, the update computes them)


class Sampled(NamedTuple):
    """What sampling computed for one (prompt, reply) input, remembered until the weights change (`actor.memory`)."""

    logprobs: torch.Tensor  # (R,) the reply's tokens' log-probs at the sampling temperature
    value: torch.Tensor  # () V(s) at the last prompt token
    features: torch.Tensor  # (H,) the value head's input there (what the value refit regresses on)


class GenerateMode(ActionMode):
    name = "generate"
    exact_kl = False
    takes_candidates = False

    def choose(self, actor, prompts, candidates=None, greedy=False) -> list[Choice]:
        """One reply per prompt, sampled (or greedy) in one `generate` call, cut after the first end-of-turn token
        (`actor.generation`: max_new_tokens, temperature). With `actor.reuse_prefix` the prompts' tokens are run
        once per distinct prompt, their shared first tokens once for all (`Policy.prefill`).

        A sampled reply's tokens' log-probs and the value at its prompt's last token, which sampling computes on the
        way, are remembered as `Sampled` (`actor.memory`) under the (prompt, reply) input: the update takes them as
        its old outputs (`recall`) instead of running the turn again. Only in fp32, where the decoding steps give the
        update's numbers to rounding: in bf16 they differ per token by 0.03 nats on average and up to 0.35 (the
        embedded model, guess-the-number), which would make the first ratio noise beside the clip range. Not for
        greedy replies (they are not trained on), nor with the base sharded (the update computes its outputs)."""
        policy = actor.policy
        if actor.reuse_prefix:
            input_ids, attention_mask, cache = policy.prefill(prompts, actor.pad_token_id)
        else:
            (input_ids, attention_mask), cache = left_pad(prompts, actor.pad_token_id, policy.device), None
        temperature = actor.generation["temperature"]
        # decoding takes each step's argmax: a sampled step's scores are the draw's (`InverseCdfDraw`)
        config = sampling_config(
            actor.generation["max_new_tokens"], temperature, greedy=True, pad_token_id=actor.pad_token_id,
            eos_ids=actor.eos_ids,
        )  # fmt: skip
        remember = not greedy and not policy.sharded and policy.precision == "fp32"
        recorder = SampledOutputs(policy, input_ids.shape[1]) if remember else None
        draw = None if greedy else InverseCdfDraw(temperature)
        processors = [p for p in (recorder, draw) if p is not None]  # the recorder reads the logits before the draw
        with recorder if recorder is not None else nullcontext():
            output = policy.generate(
                input_ids,
                attention_mask,
                generation_config=config,
                past_key_values=cache,
                logits_processor=LogitsProcessorList(processors),
            )
        replies = output[:, input_ids.shape[1] :]
        rows = replies.tolist()
        choices = [Choice(row[: reply_length(row, actor.eos_ids)]) for row in rows]
        if recorder is not None:
            self._keep(actor.memory(self), prompts, choices, *recorder.outputs(replies))
        return choices

    def _keep(self, memory: dict, prompts, choices, logprobs, values, features) -> None:
        if len(memory) + len(choices) > REMEMBERED_REPLIES:
            memory.clear()
        for i, (prompt, choice) in enumerate(zip(prompts, choices, strict=True)):
            if choice.response_ids:
                key = (tuple(prompt), tuple(choice.response_ids))
                memory[key] = Sampled(logprobs[i, : len(choice.response_ids)], values[i], features[i])

    def recall(self, memory: dict, turns: list[Turn], batch: TurnBatch) -> Recalled:
        """The outputs sampling remembered for the turns' (prompt, reply) inputs (`memory`: `actor.memory(self)`,
        so computed with the current weights): an update's old policy where acting already ran it, placed on the
        response positions of `batch`. Other rows (acted before the last weight change, evicted, or built by hand)
        are left for the trainer to compute."""
        found = [memory.get(self.input_key(turn)) for turn in turns]
        known = torch.tensor([entry is not None for entry in found], dtype=torch.bool)
        logprobs = torch.zeros(batch.response_mask.shape)
        values, features = torch.zeros(len(turns)), None
        for i, (turn, entry) in enumerate(zip(turns, found, strict=True)):
            if entry is None:
                continue
            if features is None:
                features = torch.zeros(len(turns), entry.features.shape[-1])
            start = len(turn.prompt_ids)
            logprobs[i, start : start + len(entry.logprobs)] = entry.logprobs
            values[i], features[i] = entry.value, entry.features
        device = batch.input_ids.device
        features = None if features is None else features.to(device)
        return Recalled(known.to(device), logprobs.to(device), values.to(device), None, features)

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


def draw_tokens(scores: torch.Tensor, temperature: float, uniform: torch.Tensor) -> torch.Tensor:
    """(B, V) logits -> (B,) tokens drawn from softmax(logits / temperature), each row's by its (B,) `uniform` in
    [0, 1) against the cumulative probabilities (float64): the token whose interval holds it. A token of probability
    0 has an empty interval and is never drawn."""
    probs = torch.softmax(scores.float() / temperature, dim=-1).double()
    cumulative = probs.cumsum(dim=-1)
    target = uniform.to(cumulative) * cumulative[:, -1]
    tokens = torch.searchsorted(cumulative, target[:, None], right=True).squeeze(1)
    return tokens.clamp_(max=scores.shape[-1] - 1)


class InverseCdfDraw(LogitsProcessor):
    """Sampling as the last logits processor of a greedy `generate` call: it draws each row's token (`draw_tokens`,
    one `torch.rand` number per row) and leaves it the only finite score, so that decoding's argmax takes it.

    `torch.multinomial`, which transformers' sampling calls, draws an exponential for every token of the vocabulary:
    17 ms of each 16-row decoding step of the embedded model (49152 tokens) on a 2-core Xeon with AMX, where this
    made a step 1.19x faster (`benchmarks/sampling_draw.py`). The distribution is the same, the random stream
    another."""

    def __init__(self, temperature: float):
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        uniform = torch.rand(scores.shape[0], dtype=torch.float64, device=scores.device)
        tokens = draw_tokens(scores, self.temperature, uniform)
        drawn = torch.full_like(scores, float("-inf"))
        return drawn.scatter_(1, tokens[:, None], 0.0)


def reply_length(tokens: list[int], eos_ids: set[int]) -> int:
    """How many of the generated `tokens` are the reply: up to and including the first end token (else all)."""
    return next((i + 1 for i, token in enumerate(tokens) if token in eos_ids), len(tokens))


class SampledOutputs(LogitsProcessor):
    """What a sampling `generate` call computes on the way, kept for the update: each sampled token's log-prob under
    softmax(logits / temperature), and the value head's input at each prompt's last token (the decoder's output at
    the call's first position to predict from).

    As a logits processor it sees each step's logits before the temperature (custom processors run before the
    warpers) and the tokens sampled so far: the log-probs of one step are kept until its token is known. Use as a
    context manager around the call (it hooks the decoder while inside), then `outputs(replies)`.
    """

    def __init__(self, policy, prompt_length: int):
        self.policy = policy
        self.temperature = policy.temperature
        self.prompt_length = prompt_length
        self.steps: list[torch.Tensor] = []  # (B,) the log-prob of each step's sampled token
        self.pending: torch.Tensor | None = None  # (B, V) the last step's log-probs, until its token is sampled
        self.features: torch.Tensor | None = None
        self._hook = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None and input_ids.shape[1] > self.prompt_length + len(self.steps):
            self.steps.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _first_output(self, module, args, output) -> None:
        if self.features is None:
            self.features = output[0][:, -1].detach()

    def __enter__(self):
        self._hook = self.policy.causal_lm().get_decoder().register_forward_hook(self._first_output)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()

    @torch.no_grad()
    def outputs(self, replies: torch.Tensor):
        """(B, R) log-probs of the `replies`' (B, R) tokens (after a reply's end: whatever was sampled there), the
        values (B,) and the value head's inputs (B, H), on the CPU."""
        steps = list(self.steps)
        if self.pending is not None and len(steps) < replies.shape[1]:
            steps.append(self.pending.gather(1, replies[:, len(steps), None]).squeeze(1))
        logprobs = torch.stack(steps, dim=1)[:, : replies.shape[1]]
        features = self.features.float()
        values = self.policy.value_head(features)
        return logprobs.cpu(), values.float().cpu(), features.cpu()
