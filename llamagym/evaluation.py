"""Sampled evaluation of any agent: mean return with a confidence interval, outcome rates, and atomic JSON output.

For Blackjack prefer the exact numbers of `llamagym.envs.blackjack`; this module is for every other environment,
and for checking those exact numbers against the real env.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


def summarize_returns(returns: Sequence[float], max_rates: int = 10, outcomes: bool = True) -> dict[str, Any]:
    """Mean, standard deviation and a 95% confidence interval of the mean, plus outcome rates.

    The interval is the normal approximation mean ± 1.96·std/√n with the sample std (ddof=1); it is fine for a few
    dozen episodes or more and collapses to the mean when n = 1 (std is reported as 0 then).

    Args:
        returns: one return per episode.
        max_rates: report `rates` only when there are at most this many distinct return values.
        outcomes: name the returns +1, 0, -1 win, draw and loss (as in Blackjack); False where they mean something
            else (e.g. a score of 0 is a lost game).

    Returns:
        `{"mean", "std", "stderr", "n", "ci_low", "ci_high"}` (floats, `n` an int); plus
        `"rates": {value: fraction}` (float keys, sorted) when the returns take at most `max_rates` values; plus
        `"win"`, `"draw"`, `"loss"` (the fractions of +1, 0 and -1) when `outcomes` and every return is in {-1, 0, 1}.

    Raises:
        ValueError: `returns` is empty or holds a non-finite value.
    """
    n = len(returns)
    if n == 0:
        raise ValueError("`returns` should hold at least one episode return. Received an empty sequence.")
    values = [float(r) for r in returns]
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"Every return should be finite. Received {[v for v in values if not math.isfinite(v)]}.")
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    stderr = std / math.sqrt(n)
    stats: dict[str, Any] = {
        "mean": mean,
        "std": std,
        "stderr": stderr,
        "n": n,
        "ci_low": mean - Z_95 * stderr,
        "ci_high": mean + Z_95 * stderr,
    }
    counts: dict[float, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    if len(counts) <= max_rates:
        stats["rates"] = {v: counts[v] / n for v in sorted(counts)}
    if outcomes and set(counts) <= {-1.0, 0.0, 1.0}:
        stats.update({name: counts.get(v, 0) / n for name, v in (("win", 1.0), ("draw", 0.0), ("loss", -1.0))})
    return stats


def sampled_return(play_episode: Callable[[int], float], episodes: int, seed: int = 0) -> dict[str, Any]:
    """Play `episodes` episodes and summarize their returns (see `summarize_returns`).

    Args:
        play_episode: plays one full episode and returns its undiscounted return. It receives the episode's seed,
            `seed + i` for episode i, to pass to `env.reset(seed=...)` (and to any sampling of its own), so the
            evaluation is reproducible and two agents can be compared on the same deals.
        episodes: how many episodes to play (at least 1).
        seed: seed of the first episode.

    Raises:
        ValueError: `episodes` is below 1.
    """
    if episodes < 1:
        raise ValueError(f"`episodes` should be at least 1. Received {episodes}.")
    return summarize_returns([play_episode(seed + i) for i in range(episodes)])


def _to_builtin(obj: Any) -> Any:
    """json fallback for numpy/torch scalars and arrays, and for paths."""
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable.")


def save_json(path: str | os.PathLike, data: Any) -> Path:
    """Write `data` as indented JSON atomically: to a temporary file in the same folder, then `os.replace`.

    A reader (or a crash) never sees a half-written file. Parent folders are created. Numpy/torch scalars and
    arrays are converted with `.tolist()`; non-string dict keys become strings, as `json` does.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # same folder, so os.replace is atomic
    try:
        with open(tmp, "x", encoding="utf-8") as f:  # a plain open honours the umask, unlike mkstemp's 0600
            json.dump(data, f, indent=2, default=_to_builtin, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
