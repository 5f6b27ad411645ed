"""Many envs per forward pass: batched acting equals single-env acting, slots keep their own episodes."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from llamagym import Agent, PPOConfig
from llamagym.models.tiny_random import build_tiny_model
from tests.envs import CountingEnv


def LengthEnv(length):  # noqa: N802 (an env factory read like a class)
    """Rewards 1, 2, ..., length: each reward says which step it came from."""
    return CountingEnv(length, reward=lambda action, step: float(step))


class EchoAgent(Agent):
    def get_system_prompt(self):
        return "Count."

    def format_observation(self, observation):
        return f"at {int(observation)}"

    def extract_action(self, response):
        return int(response[:1].isalpha())


def make_agent(tokenizer, lora_config, batch_size=100, **kwargs):
    torch.manual_seed(0)  # the adapter's random init: two agents built here are identical
    return EchoAgent(
        build_tiny_model(tokenizer, seed=0),
        tokenizer,
        ppo_config=PPOConfig(batch_size=batch_size, min_batch_turns=0),
        lora_config=lora_config,
        generation_config={"max_new_tokens": 4},
        **kwargs,
    )


@pytest.mark.parametrize("mode", ["generate", "score"])
def test_batched_greedy_acting_matches_single_env_acting(tokenizer, lora_config, mode):
    names = ["stick", "hit me"] if mode == "score" else None
    single, batched = make_agent(tokenizer, lora_config), make_agent(tokenizer, lora_config)
    single.action_names = batched.action_names = names
    observations = [0, 5, 17]
    with single.evaluating(), batched.evaluating():
        one_by_one = []
        for observation in observations:
            one_by_one.append((single.act(observation), list(single.episode.turns[-1].response_ids)))
            single.assign_reward(0.0)
            single.terminate_episode()
        actions = batched.act_batch(observations)
    together = [(a, list(s.episode.turns[-1].response_ids)) for a, s in zip(actions, batched.slots, strict=True)]
    assert together == one_by_one


def test_slots_finishing_at_different_times_keep_their_own_episodes(tokenizer, lora_config):
    agent = make_agent(tokenizer, lora_config)
    envs = [LengthEnv(n) for n in (1, 3, 2)]
    observations = [env.reset()[0] for env in envs]
    finished = 0
    while finished < 6:
        actions = agent.act_batch(observations)
        results = [env.step(a) for env, a in zip(envs, actions, strict=True)]
        agent.assign_rewards([r[1] for r in results])
        dones = [r[2] or r[3] for r in results]
        stats = agent.end_episodes(dones)
        finished += int(stats["env/episodes"])
        observations = [env.reset()[0] if done else r[0] for env, r, done in zip(envs, results, dones, strict=True)]
    lengths = [len(e.turns) for e in agent.batch]
    assert sorted(lengths)[:3] == [1, 1, 1]
    for episode in agent.batch:  # each episode's rewards are 1, 2, ..., its own length
        assert [t.reward for t in episode.turns] == [float(i + 1) for i in range(len(episode.turns))]


def test_vector_env_with_next_step_autoreset_skips_the_reset_step(tokenizer, lora_config):
    agent = make_agent(tokenizer, lora_config, batch_size=4)
    envs = gym.vector.SyncVectorEnv([lambda n=n: LengthEnv(n) for n in (1, 2)])
    observations, _ = envs.reset(seed=0)
    active = np.ones(2, dtype=bool)
    trained = None
    for _ in range(12):
        actions = agent.act_batch(observations, active=active)
        observations, rewards, terminated, truncated, _ = envs.step(np.array(actions))
        agent.assign_rewards(rewards, active=active)
        done = (terminated | truncated) & active
        stats = agent.end_episodes(done, truncated=truncated & ~terminated)
        trained = stats if "ppo/policy_loss" in stats else trained
        active = ~done  # a finished env spends its next step resetting (Gymnasium's NEXT_STEP autoreset)
    assert trained is not None
    assert all(t.reward >= 1.0 for e in agent.batch for t in e.turns)  # no reset-step reward (0) was recorded


def test_batched_observations_of_a_tuple_space_are_split_per_env(tokenizer, lora_config):
    agent = make_agent(tokenizer, lora_config)
    space = gym.spaces.Tuple((gym.spaces.Discrete(32), gym.spaces.Discrete(11)))
    batched = (np.array([3, 4]), np.array([5, 6]))
    agent.format_observation = lambda observation: f"{observation[0]}-{observation[1]}"
    agent.act_batch(batched, space=space)
    assert [s.history[0]["content"] for s in agent.slots] == ["3-5", "4-6"]


def test_ended_episodes_summarize_each_episode_the_last_call_ended(tokenizer, lora_config):
    agent = make_agent(tokenizer, lora_config, format_penalty=0.5)
    agent.extract_action = lambda response: None  # every reply invalid: the fallback is played, 0.5 is subtracted
    envs = [LengthEnv(n) for n in (1, 2)]
    observations = [env.reset()[0] for env in envs]
    ended, stats = [], {}
    for _ in range(2):
        agent.act_batch(observations)
        results = [env.step(0) for env in envs]
        agent.assign_rewards([r[1] for r in results])
        stats = agent.end_episodes([r[2] for r in results])
        ended.append([(e.env, e.episode_return, e.length, e.invalid_rate) for e in agent.ended_episodes])
        observations = [env.reset()[0] if r[2] else r[0] for env, r in zip(envs, results, strict=True)]
    assert ended == [[(0, 0.5, 1, 1.0)], [(0, 0.5, 1, 1.0), (1, 0.5 + 1.5, 2, 1.0)]]
    assert stats["env/return"] == (0.5 + 2.0) / 2 and stats["env/length"] == 1.5 and stats["env/episodes"] == 2
    agent.act_batch(observations)
    assert agent.abort_episodes() == 2 and all(not s.episode.turns for s in agent.slots)  # None: every env's
