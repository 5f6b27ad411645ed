"""Exact resume of the Blackjack example: stopped or SIGKILLed runs, resumed, match the uninterrupted run exactly.

Each run is a subprocess on the tiny random model (CPU, fp32, one thread, fixed seed). The stats of every update
(timings aside) and the final adapter and value-head weights must be identical, not close.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llamagym.agent.checkpoint import MANIFEST, STATE_FILE, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = "--model tiny-random --device cpu --precision fp32 --episodes 80 --num-envs 4 --batch-size 4"
TIMING_KEYS = {"time/update_s", "elapsed_s"}
pytestmark = pytest.mark.slow


def command(output_dir, *args):
    script = str(ROOT / "examples" / "blackjack.py")
    return [
        sys.executable,
        script,
        *SETTINGS.split(),
        "--checkpoint-every",
        "1",
        "--output-dir",
        str(output_dir),
        *args,
    ]


def environment():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("WANDB_PROJECT", None)
    return env


def run(output_dir, *args):
    result = subprocess.run(command(output_dir, *args), env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def metrics(output_dir):
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def weights(output_dir):
    checkpoint = Path(output_dir) / "checkpoint"
    return {
        f"{f}:{k}": v
        for f in ("adapter_model", "value_head")
        for k, v in load_file(checkpoint / f"{f}.safetensors").items()
    }


def assert_same_run(output_dir, reference):
    # json round-trips floats exactly (and NaN as NaN), so string equality is exact equality that also equates NaNs
    assert json.dumps(metrics(output_dir)) == json.dumps(metrics(reference))
    ours, theirs = weights(output_dir), weights(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (
        json.loads((output_dir / "eval.json").read_text())["exact"]
        == json.loads((reference / "eval.json").read_text())["exact"]
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    run(output_dir)
    assert len(metrics(output_dir)) >= 10
    return output_dir


def test_a_run_stopped_after_k_updates_and_resumed_equals_the_uninterrupted_run(uninterrupted, tmp_path):
    stopped = run(tmp_path, "--max-updates", "3")
    assert "stopped after 3 updates" in stopped.stdout and len(metrics(tmp_path)) == 3
    run(tmp_path, "--resume")
    assert_same_run(tmp_path, uninterrupted)


def test_a_sigkill_mid_run_loses_at_most_the_batch_in_progress_and_the_resumed_run_is_exact(uninterrupted, tmp_path):
    process = subprocess.Popen(
        command(tmp_path), env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None:
            path = tmp_path / "metrics.jsonl"
            if (tmp_path / "checkpoint" / MANIFEST).exists() and path.exists() and path.read_text().count("\n") >= 4:
                break
            time.sleep(0.01)
        time.sleep(0.03)  # well inside the next update (one takes ~80 ms here): collecting, training or saving
        assert process.poll() is None, "the run ended before it could be killed"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    logged = (tmp_path / "metrics.jsonl").read_text().count("\n")  # updates finished before the kill
    saved = torch.load(resolve_checkpoint(tmp_path / "checkpoint") / STATE_FILE, weights_only=False)["extra"]
    assert saved["updates"] >= logged - 1  # only the update being checkpointed when the kill came can be lost

    run(tmp_path, "--resume")
    resumed = metrics(tmp_path)
    assert [line["update"] for line in resumed] == list(range(1, len(resumed) + 1))
    assert saved["updates"] < len(resumed) and resumed[saved["updates"]]["episodes"] > len(saved["returns"])
    assert_same_run(tmp_path, uninterrupted)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint.")]  # no torn leftovers
