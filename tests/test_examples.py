"""Each example runs end to end in a subprocess on the tiny random model (CleanRL style)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run_example(script, *args, cwd, launcher=(sys.executable,), env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", **(env_extra or {})}
    env.pop("WANDB_PROJECT", None)
    return subprocess.run(
        [*launcher, str(ROOT / "examples" / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_blackjack_smoke_run_trains_and_writes_metrics_and_adapter(tmp_path):
    result = run_example(
        "blackjack.py",
        "--model",
        "tiny-random",
        "--episodes",
        "4",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all("ppo/policy_loss" in line for line in lines)  # 4 hands, 2 per update
    assert (tmp_path / "run" / "checkpoint" / "adapter_model.safetensors").exists()


def test_blackjack_logs_the_last_partial_batch_update_too(tmp_path):
    run = tmp_path / "run"
    args = ("--model", "tiny-random", "--episodes", "3", "--batch-size", "2", "--num-envs", "1", "--device", "cpu")
    result = run_example("blackjack.py", *args, "--eval-every", "0", "--output-dir", str(run), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["update"] for line in lines] == [1, 2] and "ppo/policy_loss" in lines[-1]  # 2 hands, then 1
    assert "updates 2" in result.stdout


@pytest.mark.parametrize("fsdp", [False, True], ids=["data-parallel", "fsdp"])
def test_blackjack_runs_unchanged_on_two_ranks(tmp_path, fsdp):
    """torchrun, 2 gloo ranks: both train together, rank 0 writes; under FSDP every forward is a collective, so the
    evaluations run on every rank and acting and training keep the ranks' forwards in step (else: a hang)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    sharded = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"} if fsdp else {}
    run = tmp_path / "run"
    script = ("--model", "tiny-random", "--episodes", "32", "--batch-size", "8", "--num-envs", "8", "--device", "cpu")
    args = (*script, "--eval-every", "2", "--output-dir", str(run))
    result = run_example("blackjack.py", *args, cwd=tmp_path, launcher=launcher, env_extra=sharded)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["update"] for line in lines if "ppo/policy_loss" in line] == [1, 2, 3, 4]
    assert lines[1]["dist/world_size"] == 2 and "eval/exact_return" in lines[1]
    for name in ("eval_before.json", "eval.json"):
        assert -1.001 <= json.loads((run / name).read_text())["exact"]["expected_return"] <= 1.001
    assert "exact expected return of the greedy policy" in result.stdout


def test_textworld_smoke_run_trains_and_writes_metrics_adapter_and_eval(tmp_path):
    pytest.importorskip("textworld")  # the optional extra: scripts/bootstrap.py --extras textworld
    run = tmp_path / "run"
    result = run_example(
        "text-world.py",
        *("--model", "tiny-random", "--device", "cpu", "--episodes", "4", "--num-envs", "2", "--batch-size", "2"),
        *("--max-steps", "3", "--world-size", "1", "--nb-objects", "2", "--quest-length", "1", "--eval-episodes", "2"),
        *("--output-dir", str(run)),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines and all("ppo/policy_loss" in line for line in lines)
    assert lines[-1]["episodes"] >= 2
    assert (run / "checkpoint" / "adapter_model.safetensors").exists()
    for name in ("eval_before.json", "eval.json"):
        evaluation = json.loads((run / name).read_text())
        assert evaluation["sampled"]["n"] == 2 and 0 <= evaluation["sampled"]["win_rate"] <= 1
        assert evaluation["greedy"]["steps"] <= 3
