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


def test_a_policy_table_is_carried_exactly_golden_values(held_out):
    # the corridor above: always action 1 ends at once with 1; always action 0 stays both moves
    table = {0: {0: [(1.0, 0, 0.0, False)], 1: [(1.0, 1, 1.0, True)]}}
    assert held_out.carry(table, 0, 2, {0: 1}) == (1.0, 1.0)
    assert held_out.carry(table, 0, 2, {0: 0}) == (0.0, 2.0)
    assert held_out.carry(table, 0, 2) == (pytest.approx(0.75), pytest.approx(1.5))  # random: 2 moves half the time


def test_the_slippery_lake_expert_is_the_best_of_its_neighbours_and_random_play_is_the_plain_lakes(held_out):
    game = suite.get_game("slippery")
    expert = game.evaluate(suite.markov(game.expert))
    assert expert["normalised"] == pytest.approx(1.0) and expert["optimal"] == pytest.approx(0.740165, abs=1e-6)
    # a slip sends a uniform random move uniformly too: random play is the plain lake's
    assert expert["random"] == pytest.approx(0.013940, abs=1e-6)
    for cell in held_out.SLIPPERY_EXPERT:  # no change of one cell's move does better over 100 moves
        for other in range(4):
            table = {**held_out.SLIPPERY_EXPERT, cell: other}
            assert game.evaluate(suite.markov(lambda o, t=table: t[int(o)]))["score"] <= expert["score"] + 1e-12
    left = game.evaluate(suite.markov(lambda o: 0))  # always left: the ice still slides it into a hole, never the goal
    assert left["score"] == 0.0 and 0 < left["mean_turns"] < 100
    with pytest.raises(ValueError, match="markov"):
        game.evaluate(lambda paths: [0] * len(paths))


def test_the_slippery_lakes_exact_figure_is_what_the_env_plays(held_out):
    env, wins = gym.make("heldout/FrozenLakeSlippery-v0"), 0.0
    for episode in range(600):
        observation, _ = env.reset(seed=episode)
        done = False
        while not done:
            observation, reward, terminated, truncated, _ = env.step(held_out.SLIPPERY_EXPERT[int(observation)])
            done = terminated or truncated
        wins += reward
    assert wins / 600 == pytest.approx(0.740165, abs=0.06)  # 3.4 standard errors
    agent = held_out.SlipperyLakeAgent.__new__(held_out.SlipperyLakeAgent)  # its prompt, without a model
    assert "The ice is slippery" in agent.get_system_prompt() and "Four cells are holes" in agent.get_system_prompt()
