"""Action modes: how the policy's actions are taken and trained on, one file each.

- `generate.py` `GenerateMode`: an action is a sampled reply; it is trained token by token (`Policy.forward`)
- `score.py`    `ScoreMode`: an action is one of a list of candidate replies; it is trained as one choice among
                them, all scored in one pass (`Policy.score`)

The trainer asks the turns' mode (`mode_of`) how to collate them, which turns share a model input (`input_key`),
how to evaluate them and how far the policy moved on them; it never asks which mode it holds. A new mode is a
subclass of `ActionMode` in a new file, named in `MODES`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..rollout import Turn, UpdateBatch, numbered


class Evaluation(NamedTuple):
    """The current policy's outputs on some rows of an update's batch, one row per turn."""

    logprobs: torch.Tensor  # (P, T) log-probs of the actions (T = 1 for a choice among candidates)
    mask: torch.Tensor  # (P, T) float: which of them count
    values: torch.Tensor  # (P,) V(s)
    entropy: torch.Tensor | None  # (P, T) the policy's entropy there, when asked for
    dists: torch.Tensor | None  # (P, C) log-probs of every candidate (scoring), else None


class ActionMode:
    """How an action is taken and trained on (see the module docstring). Subclasses fill in every method.

    `exact_kl`: the KL between two policies on a turn is exact (over the candidates), so natural-gradient steps
    and the trust region are used by default; otherwise only when `PPOConfig` asks for them.
    """

    name = ""
    exact_kl = False

    def acted(self, turn: Turn) -> bool:
        """Whether `turn` was taken in this mode."""
        raise NotImplementedError

    def input_key(self, turn: Turn) -> tuple:
        """What the model sees of `turn`: turns with the same key get the same log-probs and values."""
        raise NotImplementedError

    def collate(self, turns: list[Turn], pad_token_id: int, device: torch.device | str = "cpu"):
        """The turns' padded tensors (a `TurnBatch` or a `ScoreBatch`)."""
        raise NotImplementedError

    def action_mask(self, batch) -> torch.Tensor:
        """(N, T) float mask of the action log-probs of a collated batch."""
        raise NotImplementedError

    def evaluate(
        self,
        policy,
        batch,
        part: torch.Tensor,
        first: torch.Tensor,
        inverse: torch.Tensor,
        with_entropy: bool = False,
        watch=None,
        reference: bool = False,
    ) -> Evaluation:
        """The policy's outputs on rows `part` of `batch`, computed once per distinct input: rows `part[first]`
        are run and `inverse` spreads them back over `part`. `watch` (a `RowGradients.watch`) is given the
        per-input outputs the loss is computed from."""
        raise NotImplementedError

    def empty_distributions(self, batch) -> torch.Tensor | None:
        """An (N, C) table for the old policy's distributions over the candidates, or None when there are none."""
        return None

    def kl(self, data: UpdateBatch, part: torch.Tensor, now: Evaluation) -> torch.Tensor:
        """(P,) KL(old || now) per turn of rows `part`, the old policy's outputs being `data`'s."""
        raise NotImplementedError

    def distinct_inputs(self, turns: list[Turn]) -> torch.Tensor:
        """(N,) id of each turn's model input (`input_key`), numbered by first appearance: equal ids mean equal
        log-probs and values. Small observation spaces repeat inputs often (Blackjack has 280 states)."""
        return numbered([self.input_key(turn) for turn in turns])


from .generate import GenerateMode  # noqa: E402  (the modes subclass ActionMode)
from .score import ScoreMode  # noqa: E402

MODES: dict[str, ActionMode] = {"generate": GenerateMode(), "score": ScoreMode()}


def mode_of(turns: list[Turn]) -> ActionMode:
    """The mode the turns were taken in; all turns must share one.

    Raises:
        ValueError: the turns mix modes.
    """
    modes = {name for name, mode in MODES.items() for turn in turns if mode.acted(turn)}
    if len(modes) != 1:
        raise ValueError("A batch mixes generated and scored turns; keep one action mode per agent.")
    return MODES[modes.pop()]


__all__ = ["MODES", "ActionMode", "Evaluation", "GenerateMode", "ScoreMode", "mode_of"]
