"""PNG plots of a run: the learning curve against reference returns (a game's own plots live beside it in `envs/`).

matplotlib is optional and imported only when a plot is drawn. Figures are rendered off-screen (Agg) through
`matplotlib.figure.Figure`, so no GUI backend or global pyplot state is touched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _figure(**kwargs: Any):
    """A matplotlib Figure with an Agg canvas; raises a helpful ImportError when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "Plotting needs matplotlib: `pip install matplotlib` (or run `python scripts/bootstrap.py`)."
        ) from e
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format="png")
    return path


def moving_average(returns: Sequence[float], window: int) -> tuple[np.ndarray, np.ndarray]:
    """Trailing mean and standard error over the last `window` returns (fewer for the first episodes).

    Returns:
        means, stderrs: arrays of len(returns); stderr is std (ddof=1) / sqrt(count), 0 while count is 1.
    """
    if window < 1:
        raise ValueError(f"`window` should be at least 1. Received {window}.")
    x = np.asarray(returns, dtype=np.float64)
    s1 = np.concatenate([[0.0], np.cumsum(x)])
    s2 = np.concatenate([[0.0], np.cumsum(x * x)])
    end = np.arange(1, len(x) + 1)
    start = np.maximum(0, end - window)
    count = end - start
    mean = (s1[end] - s1[start]) / count
    var = np.clip((s2[end] - s2[start]) - count * mean**2, 0.0, None) / np.maximum(count - 1, 1)
    return mean, np.sqrt(var / count)


def plot_learning_curve(
    returns: Sequence[float],
    path: str | os.PathLike,
    window: int = 50,
    references: Mapping[str, float] | None = None,
    title: str = "Return per episode",
) -> Path:
    """Plot the trailing mean return with its 95% band and labelled horizontal reference lines.

    Args:
        returns: one return per episode, in order.
        path: where the PNG goes (parent folders are created).
        window: episodes per trailing mean.
        references: label -> expected return, e.g. `{name: r["expected_return"] for name, r in
            llamagym.envs.blackjack.reference_returns().items()}`.
        title: figure title; the episode count is appended.

    Returns:
        The path written.
    """
    if len(returns) == 0:
        raise ValueError("`returns` should hold at least one episode return. Received an empty sequence.")
    mean, stderr = moving_average(returns, window)
    episodes = np.arange(1, len(mean) + 1)
    fig = _figure(figsize=(9, 5), layout="constrained")
    ax = fig.add_subplot()
    ax.fill_between(episodes, mean - 1.96 * stderr, mean + 1.96 * stderr, color="C0", alpha=0.2, lw=0)
    ax.plot(episodes, mean, color="C0", lw=2, label=f"agent (mean of last {window}, 95% band)")
    styles = ["--", "-.", ":", (0, (5, 2, 1, 2))]
    for i, (name, value) in enumerate(sorted((references or {}).items(), key=lambda kv: -kv[1])):
        ax.axhline(value, color=f"C{i + 1}", ls=styles[i % len(styles)], lw=1.5, label=f"{name} ({value:+.3f})")
    ax.set_xlabel("episode")
    ax.set_ylabel("return")
    ax.set_xlim(1, max(2, len(mean)))
    ax.xaxis.get_major_locator().set_params(integer=True)
    # The band of the first few trailing means (1, 2, ... returns) is huge: scale the y-axis to the curve, the
    # references and the band once it averages enough returns, never beyond the returns actually seen.
    settled = np.arange(1, len(mean) + 1) >= min(window, 10)
    band = np.concatenate([mean, (mean - 1.96 * stderr)[settled], (mean + 1.96 * stderr)[settled]])
    lo, hi = max(band.min(), min(returns)), min(band.max(), max(returns))
    lo, hi = min([lo, *(references or {}).values()]), max([hi, *(references or {}).values()])
    pad = 0.05 * (hi - lo) or 0.5
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_title(f"{title} ({len(mean)} episodes)")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return _save(fig, path)
