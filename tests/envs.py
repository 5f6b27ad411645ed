"""Small Gymnasium envs shared by the tests."""

import gymnasium as gym


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
