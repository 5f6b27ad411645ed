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
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert {(r["game"], r["mode"]) for r in runs} == {(g, m) for g in suite.GAMES for m in ("score", "generate")}
    for run in runs:
        assert run["curve"][0]["train"] == 0 and run["train_s"] >= 3.0  # before training, then the budget
        assert run["best"] >= max(run["before"], run["final"])
        assert run["peak_rss_gib"] > 0 and run["final_figures"]["random"] < run["final_figures"]["optimal"]
    table = (tmp_path / "results.md").read_text()
    assert "| game | mode | seed | before | best | final |" in table and "model: tiny-random" in table
    assert all((tmp_path / f"{game}.png").stat().st_size > 0 for game in suite.GAMES)


def test_overrides_are_parsed_validated_and_reported():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import learning_suite
    finally:
        sys.path.pop(0)
    args = learning_suite.parse_args(["--quick", "--ppo", "learning_rate=1e-3", "whiten_advantages=False"])
    assert args.overrides["ppo"] == {"learning_rate": 1e-3, "whiten_advantages": False}
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--ppo", "learning_rate=-1"])
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--modes", "telepathy"])
