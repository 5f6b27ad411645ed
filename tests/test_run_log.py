"""RunLog: metrics.jsonl flushed per update and cut back to the checkpoint on resume, W&B only when asked for."""

import json
import pickle
import sys
import time
import types
from pathlib import Path

import pytest

from llamagym.agent.checkpoint import MANIFEST, CheckpointError
from llamagym.run_log import RunLog


class FakeAgent:
    """Stands in for `Agent.save` / `Agent.load`: a checkpoint is a manifest and the pickled `extra`."""

    def save(self, directory, extra=None):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "extra.pkl").write_bytes(pickle.dumps(extra))
        (directory / MANIFEST).write_text("{}")
        return directory

    def load(self, directory):
        return pickle.loads((Path(directory) / "extra.pkl").read_bytes())


def lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def no_wandb_project(monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def test_each_update_is_one_line_on_disk_at_once_numbered_and_timed(tmp_path):
    run = RunLog(tmp_path / "run")
    run.start()
    stamped = run.log({"ppo/policy_loss": 0.5})
    assert lines(tmp_path / "run") == [stamped]  # flushed: readable before close, as after a kill
    assert stamped["update"] == 1 and stamped["ppo/policy_loss"] == 0.5 and stamped["elapsed_s"] >= 0
    run.log({"ppo/policy_loss": 0.25})
    assert [line["update"] for line in lines(tmp_path / "run")] == [1, 2]
    run.close()


def test_a_new_run_starts_an_empty_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"update": 1}\n{"update": 2}\n')
    RunLog(tmp_path).start()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_resume_keeps_only_the_lines_of_checkpointed_updates_and_numbers_on(tmp_path):
    first = RunLog(tmp_path)
    first.start()
    first.log({"x": 1.0})
    first.log({"x": 2.0})
    first.save(FakeAgent(), returns=[1.0, -1.0])
    first.log({"x": 3.0})  # never checkpointed: the run is killed here, so this update runs again
    assert len(lines(tmp_path)) == 3

    second = RunLog(tmp_path)
    state = second.load(FakeAgent())
    assert state["returns"] == [1.0, -1.0] and state["updates"] == second.updates == 2
    second.start()
    assert [line["x"] for line in lines(tmp_path)] == [1.0, 2.0]
    assert second.log({"x": 30.0})["update"] == 3
    assert [(line["update"], line["x"]) for line in lines(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_the_clock_goes_on_from_the_checkpoint(tmp_path):
    first = RunLog(tmp_path)
    first.start()
    first._started -= 100.0  # as if it had trained 100 s
    first.save(FakeAgent())
    second = RunLog(tmp_path)
    assert second.load(FakeAgent())["elapsed"] >= 100.0
    second.start()
    time.sleep(0.01)
    assert second.log({})["elapsed_s"] > 100.0


def test_load_without_a_checkpoint_raises_unless_missing_ok(tmp_path):
    run = RunLog(tmp_path)
    with pytest.raises(CheckpointError, match="No checkpoint"):
        run.load(FakeAgent())
    assert run.load(FakeAgent(), missing_ok=True) == {} and run.updates == 0
    (tmp_path / "checkpoint").mkdir()  # a torn checkpoint is an error even so
    with pytest.raises(CheckpointError, match="not a complete"):
        run.load(FakeAgent(), missing_ok=True)


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, stats, step=None):
        self.calls.append(("log", stats, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_is_off_by_default(tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run = RunLog(tmp_path, config={"seed": 0})
    run.log({"x": 1.0})
    run.close({"eval": 1.0})
    assert wandb.calls == []


@pytest.mark.parametrize("project", [None, "my-project"])
def test_wandb_logs_each_update_at_its_step_when_asked_for(tmp_path, monkeypatch, project):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    if project:
        monkeypatch.setenv("WANDB_PROJECT", project)
    run = RunLog(tmp_path, wandb=project is None, config={"seed": 0})
    stamped = run.log({"x": 1.0})
    run.close({"eval": 1.0})
    assert wandb.calls == [
        ("init", {"project": project or "llamagym", "config": {"seed": 0}}),
        ("log", stamped, 1),
        ("log", {"eval": 1.0}, None),
        ("finish",),
    ]


def test_wandb_asked_for_but_missing_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        RunLog(tmp_path, wandb=True)
