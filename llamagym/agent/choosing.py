"""Choosing replies for a batch of prompts: the agent builds the prompts (and the candidates' token ids), then asks
its action mode to choose (`algos/modes/`: sampled generation, or scoring the candidates).

The `Actor` is what a mode acts with (`modes.Acting`): the policy, padding and end-of-turn ids, the sampling and
scoring settings, and each mode's memory between steps, emptied whenever the policy's outputs may change.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import NamedTuple

import torch

from ..algos.modes import MODES, ActionMode, Choice
from ..algos.modes.score import SCORE_TOKENS
from ..distributed import checksum
from ..models.policy import Policy
from .chat import ChatFormatter, Message
from .demos import response_ids
from .parsing import ParsedAction, parse_action

logger = logging.getLogger(__name__)


class Actor:
    """What the agent's action modes choose with (`modes.Acting`), and candidate reply texts as token ids.

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
        self.reuse_prefix = True  # run the prompts' shared first tokens once per step (Policy.score, Policy.prefill)
        self.score_cache_size = 65536  # distinct scored inputs remembered between weight updates
        self.score_tokens = SCORE_TOKENS  # candidate tokens per scoring forward (each a vocabulary-wide row of logits)
        self.explore = 0.0  # scoring: each candidate's least share of samples, times their number (set by `decide`)
        self._memory: dict[str, dict] = {}
        self._memory_stamp: tuple | None = None

    def memory(self, mode: ActionMode) -> dict:
        """`mode`'s own dict between calls (the score mode keeps its distributions there), emptied whenever the
        policy's outputs may have changed: its weights (`Policy.version`), temperature or precision."""
        stamp = self._stamp()
        if stamp != self._memory_stamp:
            for memory in self._memory.values():
                memory.clear()
            self._memory_stamp = stamp
        return self._memory.setdefault(mode.name, {})

    def memory_state(self) -> dict:
        """Every mode's memory with a checksum of the weights it holds outputs of; {} when it is empty or stale.

        A checkpoint keeps it, so a resumed run acts on the numbers the uninterrupted one acts on: after an update
        the memory holds the trust region's measure of the batch's inputs (`PPOTrainer.step`), which differs in its
        last bits from what acting would compute in its own batch shapes.
        """
        if self._stamp() != self._memory_stamp or not any(self._memory.values()):
            return {}
        memory = {name: dict(entries) for name, entries in self._memory.items()}  # acting goes on filling its own
        return {"weights": checksum(self.policy.trainable_parameters()), "memory": memory}

    def load_memory_state(self, state: dict) -> None:
        """Restore `memory_state()` when the policy holds the weights it was computed with (load them first);
        otherwise the memory starts empty, as it would after any change of weights."""
        if state and state["weights"] == checksum(self.policy.trainable_parameters()):
            self._memory = {name: dict(entries) for name, entries in state["memory"].items()}
            self._memory_stamp = self._stamp()

    def _stamp(self) -> tuple:
        return self.policy.version, self.policy.temperature, self.policy.precision

    def candidate_ids(self, text: str) -> list[int]:
        """Token ids of `text` as an assistant reply (chat-template exact, with its end-of-turn token); cached."""
        if text not in self._candidate_cache:
            history = [{"role": "user", "content": "."}]
            prompt = self.formatter.encode(self.formatter.messages("", history))
            rendered = self.formatter.messages("", [*history, {"role": "assistant", "content": text}])
            self._candidate_cache[text] = response_ids(self.formatter, rendered, prompt, self.eos_ids)
        return self._candidate_cache[text]


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
    candidates: list[list[int]] | None  # the candidates' token ids, when the hook listed them
    choice: int | None  # the chosen candidate's index, when there were candidates
    parsed: ParsedAction
    mode: str  # the action mode that chose it (`modes.MODES`)
    explored: bool = False  # the reply is a candidate drawn uniformly, not the model's own (`explore`)


def decide(
    agent, observations: list, histories: list, wheres: list[str], greedy: bool, explore: float = 0.0
) -> list[Decision]:
    """Each observation after its conversation `history`: prompts, then one batched choice by the agent's mode.

    The agent's hooks format the observations and name the candidates; nothing is recorded here. Under
    `action_mode="auto"` the mode is "score" when `action_candidates` lists replies, else "generate".

    `explore` (never when `greedy`): with a mode that writes its replies, each reply is replaced, with that
    probability, by one of `action_candidates` drawn uniformly (`explore_replies`); with a mode that chooses among
    them, the mode samples each of C candidates at least explore / C of the time (`Actor.explore`).
    """
    if not observations:
        return []
    system_prompt = agent.get_system_prompt()
    fixed = agent.mode  # None under "auto"
    explore = 0.0 if greedy else explore
    ask = fixed is None or fixed.takes_candidates or explore > 0
    messages, prompts, candidates = [], [], []
    for observation, history, where in zip(observations, histories, wheres, strict=True):
        hook = "format_observation"
        try:
            message = {"role": "user", "content": str(agent.format_observation(observation))}
            hook = "action_candidates"
            texts = agent.action_candidates(observation) if ask else None
        except Exception as exc:  # a user hook may raise anything: name it, and where, and record nothing
            raise RuntimeError(f"{hook}() raised {type(exc).__name__}: {exc} in {where}") from exc
        if texts is not None and not texts:
            raise ValueError(f"action_candidates returned no candidates in {where}.")
        if texts is None and fixed is not None and fixed.takes_candidates:
            raise ValueError(
                f"action_mode={fixed.name!r} but action_candidates returned None in {where}; "
                "return the list of valid replies, or set action_names."
            )
        if texts is None and explore > 0:
            raise ValueError(
                f"explore={explore} draws replies from action_candidates, which returned None in {where}; return "
                "the list of valid replies (or set action_names), or create the agent with explore=0."
            )
        messages.append([*history, message])
        try:
            prompts.append(agent.formatter.prompt_ids(system_prompt, messages[-1])[0])
        except ValueError as exc:  # over the token budget: say where
            raise ValueError(f"{where}: {exc}") from None
        candidates.append(texts)
    listed = candidates[0] is not None
    if any((texts is not None) != listed for texts in candidates):
        raise ValueError("action_candidates returned a list for some envs and None for others in one step.")
    mode = fixed or MODES["score" if listed else "generate"]
    scored = listed and mode.takes_candidates
    cand_ids = [[agent.actor.candidate_ids(t) for t in texts] for texts in candidates] if scored else None
    agent.actor.explore = explore if scored else 0.0
    with agent.trainer.greedy_weights() if greedy else nullcontext():  # greedy: the averaged adapter
        choices = mode.choose(agent.actor, prompts, cand_ids, greedy)
    explored = explore_replies(candidates, explore) if not scored and explore > 0 else {}
    decisions = []
    for k, (where, texts, chosen) in enumerate(zip(wheres, candidates, choices, strict=True)):
        index = chosen.choice  # the listed reply's index, when a listed reply was chosen
        if k in explored:  # a drawn candidate is written as the model would write it: a generated reply
            index = explored[k]
            reply, chosen = texts[index], Choice(agent.actor.candidate_ids(texts[index]))
        elif chosen.choice is not None:  # a listed reply: its text as the hook gave it
            reply = texts[chosen.choice]
        else:
            reply = agent.tokenizer.decode(chosen.response_ids, skip_special_tokens=True)
        if index is not None and texts == agent.action_names:
            parsed = ParsedAction(index + _space_start(agent.action_space), True, None)
        else:
            parsed = parse_action(reply, agent.extract_action, agent.fallback_action, agent.action_space)
        if not parsed.valid:
            logger.debug("%s: unparsable reply %r (%s)", where, reply[:200], parsed.error)
        ids = cand_ids[k] if scored else None
        decisions.append(
            Decision(
                messages[k],
                prompts[k],
                reply,
                chosen.response_ids,
                ids,
                chosen.choice,
                parsed,
                mode.name,
                k in explored or chosen.explored,
            )
        )
    return decisions


def explore_replies(candidates: list[list[str]], rate: float) -> dict[int, int]:
    """Epsilon-greedy over written replies: which replies to replace, each with probability `rate`, and by which of
    their candidates, drawn uniformly: {reply index: candidate index}. Draws from torch's global generator (a
    checkpoint keeps its state) after the mode chose, so the model's own replies are the same with it on or off."""
    draws = torch.rand(len(candidates))
    return {k: int(torch.randint(len(candidates[k]), ())) for k in torch.nonzero(draws < rate).flatten().tolist()}


def _space_start(space) -> int:
    return int(getattr(space, "start", 0)) if space is not None else 0
