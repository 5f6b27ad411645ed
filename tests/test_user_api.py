"""A user's own game, written the way the README shows, through the public API only."""

import re

import gymnasium as gym

import llamagym
from llamagym import Agent, PPOConfig, load_model_and_tokenizer


class GuessEnv(gym.Env):
    """Guess whether a hidden coin is heads: one guess per episode, observation is a text hint."""

    action_space = gym.spaces.Discrete(2)
    observation_space = gym.spaces.Text(max_length=32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.coin = int(self.np_random.integers(2))
        return "heads or tails?", {}

    def step(self, action):
        return "done", float(action == self.coin), True, False, {}


class GuessAgent(Agent):
    def get_system_prompt(self) -> str:
        return "You guess coins. Reply heads or tails."

    def format_observation(self, observation) -> str:
        return observation

    def extract_action(self, response: str):
        match = re.search(r"heads|tails", response.lower())
        return None if match is None else int(match.group(0) == "heads")


def test_public_api_runs_a_custom_env_for_a_few_batches():
    model, tokenizer = load_model_and_tokenizer("tiny-random", device="cpu")
    agent = GuessAgent(
        model,
        tokenizer,
        "cpu",
        ppo_config=PPOConfig(batch_size=4, min_batch_turns=0, mini_batch_size=4),
        generation_config={"max_new_tokens": 4},
        sft_warm_start=True,
        use_target_kl=True,
    )
    env = GuessEnv()
    trained = []
    for episode in range(12):
        observation, info = env.reset(seed=episode)
        done = False
        while not done:
            action = agent.act(observation)
            observation, reward, terminated, truncated, info = env.step(action)
            agent.assign_reward(reward)
            done = terminated or truncated
        train_stats = agent.terminate_episode()
        if "ppo/policy_loss" in train_stats:
            trained.append(train_stats)
    assert len(trained) == 3
    assert {
        "ppo/policy_loss",
        "ppo/value_loss",
        "ppo/approx_kl",
        "kl/ref",
        "kl/coef",
        "sft/buffer_size",
        "env/return",
        "agent/invalid_action_rate",
        "ppo/early_stopped",
    } <= set(trained[-1])
    assert set(llamagym.__all__) >= {"Agent", "PPOConfig", "ReplayConfig", "load_model_and_tokenizer", "register_model"}
