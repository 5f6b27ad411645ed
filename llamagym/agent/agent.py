"""The abstract `Agent`: three prompt hooks plus the loop API `act` / `assign_reward` / `terminate_episode`.

It keeps each episode's conversation, records every turn with the exact tokens the model saw and produced,
batches finished episodes and hands them to the `PPOTrainer` when the batch is full. It knows prompts, never
losses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import distributed
from ..algos.modes import MODES
from ..algos.rollout import Episode, Turn
from ..algos.trainer import PPOTrainer, needs_scoring
from ..config import PPOConfig, ReplayConfig
from ..models import sharding
from ..models.devices import resolve_device
from ..models.policy import Policy
from ..models.registry import find_model_spec
from . import demos
from .chat import ChatFormatter, Message
from .checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .choosing import Actor, decide, eos_ids, generation_settings
from .running_episodes import Slot, episodes_state, load_episodes_state

_FROM_CLASS = object()  # `context_turns` left out: the class attribute decides


@dataclasses.dataclass(frozen=True)
class EpisodeSummary:
    """What a training loop reports of one ended episode (see `Agent.ended_episodes`)."""

    env: int  # the env's index in `act_batch` (0 for the single-env loop)
    episode_return: float  # the sum of its rewards (any format penalties included)
    length: int  # its turns
    invalid_rate: float  # the fraction of its replies that named no valid action (the fallback was played)


class Agent(ABC):
    """An LLM agent that learns online with PPO. Subclass it and implement the three hooks.

    Args:
        model: a causal LM from `load_model_and_tokenizer` (its registry spec supplies LoRA and generation
            defaults), any transformers causal LM, or a `PeftModel`.
        tokenizer: its tokenizer; it must have a chat template.
        device: where to run ("auto", "cpu", "cuda", ...); None keeps the model where it is.
        ppo_config: PPO hyperparameters (`PPOConfig()` when None).
        replay_config: settings of the SFT warm-start buffer (`ReplayConfig()` when None).
        generation_config: overrides of the sampling settings, e.g. `{"max_new_tokens": 16}`. A sampled reply cut
            at `max_new_tokens` before its end-of-turn token is still parsed and played, but it was read before it
            ended: training never reinforces it (its advantage is capped at 0) nor imitates it, so the model learns
            to end its replies (guess-the-number in generate mode, 20 minutes: sampled replies cut 39-42% -> 1-6%);
            `PPOConfig(cap_cut_replies=False)` for replies meant to be cut, such as one-token answers.
        lora_config: a `peft.LoraConfig`; None uses the registry defaults for this model.
        lora_layers: adapt only the top N transformer layers (training's backward pass stops there; about 2x
            faster on a CPU). None adapts every layer; "auto" takes the registry's default for this model (the
            embedded SmolLM2-135M: the top 8 of 30), else every layer.
        frozen_cache_mb: with `lora_layers`, memory for the hidden states leaving the frozen layers, kept per
            distinct prompt so repeated ones run the adapted layers only (exact); a state no forward used since
            the previous update is dropped at the next. 0 turns it off.
        full_finetune: train every weight instead of a LoRA adapter (keeps a frozen reference copy).
        sft_warm_start: keep the best episodes and imitate them for a few supervised steps after each PPO update.
            None (the default) does so after updates on generated (free-text) replies, where it teaches the reply
            format (tic-tac-toe, 20 minutes: 0.80 with 0% invalid replies, against 0.72 with 5.2% without it;
            docs/learning-that-holds.md), and not after updates on scored candidates, which cannot be misformatted;
            True after every update; False never. Loading demonstrations (`load_demonstrations`, `seed_from_expert`)
            turns it on for every update.
        use_target_kl: overrides `ppo_config.use_target_kl` (early-stop updates past 1.5 x target_kl).
        max_prompt_tokens: token budget of one prompt; older exchanges are dropped to fit it. The system prompt
            alone must fit: it is checked here, so `get_system_prompt` must work once `__init__` is called.
        context_turns: how many past exchanges a prompt keeps (None = as many as fit; 0 = only the current
            observation, a Markov policy when the observation is the whole state, e.g. Blackjack). Left out, the
            class attribute `context_turns` decides (None unless the subclass sets it).
        fallback_action: the action used when a reply cannot be parsed. Set it to a valid action of your env.
        format_penalty: subtracted from a turn's reward when its reply could not be parsed (a scored reply always
            can), and so part of the returns trained on and reported. Consider it when `fallback_action` can be a
            good move and the replies stay unreadable: the env then rewards an unreadable reply like a readable one
            (tic-tac-toe, whose fallback is the centre, seed 1 in generate mode for 20 minutes, before cut replies
            were capped: 1.0% of the greedy replies unreadable at the end with 0.5, 8.8% without; with the cap,
            2.7% without; docs/learning-that-holds.md).
        explore: how much sampled acting explores beyond the policy (never greedy acting nor `predict`; 0, the
            default, not at all). In scoring mode each of a turn's C candidates is sampled at least explore / C of
            the time (`modes.score.floored`): nothing changes where every candidate keeps that share, and a state
            the policy has settled still draws the others, so a better choice given up early can be learned again.
            In generate mode, the share of sampled replies replaced by one of `action_candidates` drawn uniformly
            (epsilon-greedy over written replies), for a game whose good moves the model never writes (it learns
            only among the replies it samples); a drawn reply is written as the model writes one (measured on
            guess-the-number, 0.2, 20 minutes, seeds 0 and 2: the greedy replies were readable sooner, the score no
            higher; docs/learning-that-holds.md, thirty-third session). Either way a drawn choice is played and
            trained on as the policy's own (PPO's old log-probs are the policy's), and `agent/explored_rate` counts
            the drawn share. Needs `action_candidates`.
        action_space: the env's action space, to reject parsed actions outside it.
        action_mode: "generate" (sample a reply and parse it), "score" (choose among `action_candidates`), "auto"
            (score when `action_candidates` returns a list, else generate), or the name of a mode added with
            `llamagym.algos.modes.register_mode` (a new action mode is one file: see `algos/modes/__init__.py`).
        precision: "auto" (bf16 autocast where bf16 is native, e.g. CPUs with AVX512-BF16/AMX; else fp32),
            "bf16" or "fp32". Weights, LoRA and the value head stay fp32 either way.
        gradient_checkpointing: recompute the adapted layers' activations in the backward pass instead of keeping
            them: less memory per update for one more forward of those layers, the same update. "auto" takes the
            registry's default for this model (on for the 1B+ models, off for the embedded 135M one), else off.
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
        sft_warm_start: bool | None = None,
        use_target_kl: bool | None = None,
        max_prompt_tokens: int = 1024,
        context_turns: int | None | object = _FROM_CLASS,
        fallback_action: Any = 0,
        format_penalty: float = 0.0,
        explore: float = 0.0,
        action_space=None,
        action_mode: str = "auto",
        precision: str = "auto",
        lora_layers: int | None | str = "auto",
        frozen_cache_mb: float = 512,
        gradient_checkpointing: bool | str = "auto",
    ):
        if action_mode != "auto" and action_mode not in MODES:
            raise ValueError(f"`action_mode` should be one of {', '.join(['auto', *MODES])}. Received {action_mode!r}.")
        if sft_warm_start is not None and not isinstance(sft_warm_start, bool):
            raise ValueError(
                f"`sft_warm_start` should be True, False or None (after updates on generated replies). "
                f"Received {sft_warm_start!r}."
            )
        if fallback_action is None:
            raise ValueError("`fallback_action` should be a valid action of your env (it replaces unparsable replies).")
        if not isinstance(format_penalty, (int, float)) or not math.isfinite(format_penalty) or format_penalty < 0:
            raise ValueError(f"`format_penalty` should be a finite number >= 0. Received {format_penalty!r}.")
        if not isinstance(explore, (int, float)) or isinstance(explore, bool) or not 0 <= explore < 1:
            raise ValueError(f"`explore` should be a number in [0, 1). Received {explore!r}.")
        distributed.init_from_env()  # under a launcher (WORLD_SIZE > 1): join its process group; else nothing
        self.ppo_config = ppo_config or PPOConfig()
        if action_mode == "generate" and (error := needs_scoring(self.ppo_config)):  # said before a batch is played
            raise error
        if use_target_kl is not None:  # a copy: the caller's config object is left as it was
            self.ppo_config = dataclasses.replace(self.ppo_config, use_target_kl=bool(use_target_kl))
        if device is not None:
            model = model.to(resolve_device(device))
        self.tokenizer = tokenizer
        self.spec = getattr(model, "llamagym_spec", None) or find_model_spec(
            str(getattr(model.config, "name_or_path", "")), getattr(model.config, "model_type", None)
        )
        system_role = False if (self.spec is not None and not self.spec.system_role) else None
        if context_turns is not _FROM_CLASS:
            self.context_turns = context_turns
        self.formatter = ChatFormatter(tokenizer, max_prompt_tokens, system_role, self.context_turns)
        system_tokens = len(self.formatter.encode(self.formatter.messages(self.get_system_prompt(), [_EMPTY_USER])))
        if system_tokens > max_prompt_tokens:
            raise ValueError(
                f"The system prompt alone takes {system_tokens} tokens with the chat template, more than "
                f"`max_prompt_tokens`={max_prompt_tokens}. Raise max_prompt_tokens or shorten get_system_prompt()."
            )
        if not isinstance(frozen_cache_mb, (int, float)) or isinstance(frozen_cache_mb, bool) or frozen_cache_mb < 0:
            raise ValueError(f"`frozen_cache_mb` should be a number >= 0. Received {frozen_cache_mb!r}.")
        if lora_layers == "auto":
            lora_layers = self.spec.lora_layers if self.spec is not None and lora_config is None else None
        if gradient_checkpointing == "auto":  # the registry's default, or the accelerate FSDP config's
            spec_default = self.spec is not None and self.spec.gradient_checkpointing
            gradient_checkpointing = spec_default or sharding.fsdp_activation_checkpointing()
        elif not isinstance(gradient_checkpointing, bool):
            raise ValueError(
                f"`gradient_checkpointing` should be True, False or 'auto'. Received {gradient_checkpointing!r}."
            )
        self.policy = Policy(
            model, lora_config, full_finetune, precision, lora_layers, frozen_cache_mb, gradient_checkpointing
        )
        sharding.shard_from_env(self.policy)  # `accelerate launch` with an FSDP config: shard the frozen weights
        sharding.check(self.policy)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = eos_ids(tokenizer, model)
        self.generation = generation_settings(self.spec, generation_config or {})
        self.policy.temperature = self.generation["temperature"]
        replay_config = (replay_config or ReplayConfig()) if sft_warm_start is not False else None
        replay_modes = ("generate",) if sft_warm_start is None else None
        self.trainer = PPOTrainer(self.policy, self.ppo_config, self.pad_token_id, replay_config, replay_modes)
        # data-parallel: each rank samples with its own seed, PPOConfig.seed + rank (reported as dist/sampling_seed)
        self.sampling_seed = None
        if distributed.is_distributed():
            self.sampling_seed = self.ppo_config.seed + distributed.rank()
            torch.manual_seed(self.sampling_seed)
        self.fallback_action = fallback_action
        self.format_penalty = float(format_penalty)
        self.explore = float(explore)
        self._drawn = self._sampled = 0  # since the last update: choices drawn by `explore`, choices sampled
        self.action_space = action_space
        self.actor = Actor(self.policy, self.formatter, self.pad_token_id, self.eos_ids, self.generation)
        self.action_mode = action_mode
        self.mode = None if action_mode == "auto" else MODES[action_mode]  # the `ActionMode` that chooses (None: auto)
        self.greedy = False
        self.batch: list[Episode] = []
        self.ended_episodes: list[EpisodeSummary] = []  # see end_episodes
        self.episode_count = 0
        self.slots: list[Slot] = []
        self._ensure_slots(1)  # slot 0 is the single-env loop's

    # ---- the three hooks (and one optional) --------------------------------------------------------------------
    @abstractmethod
    def get_system_prompt(self) -> str:
        """The system prompt that opens every episode's conversation."""

    @abstractmethod
    def format_observation(self, observation) -> str:
        """The user message for an env observation (any type the env returns)."""

    @abstractmethod
    def extract_action(self, response: str):
        """The env action for a model reply; return None (or raise) when the reply has no valid action."""

    def action_candidates(self, observation) -> list[str] | None:
        """Optional: the valid replies for `observation`, to score instead of generating (scoring mode).

        The default returns `action_names` when the subclass sets it (for a `Discrete` space, reply i is action
        i), else None (generate mode). Overriding it with, e.g., TextWorld's admissible commands makes every
        reply valid; each chosen candidate then goes through `extract_action` like a generated reply.
        """
        return list(self.action_names) if self.action_names is not None else None

    action_names: list[str] | None = None
    # A subclass whose observation is the whole state sets 0: prompts then hold the current observation only
    # (a Markov policy: shorter prompts, repeated inputs computed once, exact table evaluation).
    context_turns: int | None = None

    # ---- the loop API: one env ---------------------------------------------------------------------------------
    def act(self, observation):
        """Reply to `observation` with the current policy and return the env action it names.

        Each call records a turn. Calling `act` again without `assign_reward` in between is allowed: that turn's
        reward stays 0 (minus any format penalty), as for an env step that pays nothing.
        """
        return self.act_batch([observation])[0]

    def assign_reward(self, reward: float) -> None:
        """Add the env reward that followed the last action (call it after every `env.step`)."""
        self.assign_rewards([reward], active=[True] + [False] * (len(self.slots) - 1))

    def terminate_episode(self, truncated: bool = False, final_observation=None) -> dict[str, float]:
        """End the episode; train when the batch is full. Returns episode stats, plus training stats if it trained.

        Args:
            truncated: the episode was cut off (time limit) rather than ended by the env: its return is then
                bootstrapped from the value of `final_observation` (or of the last state when not given).
            final_observation: the observation after the last step, used only when `truncated`.
        """
        dones = [True] + [False] * (len(self.slots) - 1)
        return self.end_episodes(dones, truncated=[truncated] + dones[1:], final_observations=[final_observation])

    def abort_episode(self) -> None:
        """Discard the running episode, e.g. after `env.step` raised: none of its turns is trained on.

        The agent is then consistent and ready for a new episode: reset the env and `act` on its first observation.
        """
        self.abort_episodes([True])

    # ---- the loop API: many envs at once -----------------------------------------------------------------------
    def act_batch(self, observations, active=None, space=None) -> list:
        """Actions for N envs from one batched generate (or scoring) call; slot i keeps env i's conversation.

        Args:
            observations: one observation per env (a list), or a vector env's batched observation with `space`.
            active: optional N booleans; inactive slots (e.g. a vector env's autoreset step) get the fallback
                action and record nothing.
            space: the single-env observation space, to split a vector env's batched observation.
        """
        if space is not None:
            observations = unbatch(space, observations)
        observations = list(observations)
        self._ensure_slots(len(observations))
        active = [True] * len(observations) if active is None else [bool(a) for a in active]
        index = [i for i, on in enumerate(active) if on]
        slots = [self.slots[i] for i in index]
        history, wheres = [s.history for s in slots], [s.where() for s in slots]
        decisions = decide(self, [observations[i] for i in index], history, wheres, self.greedy, self.explore)
        if not self.greedy:  # greedy decisions are never explored, nor trained on
            self._drawn += sum(d.explored for d in decisions)
            self._sampled += len(decisions)
        actions = [self.fallback_action] * len(observations)
        for i, slot, d in zip(index, slots, decisions, strict=True):
            # Only now, with nothing left that can fail, is the turn recorded.
            slot.history = [*d.history, {"role": "assistant", "content": d.reply}]
            reward = -self.format_penalty if not d.parsed.valid and self.format_penalty else 0.0
            finished = d.candidates is not None or (bool(d.reply_ids) and d.reply_ids[-1] in self.eos_ids)
            slot.episode.turns.append(
                Turn(d.prompt, d.reply_ids, reward, d.parsed.valid, d.candidates, d.choice, d.mode, finished)
            )
            slot.last_reply = d.reply
            actions[i] = d.parsed.action
        return actions

    def abort_episodes(self, mask=None) -> int:
        """Discard the running episodes of the slots where `mask` is true, or of every slot when `mask` is None
        (e.g. games still running when the loop stops, or after a resume without the envs; see `abort_episode`).

        Returns how many of them had recorded turns (the ones whose data was thrown away).
        """
        discarded = 0
        for i, abort in enumerate([True] * len(self.slots) if mask is None else mask):
            if abort and i < len(self.slots):
                discarded += bool(self.slots[i].episode.turns)
                self.slots[i] = self._new_slot()
        return discarded

    def predict(self, observations, greedy: bool = True, chunk: int = 64) -> list:
        """Actions for observations seen afresh (no conversation history), recording nothing: for evaluation.

        Greedy actions come from the adapter averaged over the last updates (`PPOConfig.average_updates`), sampled
        ones from the latest weights, as in training.

        Runs in float32 (`Policy.float32`), so greedy actions are the same on any thread count and in any chunk:
        under bf16, rounding can flip near-tied choices, and the evaluated policy would depend on the machine.
        """
        observations, actions = list(observations), []
        lent = self.trainer.greedy_weights() if greedy else contextlib.nullcontext()  # once for every chunk
        with self.policy.float32(), lent:
            for start in range(0, len(observations), chunk):  # bounded memory however many observations
                part = observations[start : start + chunk]
                wheres = [f"predict({start + i})" for i in range(len(part))]
                actions += [d.parsed.action for d in decide(self, part, [[] for _ in part], wheres, greedy)]
        return actions

    def assign_rewards(self, rewards, active=None) -> None:
        """Add each env's reward to its slot's last turn (inactive slots are skipped)."""
        rewards = list(rewards)
        active = [True] * len(rewards) if active is None else [bool(a) for a in active]
        checked = []
        for i, (reward, on) in enumerate(zip(rewards, active, strict=True)):
            if not on:
                continue
            slot = self._slot(i)
            if not slot.episode.turns:
                raise RuntimeError(f"assign_reward() was called before act() in episode {slot.number}.")
            try:
                value = float(reward)
            except (TypeError, ValueError):
                raise ValueError(f"reward should be a number; got {reward!r} in {slot.where(-1)}.") from None
            if not math.isfinite(value):
                raise ValueError(f"reward should be finite; got {value} in {slot.where(-1)}. Check the env's reward.")
            checked.append((slot, value))
        for slot, value in checked:
            slot.episode.turns[-1].reward += value

    def end_episodes(self, dones, truncated=None, final_observations=None) -> dict[str, float]:
        """End the episodes of the slots where `dones` is true; train when the batch is full (`PPOConfig.batch_size`
        episodes, holding at least `min_batch_turns` turns between them).

        Returns the mean `env/return`, `env/length` and `agent/invalid_action_rate` of the episodes that ended
        (with `env/episodes` their count), plus the training stats when an update ran. Each ended episode's own
        numbers are then in `ended_episodes`: one `EpisodeSummary` each, in env order, until the next call.

        With the base sharded (FSDP), every forward is a collective: every rank must call `act_batch` and
        `end_episodes` once per step, and the ranks train together once every rank's batch is full (a rank whose
        batch filled first keeps playing and trains on its extra episodes too).
        """
        dones = [bool(d) for d in dones]
        truncated = [False] * len(dones) if truncated is None else [bool(t) for t in truncated]
        finals = list(final_observations) if final_observations is not None else [None] * len(dones)
        summaries = []
        for i in (i for i, done in enumerate(dones) if done):
            slot = self._slot(i)
            episode, turns = slot.episode, slot.episode.turns
            episode.truncated = truncated[i]
            if truncated[i] and i < len(finals) and finals[i] is not None and turns:
                message = {"role": "user", "content": str(self.format_observation(finals[i]))}
                episode.bootstrap_prompt_ids, _ = self.formatter.prompt_ids(
                    self.get_system_prompt(), [*slot.history, message]
                )
            summaries.append(EpisodeSummary(i, episode.env_return, len(turns), _mean(not t.valid for t in turns)))
            self.slots[i] = self._new_slot()
            if turns and not self.greedy:
                self.batch.append(episode)
        self.ended_episodes = summaries
        stats = {
            "env/return": _mean(s.episode_return for s in summaries),
            "env/length": _mean(s.length for s in summaries),
            "agent/invalid_action_rate": _mean(s.invalid_rate for s in summaries),
            "env/episodes": float(len(summaries)),
        }
        config, turns = self.ppo_config, sum(len(episode.turns) for episode in self.batch)
        full = len(self.batch) >= config.batch_size and turns >= config.min_batch_turns
        if self.policy.sharded:  # every forward is a collective: the ranks train together, once every batch is full
            full = distributed.all_true(full)
        if full:
            stats.update(self.train())
        return stats

    def train(self) -> dict[str, float]:
        """Run a PPO update on the episodes collected so far (the loop calls it when the batch is full)."""
        if not self.batch:
            return {}
        episodes, self.batch = self.batch, []
        stats = self.trainer.step(episodes, acted=self.actor.memory)  # old outputs acting computed are reused
        stats["agent/batch_invalid_action_rate"] = _mean(not t.valid for e in episodes for t in e.turns)
        stats["agent/batch_cut_reply_rate"] = _mean(not t.finished for e in episodes for t in e.turns)
        if self.explore:  # choices drawn by `explore` since the last update, of those acted
            stats["agent/explored_rate"] = self._drawn / max(1, self._sampled)
            self._drawn = self._sampled = 0
        if self.sampling_seed is not None:
            stats.update(
                {
                    "dist/world_size": float(distributed.world_size()),
                    "dist/rank": float(distributed.rank()),
                    "dist/sampling_seed": float(self.sampling_seed),
                }
            )
        return stats

    @contextlib.contextmanager
    def evaluating(self):
        """Inside this context the agent acts greedily, with the adapter averaged over the last updates
        (`PPOConfig.average_updates`), and its episodes are not trained on."""
        previous, self.greedy = self.greedy, True
        try:
            yield self
        finally:
            self.greedy = previous

    # slot 0 is the single-env loop's episode
    @property
    def episode(self) -> Episode:
        return self.slots[0].episode

    @property
    def history(self) -> list[Message]:
        return self.slots[0].history

    @property
    def last_reply(self) -> str:
        return self.slots[0].last_reply

    # ---- demonstrations --------------------------------------------------------------------------------------
    def load_demonstrations(self, path: str | Path) -> int:
        """Seed the SFT replay buffer from a JSONL file of transcripts; returns the number of episodes."""
        episodes = demos.load_demonstrations(path, self.formatter, self.get_system_prompt(), self.eos_ids)
        for episode in episodes:
            self._replay().add_demo(episode)
        return len(episodes)

    def seed_from_expert(self, env, expert: Callable[[Any], str], episodes: int = 8, seed: int | None = None) -> float:
        """Play `episodes` in `env` with a scripted `expert(observation) -> reply text`; keep them as demonstrations.

        Returns the expert's mean return. Raises if a reply of the expert does not parse into a valid action.
        """
        replay = self._replay()
        played = demos.play_expert(self, env, expert, episodes, seed)
        for episode in played:
            replay.add_demo(episode)
        return _mean(e.env_return for e in played)

    # ---- persistence -----------------------------------------------------------------------------------------
    def save(self, directory: str | Path, extra: dict | None = None) -> Path:
        """Write a crash-safe checkpoint: adapter, value head, optimizer, KL controller, replay buffer, counters,
        running and untrained episodes, RNG states and `extra` (see `llamagym.agent.checkpoint`).

        Data-parallel, every rank calls it: rank 0 alone writes, with every rank's own part (its `state_dict()`,
        RNG states and `extra`) inside, while the others wait; `load` gives each rank its part back.
        """
        if not distributed.is_distributed():
            return save_checkpoint(self, directory, extra)
        ranks = distributed.all_gather_objects({"agent": self.state_dict(), "rng": rng_state(), "extra": extra or {}})
        if distributed.is_main():
            save_checkpoint(self, directory, {**(extra or {}), RANKS_KEY: ranks})
        distributed.barrier()
        return Path(directory)

    def load(self, directory: str | Path, restore_rng: bool = True, restore_episodes: bool = True) -> dict:
        """Resume from a checkpoint written by `save` (same base model); returns its `extra` dict.

        With `restore_episodes` the running episodes continue where they were (restore your envs too, e.g.
        from `extra`); without it they are discarded. Finished, untrained episodes are restored either way.

        Data-parallel, every rank loads the same checkpoint and continues from its own part of it (see `save`); it
        must have been written by as many ranks. One process loading a data-parallel checkpoint continues rank 0's.
        """
        extra = load_checkpoint(self, directory, restore_rng, restore_episodes)
        ranks = extra.pop(RANKS_KEY, None)
        if not distributed.is_distributed():
            return extra
        if ranks is None or len(ranks) != distributed.world_size():
            written = len(ranks) if ranks is not None else 1
            raise CheckpointError(
                f"{directory} was written by {written} rank(s) but this run has {distributed.world_size()}: each rank "
                f"resumes its own envs and episodes. Resume with --num_processes {written}, or start a new run."
            )
        own = ranks[distributed.rank()]
        self.load_state_dict(own["agent"], restore_episodes)
        if restore_rng:
            set_rng_state(own["rng"])
        return own["extra"]

    def state_dict(self) -> dict:
        """What a resumed run needs besides the policy's weights (`Policy.save`) and the RNG states: the trainer's
        state (optimizer, KL controller, replay buffer, counters), the episode count, the running episodes and the
        finished ones not yet trained on, and what acting remembers of the current weights' outputs. Picklable;
        `save` writes it into the checkpoint."""
        return {
            "trainer": self.trainer.state_dict(),
            "episode_count": self.episode_count,
            "episodes": episodes_state(self.slots, self.batch),
            "acting_memory": self.actor.memory_state(),
        }

    def load_state_dict(self, state: dict, restore_episodes: bool = True) -> None:
        """Restore what `state_dict` returned. `restore_episodes` continues the running episodes; without it they
        are dropped and a fresh one starts. The finished, untrained episodes come back either way; what acting
        remembered only if the policy already holds the weights it was saved with (`Policy.load` first)."""
        self.trainer.load_state_dict(state["trainer"])
        self.episode_count = state["episode_count"]
        if "acting_memory" in state:  # absent in checkpoints written before it was kept
            self.actor.load_memory_state(state["acting_memory"])
        if "episodes" in state:  # absent in checkpoints written before it existed
            slots, self.batch = load_episodes_state(state["episodes"])
            if restore_episodes:
                self.slots = slots
            else:
                self.slots = []
                self._ensure_slots(1)

    # ---- internals -------------------------------------------------------------------------------------------
    def _new_slot(self) -> Slot:
        self.episode_count += 1
        return Slot(Episode(), [], self.episode_count - 1)

    def _ensure_slots(self, n: int) -> None:
        while len(self.slots) < n:
            self.slots.append(self._new_slot())

    def _slot(self, i: int) -> Slot:
        if i >= len(self.slots):
            raise RuntimeError(f"env slot {i} has not acted yet; call act_batch() with its observation first.")
        return self.slots[i]

    def _replay(self):
        if self.trainer.replay is None:
            raise RuntimeError("Demonstrations need the replay buffer: create the agent without sft_warm_start=False.")
        return self.trainer.replay


_EMPTY_USER: Message = {"role": "user", "content": ""}
RANKS_KEY = "llamagym_ranks"  # a data-parallel checkpoint's `extra`: every rank's own part (see `Agent.save`)


def _mean(values) -> float:
    values = list(values)
    return float(sum(values)) / len(values) if values else 0.0


def unbatch(space, observations) -> list:
    """Split a vector env's batched observation into one observation per env (Tuple and Dict spaces nest)."""
    name = type(space).__name__
    if name == "Tuple":
        parts = [unbatch(sub, batched) for sub, batched in zip(space.spaces, observations, strict=True)]
        return [tuple(items) for items in zip(*parts, strict=True)]
    if name == "Dict":
        parts = {key: unbatch(sub, observations[key]) for key, sub in space.spaces.items()}
        count = len(next(iter(parts.values()))) if parts else 0
        return [{key: values[i] for key, values in parts.items()} for i in range(count)]
    return list(observations)
