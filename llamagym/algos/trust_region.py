"""A trust region on every policy step: the batch's KL(old || new) stays under `max_kl` (TRPO's line search).

Why: with whole-batch minibatches the PPO ratio is 1 on an epoch's first step, so the clip never binds there and
the step size alone decides how far the policy moves. A natural-gradient step moves each input's log-probs by a
set amount whatever their probability, so one step can push a rare (wrong) action of a solved, near-deterministic
state far up. TRPO's answer (Schulman et al. 2015, arXiv:1502.05477, §6) bounds the mean KL between the policy that
collected the batch and the new one, and backtracks a step until the bound holds and the surrogate objective
improved. Here the KL is measured, not predicted: after each optimizer step the minibatch's distinct inputs are
scored again (no gradient; in scoring mode the KL over the candidates is exact and counted per bit of choice,
`modes.score.relative_kl`; in generate mode it is the k3 estimate on the sampled reply tokens) and the adapter is
moved back along the step until it fits.

Each step starts at the scale the last accepted one suggests (`next_start`), as TRPO sizes its step to the bound
before the line search: a proposal that keeps overshooting costs tries, and one that keeps undershooting leaves
most of the bound unused (both were measured on the suite, docs/learning-that-holds.md). A step of zero (a batch of
equal returns, whose advantages are all 0) leaves that scale as it was: its KL of 0 once doubled it on every such
batch, to 8 after a few, and the next real step then took 3-4 measures to come back within the bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def categorical_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim of log-probabilities; entries where p is 0 (-inf, padding) contribute 0.

    Args:
        logp, logq: (..., C) log-probabilities (each row's finite entries sum to 1 in probability).
    Returns:
        (...) the KL of each row, >= 0.
    """
    p = logp.exp()
    diff = torch.where(p > 0, logp - logq, torch.zeros_like(logp))
    return (p * diff).sum(-1).clamp_min(0.0)


def step_scale(scale: float, kl: float, max_kl: float, gained: bool) -> float:
    """The next scale of a rejected step, given the KL it reached at `scale`.

    KL grows about quadratically with a small step, so the scale that reaches 0.9 x `max_kl` is
    scale x sqrt(0.9 x max_kl / kl); it is kept within [0.1, 0.5] x scale so that a poor quadratic fit still makes
    progress and never overshoots. A step inside the bound whose surrogate did not improve is halved.

    Examples: (1.0, kl=4 max_kl, ...) -> 0.474; (1.0, kl=1.5 max_kl, ...) -> 0.5; (1.0, 100 max_kl) -> 0.1.
    """
    if kl <= max_kl and not gained:
        return 0.5 * scale
    return scale * min(0.5, max(0.1, math.sqrt(0.9 * max_kl / kl)))


def next_start(start: float, scale: float, kl: float, max_kl: float, low: float = 1e-3, high: float = 8.0) -> float:
    """The scale the next step starts at, after one that started at `start` was accepted at `scale` with mean KL `kl`.

    The quadratic model's scale for 0.9 x `max_kl` (scale x sqrt(0.9 max_kl / kl)), within [0.5, 2] x `start` (the
    next batch's step has its own size, and a step shrunk for its surrogate rather than its KL says little about
    the next one), and within [`low`, `high`].

    Examples (max_kl 0.02): (1, 1, kl=0.005) -> 1.897; (1, 1, kl=0) -> 2; (0.2, 0.2, kl=0.019) -> 0.195;
    (1, 0.01, kl=0.0003) -> 0.5 (a step halved for its surrogate: the next still starts near the last start).
    """
    suggested = scale * math.sqrt(0.9 * max_kl / kl) if kl > 0 else math.inf
    return min(high, max(low, 0.5 * start, min(2.0 * start, suggested)))


class TrustRegion:
    """Backtracks the last optimizer step of `params` until `measure()` says it is inside the bound.

    Args:
        params: the parameters the policy step moves (the adapter; the value head is not the policy's).
        max_kl: bound on the mean, over the minibatch's turns, of KL(old policy || new policy) per turn, where the
            old policy is the one that collected the batch (so the bound holds across epochs too).
        max_tries: steps measured before giving up; the step is then undone. (The KL along a step is not always
            quadratic: a LoRA update is bilinear in its two matrices, so far from the start the second-order term
            can cancel the first, and a few more tries than the quadratic model needs are allowed.)
        input_factor: also bound the largest KL of one input, at `input_factor` x `max_kl` (so it follows `max_kl`
            when that is rescaled, e.g. annealed); None = only the mean is bound.
    """

    def __init__(
        self, params: list[nn.Parameter], max_kl: float, max_tries: int = 6, input_factor: float | None = None
    ):
        self.params, self.max_kl, self.max_tries, self.input_factor = params, max_kl, max_tries, input_factor
        self.start = 1.0  # the scale the next step is first measured at (see `next_start`); checkpointed
        self._before: list[torch.Tensor] | None = None

    def remember(self) -> None:
        """Call before the optimizer step: the point to backtrack toward."""
        self._before = [p.detach().clone() for p in self.params]

    def binding_kl(self, kl: float, kl_max: float) -> float:
        """The KL the line search sizes the step by: the mean's, or the largest input's in units of the mean's bound
        where that binds more (both grow about as the step squared, so one quadratic model serves either).

        Examples (max_kl 0.02, input_factor 5, i.e. 0.1 on one input): (0.01, 0.05) -> 0.01; (0.01, 0.2) -> 0.04.
        """
        if self.input_factor is None:
            return kl
        return max(kl, kl_max / self.input_factor)

    @torch.no_grad()
    def enforce(self, measure: Callable[[], tuple[float, float, bool]], moved: Callable[[], None]) -> dict[str, float]:
        """Rescale the step just taken to `start`, then shrink it until it fits; returns its `scale` (on the step as
        taken), `kl`, `kl_max` and `tries` (measures made), or `scale` 0 and `tries` when no scale fitted within
        `max_tries` and the step was undone.

        Args:
            measure: scores the policy as it is now: (mean KL per turn, the largest KL of one input, whether the
                surrogate improved on the step's start).
            moved: called whenever the parameters are changed here (to invalidate cached outputs).
        """
        if self._before is None:
            raise RuntimeError("TrustRegion.remember() must be called before the step.")
        before, self._before = self._before, None
        deltas = [p.detach() - b for p, b in zip(self.params, before, strict=True)]
        moving = any(bool(d.any()) for d in deltas)
        scale = start = self.start
        for tries in range(1, self.max_tries + 1):
            if scale != 1.0 or tries > 1:
                for p, b, d in zip(self.params, before, deltas, strict=True):
                    p.copy_(b + scale * d)
                moved()
            kl, kl_max, gained = measure()
            binding = self.binding_kl(kl, kl_max)
            if binding <= self.max_kl and gained:
                if moving:  # a step of zero (every advantage 0) says nothing of the next one's size
                    self.start = next_start(start, scale, binding, self.max_kl)
                return {"scale": scale, "kl": kl, "kl_max": kl_max, "tries": float(tries)}
            scale = step_scale(scale, binding, self.max_kl, gained)
        for p, b in zip(self.params, before, strict=True):
            p.copy_(b)
        moved()  # self.start stays: the step was undone for its surrogate or a KL far off the quadratic model
        return {"scale": 0.0, "tries": float(self.max_tries)}  # undone: back where the step started
