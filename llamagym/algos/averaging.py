"""Polyak averaging of the adapter: the greedy policy is that of the mean of the last updates' weights.

Why: with batches of 32 episodes a step is mostly noise even on a solved game (Blackjack's returns spread by ~1 per
hand around a 0.03 gap between good and best play), so the trained weights keep moving around the optimum by one
trust-region step after another, and the greedy policy of the latest weights flips near-tied states back and forth.
The average of the weights over the last updates sits near the centre of that walk (Polyak and Juditsky 1992;
in deep RL, Nikishin et al. 2018, "Improving stability in deep RL with weight averaging"). Sampling, and so
training, keeps the current weights: the average never feeds back into the updates.

The average is an exponential one over about `horizon` updates, and over fewer while the run is short: it spans at most
the latest quarter of the updates so far (`average_weight`), so a short run's first, far-behind weights leave it. The
plain mean of every update since the first, the rule until the forty-sixth session, lagged a rising policy by half
the run (the mean age of its weights after 20 updates, about what a slow CPU makes in 10 minutes: 7.4 updates, against
3.4 under this rule); on eight runs of the suite on such a CPU this rule's final greedy policy was as good or better on
every one (docs/learning-that-holds.md). The default horizon (`PPOConfig.average_updates`) is 3, binding from the ninth
update: a policy still rising at the end of a run trails the average of the last 3 updates less than that of the last
10, the default until the fifty-ninth session; side by side on the same runs (eighteen of the suite's scoring games,
on a fast bf16 CPU and a slow fp32 one) 3 ended up to 0.26 higher on guess-the-number and never more than 0.021 lower.
LoRA's A and B are averaged apart; their product's average differs from the product of their averages by
second-order terms in the moves, which are small over a horizon of updates bounded by the trust region.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

SHARE = 4  # the average spans at most the latest 1 / SHARE of the updates so far


def average_weight(count: int, horizon: int) -> float:
    """The weight of the newest weights in the average after `count` updates: 1 / min(ceil(count / SHARE), horizon).

    Examples (SHARE = 4): (1, 10) -> 1.0 and (4, 10) -> 1.0 (the latest weights: a quarter of four updates is one);
    (8, 10) -> 0.5; (40, 10) -> 0.1 (an exponential average over about ten).
    """
    if count < 1 or horizon < 1:
        raise ValueError(f"average_weight needs count >= 1 and horizon >= 1. Received {count!r}, {horizon!r}.")
    return 1.0 / min(-(-count // SHARE), horizon)


class WeightAverage:
    """The running average of `params` over about `horizon` updates; `swapped()` lends it to the model.

    Args:
        params: the adapter's parameters (the policy's trained weights).
        horizon: updates the average spans (>= 1; 1 = the latest weights).
    """

    def __init__(self, params: list[nn.Parameter], horizon: int):
        self.params, self.horizon = params, horizon
        self.count = 0
        self.mean: list[torch.Tensor] | None = None

    @torch.no_grad()
    def update(self) -> None:
        """Fold the parameters as they are now into the average (after each update)."""
        self.count += 1
        weight = average_weight(self.count, self.horizon)
        if self.mean is None:
            self.mean = [p.detach().float().clone() for p in self.params]
            return
        for mean, p in zip(self.mean, self.params, strict=True):
            mean.lerp_(p.detach().float(), weight)

    @contextmanager
    def swapped(self):
        """Inside this block the parameters hold the average (before any update: themselves); restored after."""
        if self.mean is None:
            yield
            return
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            for p, mean in zip(self.params, self.mean, strict=True):
                p.copy_(mean.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(self.params, saved, strict=True):
                    p.copy_(value)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": None if self.mean is None else [m.clone() for m in self.mean]}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]
        means = state["mean"]
        self.mean = None if means is None else [m.to(p.device).clone() for m, p in zip(means, self.params, strict=True)]
