"""A training run's record in its output folder: `metrics.jsonl`, optional Weights & Biases, the checkpoint.

The bookkeeping every training script repeats, kept out of its loop so the loop reads top to bottom:

    run = RunLog(args.output_dir, wandb=args.wandb, config=vars(args))
    state = run.load(agent) if args.resume else {}  # the loop's own state, as the last `save` left it
    run.start()
    while ...:  # the RL loop
        ...
        if "ppo/policy_loss" in stats:  # an update ran
            run.log(stats)
            run.save(agent, envs=envs, observations=observations)
    run.close()
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import distributed
from .agent.checkpoint import CheckpointError, resolve_checkpoint

METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint"


class RunLog:
    """The record of one training run in `output_dir` (created if missing).

    - `metrics.jsonl`: `log(stats)` writes one JSON line per update, flushed at once, so a killed run keeps every
      update it logged. `start()` opens it: empty for a new run; after `load`, holding only the lines of the
      updates the checkpoint holds (the later ones run again, and log again).
    - W&B: on when `wandb` is true or the env var WANDB_PROJECT is set (which names the project; else
      "llamagym"); every logged update then goes to W&B too, at step `update`. `wandb` is imported only then, and
      honours its own WANDB_MODE (offline, disabled).
    - `checkpoint/`: `save(agent, **state)` writes the agent's crash-safe checkpoint with the loop's `state`
      (anything picklable: envs, observations, lists of returns) plus `updates` and `elapsed`; `load(agent)`
      restores the agent, the update count and the clock, and returns that state.
    - Data-parallel (several ranks, docs/scaling.md): every rank makes the same calls; rank 0 alone writes
      `metrics.jsonl`, W&B and the checkpoint (into which every rank's own state goes, see `Agent.save`), and every
      rank loads the same checkpoint.

    Attributes:
        dir: the output folder.
        checkpoint: the checkpoint folder, `dir / "checkpoint"`.
        updates: the updates logged so far in this run, resumed ones included.

    Args:
        output_dir: the run's folder.
        wandb: log to Weights & Biases too.
        config: the run's settings (e.g. `vars(args)`), recorded by W&B.

    Raises:
        ImportError: W&B was asked for but `wandb` is not installed; the message says how to install it.
    """

    def __init__(self, output_dir: str | Path, *, wandb: bool = False, config: dict | None = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint = self.dir / CHECKPOINT
        self.updates = 0
        self._elapsed_before = 0.0  # seconds the run had trained before this process (from the checkpoint)
        self._started: float | None = None
        self._metrics = None
        distributed.init_from_env()  # under a launcher (WORLD_SIZE > 1): join its process group; else nothing
        self.writes = distributed.is_main()  # data-parallel: rank 0 alone writes
        wanted = wandb or os.environ.get("WANDB_PROJECT")
        self._wandb = _start_wandb(config) if wanted and self.writes else None

    @property
    def elapsed(self) -> float:
        """Seconds of training: since `start()`, plus those of the run before its checkpoint."""
        if self._started is None:
            return self._elapsed_before
        return time.time() - self._started

    def load(self, agent, missing_ok: bool = False) -> dict:
        """Resume from `checkpoint/` (see `Agent.load`): the agent, the update count and the clock.

        Returns the loop's state as passed to `save` (with `updates` and `elapsed`). With `missing_ok`, a folder
        with no checkpoint yet returns {} and changes nothing (a torn checkpoint still raises).

        Raises:
            CheckpointError: no checkpoint (unless `missing_ok`), a torn one, or one of another base model.
        """
        try:
            resolve_checkpoint(self.checkpoint)
        except CheckpointError:
            if missing_ok and not self.checkpoint.exists():
                return {}
            raise
        state = agent.load(self.checkpoint)
        self.updates, self._elapsed_before = int(state.get("updates", 0)), float(state.get("elapsed", 0.0))
        return state

    def start(self) -> None:
        """Start (or, after `load`, continue) the clock and open `metrics.jsonl`, keeping the lines of the first
        `updates` updates only: call it just before the loop. `log` calls it if the loop did not."""
        self._started = time.time() - self._elapsed_before
        if not self.writes:
            return
        path = self.dir / METRICS
        kept = path.read_text().splitlines()[: self.updates] if self.updates and path.exists() else []
        path.write_text("".join(line + "\n" for line in kept))
        if self._metrics is not None:
            self._metrics.close()
        self._metrics = open(path, "a")  # noqa: SIM115 (open for the run's length; `close` closes it)

    def log(self, stats: dict) -> dict:
        """Record one update's `stats` (a flat dict of numbers): stamped with `update` (its number, from 1, going
        on from a resumed run's) and `elapsed_s`, written as one flushed line, and sent to W&B when it is on.

        Returns the stamped stats.
        """
        if self._started is None:
            self.start()
        self.updates += 1
        stats = {**stats, "update": self.updates, "elapsed_s": self.elapsed}
        if self._metrics is not None:
            self._metrics.write(json.dumps(stats) + "\n")
            self._metrics.flush()
        if self._wandb is not None:
            self._wandb.log(stats, step=self.updates)
        return stats

    def save(self, agent, **state) -> Path:
        """Write the agent's checkpoint (see `Agent.save`) with the loop's `state`, plus `updates` and `elapsed`.

        Call it where the loop's state and the agent's running episodes agree (e.g. after the envs' resets), so
        `load` continues exactly there.
        """
        return agent.save(self.checkpoint, extra={**state, "updates": self.updates, "elapsed": self.elapsed})

    def close(self, final: dict | None = None) -> None:
        """Close `metrics.jsonl` and finish the W&B run, sending it `final` first (e.g. the last evaluation; the
        metrics file holds updates only)."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._wandb is not None:
            if final:
                self._wandb.log(final)
            self._wandb.finish()
            self._wandb = None


def _start_wandb(config: dict | None):
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            "W&B logging (--wandb, or WANDB_PROJECT set) needs the wandb package: `pip install wandb` (or "
            "`python scripts/bootstrap.py --extras wandb`); or unset WANDB_PROJECT to run without it."
        ) from error
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "llamagym"), config=config)
