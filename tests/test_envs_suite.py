"""The suite's contract: exact play-out of a deterministic policy, normalisation, and hashable observations."""

import numpy as np
import pytest

from llamagym.envs.suite import Transition, freeze, get_game, markov, normalised, play_out, summary


def coin_step(state, action):
    """Turn 1 or 2: action 0 banks 0.5 and ends; action 1 wins 1 with p=0.3, else goes on (ends with 0 after 2)."""
    if action == 0:
        return [Transition(1.0, state, None, 0.5, True)]
    return [Transition(0.3, state, None, 1.0, True), Transition(0.7, state + 1, state + 1, 0.0, state + 1 >= 3)]


def test_play_out_gives_exact_probabilities_of_a_chance_game():
    always_flip = play_out([(1.0, 1, 1)], markov(lambda obs: 1), coin_step)
    # flip at turn 1: 0.3 win; else turn 2: 0.7 * 0.3 win, 0.7 * 0.7 lose -> expected 0.3 + 0.21 = 0.51
    assert sorted(round(leaf.prob, 10) for leaf in always_flip.leaves) == [0.21, 0.3, 0.49]
    figures = summary(always_flip, random=0.0, optimal=1.0)
    assert figures["expected_return"] == pytest.approx(0.51)
    assert figures["mean_turns"] == pytest.approx(1 * 0.3 + 2 * 0.7)  # 1.7
    assert always_flip.invalid_rate is None  # a plain decider says nothing about validity
    assert "invalid_rate" not in figures


def test_play_out_asks_a_path_dependent_policy_with_the_whole_path():
    seen = []

    def decide(paths):
        seen.extend(paths)
        return [1 if len(path) == 1 else 0 for path in paths]  # flip once, then bank

    leaves = play_out([(1.0, 1, 1)], decide, coin_step).leaves
    assert seen == [(1,), (1, 2)]
    # 0.3 win at turn 1, else 0.7 * 0.5 banked at turn 2 -> 0.65
    assert sum(leaf.prob * leaf.total for leaf in leaves) == pytest.approx(0.65)


def test_play_out_weights_invalid_replies_by_probability():
    def decide(paths):
        return [1] * len(paths)

    decide.valid = lambda paths: [len(path) == 1 for path in paths]  # the turn-2 reply is invalid
    # turns: 1 (turn 1) + 0.7 (turn 2); invalid mass 0.7 -> 0.7 / 1.7
    out = play_out([(1.0, 1, 1)], decide, coin_step)
    assert out.invalid_rate == pytest.approx(0.7 / 1.7)
    assert summary(out, random=0.0, optimal=1.0)["invalid_rate"] == out.invalid_rate


def test_play_out_rejects_a_wrong_number_of_actions_and_endless_games():
    with pytest.raises(RuntimeError, match="returned 0 actions for 1"):
        play_out([(1.0, 1, 1)], lambda paths: [], coin_step)
    endless = lambda state, action: [Transition(1.0, state, state, 0.0, False)]  # noqa: E731
    with pytest.raises(RuntimeError, match="still running after 5 turns"):
        play_out([(1.0, 0, 0)], markov(lambda obs: 0), endless, max_turns=5)


def test_normalised_maps_random_to_0_and_optimal_to_1():
    assert normalised(-0.4, -0.4, 0.6) == 0.0
    assert normalised(0.6, -0.4, 0.6) == 1.0
    assert normalised(0.1, -0.4, 0.6) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="nothing to learn"):
        normalised(1.0, 0.5, 0.5)


def test_freeze_makes_observations_hashable():
    assert freeze(np.array([1, 0, 2])) == (1, 0, 2)
    assert freeze({"b": [1, 2], "a": np.int64(3)}) == (("a", 3), ("b", (1, 2)))
    assert freeze(((1, 2), "text")) == ((1, 2), "text")


def test_unknown_game_lists_the_known_ones():
    with pytest.raises(KeyError, match="Known games"):
        get_game("chess")


def test_agent_for_gives_the_agent_of_an_envs_size():
    rooms, tictactoe = get_game("rooms"), get_game("tictactoe")
    assert rooms.agent_for() is rooms.agent  # the default house
    assert rooms.agent_for(num_rooms=12).num_rooms == 12
    assert tictactoe.agent_for(agent_first=False) is tictactoe.agent  # its hooks do not depend on the size
