"""`benchmarks/guess_number_states.py`: the exact values of guess-the-number's states under a policy table."""

import subprocess
import sys

import numpy as np
import pytest

from llamagym.envs.guess_number import expert, references
from tests.test_learning_suite import ROOT, load_benchmark, quick_probe_run

states = load_benchmark("guess_number_states")
KEYS = states.reachable()


def table(choose) -> dict:
    """The deterministic policy `choose(low, high, left) -> guess` as a table of probabilities."""
    return {key: np.eye(16)[choose(*key) - 1] for key in KEYS}


def binary_search(low, high, left):
    return expert((16, low, high, left))


def test_every_state_play_can_reach_is_listed_before_those_that_lead_to_it():
    assert KEYS[-1] == (1, 16, 5) and (1, 3, 2) in KEYS and (5, 5, 1) in KEYS
    order = {key: i for i, key in enumerate(KEYS)}
    for key in KEYS:
        for guess in range(1, 17):
            for _, _, following in states.outcomes(key, guess):
                assert following is None or order[following] < order[key]


def test_outcomes_of_guesses_inside_and_outside_the_interval():
    assert states.outcomes((1, 3, 2), 2) == [(1 / 3, 0.0, (1, 1, 1)), (1 / 3, 1.0, None), (1 / 3, 0.0, (3, 3, 1))]
    assert states.outcomes((1, 3, 2), 5) == [(1.0, 0.0, (1, 3, 1))]  # wasted: the hint says what was known
    assert states.outcomes((1, 3, 1), 1) == [(1 / 3, 1.0, None), (2 / 3, 0.0, None)]  # the last guess


def test_values_golden_uniform_play_optimal_play_and_one_wrong_state():
    uniform = {key: np.full(16, 1 / 16) for key in KEYS}
    values, _ = states.action_values(uniform, KEYS)
    assert values[(1, 16, 5)] == pytest.approx(1 - (15 / 16) ** 5) == pytest.approx(references()["random"])
    best, q_star = states.action_values(None, KEYS)
    assert best[(1, 16, 5)] == pytest.approx(1.0)
    assert q_star[(1, 3, 2)][:4] == pytest.approx([2 / 3, 1.0, 2 / 3, 1 / 3])  # the middle, an end, outside
    assert states.figures(table(binary_search), KEYS) == {"sampled": 1.0, "entropy": 0.0, "on_optimal": 1.0,
                                                          "errors": []}  # fmt: skip

    # under binary search's later play, 1..3 with 2 guesses left: the middle finds all 3, the high end 2 of them
    _, q = states.action_values(table(binary_search), KEYS)
    assert q[(1, 3, 2)][1:3] == pytest.approx([1.0, 2 / 3])

    # binary search but for its last guess on secret 16, where it guesses 15: 15 of the 16 secrets
    def miss_16(low, high, left):
        return 15 if (low, high, left) == (16, 16, 1) else binary_search(low, high, left)

    found = states.figures(table(miss_16), KEYS)
    assert found["sampled"] == pytest.approx((15 / 16 - references()["random"]) / (1 - references()["random"]))
    (error,) = found["errors"]
    assert error["state"] == [16, 16, 1] and error["reach"] == pytest.approx(1.0)  # secret 16 alone passes there
    assert (error["guess"], error["p_guess"], error["p_optimal"]) == (15, 1.0, 0.0)
    assert (error["q_guess"], error["q_best"]) == (0.0, 1.0)


def test_occupancy_of_binary_search():
    reach = states.occupancy(table(binary_search), KEYS)
    assert reach[(1, 16, 5)] == 1.0 and reach[(1, 7, 4)] == pytest.approx(7 / 16)
    assert reach[(9, 16, 4)] == pytest.approx(8 / 16) and reach[(1, 3, 3)] == pytest.approx(3 / 16)
    assert reach[(1, 3, 2)] == 0.0  # with 5 guesses for 16 numbers, binary search has one to spare


def test_probe_needs_a_registered_probe():
    learning_suite = load_benchmark()
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--quick", "--games", "tictactoe", "--probe"])  # no probe registered


@pytest.mark.slow
def test_a_quick_run_records_the_sampled_policy_at_each_evaluation(tmp_path):
    run, printed = quick_probe_run("guess_number_states.py", tmp_path)
    for point in run["curve"]:
        probed = point["probe"]
        assert -1 < probed["sampled"] < 1 and 0 < probed["entropy"] <= 1 and 0 < probed["on_optimal"] < 1
        assert all(0 <= error["p_optimal"] < 1 for error in probed["errors"])
    assert "seed 0: final" in printed and "sampled" in printed


@pytest.mark.slow
def test_generate_mode_is_refused_with_what_to_do():
    cmd = [sys.executable, "benchmarks/guess_number_states.py", "--quick", "--modes", "generate"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "run it with --modes score" in done.stderr
