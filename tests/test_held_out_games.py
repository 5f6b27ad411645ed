"""`benchmarks/held_out_games.py`: Gymnasium's FrozenLake and CliffWalking as a user brings them, evaluated exactly."""

import gymnasium as gym
import pytest

from llamagym.envs import suite
from tests.test_learning_suite import load_benchmark


@pytest.fixture(scope="module")
def held_out():
    module = load_benchmark("held_out_games")
    module.register()
    yield module
    for game in module.GAMES:  # the suite's registry is what the other tests list
        suite.GAMES.pop(game.name, None)


@pytest.mark.parametrize("name, random", [("frozenlake", 0.013940), ("cliff", -579.1588), ("cliff200", -2079.1160)])
def test_the_experts_are_optimal_and_random_play_is_exact(held_out, name, random):
    game = suite.get_game(name)
    expert = game.evaluate(suite.markov(game.expert), **game.env_kwargs)
    assert expert["normalised"] == pytest.approx(1.0) and expert["random"] == pytest.approx(random, abs=1e-4)
    stay = game.evaluate(lambda paths: [0] * len(paths), **game.env_kwargs)  # left (a wall) / up: never arrives
    limit = held_out.LIMITS[name]
    assert stay["score"] == (0.0 if name == "frozenlake" else -limit) and stay["mean_turns"] == limit


def test_random_play_over_a_small_chain_golden_value(held_out):
    # a corridor of 2 states: from 0, action 0 stays (reward 0), action 1 ends with reward 1; 2 moves allowed
    table = {0: {0: [(1.0, 0, 0.0, False)], 1: [(1.0, 1, 1.0, True)]}}
    assert held_out.random_return(table, 0, 2) == pytest.approx(0.5 + 0.25)


def test_the_envs_play_as_registered_and_the_agents_read_their_moves(held_out):
    env = gym.make("heldout/FrozenLake-v0")
    observation, _ = env.reset(seed=0)
    for action in (1, 1, 2, 1, 2, 2):
        observation, reward, terminated, truncated, _ = env.step(action)
    assert (observation, reward, terminated) == (15, 1.0, True)
    assert held_out.one_word("I go DOWN.", held_out.FROZEN_LAKE_MOVES) == 1
    assert held_out.one_word("up or down?", held_out.FROZEN_LAKE_MOVES) is None
    assert gym.make("heldout/CliffWalking-v0").spec.max_episode_steps == 50
    assert gym.make("heldout/CliffWalking200-v0").spec.max_episode_steps == 200
