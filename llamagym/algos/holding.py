"""Held inputs, an experiment (`PPOConfig.hold_batches`): a natural step that leaves the policy where the batch
says nothing.

Why: a small LM's states share nearly one direction in the model's tangent kernel, so a step that moves the
batch's ~90 Blackjack states moves the other ~190 as well, the way the batch leans on average. Measured on the
Blackjack example (docs/learning-that-holds.md, seventy-seventh session): about 7/10 of an update's KL over the 280
states lay outside the batch, the trust region (which measures the batch only) never saw it, and those states' flips,
carrying no evidence of their own, made most of a late slide. The natural step is the smallest change that reaches
each batch input's target move; here the inputs of the last few batches that are not in this one join its solve as
rows whose target move is zero (`natural_gradient.natural_coefficients`).

What is held of an input: its likeliest candidate's log-prob against the candidates' mean,
y = sum_c (1[c = top] - p_c) log p_c (`held_outputs`); for a choice of two that is p_other x the log-odds of the
top one, so a step held there cannot flip it to first order, and a near-certain input, which a step barely moves,
weighs little. Scoring mode only (it needs every candidate's log-prob), one process.
"""

from __future__ import annotations

from collections import deque

import torch

from .rollout import Turn


def held_outputs(logprobs: torch.Tensor) -> torch.Tensor:
    """(N,) y = sum_c (1[c = argmax] - p_c) log p_c of each row of candidate log-probs (N, C) (-inf = padding);
    the direction (1[c = argmax] - p) is taken as a constant, so d y / d logprobs is that direction.

    Examples: (log 0.75, log 0.25) -> 0.25 x log 3 = 0.2747; uniform rows -> 0; (log 0.5, log 0.5, -inf) -> 0.
    """
    p = logprobs.detach().exp()
    top = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).to(p.dtype)
    direction = torch.where(p > 0, top - p, torch.zeros_like(p))
    return (direction * torch.where(p > 0, logprobs, torch.zeros_like(logprobs))).sum(-1)


class HeldInputs:
    """The distinct inputs of the last `batches` batches, one turn each (the input is what is held, not the turn).

    Use: `others(mode, turns)` before an update, the inputs to hold in it (those of earlier batches of the same
    action mode that are not among `turns`); `add(mode, turns)` after it. Checkpointed with the trainer
    (`state_dict`), so a resumed run holds what it would have held.
    """

    def __init__(self, batches: int):
        self._batches: deque[tuple[str, dict[tuple, Turn]]] = deque(maxlen=batches)

    def others(self, mode, turns: list[Turn]) -> list[Turn]:
        """One turn per input met in the remembered batches of `mode` and not in `turns`, most recent first."""
        seen = {mode.input_key(turn) for turn in turns}
        held = []
        for name, inputs in reversed(self._batches):
            if name != mode.name:
                continue
            for key, turn in inputs.items():
                if key not in seen:
                    seen.add(key)
                    held.append(turn)
        return held

    def add(self, mode, turns: list[Turn]) -> None:
        """Remember this batch's inputs (the oldest remembered batch is forgotten past `batches`)."""
        self._batches.append((mode.name, {mode.input_key(turn): turn for turn in turns}))

    def state_dict(self) -> dict:
        return {"batches": list(self._batches)}

    def load_state_dict(self, state: dict) -> None:
        self._batches = deque(state["batches"], maxlen=self._batches.maxlen)
