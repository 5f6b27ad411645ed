"""Small Gymnasium envs, an agent that plays them, and a watch on an update's old outputs, shared by the tests."""

import gymnasium as gym

from llamagym import Agent
from llamagym.algos.trainer import PPOTrainer


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


def watch_old_outputs(monkeypatch) -> tuple[list, list]:
    """Patch `PPOTrainer` so that each update's old outputs are also computed without what acting remembered.

    Returns (compared, rows_run): `compared` gets (recalled, fresh, used) per `_score` call (what acting remembered, all
    outputs computed again, what the update used); `rows_run` the rows of each forward since the last `_score` began
    its used pass (the rows the update ran itself come first)."""
    compared, rows_run = [], []
    score, evaluate = PPOTrainer._score, PPOTrainer._evaluate

    def both_ways(trainer, data, plan, reference, recalled=None):
        fresh = score(trainer, data, plan, reference)
        rows_run.clear()
        used = score(trainer, data, plan, reference, recalled)
        compared.append((recalled, fresh, used))
        return used

    def counted(trainer, data, part, *args, **kwargs):
        rows_run.append(len(part))
        return evaluate(trainer, data, part, *args, **kwargs)

    monkeypatch.setattr(PPOTrainer, "_score", both_ways)
    monkeypatch.setattr(PPOTrainer, "_evaluate", counted)
    return compared, rows_run
