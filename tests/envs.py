"""Small Gymnasium envs, and an agent that plays them, shared by the tests."""

import gymnasium as gym

from llamagym import Agent


class CountingEnv(gym.Env):
    """Observation = step number; ends after `length` steps; reward = `reward(action, step)`."""

    observation_space = gym.spaces.Discrete(100)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, length=2, reward=lambda action, step: float(action == 1)):
        self.length, self.reward = length, reward

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.t, {}

    def step(self, action):
        self.t += 1
        return self.t, self.reward(action, self.t), self.t >= self.length, False, {}


class YesNoAgent(Agent):
    """Scores "no" (action 0) and "yes" (action 1) after "Turn {observation}."; a CountingEnv's player."""

    action_names = ["no", "yes"]

    def get_system_prompt(self):
        return "Say yes or no."

    def format_observation(self, observation):
        return f"Turn {observation}."

    def extract_action(self, response):
        words = response.lower().split()
        return 1 if "yes" in words else 0 if "no" in words else None
