"""Bad input, one table: every case is refused with a specific error and message, or recovered from as stated.

A row is (case, error, fragments). With an error, the case must raise exactly that type and its message must hold
every fragment. With None, the case recovers and returns a text (a stat, a prompt, a parse result) that must hold
every fragment; the case asserts the rest of the recovery itself.
"""

import json

import gymnasium as gym
import numpy as np
import pytest
import torch

from llamagym import Agent, ModelLoadError, PPOConfig, ReplayConfig, UnknownModelError, load_model_and_tokenizer
from llamagym.agent.checkpoint import MANIFEST, STATE_FILE, CheckpointError
from llamagym.agent.parsing import parse_action


def words(response):
    for word in response.lower().split():
        if word in ("stick", "hit"):
            return int(word == "hit")
    return None


class TableAgent(Agent):
    def get_system_prompt(self):
        return "Reply hit or stick."

    def format_observation(self, observation):
        return str(observation)

    def extract_action(self, response):
        return words(response)


class FailingHookAgent(TableAgent):
    def format_observation(self, observation):
        raise KeyError(observation)


class CrashingEnv(gym.Env):
    """Two steps per episode, reward 1 a step; `step` raises while `crash` is set."""

    observation_space = gym.spaces.Discrete(10)
    action_space = gym.spaces.Discrete(2)
    crash = False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.t, {}

    def step(self, action):
        if self.crash:
            raise ConnectionError("the game server went away")
        self.t += 1
        return self.t, 1.0, self.t >= 2, False, {}


class Context:
    def __init__(self, tokenizer, model, lora_config, tmp_path):
        self.tokenizer, self.model, self.lora_config, self.tmp_path = tokenizer, model, lora_config, tmp_path

    def agent(self, cls=TableAgent, ppo_config=None, **kwargs):
        kwargs = {"generation_config": {"max_new_tokens": 2}, "action_space": gym.spaces.Discrete(2), **kwargs}
        ppo_config = ppo_config or PPOConfig(batch_size=1, min_batch_turns=0, ppo_epochs=1)
        return cls(self.model, self.tokenizer, ppo_config=ppo_config, lora_config=self.lora_config, **kwargs)

    def checkpoint(self, damage=None):
        """A saved checkpoint, damaged by `damage(directory)`, loaded into a fresh agent."""
        directory = self.tmp_path / "ckpt"
        self.agent().save(directory)
        if damage is not None:
            damage(directory)
        return self.agent().load(directory)


@pytest.fixture
def ctx(tokenizer, model, lora_config, tmp_path):
    return Context(tokenizer, model, lora_config, tmp_path)


# ---- recoveries (each returns the text its row checks) --------------------------------------------------------------
def mini_batch_larger_than_batch(ctx):
    """Not an error: batch_size counts episodes, mini_batch_size turns. A larger mini-batch is one full-batch step."""
    agent = ctx.agent(ppo_config=PPOConfig(batch_size=1, min_batch_turns=0, mini_batch_size=64, ppo_epochs=2))
    agent.act(0)
    agent.assign_reward(1.0)
    stats = agent.terminate_episode()
    return f"minibatches {stats['ppo/minibatches']}, epochs {stats['ppo/epochs_completed']}"


def observation_prompt(observation):
    def case(ctx):
        agent = ctx.agent()
        assert agent.act(observation) in (0, 1)
        return ctx.tokenizer.decode(agent.episode.turns[-1].prompt_ids)

    return case


def too_long_observation(ctx):
    agent = ctx.agent()
    try:
        agent.act("x" * 10_000)
    finally:
        assert agent.episode.turns == [] and agent.history == []  # nothing half-recorded


def parsed(reply):
    def case(ctx):
        result = parse_action(reply, words, 0, gym.spaces.Discrete(2))
        return f"action={result.action} valid={result.valid} error={result.error}"

    return case


def env_step_raises_then_abort(ctx):
    agent, env = ctx.agent(), CrashingEnv()
    observation, _ = env.reset()
    agent.act(observation)
    env.crash = True
    with pytest.raises(ConnectionError):
        env.step(0)
    agent.abort_episode()  # the crashed episode's turn is dropped; the agent is ready for a new episode
    env.crash = False
    observation, _ = env.reset()
    done = False
    while not done:
        observation, reward, terminated, truncated, _ = env.step(agent.act(observation))
        agent.assign_reward(reward)
        done = terminated or truncated
    stats = agent.terminate_episode()
    return f"trained on {stats['ppo/num_turns']:.0f} turns, return {stats['env/return']}"


def abort_one_of_two_envs(ctx):
    agent = ctx.agent()
    agent.act_batch([0, 1])
    discarded = agent.abort_episodes([False, True])
    assert len(agent.slots[0].episode.turns) == 1 and agent.slots[1].episode.turns == []
    return f"discarded {discarded}"


def act_twice_without_reward(ctx):
    agent = ctx.agent()
    agent.act(0)
    agent.act(1)
    agent.assign_reward(1.0)
    return f"rewards {[turn.reward for turn in agent.episode.turns]}"


def terminate_without_turns(ctx):
    agent = ctx.agent()
    stats = agent.terminate_episode()
    assert agent.batch == []
    return f"env/length {stats['env/length']}, env/episodes {stats['env/episodes']}"


# ---- refusals ------------------------------------------------------------------------------------------------------
def assign_reward(reward, act_first=True):
    def case(ctx):
        agent = ctx.agent()
        if act_first:
            agent.act(0)
        agent.assign_reward(reward)

    return case


def failing_hook(ctx):
    agent = ctx.agent(cls=FailingHookAgent)
    try:
        agent.act(0)
    finally:
        assert agent.episode.turns == []


def diverged_updates(ctx):
    """A reward that went non-finite behind assign_reward's back (as diverged values do) stops the run."""
    agent = ctx.agent(ppo_config=PPOConfig(batch_size=1, min_batch_turns=0, mini_batch_size=1, max_skipped_steps=2))
    agent.act(0)
    agent.act(1)
    agent.episode.turns[0].reward = float("inf")
    agent.terminate_episode()


def set_manifest(**fields):
    def damage(directory):
        manifest = json.loads((directory / MANIFEST).read_text())
        (directory / MANIFEST).write_text(json.dumps({**manifest, **fields}))

    return damage


def truncate_state(directory):
    (directory / STATE_FILE).write_bytes((directory / STATE_FILE).read_bytes()[:100])


def missing_checkpoint(ctx):
    ctx.agent().load(ctx.tmp_path / "nowhere")


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def row(name, case, error, fragments, marks=()):
    return pytest.param(case, error, fragments, id=name, marks=marks)


# fmt: off
CASES = [
    # ---- config values
    row("config-negative-learning-rate", lambda c: PPOConfig(learning_rate=-1e-4),
        ValueError, "`learning_rate` should be a number > 0. Received -0.0001."),
    row("config-gamma-above-one", lambda c: PPOConfig(gamma=1.5),
        ValueError, "`gamma` should be in the interval [0, 1]. Received 1.5."),
    row("config-policy-lam-above-one", lambda c: PPOConfig(policy_lam=2),
        ValueError, "`policy_lam` should be None (= lam) or a number in the interval [0, 1]. Received 2."),
    row("config-pool-tail-without-policy-lam", lambda c: PPOConfig(pool_tail=True),
        ValueError, ("`pool_tail=True` gives the policy back part of the `lam` advantage", "Set policy_lam below lam")),
    row("config-turn-values-without-refit", lambda c: PPOConfig(turn_values=8, value_refit=None),
        ValueError, ("`turn_values=8` adds a value per turn index", "Set value_refit (e.g. 1.0)")),
    row("config-turn-values-not-an-integer", lambda c: PPOConfig(turn_values=2.5),
        ValueError, ("turn_values", "an integer >= 0")),
    row("config-batch-size-float", lambda c: PPOConfig(batch_size=2.5),
        ValueError, "`batch_size` should be an integer >= 1. Received 2.5."),
    row("config-min-batch-turns-negative", lambda c: PPOConfig(min_batch_turns=-1),
        ValueError, "`min_batch_turns` should be an integer >= 0 (0 = count episodes only). Received -1."),
    row("config-entropy-floor-one", lambda c: PPOConfig(entropy_floor=1.0),
        ValueError, "`entropy_floor` should be None (off) or a number in (0, 1). Received 1.0."),
    row("config-mini-batch-size-string", lambda c: PPOConfig(mini_batch_size="8"),
        ValueError, "`mini_batch_size` should be None or an integer >= 1. Received '8'."),
    row("config-clip-coef-nan", lambda c: PPOConfig(clip_coef=float("nan")),
        ValueError, "`clip_coef` should be a finite number. Received nan."),
    row("config-unknown-kl-estimator", lambda c: PPOConfig(kl_estimator="k4"),
        ValueError, "`kl_estimator` should be one of k1, k2, k3. Received 'k4'."),
    row("config-unknown-advantage-scale", lambda c: PPOConfig(advantage_scale="rank"),
        ValueError, "`advantage_scale` should be one of batch, returns, none. Received 'rank'."),
    row("config-repeated-input-power-above-one", lambda c: PPOConfig(repeated_input_power=1.5),
        ValueError, "`repeated_input_power` should be None or a number in the interval [0, 1]. Received 1.5."),
    row("config-max-kl-zero", lambda c: PPOConfig(max_kl=0),
        ValueError, "`max_kl` should be None (no trust region) or a number > 0. Received 0."),
    row("config-max-kl-generate-not-bool", lambda c: PPOConfig(max_kl_generate=1),
        ValueError, "`max_kl_generate` should be True or False. Received 1."),
    row("config-flag-not-bool", lambda c: PPOConfig(whiten_advantages="yes"),
        ValueError, "`whiten_advantages` should be True or False. Received 'yes'."),
    row("config-natural-damping-zero", lambda c: PPOConfig(natural_damping=0),
        ValueError, "`natural_damping` should be a number > 0. Received 0."),
    row("config-anneal-updates-negative", lambda c: PPOConfig(anneal_updates=-1),
        ValueError, "`anneal_updates` should be an integer >= 0 (0 = no annealing). Received -1."),
    row("config-max-skipped-steps-zero", lambda c: PPOConfig(max_skipped_steps=0),
        ValueError, "`max_skipped_steps` should be an integer >= 1. Received 0."),
    row("replay-top-fraction-zero", lambda c: ReplayConfig(top_fraction=0),
        ValueError, "`top_fraction` should be in the interval (0, 1]. Received 0."),
    row("replay-capacity-bool", lambda c: ReplayConfig(capacity=True),
        ValueError, "`capacity` should be an integer >= 1. Received True."),
    row("config-mini-batch-larger-than-batch-is-fine", mini_batch_larger_than_batch,
        None, "minibatches 2.0, epochs 2.0"),
    # ---- Agent kwargs
    row("agent-negative-format-penalty", lambda c: c.agent(format_penalty=-1.0),
        ValueError, "`format_penalty` should be a finite number >= 0. Received -1.0."),
    row("agent-unknown-action-mode", lambda c: c.agent(action_mode="sample"),
        ValueError, "`action_mode` should be one of auto, generate, score. Received 'sample'."),
    row("agent-unknown-precision", lambda c: c.agent(precision="fp16"),
        ValueError, "`precision` should be one of auto, fp32, bf16. Received 'fp16'."),
    row("agent-negative-frozen-cache", lambda c: c.agent(frozen_cache_mb=-1),
        ValueError, "`frozen_cache_mb` should be a number >= 0. Received -1."),
    row("agent-top-p", lambda c: c.agent(generation_config={"top_p": 0.9}),
        ValueError, "`generation_config['top_p']` is not supported: PPO must score the distribution it samples"),
    row("agent-max-new-tokens-zero", lambda c: c.agent(generation_config={"max_new_tokens": 0}),
        ValueError, "`max_new_tokens` should be an integer >= 1. Received 0."),
    row("agent-negative-context-turns", lambda c: c.agent(context_turns=-1),
        ValueError, "`context_turns` should be None or an integer >= 0. Received -1."),
    row("agent-budget-below-system-prompt", lambda c: c.agent(max_prompt_tokens=8),
        ValueError, ("The system prompt alone takes", "more than `max_prompt_tokens`=8")),
    row("agent-no-fallback-action", lambda c: c.agent(fallback_action=None),
        ValueError, "`fallback_action` should be a valid action of your env"),
    # ---- devices
    row("device-unknown", lambda c: c.agent(device="tpu"),
        ValueError, "`device` should be one of auto, cpu, cuda, mps (or cuda:N). Received 'tpu'."),
    row("device-cuda-without-cuda", lambda c: c.agent(device="cuda"),
        ValueError, "'cuda' was requested but CUDA is not available on this machine", marks=no_cuda),
    # ---- model loading
    row("load-unknown-name", lambda c: load_model_and_tokenizer("no-such-model"),
        UnknownModelError, ("Unknown model 'no-such-model'.", "Known models: ", "tiny-random")),
    row("load-4bit-without-cuda", lambda c: load_model_and_tokenizer("tiny-random", "cpu", quantization="4bit"),
        ValueError, "`quantization`='4bit' is not available on device 'cpu'", marks=no_cuda),
    row("load-unknown-quantization", lambda c: load_model_and_tokenizer("tiny-random", "cpu", quantization="3bit"),
        ValueError, "`quantization` should be None, '4bit' or '8bit'. Received '3bit'."),
    row("load-missing-local-path", lambda c: load_model_and_tokenizer(str(c.tmp_path / "missing.gguf")),
        ModelLoadError, "No model at local path"),
    # ---- observation types
    row("observation-numpy-array", observation_prompt(np.array([1, 2, 3])),
        None, "<|user|>[1 2 3]<|end|>"),
    row("observation-tuple", observation_prompt((14, 10, False)),
        None, "<|user|>(14, 10, False)<|end|>"),
    row("observation-dict", observation_prompt({"hand": 14, "dealer": 10}),
        None, "<|user|>{'hand': 14, 'dealer': 10}<|end|>"),
    row("observation-unicode-emoji", observation_prompt("♠ A♥ 🂡 ünïcödé 漢字"),
        None, "<|user|>♠ A♥ 🂡 ünïcödé 漢字<|end|>"),
    row("observation-10k-chars-over-budget", too_long_observation,
        ValueError, ("episode 0, turn 0: The system prompt plus the latest observation take",
                     "more than `max_prompt_tokens`=1024")),
    # ---- replies
    row("reply-empty", parsed(""),
        None, "action=0 valid=False error=extract_action returned None"),
    row("reply-huge", parsed("blah " * 200_000 + "hit"),
        None, "action=1 valid=True"),
    row("reply-undecodable-bytes", parsed(b"\xff\xfe\xf0\x9f hit".decode("utf-8", errors="replace")),
        None, "action=1 valid=True"),
    row("reply-only-garbage", parsed("\ufffd\ufffd\x00"),
        None, "action=0 valid=False error=extract_action returned None"),
    row("reply-json-wrong-type", parsed('{"action": [1]}'),
        None, "valid=False error=action [1] is not in the action space Discrete(2); extract_action returned None"),
    row("reply-json-out-of-range", parsed('{"action": 7}'),
        None, "valid=False error=action 7 is not in the action space Discrete(2)"),
    row("reply-json-number-as-string", parsed('{"action": "1"}'),
        None, "action=1 valid=True"),
    # ---- env and hook faults, misuse
    row("env-step-raises-then-abort-episode", env_step_raises_then_abort,
        None, "trained on 2 turns, return 2.0"),
    row("env-abort-one-of-two-envs", abort_one_of_two_envs,
        None, "discarded 1"),
    row("hook-format-observation-raises", failing_hook,
        RuntimeError, "format_observation() raised KeyError: 0 in episode 0, turn 0"),
    row("misuse-reward-before-act", assign_reward(1.0, act_first=False),
        RuntimeError, "assign_reward() was called before act() in episode 0."),
    row("misuse-nan-reward", assign_reward(float("nan")),
        ValueError, "reward should be finite; got nan in episode 0, turn 0."),
    row("misuse-reward-not-a-number", assign_reward("lots"),
        ValueError, "reward should be a number; got 'lots' in episode 0, turn 0."),
    row("misuse-act-twice-without-reward-is-allowed", act_twice_without_reward,
        None, "rewards [0.0, 1.0]"),
    row("misuse-terminate-without-turns", terminate_without_turns,
        None, "env/length 0.0, env/episodes 1.0"),
    # ---- numeric guards
    row("numeric-repeated-non-finite-steps-stop", diverged_updates,
        RuntimeError, ("2 optimizer steps in a row were skipped", "Check the reward scale")),
    # ---- checkpoint corruption (tests/test_checkpoint.py also covers the atomic swap)
    row("checkpoint-truncated-file", lambda c: c.checkpoint(truncate_state),
        CheckpointError, "is damaged: state.pt is missing or has the wrong size"),
    row("checkpoint-missing-file", lambda c: c.checkpoint(lambda d: (d / "adapter_model.safetensors").unlink()),
        CheckpointError, "is damaged: adapter_model.safetensors is missing"),
    row("checkpoint-no-manifest", lambda c: c.checkpoint(lambda d: (d / MANIFEST).unlink()),
        CheckpointError, "has no manifest.json: it is not a complete llamagym checkpoint"),
    row("checkpoint-missing-directory", missing_checkpoint,
        CheckpointError, "No checkpoint at"),
    row("checkpoint-wrong-model", lambda c: c.checkpoint(set_manifest(base_model="phi-2")),
        CheckpointError, "was trained on base model 'phi-2', but this agent uses"),
    row("checkpoint-newer-format", lambda c: c.checkpoint(set_manifest(format=99)),
        CheckpointError, "this version reads format 2. Upgrade llamagym."),
]
# fmt: on


@pytest.mark.parametrize("case, error, fragments", CASES)
def test_bad_input_is_refused_clearly_or_recovered_from(ctx, case, error, fragments):
    fragments = (fragments,) if isinstance(fragments, str) else fragments
    if error is None:
        text = case(ctx)
    else:
        with pytest.raises(error) as caught:
            case(ctx)
        assert type(caught.value) is error, f"{type(caught.value).__name__}: {caught.value}"
        text = str(caught.value)
    for fragment in fragments:
        assert fragment in text
