"""Train an agent's hooks in a Gymnasium env with TRL's `GRPOTrainer` (needs the extra: `pip install -e .[trl]`).

    import gymnasium as gym
    from trl import GRPOConfig, GRPOTrainer

    import llamagym.envs
    from llamagym.envs.guess_number import GuessNumberAgent
    from llamagym.integrations.trl import EpisodeRollout, episode_dataset, episode_return_reward

    rollout = EpisodeRollout(GuessNumberAgent, "llamagym/GuessNumber-v0", fallback_action=1)
    trainer = GRPOTrainer(model, reward_funcs=episode_return_reward, args=GRPOConfig(...),
                          train_dataset=episode_dataset(64), processing_class=tokenizer, rollout_func=rollout)
    trainer.train()
    llamagym.envs.evaluate("guess_number", rollout.greedy_decider(model, tokenizer))  # exact, the trained policy

The contract with TRL (`GRPOTrainer(rollout_func=...)`, experimental in TRL 1.16, the release this is tested with):

- Prompts. The dataset has one row per env seed (`episode_dataset`): `prompt` names the seed ("llamagym episode,
  env seed 7") and `env_seed` holds it. TRL's sampler repeats each row `num_generations` times in a row and hands
  the repeated prompts to `rollout(prompts, trainer)`, which returns one episode per prompt. Each copy starts from
  `env.reset(seed=seed)`, so the episodes of one GRPO group start from the same state and face the same chance
  drawn at reset (the secret number, the layout); chance drawn later from the env's generator (an opponent's
  moves) is the same as long as the episodes' actions are.
- Play. All of a call's episodes run side by side in generate mode (one `generate` call per turn), with the agent's
  system prompt, `format_observation` and parsing (`parse_action`: a JSON `{"action": ...}` first, then
  `extract_action`; a reply that names no valid action plays the fallback action and is counted).
- Tokens. One episode is one sequence. `prompt_ids` is the first prompt: the system prompt and the first
  observation through the tokenizer's chat template, as the agent renders it (`ChatFormatter`). `completion_ids`
  is the rest: the model's reply tokens and the env's feedback tokens interleaved, where the feedback after a reply
  is what the chat template puts between that reply and the next one (the end of the assistant turn, the next
  observation as a user message, the generation prompt). `env_mask` is 1 on the model's tokens and 0 on the env's,
  so TRL trains on the model's tokens only. `logprobs` are the sampling log-probabilities of the model's tokens
  (0.0 on the env's). Each reply is sampled from exactly the sequence so far, so the log-probs TRL recomputes on the
  whole sequence are those of the policy that acted. Hence the TRL path trains a policy that sees the whole episode:
  the agent's `context_turns` and `max_prompt_tokens` (which drop old turns) do not apply. An episode stops early
  (`truncated`) after `max_turns`, or when one more turn could take the completion past the trainer's
  `max_completion_length`.
- Sampling. The trainer's `temperature`, with top-k and top-p off: the distribution TRL scores.
- Rewards. Extra keys, one value per episode, reach every reward function as keyword arguments: `episode_return`
  (the env's return minus the agent's `format_penalty` per invalid reply, as `Agent` counts it), `env_return`,
  `invalid_replies`, `turns`, `truncated` and `env_seed`. `episode_return_reward` returns `episode_return` and logs
  the means of the others (`episode/...` in TRL's logs).

`greedy_decider(model, tokenizer)` builds the same token sequences and decodes greedily, as a decider for the
suite's exact evaluators (`llamagym.envs.evaluate(game, decider)`), so what is evaluated is what was trained.

Beside llamagym's own loop this path lacks per-turn rewards (one reward per episode: every model token of an
episode gets its group-relative advantage), a value head (no GAE, no bootstrapping of truncated episodes), scoring
mode (`action_candidates` is not used) and the user's own `act` / `assign_reward` loop (TRL owns the loop).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..agent import Agent
from ..agent.chat import ChatFormatter, Message
from ..agent.choosing import eos_ids as model_eos_ids
from ..agent.parsing import parse_action
from ..algos.modes.generate import reply_length, sampling_config
from ..algos.rollout import left_pad
from ..envs.suite import Path, freeze

TESTED_TRL = "1.16.0"  # requirements/trl.txt; rollout_func is experimental, so other releases may differ
INSTALL = "pip install -e .[trl]"
PROMPT_PREFIX = "llamagym episode, env seed "
_PROMPT = re.compile(r"llamagym episode, env seed (-?\d+)")
_MARK = "LLAMAGYM-REPLY-MARK"  # stands for a reply while rendering the template around it
_UNSET = object()

try:
    import trl as _trl
except ImportError as _err:  # the core never imports this module; its users need the extra
    raise ImportError(
        f"llamagym.integrations.trl needs TRL (tested with trl=={TESTED_TRL}). Install the extra: {INSTALL}"
    ) from _err


def check_trl() -> str:
    """The installed TRL version; raises ImportError naming the fix when its `GRPOTrainer` takes no `rollout_func`,
    and warns when it is not the tested release."""
    from trl import GRPOTrainer

    if "rollout_func" not in inspect.signature(GRPOTrainer.__init__).parameters:
        raise ImportError(
            f"trl {_trl.__version__}'s GRPOTrainer takes no `rollout_func` (added in 0.25). Install the tested "
            f"release: {INSTALL} (trl=={TESTED_TRL})."
        )
    if _trl.__version__ != TESTED_TRL:
        warnings.warn(
            f"llamagym.integrations.trl is tested with trl=={TESTED_TRL}; this is trl {_trl.__version__} "
            f"(`rollout_func` is experimental in TRL). If it fails, {INSTALL}.",
            stacklevel=3,
        )
    return _trl.__version__


# ---- the dataset and the reward ------------------------------------------------------------------------------------
def episode_prompt(seed: int) -> str:
    """The dataset prompt that stands for one episode from `env.reset(seed=seed)`."""
    return f"{PROMPT_PREFIX}{int(seed)}"


def seed_of(prompt: Any) -> int:
    """The env seed a prompt from `episode_dataset` names.

    Raises:
        ValueError: the prompt was not made by `episode_dataset` / `episode_prompt`.
    """
    match = _PROMPT.fullmatch(prompt.strip()) if isinstance(prompt, str) else None
    if match is None:
        raise ValueError(
            f"EpisodeRollout got the prompt {str(prompt)[:80]!r}, which names no env seed. Train on "
            "`episode_dataset(...)` (one row per env seed), not on a dataset of text prompts."
        )
    return int(match.group(1))


def episode_dataset(num_seeds: int, start: int = 0):
    """A `datasets.Dataset` with one row per env seed `start, start + 1, ...`: `prompt` (see `episode_prompt`)
    and `env_seed`. TRL repeats each row `num_generations` times: one GRPO group per seed."""
    if not isinstance(num_seeds, int) or isinstance(num_seeds, bool) or num_seeds < 1:
        raise ValueError(f"`num_seeds` should be an integer >= 1. Received {num_seeds!r}.")
    from datasets import Dataset  # a dependency of trl

    seeds = list(range(start, start + num_seeds))
    return Dataset.from_dict({"prompt": [episode_prompt(s) for s in seeds], "env_seed": seeds})


def episode_return_reward(completions, episode_return=None, log_metric=None, **kwargs) -> list[float]:
    """TRL reward function: each episode's return (from `EpisodeRollout`), format penalties included.

    With TRL's `log_metric`, also logs the batch means of `episode/env_return`, `episode/invalid_replies`,
    `episode/turns` and `episode/truncated`.
    """
    if episode_return is None:
        raise ValueError(
            "episode_return_reward needs `episode_return` from the rollout: pass `rollout_func=EpisodeRollout(...)` "
            "to GRPOTrainer."
        )
    if log_metric is not None:
        for key in ("env_return", "invalid_replies", "turns", "truncated"):
            values = kwargs.get(key)
            if values:
                log_metric(f"episode/{key}", float(sum(map(float, values)) / len(values)))
    return [float(r) for r in episode_return]


# ---- one episode as one token sequence -----------------------------------------------------------------------------
@dataclass
class EpisodeRecord:
    """One episode as TRL sees it, with what the reward functions get."""

    env_seed: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1: the model's token, 0: the env's
    logprobs: list[float] = field(default_factory=list)  # sampling log-probs (0.0 on env tokens)
    messages: list[Message] = field(default_factory=list)  # the conversation as text (system prompt not included)
    env_return: float = 0.0
    invalid_replies: int = 0
    turns: int = 0
    done: bool = False
    truncated: bool = False

    def episode_return(self, format_penalty: float) -> float:
        return self.env_return - format_penalty * self.invalid_replies


class _Dialogue:
    """Renders an episode's tokens with one tokenizer: the first prompt, and the env's tokens after a reply."""

    def __init__(self, hooks, tokenizer, system_role: bool | None):
        self.hooks = hooks
        self.tokenizer = tokenizer
        self.formatter = ChatFormatter(tokenizer, 1 << 30, system_role, None)  # no budget: nothing is dropped

    def user(self, observation) -> Message:
        try:
            return {"role": "user", "content": str(self.hooks.format_observation(observation))}
        except Exception as exc:  # a user hook: name it
            raise RuntimeError(f"format_observation() raised {type(exc).__name__}: {exc}") from exc

    def start(self, system: str, observation) -> tuple[list[Message], list[int]]:
        messages = [self.user(observation)]
        return messages, self.formatter.encode(self.formatter.messages(system, messages))

    def feedback(
        self, system: str, messages: list[Message], reply_ids: list[int], eos: set[int], observation
    ) -> tuple[list[Message], list[int]]:
        """The conversation with the reply and the next observation, and the env's tokens between them."""
        user = self.user(observation)
        marked = self.formatter.messages(system, [*messages, {"role": "assistant", "content": _MARK}, user])
        text = self.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
        at = text.rfind(_MARK)
        if at < 0:
            raise ValueError("The chat template does not render the assistant's earlier replies; multi-turn needs it.")
        tail = text[at + len(_MARK) :]
        if reply_ids and reply_ids[-1] in eos:  # the model closed its turn itself; the template's closing is its
            closing = self.tokenizer.decode([reply_ids[-1]])
            if closing and tail.startswith(closing):
                tail = tail[len(closing) :]
        env_ids = list(self.tokenizer.encode(tail, add_special_tokens=False))
        reply = {"role": "assistant", "content": self.tokenizer.decode(reply_ids, skip_special_tokens=True)}
        return [*messages, reply, user], env_ids


@contextlib.contextmanager
def _generation_config(model, config):
    """`model.generate` reads `config` only: transformers merges a passed config with the model's own defaults
    (e.g. its temperature), so the model's is swapped for the call (as TRL does for its own generation)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = base.generation_config
    base.generation_config = config
    try:
        yield
    finally:
        base.generation_config = saved


@torch.no_grad()
def generate(
    model,
    sequences: list[list[int]],
    *,
    max_new_tokens: int,
    eos: set[int],
    pad_token_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
) -> tuple[list[list[int]], list[list[float]]]:
    """One reply per sequence (left-padded, one batched call), cut after its first end token, with each token's
    log-probability under the sampling distribution (softmax of logits / temperature; empty lists when greedy)."""
    input_ids, attention_mask = left_pad(sequences, pad_token_id, next(model.parameters()).device)
    width = input_ids.shape[1]
    config = sampling_config(max_new_tokens, temperature, greedy, pad_token_id, eos)
    with _generation_config(model, config):
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_scores=not greedy,
            return_dict_in_generate=True,
        )
    new = out.sequences[:, width:].cpu()
    logps = None
    if not greedy:  # scores are the processed logits: logits / temperature
        logps = torch.stack(
            [torch.log_softmax(s.float(), -1).gather(1, new[:, t : t + 1].to(s.device)).squeeze(1).cpu()
             for t, s in enumerate(out.scores)],
            dim=1,
        )  # fmt: skip
    replies, logprobs = [], []
    for i, row in enumerate(new.tolist()):
        end = reply_length(row, eos)
        replies.append(row[:end])
        logprobs.append(logps[i, :end].tolist() if logps is not None else [])
    return replies, logprobs


# ---- the rollout function ------------------------------------------------------------------------------------------
class EpisodeRollout:
    """A TRL `rollout_func` that plays episodes of a Gymnasium env with an agent's hooks (see the module docstring).

    Args:
        agent: an `Agent` (its hooks, `fallback_action`, `action_space`, `format_penalty`, reply length and the
            chat-template system-role setting are used; its model is not), or an `Agent` subclass used for its hooks
            only, without a model (the suite's agents allow it).
        env_factory: a Gymnasium id (`gym.make(id, **env_kwargs)`) or a callable returning a new env.
        fallback_action: the action an unparsable reply plays (default: the agent's; 0 for a class).
        action_space: parsed actions outside it are invalid (default: the agent's, else the env's).
        format_penalty: subtracted from `episode_return` per invalid reply (default: the agent's; 0 for a class).
        max_new_tokens: tokens per reply (default: the agent's `generation_config`; 32 for a class).
        max_turns: stop an episode after this many replies (`truncated`); None: the env (and the token budget) end it.
        env_kwargs: keyword arguments of `gym.make` when `env_factory` is an id.

    After each call, `last_episodes` holds the `EpisodeRecord`s it played.
    """

    def __init__(
        self,
        agent: Agent | type[Agent],
        env_factory: str | Callable[[], Any],
        *,
        fallback_action: Any = _UNSET,
        action_space: Any = _UNSET,
        format_penalty: float | None = None,
        max_new_tokens: int | None = None,
        max_turns: int | None = None,
        env_kwargs: dict | None = None,
    ):
        check_trl()
        if isinstance(agent, type):
            if not issubclass(agent, Agent):
                raise TypeError(f"`agent` should be an Agent or an Agent subclass. Received {agent!r}.")
            hooks, instance = object.__new__(agent), None  # the hooks only: no model is loaded
        elif isinstance(agent, Agent):
            hooks, instance = agent, agent
        else:
            raise TypeError(f"`agent` should be an Agent or an Agent subclass. Received {type(agent).__name__}.")
        self.hooks = hooks
        self.fallback_action = (
            fallback_action if fallback_action is not _UNSET else (instance.fallback_action if instance else 0)
        )
        if self.fallback_action is None:
            raise ValueError("`fallback_action` should be a valid action of your env (it replaces unparsable replies).")
        self.action_space = (
            action_space if action_space is not _UNSET else (instance.action_space if instance else None)
        )
        penalty = format_penalty if format_penalty is not None else (instance.format_penalty if instance else 0.0)
        if not isinstance(penalty, (int, float)) or not math.isfinite(penalty) or penalty < 0:
            raise ValueError(f"`format_penalty` should be a finite number >= 0. Received {penalty!r}.")
        self.format_penalty = float(penalty)
        if max_new_tokens is None:
            max_new_tokens = instance.generation["max_new_tokens"] if instance else 32
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` should be an integer >= 1. Received {max_new_tokens!r}.")
        self.max_new_tokens = max_new_tokens
        if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"`max_turns` should be None or an integer >= 1. Received {max_turns!r}.")
        self.max_turns = max_turns
        self.system_role = instance.formatter.system_role if instance else None
        if isinstance(env_factory, str):
            import gymnasium as gym

            env_id, kwargs = env_factory, dict(env_kwargs or {})
            env_factory = lambda: gym.make(env_id, **kwargs)  # noqa: E731
        elif not callable(env_factory):
            raise TypeError(f"`env_factory` should be a Gymnasium id or a callable. Received {env_factory!r}.")
        self.env_factory = env_factory
        self._envs: list = []
        self._dialogues: dict[int, _Dialogue] = {}
        self.last_episodes: list[EpisodeRecord] = []

    # -- TRL's entry point
    def __call__(self, prompts: Sequence[Any], trainer) -> dict[str, list]:
        """Play one episode per prompt (TRL has repeated each dataset row `num_generations` times)."""
        seeds = [seed_of(p) for p in prompts]
        processing = trainer.processing_class
        tokenizer = getattr(processing, "tokenizer", processing)
        model = trainer.accelerator.unwrap_model(trainer.model)
        episodes = self.play(
            model,
            tokenizer,
            seeds,
            temperature=float(trainer.temperature),
            eos=set(trainer.eos_token_ids),
            max_completion_tokens=trainer.max_completion_length,
        )
        self.last_episodes = episodes
        return {
            "prompt_ids": [e.prompt_ids for e in episodes],
            "completion_ids": [e.completion_ids for e in episodes],
            "logprobs": [e.logprobs for e in episodes],
            "env_mask": [e.env_mask for e in episodes],
            "episode_return": [e.episode_return(self.format_penalty) for e in episodes],
            "env_return": [e.env_return for e in episodes],
            "invalid_replies": [e.invalid_replies for e in episodes],
            "turns": [e.turns for e in episodes],
            "truncated": [e.truncated for e in episodes],
            "env_seed": [e.env_seed for e in episodes],
        }

    def play(
        self,
        model,
        tokenizer,
        seeds: Sequence[int],
        *,
        temperature: float = 1.0,
        eos: set[int] | None = None,
        max_completion_tokens: int | None = None,
        greedy: bool = False,
    ) -> list[EpisodeRecord]:
        """Play one episode per seed, side by side: one batched `generate` call per turn."""
        eos = eos or model_eos_ids(tokenizer, model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        dialogue = self._dialogue(tokenizer)
        system = self.hooks.get_system_prompt()
        while len(self._envs) < len(seeds):
            self._envs.append(self.env_factory())
        episodes, observations = [], []
        for env, seed in zip(self._envs, seeds, strict=False):
            observation, _ = env.reset(seed=int(seed))
            messages, prompt_ids = dialogue.start(system, observation)
            episodes.append(EpisodeRecord(int(seed), prompt_ids, messages=messages))
            observations.append(observation)
        running = list(range(len(episodes)))
        while running:
            sequences = [episodes[i].prompt_ids + episodes[i].completion_ids for i in running]
            replies, logprobs = generate(
                model,
                sequences,
                max_new_tokens=self.max_new_tokens,
                eos=eos,
                pad_token_id=pad,
                temperature=temperature,
                greedy=greedy,
            )
            still = []
            for i, reply_ids, logps in zip(running, replies, logprobs, strict=True):
                episode, env = episodes[i], self._envs[i]
                text = tokenizer.decode(reply_ids, skip_special_tokens=True)
                parsed = parse_action(text, self.hooks.extract_action, self.fallback_action, self._space(env))
                observation, reward, terminated, truncated, _ = env.step(parsed.action)
                episode.completion_ids += reply_ids
                episode.env_mask += [1] * len(reply_ids)
                episode.logprobs += logps or [0.0] * len(reply_ids)
                episode.env_return += float(reward)
                episode.invalid_replies += not parsed.valid
                episode.turns += 1
                if terminated or truncated:
                    episode.done, episode.truncated = True, bool(truncated and not terminated)
                    episode.messages.append({"role": "assistant", "content": text})
                    continue
                messages, env_ids = dialogue.feedback(system, episode.messages, reply_ids, eos, observation)
                budget = max_completion_tokens is not None and (
                    len(episode.completion_ids) + len(env_ids) + self.max_new_tokens > max_completion_tokens
                )
                if budget or (self.max_turns is not None and episode.turns >= self.max_turns):
                    episode.done, episode.truncated = True, True
                    episode.messages.append({"role": "assistant", "content": text})
                    continue
                episode.messages = messages
                episode.completion_ids += env_ids
                episode.env_mask += [0] * len(env_ids)
                episode.logprobs += [0.0] * len(env_ids)
                still.append(i)
            running = still
        return episodes

    def greedy_decider(self, model, tokenizer) -> GreedyDecider:
        """The model's greedy policy on these hooks, as a decider for `llamagym.envs.evaluate(game, decider)`."""
        return GreedyDecider(self, model, tokenizer)

    def space(self):
        """The action space parsed actions must be in: the given one, else the env's."""
        if self.action_space is not None:
            return self.action_space
        if not self._envs:
            self._envs.append(self.env_factory())
        return self._envs[0].action_space

    # -- internals
    def _space(self, env):
        return self.action_space if self.action_space is not None else env.action_space

    def _dialogue(self, tokenizer) -> _Dialogue:
        if id(tokenizer) not in self._dialogues:
            self._dialogues[id(tokenizer)] = _Dialogue(self.hooks, tokenizer, self.system_role)
        return self._dialogues[id(tokenizer)]


class GreedyDecider:
    """A suite decider (`decide(paths) -> actions`) that replies greedily on the token sequences `EpisodeRollout`
    trains on: the first prompt, then each earlier reply and the env's tokens, for whole paths of observations.
    Each distinct path is decoded once; one batched `generate` call per evaluator turn (in `chunk`s)."""

    markov = False  # the replies read the whole episode

    def __init__(self, rollout: EpisodeRollout, model, tokenizer, chunk: int = 32):
        self.rollout, self.model, self.tokenizer, self.chunk = rollout, model, tokenizer, chunk
        self.eos = model_eos_ids(tokenizer, model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.dialogue = rollout._dialogue(tokenizer)
        self.system = rollout.hooks.get_system_prompt()
        self.space = rollout.space()
        # path -> (conversation before the reply, token ids before the reply, reply ids, action, valid)
        self._done: dict[Any, tuple[list[Message], list[int], list[int], Any, bool]] = {}

    def _context(self, path: Path) -> tuple[list[Message], list[int]]:
        """The conversation and the token ids the model answers at the end of `path`."""
        if len(path) == 1:
            return self.dialogue.start(self.system, path[0])
        messages, ids, reply, _, _ = self._done[freeze(path[:-1])]
        messages, env_ids = self.dialogue.feedback(self.system, messages, reply, self.eos, path[-1])
        return messages, ids + reply + env_ids

    def __call__(self, paths: list[Path]) -> list[Any]:
        first = {}
        for path in paths:
            first.setdefault(freeze(path), path)
        todo = [key for key in first if key not in self._done]
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(todo), self.chunk):
                keys = todo[start : start + self.chunk]
                contexts = [self._context(first[key]) for key in keys]
                replies, _ = generate(
                    self.model,
                    [ids for _, ids in contexts],
                    max_new_tokens=self.rollout.max_new_tokens,
                    eos=self.eos,
                    pad_token_id=self.pad,
                    greedy=True,
                )
                for key, (messages, ids), reply in zip(keys, contexts, replies, strict=True):
                    text = self.tokenizer.decode(reply, skip_special_tokens=True)
                    hooks, fallback = self.rollout.hooks, self.rollout.fallback_action
                    parsed = parse_action(text, hooks.extract_action, fallback, self.space)
                    self._done[key] = (messages, ids, reply, parsed.action, parsed.valid)
        finally:
            self.model.train(was_training)
        return [self._done[freeze(p)][3] for p in paths]

    def valid(self, paths: list[Path]) -> list[bool]:
        """Whether each path's reply named a valid action (asked after `__call__`)."""
        return [self._done[freeze(p)][4] for p in paths]
