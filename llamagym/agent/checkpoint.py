"""Crash-safe checkpoints: everything needed to resume training, written atomically.

A checkpoint is written into a temporary sibling directory, its manifest last, then swapped into place with
renames, so a kill at any moment leaves the previous or the new checkpoint whole, never a torn one. The
manifest records the files (with sizes), the library version and the base model, and loading checks them.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
FORMAT = 2  # bump when a checkpoint written by this version can no longer be read by older ones
# 2: llamagym 0.3 moved modules into agent/, algos/ and models/; format-1 checkpoints pickled their episodes under
# the old module names, which loading maps to the new ones
MOVED_MODULES = {"llamagym.rollout": "llamagym.algos.rollout", "llamagym.slots": "llamagym.agent.running_episodes"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return super().find_class(MOVED_MODULES.get(module, module), name)


class _RenamingPickle:  # the pickle module `torch.load` is given: the standard one, with moved modules renamed
    Unpickler = _Unpickler
    load = staticmethod(lambda file, **kwargs: _Unpickler(file, **kwargs).load())


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, or belongs to another model or an incompatible version."""


def rng_state() -> dict:
    """The global random states of python, numpy and torch."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(agent, directory: str | Path, extra: dict | None = None) -> Path:
    """Write the agent's adapter and value head (`Policy.save`), its `state_dict()` (trainer state: optimizer, KL
    controller, replay buffer, counters; the episode count; its running episodes and the finished ones not yet
    trained on), the global RNG states and `extra` (anything picklable the caller needs to resume, e.g. the envs and
    their observations) into `directory`."""
    from .. import __version__

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-{os.getpid()}-", dir=directory.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is an ordinary folder
    try:
        agent.policy.save(tmp)
        state = {**agent.state_dict(), "rng": rng_state(), "extra": extra or {}}  # trainer, episode_count, episodes
        torch.save(state, tmp / STATE_FILE)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        manifest = {
            "format": FORMAT,
            "llamagym_version": __version__,
            "base_model": model_name(agent),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
        }
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=2))
        _swap_into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_checkpoint(agent, directory: str | Path, restore_rng: bool = True, restore_episodes: bool = True) -> dict:
    """Load a checkpoint written by `save_checkpoint` into `agent`; returns its `extra` dict.

    `restore_episodes` continues the running episodes (the caller restores its envs); without it they are dropped
    and fresh ones start. The finished, untrained episodes come back either way.

    Raises:
        CheckpointError: nothing there, a torn or corrupt checkpoint, another base model, or a newer format.
    """
    directory = resolve_checkpoint(directory)
    manifest = read_manifest(directory)
    if manifest.get("format", 0) > FORMAT:
        raise CheckpointError(
            f"{directory} was written by llamagym {manifest.get('llamagym_version')} in checkpoint "
            f"format {manifest['format']}; this version reads format {FORMAT}. Upgrade llamagym."
        )
    expected, actual = manifest.get("base_model"), model_name(agent)
    if expected != actual:
        raise CheckpointError(
            f"{directory} was trained on base model {expected!r}, but this agent uses {actual!r}. "
            "Load it with the same --model."
        )
    for name, size in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            raise CheckpointError(
                f"{directory} is damaged: {name} is missing or has the wrong size. "
                "Delete it to start over, or restore a backup."
            )
    try:
        agent.policy.load(directory)
        state = torch.load(directory / STATE_FILE, weights_only=False, pickle_module=_RenamingPickle)
        agent.load_state_dict(state, restore_episodes)
    except (OSError, RuntimeError, ValueError, KeyError, EOFError) as exc:
        raise CheckpointError(f"{directory} could not be loaded: {exc}") from exc
    if restore_rng:
        set_rng_state(state["rng"])
    return state["extra"]


def read_manifest(directory: Path) -> dict:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} has no {MANIFEST}: it is not a complete llamagym checkpoint.") from None
    except ValueError as exc:
        raise CheckpointError(f"{directory}/{MANIFEST} is corrupt ({exc}).") from None


def resolve_checkpoint(directory: str | Path) -> Path:
    """`directory` if it holds a complete checkpoint; after a kill during the swap, the newest complete sibling."""
    directory = Path(directory)
    if (directory / MANIFEST).is_file():
        return directory
    siblings = [p for p in directory.parent.glob(f".{directory.name}.*-*") if (p / MANIFEST).is_file()]
    if siblings:
        return max(siblings, key=lambda p: (p / MANIFEST).stat().st_mtime)
    if directory.exists():
        raise CheckpointError(f"{directory} has no {MANIFEST}: it is not a complete llamagym checkpoint.")
    raise CheckpointError(f"No checkpoint at {directory}.")


def model_name(agent) -> str:
    spec = getattr(agent, "spec", None)
    if spec is not None and spec.name != "generic":
        return spec.name
    return str(getattr(agent.policy.causal_lm().config, "name_or_path", "")) or "unknown"


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _swap_into_place(tmp: Path, directory: Path) -> None:
    """Replace `directory` by `tmp`: the old one is renamed aside first and removed only after the swap."""
    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}-{time.time_ns()}")
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for stale in directory.parent.glob(f".{directory.name}.*-*"):  # left by a writer killed mid-save
        if not _writer_alive(stale.name):
            shutil.rmtree(stale, ignore_errors=True)


def _writer_alive(name: str) -> bool:
    """Whether the process that named a temporary `.<name>.tmp-<pid>-...` / `.<name>.old-<pid>-...` may still run."""
    try:
        pid = int(name.rsplit(".", 1)[-1].split("-")[1])
    except (IndexError, ValueError):
        return True  # not named by us: leave it
    if pid == os.getpid():
        return False
    if os.name != "posix":
        return True  # os.kill(pid, 0) is no probe on Windows (signal 0 is CTRL_C_EVENT there)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True
