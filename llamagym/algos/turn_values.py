"""A value for each turn's index in its episode, added to the value head's (`PPOConfig.turn_values`).

The value head reads the prompt. Where the reward also hangs on the time an episode has spent, which a prompt need not
show (a score for the fewest moves, a time limit, rooms' d(start, goal) / steps), the best head of the prompt prices a
state after a detour as it prices it on the shortest way, and a bootstrapped advantage (GAE at a low lambda) hands the
detour little of its cost (`benchmarks/lambda_credit.py`: 0.30 at lambda 0.5 on rooms). The one piece of that history
every game has is the turn's index, so V(s, t) = head(s) + b[t]: on rooms' exact tables the best head of that form
hands a detour 0.61 of its cost at lambda 0.5, and 0.95 at 0.95 (0.86 without). Time-aware values as in "Time Limits in
Reinforcement Learning" (Pardo et al., 2018).

The values b (one per index, turns past the last sharing it) are fit with the head, by one ridge regression
(`ppo.ridge_refit`) over its features and a one-hot of the index scaled to the features' root mean square, so that
each b[t] is pulled toward its last value as much as a typical direction of the features is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ppo


def turn_indices(lengths: Tensor, count: int) -> Tensor:
    """(N,) each turn's index in its episode, capped at `count - 1`, from the episodes' lengths (E,) in turn order.

    Example: lengths [2, 3], count 2 -> [0, 1, 0, 1, 1].
    """
    starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return (torch.arange(int(lengths.sum()), device=lengths.device) - starts).clamp(max=count - 1)


def refit(
    features: Tensor, turns: Tensor, targets: Tensor, weight: Tensor, bias: Tensor, values: Tensor, damping: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The head (weight, bias) and the turn values (K,) refit together to `targets` by `ppo.ridge_refit`.

    Args:
        features: (N, H) the head's inputs; turns: (N,) indices in [0, K); targets: (N,) returns;
        weight: (1, H), bias: (1,), values: (K,) the current ones; damping: `PPOConfig.value_refit`.
    Returns:
        (weight, bias, values) with their shapes; the fitted values are features @ weight.T + bias + values[turns].

    Example (damping -> 0, the least-squares fit of least change): features [[1], [-1], [1], [-1]], turns [0, 0, 1, 1],
    targets [2, 0, 3, 1], all zero before -> weight [[1]], and bias + values [0] = 1, bias + values [1] = 2 with
    bias^2 + values^2 least: bias 1, values [0, 1].
    """
    count = len(values)
    scale = features.double().pow(2).mean().sqrt().clamp(min=1e-12)
    onehot = torch.nn.functional.one_hot(turns.long(), count).double() * scale
    both = torch.cat([features.double(), onehot], dim=1)
    start = torch.cat([weight.double(), (values.double() / scale).view(1, -1)], dim=1)
    joint, new_bias = ppo.ridge_refit(both, targets, start, bias.double(), damping)  # (1, H + K): head, then turns
    new_weight, new_values = joint[:, : features.shape[1]], joint[0, features.shape[1] :] * scale
    return new_weight.to(weight.dtype), new_bias.to(bias.dtype), new_values.to(values.dtype)
