"""`benchmarks/rooms_walks.py`: the exact figures of rooms' policy tables, state by state."""

import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest

from llamagym.envs import rooms, suite
from tests.test_learning_suite import ROOT, load_benchmark

walks = load_benchmark("rooms_walks")
LAYOUT, LIMIT = rooms.settings()  # the suite's house: 8 rooms, 8 steps


def table(choose) -> dict:
    """The deterministic policy `choose(room, goal) -> door` as a table of probabilities."""
    return {(r, g): {d: float(d == choose(r, g)) for d in LAYOUT.doors[r]} for r, g in walks.states(LAYOUT)}


def expert(room, goal):
    return rooms.expert((room, goal))


def astray(room, goal):  # in the pantry (3) bound for the kitchen (0), the library (2): whose way back is the pantry
    return 2 if (room, goal) == (3, 0) else expert(room, goal)


def test_the_house_the_golden_values_are_worked_on():
    assert LAYOUT.doors == ((5,), (6,), (3, 4), (2, 4, 5, 6), (2, 3), (0, 3, 7), (1, 3, 7), (5, 6)) and LIMIT == 8
    assert len(walks.states(LAYOUT)) == 56


def test_shortest_paths_score_one_and_meet_each_state_as_often_as_its_distance_says():
    found = walks.figures(table(expert))
    assert found == {"sampled": 1.0, "greedy": 1.0, "entropy": 0.0, "on_shortest": 1.0, "errors": [], "thin": []}
    reach = walks.occupancy(table(expert), LAYOUT, LIMIT)
    assert sum(reach.values()) == pytest.approx(57 / 28)  # the mean shortest distance: one state met per step


def test_one_state_astray_by_hand_and_as_the_suite_evaluates_it():
    found = walks.figures(table(astray))
    # 5 of the 56 tasks cross the pantry bound for the kitchen and go back and forth to the library until time is up
    doors = walks.greedy(table(astray))
    evaluated = rooms.evaluate(suite.markov(lambda obs: doors[tuple(obs)]))
    assert found["sampled"] == found["greedy"] == pytest.approx(evaluated["normalised"])
    assert evaluated["score"] == pytest.approx(51 / 56)
    (error,) = found["errors"]
    assert (error["state"], error["door"], error["p_door"], error["p_shortest"]) == ([3, 0], 2, 1.0, 0.0)
    assert error["tasks"] == [[1, 4, None], [2, 3, None], [3, 2, None], [4, 3, None], [6, 3, None]]
    # visits to the pantry per episode from starts 1, 2, 3, 4, 6 (8 steps each): 3 + 4 + 4 + 4 + 4
    assert error["reach"] == pytest.approx(19 / 56)


def test_a_biased_coin_at_one_state_by_hand():
    # at (pantry, kitchen): 0.55 to the cellar (5, a door of the kitchen), 0.45 astray to the library, which leads
    # back; from the pantry with k steps used, W(k) = 0.55 / (k + 2) + 0.45 W(k + 2), arriving by step 8 at the latest
    coin = table(expert)
    coin[3, 0] = {2: 0.45, 4: 0.0, 5: 0.55, 6: 0.0}

    def w(k):
        return Fraction(0) if k > 6 else Fraction(11, 20) / (k + 2) + Fraction(9, 20) * w(k + 2)

    # the starts through the pantry: 1 (d 4, there at step 2), 2, 4, 6 (d 3, at step 1), 3 (d 2, at step 0)
    total = (51 + 4 * w(2) + 3 * 3 * w(1) + 2 * w(0)) / 56
    assert walks.spl(coin, LAYOUT, LIMIT) == pytest.approx(float(total))
    found = walks.figures(coin)
    random, optimal = rooms.random_spl(), rooms.optimal_spl()
    assert found["sampled"] == pytest.approx((float(total) - random) / (optimal - random))
    assert found["greedy"] == 1.0 and found["errors"] == []
    ((thin, reach),) = [((t["state"], t["p_shortest"]), t["reach"]) for t in found["thin"]]
    assert thin == ([3, 0], 0.55) and 5 / 56 < reach < 19 / 56  # met once by each of 5 starts, and again on a return


def test_uniform_doors_have_full_entropy():
    uniform = {(r, g): dict.fromkeys(LAYOUT.doors[r], 1 / len(LAYOUT.doors[r])) for r, g in walks.states(LAYOUT)}
    found = walks.figures(uniform)
    assert found["entropy"] == pytest.approx(1.0) and 0 < found["on_shortest"] < 1 and 0 < found["sampled"] < 1


@pytest.mark.slow
def test_the_probe_leaves_training_as_it_was(tmp_path):
    # two updates of the tiny model, with the probe and without: the same episodes, losses and evaluations
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = ["--model", "tiny-random", "--seeds", "0", "--budget", "0", "--min-updates", "2", "--eval-every", "1e9"]
    flags += ["--num-envs", "4", "--threads", "1"]
    runs = {}
    for name, script in (("probed", "rooms_walks.py"), ("plain", "learning_suite.py")):
        extra = [] if name == "probed" else ["--games", "rooms", "--modes", "score"]
        cmd = [sys.executable, f"benchmarks/{script}", *flags, *extra, "--output", str(tmp_path / name)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (runs[name],) = json.loads((tmp_path / name / "results.json").read_text())["runs"]
    probed, plain = runs["probed"], runs["plain"]
    assert probed["updates"] == plain["updates"] == 2 and probed["episodes"] == plain["episodes"]

    def figures(logged: dict) -> dict:  # what training computed, without its clock
        return {k: v for k, v in logged.items() if k != "train" and not k.startswith("time/")}

    for a, b in zip(probed["updates_log"], plain["updates_log"], strict=True):
        assert figures(a) == figures(b) and len(figures(a)) > 10
    assert [p["normalised"] for p in probed["curve"]] == [p["normalised"] for p in plain["curve"]]
    for point in probed["curve"]:  # before training and at the end
        found = point["probe"]
        assert -1 < found["sampled"] < 1 and -1 < found["greedy"] <= 1 and 0 < found["entropy"] <= 1
        assert 0 < found["on_shortest"] < 1 and all(0 <= e["p_shortest"] < 1 and e["tasks"] for e in found["errors"])
