"""Choosing replies for a batch of prompts: sampled generation, or scoring a list of candidate replies.

Both take many prompts (one per env slot) in a single batched call. Generation left-pads and samples; scoring
packs each prompt with its candidates into one sequence and samples from the softmax over their
length-normalised log-likelihoods (every action is valid by construction, one forward pass per step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers import GenerationConfig

from ..algos.modes.score import ScoreMode
from ..algos.rollout import collate_scored, left_pad
from ..models.policy import Policy
from .chat import ChatFormatter, Message
from .demos import response_ids
from .parsing import ParsedAction, parse_action

logger = logging.getLogger(__name__)


class Actor:
    """Turns prompts into replies with the current policy.

    Args:
        policy: the policy to act with.
        formatter: renders candidate replies through the chat template.
        pad_token_id: padding id for batched prompts.
        eos_ids: tokens that end a reply.
        generation: sampling settings (`max_new_tokens`, `temperature`).
    """

    def __init__(
        self, policy: Policy, formatter: ChatFormatter, pad_token_id: int, eos_ids: set[int], generation: dict
    ):
        self.policy = policy
        self.formatter = formatter
        self.pad_token_id = pad_token_id
        self.eos_ids = eos_ids
        self.generation = generation
        self._candidate_cache: dict[str, list[int]] = {}
        self.reuse_prefix = True  # score the prompts' common prefix once per step (see Policy.score)
        self.score_cache_size = 65536  # distinct scored inputs remembered between weight updates
        # candidate tokens per scoring forward: each costs a vocabulary-wide row of logits (49k floats for SmolLM2),
        # so 64 prompts x 21 candidates in one pass took arithmetic's evaluation from 0.95 to 2.85 GiB
        self.score_tokens = 1024
        self._scores: dict[tuple, torch.Tensor] = {}
        self._scores_stamp: tuple | None = None

    def generate(self, prompts: list[list[int]], greedy: bool = False) -> list[list[int]]:
        """One reply per prompt, sampled (or greedy), cut after the first end-of-turn token."""
        input_ids, attention_mask = left_pad(prompts, self.pad_token_id, self.policy.device)
        config = sampling_config(
            self.generation["max_new_tokens"], self.generation["temperature"], greedy, self.pad_token_id, self.eos_ids
        )
        output = self.policy.generate(input_ids, attention_mask, generation_config=config)
        return [row[: reply_length(row, self.eos_ids)] for row in output[:, input_ids.shape[1] :].tolist()]

    def candidate_ids(self, text: str) -> list[int]:
        """Token ids of `text` as an assistant reply (chat-template exact, with its end-of-turn token); cached."""
        if text not in self._candidate_cache:
            history = [{"role": "user", "content": "."}]
            prompt = self.formatter.encode(self.formatter.messages("", history))
            rendered = self.formatter.messages("", [*history, {"role": "assistant", "content": text}])
            self._candidate_cache[text] = response_ids(self.formatter, rendered, prompt, self.eos_ids)
        return self._candidate_cache[text]

    @torch.no_grad()
    def choose(self, prompts: list[list[int]], candidates: list[list[list[int]]], greedy: bool = False) -> list[int]:
        """Index of the chosen candidate for each prompt: sampled from the policy, or its arg-max when greedy.

        Each distinct (prompt, candidates) input is scored once per policy version: envs in the same state, now
        or later in the rollout, reuse its distribution until the weights (or the precision) change (see
        `Policy.version`).
        """
        stamp = (self.policy.version, self.policy.temperature, self.policy.precision)
        if stamp != self._scores_stamp:
            self._scores.clear()
            self._scores_stamp = stamp
        keys = [ScoreMode.key(p, c) for p, c in zip(prompts, candidates, strict=True)]  # the trainer's input key
        missing = list(dict.fromkeys(key for key in keys if key not in self._scores))
        if len(self._scores) + len(missing) > self.score_cache_size:
            self._scores.clear()
        for part in token_chunks(missing, lambda key: sum(map(len, key[1])), self.score_tokens):
            todo = [list(key[0]) for key in part]
            batch = collate_scored(
                todo,
                [[list(c) for c in key[1]] for key in part],
                pad_token_id=self.pad_token_id,
                device=self.policy.device,
            )
            # the frozen-layer cache already skips the shared layers: the prefix KV reuse would go unused
            reuse = self.reuse_prefix and len(todo) > 1 and self.policy.frozen_cache is None
            prefix = shared_prefix(todo) if reuse else 0
            logprobs = self.policy.score(batch, prefix=prefix).logprobs.float().cpu()
            for key, row in zip(part, logprobs, strict=True):
                self._scores[key] = row[: len(key[1])]
        rows = [self._scores[key] for key in keys]
        if greedy:
            return [int(row.argmax()) for row in rows]
        return [int(torch.multinomial(row.exp(), 1)) for row in rows]


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


def token_chunks(items: list, size: Callable[[Any], int], budget: int) -> list[list]:
    """`items` in order, cut into consecutive chunks of at most `budget` by `size` (an item larger than the budget
    makes a chunk of its own)."""
    chunks, total = [], 0
    for item in items:
        n = size(item)
        if not chunks or total + n > budget:
            chunks.append([])
            total = 0
        chunks[-1].append(item)
        total += n
    return chunks


def shared_prefix(prompts: list[list[int]]) -> int:
    """Length of the token prefix all prompts share, leaving each at least its last token (where V is read)."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for i in range(limit):
        if any(p[i] != first[i] for p in prompts):
            return i
    return max(limit, 0)


def generation_settings(spec, overrides: dict) -> dict:
    """Sampling settings: the registry's max_new_tokens and temperature, then the user's overrides, validated.

    top-k/top-p stay off: PPO needs the sampled distribution to be the one it scores.
    """
    defaults = dict(spec.generation) if spec is not None else {}
    settings = {
        "max_new_tokens": defaults.get("max_new_tokens", 32),
        "temperature": defaults.get("temperature", 1.0),
        **overrides,
    }
    for key in ("top_k", "top_p"):
        if key in settings:
            raise ValueError(
                f"`generation_config[{key!r}]` is not supported: PPO must score the distribution "
                "it samples from. Use `temperature` instead."
            )
    if not isinstance(settings["max_new_tokens"], int) or settings["max_new_tokens"] < 1:
        raise ValueError(f"`max_new_tokens` should be an integer >= 1. Received {settings['max_new_tokens']!r}.")
    temperature = settings["temperature"]
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"`temperature` should be a number > 0. Received {temperature!r}.")
    settings["temperature"] = float(temperature)
    return settings


def eos_ids(tokenizer, model) -> set[int]:
    """Every token that ends a reply: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    ids.discard(None)
    if not ids:
        raise ValueError("The tokenizer has no end-of-sequence token; set `tokenizer.eos_token` before training.")
    return ids


class Decision(NamedTuple):
    """What the agent decided for one observation, ready to be recorded as a turn."""

    history: list[Message]  # the conversation up to and including the new user message
    prompt: list[int]  # the prompt ids the model saw
    reply: str
    reply_ids: list[int]
    candidates: list[list[int]] | None  # scoring mode only
    choice: int | None  # scoring mode only
    parsed: ParsedAction


def decide(agent, observations: list, histories: list, wheres: list[str], greedy: bool) -> list[Decision]:
    """Each observation after its conversation `history`: prompts, then one batched generate or scoring call.

    The agent's hooks format the observations and name the candidates; nothing is recorded here.
    """
    if not observations:
        return []
    system_prompt = agent.get_system_prompt()
    messages, prompts, candidates = [], [], []
    for observation, history, where in zip(observations, histories, wheres, strict=True):
        hook = "format_observation"
        try:
            message = {"role": "user", "content": str(agent.format_observation(observation))}
            hook = "action_candidates"
            texts = agent.action_candidates(observation) if agent.action_mode != "generate" else None
        except Exception as exc:  # a user hook may raise anything: name it, and where, and record nothing
            raise RuntimeError(f"{hook}() raised {type(exc).__name__}: {exc} in {where}") from exc
        if texts is not None and not texts:
            raise ValueError(f"action_candidates returned no candidates in {where}.")
        if texts is None and agent.action_mode == "score":
            raise ValueError(
                f"action_mode='score' but action_candidates returned None in {where}; "
                "return the list of valid replies, or set action_names."
            )
        messages.append([*history, message])
        try:
            prompts.append(agent.formatter.prompt_ids(system_prompt, messages[-1])[0])
        except ValueError as exc:  # over the token budget: say where
            raise ValueError(f"{where}: {exc}") from None
        candidates.append(texts)
    scoring = candidates[0] is not None
    if any((texts is not None) != scoring for texts in candidates):
        raise ValueError("action_candidates returned a list for some envs and None for others in one step.")
    if scoring:
        cand_ids = [[agent.actor.candidate_ids(t) for t in texts] for texts in candidates]
        choices = agent.actor.choose(prompts, cand_ids, greedy=greedy)
        replies = [texts[c] for texts, c in zip(candidates, choices, strict=True)]
        reply_ids = [ids[c] for ids, c in zip(cand_ids, choices, strict=True)]
    else:
        cand_ids, choices = [None] * len(prompts), [None] * len(prompts)
        reply_ids = agent.actor.generate(prompts, greedy=greedy)
        replies = [agent.tokenizer.decode(ids, skip_special_tokens=True) for ids in reply_ids]
    decisions = []
    for k, where in enumerate(wheres):
        if scoring and candidates[k] == agent.action_names:
            parsed = ParsedAction(choices[k] + _space_start(agent.action_space), True, None)
        else:
            parsed = parse_action(replies[k], agent.extract_action, agent.fallback_action, agent.action_space)
        if not parsed.valid:
            logger.debug("%s: unparsable reply %r (%s)", where, replies[k][:200], parsed.error)
        decisions.append(Decision(messages[k], prompts[k], replies[k], reply_ids[k], cand_ids[k], choices[k], parsed))
    return decisions


def _space_start(space) -> int:
    return int(getattr(space, "start", 0)) if space is not None else 0
