"""The Blackjack policy picture: hit/stick heatmaps of a policy beside the optimal one (matplotlib, imported lazily).

Rendered off-screen like `llamagym.plots`, whose figure helpers it shares.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..plots import _figure, _save
from .blackjack import optimal_policy, policy_table

STICK_COLOR, HIT_COLOR = "#9ecae1", "#fd8d3c"


def _as_grid(rows: Mapping[Any, Sequence[float]]) -> tuple[list[int], np.ndarray]:
    """Player sums (ascending) and the P(hit) grid; accepts int or str keys (a table read back from JSON)."""
    items = sorted((int(total), row) for total, row in rows.items())
    return [total for total, _ in items], np.array([row for _, row in items], dtype=np.float64)


def plot_blackjack_policy(
    agent_table: Mapping[str, Mapping[Any, Sequence[float]]],
    optimal_table: Mapping[str, Mapping[Any, Sequence[float]]] | None,
    path: str | os.PathLike,
    title: str = "Blackjack policy: agent vs optimal",
) -> Path:
    """Heatmaps of hit/stick: rows hard and soft totals, columns the agent and the optimal policy.

    Args:
        agent_table, optimal_table: `policy_table(...)` outputs, `{"hard"|"soft": {sum: [P(hit) vs dealer
            A..10]}}`. `optimal_table=None` uses `optimal_policy()`.
        path: where the PNG goes.
        title: figure title.

    Returns:
        The path written. Agent cells that differ from the optimal action are outlined in black.
    """
    if optimal_table is None:
        optimal_table = policy_table(optimal_policy())
    fig = _figure(figsize=(10, 11), layout="constrained")  # first, for its ImportError message
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.patches import Patch, Rectangle

    cmap = LinearSegmentedColormap.from_list("stick_hit", [STICK_COLOR, HIT_COLOR])
    axes = fig.subplots(2, 2, gridspec_kw={"height_ratios": [18, 10]})
    differ = 0
    for row, (kind, label) in enumerate((("hard", "hard total"), ("soft", "soft total (usable ace)"))):
        sums, agent = _as_grid(agent_table[kind])
        opt_sums, optimal = _as_grid(optimal_table[kind])
        if sums != opt_sums or agent.shape != optimal.shape:
            raise ValueError(f"The agent and optimal `{kind}` tables cover different states: {sums} vs {opt_sums}.")
        mismatch = np.abs(agent - optimal) > 1e-9
        differ += int(mismatch.sum())
        for col, (name, grid) in enumerate((("agent", agent), ("optimal", optimal))):
            ax = axes[row, col]
            ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=1.0, origin="lower", aspect="auto")
            for (i, j), p in np.ndenumerate(grid):
                text = "H" if p == 1.0 else "S" if p == 0.0 else f"{p:.1f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=9)
                if name == "agent" and mismatch[i, j]:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="black", lw=2))
            ax.set_xticks(range(grid.shape[1]), ["A"] + [str(c) for c in range(2, grid.shape[1] + 1)])
            ax.set_yticks(range(len(sums)), [str(s) for s in sums])
            ax.set_xlabel("dealer showing")
            ax.set_ylabel(f"player {label}")
            ax.set_title(f"{name}: {kind} hands")
    legend = [Patch(color=HIT_COLOR, label="H = hit"), Patch(color=STICK_COLOR, label="S = stick")]
    legend.append(Patch(fill=False, ec="black", lw=2, label=f"differs from optimal ({differ} cells)"))
    fig.legend(handles=legend, loc="outside lower center", ncols=3, frameon=False)
    fig.suptitle(title)
    return _save(fig, path)
