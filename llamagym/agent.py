"""The abstract `Agent`: three prompt hooks plus the loop API `act` / `assign_reward` / `terminate_episode`.

It keeps each episode's conversation, records every turn with the exact tokens the model saw and produced,
batches finished episodes and hands them to the `PPOTrainer` when the batch is full. It knows prompts, never
losses.
"""

from __future__ import annotations

import contextlib
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from .actions import parse_action
from .chat import ChatFormatter, Message
from .config import PPOConfig, ReplayConfig
from .demos import episode_from_messages, load_jsonl, response_ids
from .devices import resolve_device
from .policy import Policy
from .registry import find_model_spec
from .rollout import Episode, Turn, left_pad
from .trainer import PPOTrainer

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer.pt"


class Agent(ABC):
    """An LLM agent that learns online with PPO. Subclass it and implement the three hooks.

    Args:
        model: a causal LM from `load_model_and_tokenizer` (its registry spec supplies LoRA and generation
            defaults), any transformers causal LM, or a `PeftModel`.
        tokenizer: its tokenizer; it must have a chat template.
        device: where to run ("auto", "cpu", "cuda", ...); None keeps the model where it is.
        ppo_config: PPO hyperparameters (`PPOConfig()` when None).
        replay_config: settings of the SFT warm-start buffer (`ReplayConfig()` when None).
        generation_config: overrides of the sampling settings, e.g. `{"max_new_tokens": 16}`.
        lora_config: a `peft.LoraConfig`; None uses the registry defaults for this model.
        full_finetune: train every weight instead of a LoRA adapter (keeps a frozen reference copy).
        sft_warm_start: keep the best episodes and imitate them after each PPO update.
        use_target_kl: overrides `ppo_config.use_target_kl` (early-stop updates past 1.5 x target_kl).
        max_prompt_tokens: token budget of one prompt; older exchanges are dropped to fit it.
        fallback_action: the action used when a reply cannot be parsed. Set it to a valid action of your env.
        format_penalty: subtracted from a turn's reward when its reply could not be parsed.
        action_space: the env's action space, to reject parsed actions outside it.
    """

    def __init__(
        self,
        model,
        tokenizer,
        device: str | torch.device | None = None,
        *,
        ppo_config: PPOConfig | None = None,
        replay_config: ReplayConfig | None = None,
        generation_config: dict | None = None,
        lora_config=None,
        full_finetune: bool = False,
        sft_warm_start: bool = False,
        use_target_kl: bool | None = None,
        max_prompt_tokens: int = 1024,
        fallback_action: Any = 0,
        format_penalty: float = 0.0,
        action_space=None,
    ):
        if fallback_action is None:
            raise ValueError("`fallback_action` should be a valid action of your env (it replaces unparsable replies).")
        if not isinstance(format_penalty, (int, float)) or not math.isfinite(format_penalty) or format_penalty < 0:
            raise ValueError(f"`format_penalty` should be a finite number >= 0. Received {format_penalty!r}.")
        self.ppo_config = ppo_config or PPOConfig()
        if use_target_kl is not None:
            self.ppo_config.use_target_kl = bool(use_target_kl)
        if device is not None:
            model = model.to(resolve_device(device))
        self.tokenizer = tokenizer
        self.spec = getattr(model, "llamagym_spec", None) or find_model_spec(
            str(getattr(model.config, "name_or_path", "")), getattr(model.config, "model_type", None)
        )
        system_role = False if (self.spec is not None and not self.spec.system_role) else None
        self.formatter = ChatFormatter(tokenizer, max_prompt_tokens, system_role)
        self.policy = Policy(model, lora_config=lora_config, full_finetune=full_finetune)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = _eos_ids(tokenizer, model)
        self.generation = self._generation_settings(generation_config or {})
        replay_config = (replay_config or ReplayConfig()) if sft_warm_start else None
        self.trainer = PPOTrainer(self.policy, self.ppo_config, self.pad_token_id, replay_config)
        self.fallback_action = fallback_action
        self.format_penalty = float(format_penalty)
        self.action_space = action_space
        self.greedy = False
        self.batch: list[Episode] = []
        self.episode_count = 0
        self._start_episode()

    # ---- the three hooks -------------------------------------------------------------------------------------
    @abstractmethod
    def get_system_prompt(self) -> str:
        """The system prompt that opens every episode's conversation."""

    @abstractmethod
    def format_observation(self, observation) -> str:
        """The user message for an env observation (any type the env returns)."""

    @abstractmethod
    def extract_action(self, response: str):
        """The env action for a model reply; return None (or raise) when the reply has no valid action."""

    # ---- the loop API ----------------------------------------------------------------------------------------
    def act(self, observation):
        """Reply to `observation` with the current policy and return the env action it names."""
        where = f"episode {self.episode_count}, turn {len(self.episode.turns)}"
        try:
            message = {"role": "user", "content": str(self.format_observation(observation))}
        except Exception as exc:
            raise RuntimeError(f"format_observation failed in {where}: {exc}") from exc
        history = [*self.history, message]
        prompt, _ = self.formatter.prompt_ids(self.get_system_prompt(), history)
        reply_ids = self._generate([prompt])[0]
        reply = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
        parsed = parse_action(reply, self.extract_action, self.fallback_action, self.action_space)
        if not parsed.valid:
            logger.debug("%s: unparsable reply %r (%s); using the fallback action", where, reply[:200], parsed.error)
        # Only now, with nothing left that can fail, is the turn recorded.
        self.history = [*history, {"role": "assistant", "content": reply}]
        self.episode.turns.append(Turn(prompt, reply_ids, 0.0 if parsed.valid else -self.format_penalty, parsed.valid))
        self.last_reply = reply
        return parsed.action

    def assign_reward(self, reward: float) -> None:
        """Add the env reward that followed the last action (call it after every `env.step`)."""
        where = f"episode {self.episode_count}, turn {len(self.episode.turns) - 1}"
        if not self.episode.turns:
            raise RuntimeError(f"assign_reward() was called before act() in episode {self.episode_count}.")
        try:
            value = float(reward)
        except (TypeError, ValueError):
            raise ValueError(f"reward should be a number; got {reward!r} in {where}.") from None
        if not math.isfinite(value):
            raise ValueError(f"reward should be finite; got {value} in {where}. Check the env's reward.")
        self.episode.turns[-1].reward += value

    def terminate_episode(self, truncated: bool = False, final_observation=None) -> dict[str, float]:
        """End the episode; train when the batch is full. Returns episode stats, plus training stats if it trained.

        Args:
            truncated: the episode was cut off (time limit) rather than ended by the env: its return is then
                bootstrapped from the value of `final_observation` (or of the last state when not given).
            final_observation: the observation after the last step, used only when `truncated`.
        """
        episode, history = self.episode, self.history
        turns = episode.turns
        stats = {
            "env/return": episode.env_return,
            "env/length": float(len(turns)),
            "agent/invalid_action_rate": sum(not t.valid for t in turns) / len(turns) if turns else 0.0,
        }
        episode.truncated = bool(truncated)
        if truncated and final_observation is not None and turns:
            message = {"role": "user", "content": str(self.format_observation(final_observation))}
            episode.bootstrap_prompt_ids, _ = self.formatter.prompt_ids(self.get_system_prompt(), [*history, message])
        self._start_episode()
        self.episode_count += 1
        if turns and not self.greedy:
            self.batch.append(episode)
        if len(self.batch) >= self.ppo_config.batch_size:
            stats.update(self.train())
        return stats

    def train(self) -> dict[str, float]:
        """Run a PPO update on the episodes collected so far (terminate_episode calls it when the batch is full)."""
        if not self.batch:
            return {}
        episodes, self.batch = self.batch, []
        stats = self.trainer.step(episodes)
        stats["agent/batch_invalid_action_rate"] = _mean([not t.valid for e in episodes for t in e.turns])
        return stats

    @contextlib.contextmanager
    def evaluating(self):
        """Inside this context the agent acts greedily and its episodes are not trained on."""
        previous, self.greedy = self.greedy, True
        try:
            yield self
        finally:
            self.greedy = previous

    # ---- demonstrations --------------------------------------------------------------------------------------
    def load_demonstrations(self, path: str | Path) -> int:
        """Seed the SFT replay buffer from a JSONL file of transcripts; returns the number of episodes."""
        replay = self._replay()
        transcripts = load_jsonl(path)
        for number, messages in transcripts:
            try:
                episode = episode_from_messages(self.formatter, self.get_system_prompt(), messages, self.eos_ids)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
            replay.add_demo(episode)
        return len(transcripts)

    def seed_from_expert(self, env, expert: Callable[[Any], str], episodes: int = 8, seed: int | None = None) -> float:
        """Play `episodes` in `env` with a scripted `expert(observation) -> reply text`; keep them as demonstrations.

        Returns the experts' mean return. Raises if a reply of the expert does not parse into a valid action.
        """
        replay, returns = self._replay(), []
        for i in range(episodes):
            observation, _ = env.reset(seed=None if seed is None else seed + i)
            history: list[Message] = []
            episode, done = Episode(), False
            while not done:
                history.append({"role": "user", "content": str(self.format_observation(observation))})
                prompt, _ = self.formatter.prompt_ids(self.get_system_prompt(), history)
                reply = expert(observation)
                history.append({"role": "assistant", "content": reply})
                rendered = self.formatter.messages(self.get_system_prompt(), history)
                parsed = parse_action(reply, self.extract_action, self.fallback_action, self.action_space)
                if not parsed.valid:
                    raise ValueError(f"the expert's reply {reply!r} is not a valid action: {parsed.error}")
                observation, reward, terminated, truncated, _ = env.step(parsed.action)
                episode.turns.append(
                    Turn(prompt, response_ids(self.formatter, rendered, prompt, self.eos_ids), float(reward))
                )
                done = terminated or truncated
            replay.add_demo(episode)
            returns.append(episode.env_return)
        return _mean(returns)

    # ---- persistence -----------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Save the adapter, the value head and the trainer state (optimizer, KL controller, replay, counters)."""
        directory = Path(directory)
        self.policy.save(directory)
        torch.save(
            {"trainer": self.trainer.state_dict(), "episode_count": self.episode_count}, directory / TRAINER_STATE_FILE
        )

    def load(self, directory: str | Path) -> None:
        """Load what `save` wrote, into an agent built on the same base model."""
        directory = Path(directory)
        self.policy.load(directory)
        state = torch.load(directory / TRAINER_STATE_FILE, weights_only=False)
        self.trainer.load_state_dict(state["trainer"])
        self.episode_count = state["episode_count"]

    # ---- internals -------------------------------------------------------------------------------------------
    def _start_episode(self) -> None:
        self.episode = Episode()
        self.history: list[Message] = []

    def _replay(self):
        if self.trainer.replay is None:
            raise RuntimeError("Demonstrations need the replay buffer: create the agent with sft_warm_start=True.")
        return self.trainer.replay

    def _generation_settings(self, overrides: dict) -> dict:
        """Sampling settings: the registry's max_new_tokens and temperature, then the user's overrides.

        top-k/top-p stay off: PPO needs the sampled distribution to be the one it scores.
        """
        defaults = dict(self.spec.generation) if self.spec is not None else {}
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
        self.policy.temperature = float(temperature)
        return settings

    def _generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Replies for left-padded prompts: sampled (or greedy in `evaluating()`), cut after the end token."""
        input_ids, attention_mask = left_pad(prompts, self.pad_token_id, self.policy.device)
        config = GenerationConfig(
            max_new_tokens=self.generation["max_new_tokens"],
            do_sample=not self.greedy,
            temperature=self.generation["temperature"] if not self.greedy else None,
            top_k=None if self.greedy else 0,
            top_p=None if self.greedy else 1.0,
            pad_token_id=self.pad_token_id,
            eos_token_id=sorted(self.eos_ids),
        )
        output = self.policy.generate(input_ids, attention_mask, generation_config=config)
        replies = []
        for row in output[:, input_ids.shape[1] :].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in self.eos_ids), len(row))
            replies.append(row[:end])
        return replies


def _eos_ids(tokenizer, model) -> set[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    ids.discard(None)
    if not ids:
        raise ValueError("The tokenizer has no end-of-sequence token; set `tokenizer.eos_token` before training.")
    return ids


def _mean(values) -> float:
    values = list(values)
    return float(sum(values)) / len(values) if values else 0.0
