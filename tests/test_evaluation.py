"""Sampled evaluation: the confidence interval covers the true mean, outcome rates, and atomic JSON writes."""

import json
import math
import os

import numpy as np
import pytest

from llamagym.evaluation import Z_95, sampled_return, save_json, summarize_returns


def test_summary_of_known_values():
    stats = summarize_returns([1.0, -1.0, 0.0, 1.0])
    assert stats["n"] == 4
    assert stats["mean"] == pytest.approx(0.25)
    assert stats["std"] == pytest.approx(np.std([1, -1, 0, 1], ddof=1))
    assert stats["stderr"] == pytest.approx(stats["std"] / 2)
    assert stats["ci_low"] == pytest.approx(0.25 - Z_95 * stats["stderr"])
    assert stats["ci_high"] == pytest.approx(0.25 + Z_95 * stats["stderr"])
    assert stats["rates"] == {-1.0: 0.25, 0.0: 0.25, 1.0: 0.5}
    assert (stats["win"], stats["draw"], stats["loss"]) == (0.5, 0.25, 0.25)


def test_rates_only_for_few_distinct_values_and_win_rates_only_for_unit_outcomes():
    stats = summarize_returns([0.5, 2.0, 2.0])
    assert stats["rates"] == {0.5: pytest.approx(1 / 3), 2.0: pytest.approx(2 / 3)}
    assert "win" not in stats
    assert "rates" not in summarize_returns([float(i) for i in range(11)])


def test_single_episode_has_zero_width_interval():
    stats = summarize_returns([3.0])
    assert stats["std"] == 0.0 and stats["ci_low"] == stats["ci_high"] == 3.0


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")]])
def test_empty_or_non_finite_returns_raise(bad):
    with pytest.raises(ValueError):
        summarize_returns(bad)


def test_episodes_must_be_positive():
    with pytest.raises(ValueError, match="Received 0"):
        sampled_return(lambda seed: 0.0, episodes=0)


def test_play_episode_receives_consecutive_seeds():
    seen = []
    sampled_return(lambda seed: seen.append(seed) or 0.0, episodes=3, seed=10)
    assert seen == [10, 11, 12]


def test_confidence_interval_covers_the_true_mean_about_95_percent_of_the_time():
    """Outcomes +1/0/-1 with probabilities 0.4/0.1/0.5 (true mean -0.1): 400 evaluations of 200 episodes each."""
    true_mean, covered, rng = -0.1, 0, np.random.default_rng(0)
    for _ in range(400):
        outcomes = rng.choice([1.0, 0.0, -1.0], p=[0.4, 0.1, 0.5], size=200)
        stats = sampled_return(lambda seed, outcomes=outcomes: float(outcomes[seed]), episodes=200)
        covered += stats["ci_low"] <= true_mean <= stats["ci_high"]
    assert 0.91 <= covered / 400 <= 0.99  # binomial(400, 0.95) has std 1.1%


def test_save_json_is_atomic_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "eval.json"
    data = {"mean": np.float64(-0.05), "values": np.arange(3), "n": 3, "path": tmp_path}
    assert save_json(path, data) == path
    assert json.loads(path.read_text()) == {"mean": -0.05, "values": [0, 1, 2], "n": 3, "path": str(tmp_path)}
    save_json(path, {"replaced": True})
    assert json.loads(path.read_text()) == {"replaced": True}
    assert os.listdir(path.parent) == ["eval.json"]


def test_save_json_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "eval.json"
    save_json(path, {"ok": 1})
    for bad in ({"x": object()}, {"x": math.inf}):
        with pytest.raises((TypeError, ValueError)):
            save_json(path, bad)
    assert json.loads(path.read_text()) == {"ok": 1}
    assert os.listdir(tmp_path) == ["eval.json"]


def test_outcome_names_are_left_out_when_returns_are_not_win_draw_loss():
    named, plain = summarize_returns([1.0, 0.0, 0.0]), summarize_returns([1.0, 0.0, 0.0], outcomes=False)
    assert named["win"] == pytest.approx(1 / 3) and named["draw"] == pytest.approx(2 / 3)
    assert "win" not in plain and "draw" not in plain and plain["rates"] == named["rates"]
