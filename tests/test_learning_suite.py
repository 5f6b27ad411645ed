"""`benchmarks/learning_suite.py --quick` runs every game in both modes end to end and writes its three outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import llamagym.envs as suite

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_suite_trains_and_evaluates_every_game_in_both_modes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "benchmarks/learning_suite.py", "--quick", "--threads", "1", "--output", str(tmp_path)]
    cmd += ["--also-average", "2"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert {(r["game"], r["mode"]) for r in runs} == {(g, m) for g in suite.GAMES for m in ("score", "generate")}
    for run in runs:
        assert run["curve"][0]["train"] == 0 and run["train_s"] >= 3.0  # before training, then the budget
        assert run["updates"] >= 1, (run["game"], run["mode"])  # --quick trains past its budget to an update
        assert run["best"] >= max(run["before"], run["final"])
        assert run["peak_rss_gib"] > 0 and run["final_figures"]["random"] < run["final_figures"]["optimal"]
        # greedy acting uses the averaged adapter: the latest weights are evaluated beside it
        assert run["final_latest"] == run["curve"][-1]["latest_normalised"]
        assert run["curve"][-1]["avg2_normalised"] <= 1.0  # and the average over 2 (--also-average)
    table = (tmp_path / "results.md").read_text()
    assert "| game | mode | seed | before | best | final | latest |" in table and "model: tiny-random" in table
    assert all((tmp_path / f"{game}.png").stat().st_size > 0 for game in suite.GAMES)


def load_benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import learning_suite
    finally:
        sys.path.pop(0)
    return learning_suite


def test_overrides_are_parsed_validated_and_reported():
    learning_suite = load_benchmark()
    args = learning_suite.parse_args(["--quick", "--ppo", "learning_rate=1e-3", "whiten_advantages=False"])
    assert args.overrides["ppo"] == {"learning_rate": 1e-3, "whiten_advantages": False}
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--ppo", "learning_rate=-1"])
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--modes", "telepathy"])
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--group-size", "0"])
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--min-updates", "-1"])
    assert learning_suite.parse_args(["--quick"]).min_updates == 1 and learning_suite.parse_args([]).min_updates == 0
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--device", "tpu"])
    assert learning_suite.parse_args(["--also-average", "3,5"]).also_average == [3, 5]
    assert learning_suite.parse_args([]).also_average == []
    for bad in ("0", "three"):
        with pytest.raises(SystemExit):
            learning_suite.parse_args(["--also-average", bad])


def test_groups_of_envs_share_a_seed_per_episode_and_nothing_else_does():
    group_seed = load_benchmark().group_seed
    seeds = {
        (env, episode): group_seed(3, env, episode, num_envs=5, group_size=2)
        for env in range(5)
        for episode in range(3)
    }
    for episode in range(3):
        assert seeds[0, episode] == seeds[1, episode] and seeds[2, episode] == seeds[3, episode]
    distinct = {(env // 2, episode) for env, episode in seeds}
    assert len(set(seeds.values())) == len(distinct) == 9  # 3 groups (the last of one env) x 3 episodes
