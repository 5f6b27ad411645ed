"""Advantage estimators as plug-ins: pure functions from a batch's per-turn rewards to advantages and returns.

Each estimator takes an `AdvantageBatch` (the batch's turns in order, flat) and `gamma`, `lam`, `scale`, and returns
an `Estimate`: advantages (T,), returns (T,) (the value head's targets) and a small stats dict. They are registered
by name with `register_estimator(name, needs_value)`; `PPOConfig.advantage` picks one, `get_estimator` looks it up.

- `gae`:   GAE over the turns of each episode with the value head, bootstrapping truncated episodes (the default).
- `grpo`:  the episode's return minus its group's mean (/ the group's std when `scale`), on every turn of it.
- `rloo`:  the episode's return minus the mean of the other episodes of its group (leave-one-out).
- `rebn`:  discounted returns-to-go normalised over the whole batch (GEM's ReBN).
- `gigpo`: grpo's episode advantage plus a step advantage within turns that acted in the same state (GiGPO).

Notation: turn t of episode e(t); G_t = Σ_{k≥0} γ^k r_{t+k} over the rest of its episode (no bootstrap) is its
discounted return-to-go; an episode's return R_e = G at its first turn (= Σ r at γ = 1). Critic-free estimators
ignore `values`, `terminal` and `bootstrap`, and return G as the returns. A group (of episodes, or of turns for
gigpo's step groups) whose returns are all equal, a group of one included, says nothing about which action was
better: its advantage is exactly 0, and it is counted in `adv/zero_variance_groups`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from . import ppo

EPS = 1e-6  # added to a std before dividing by it


class AdvantageBatch(NamedTuple):
    """One batch's turns, episode after episode, as flat tensors. T turns, E episodes."""

    rewards: Tensor  # (T,) float: the turn's reward (env reward minus the KL penalty)
    episode: Tensor  # (T,) long: the turn's episode index, 0..E-1, non-decreasing (an episode's turns are adjacent)
    terminal: Tensor  # (E,) bool: the episode ended (True) or was truncated (False, bootstraps under gae)
    group: Tensor  # (E,) long: the episode's group id (episodes of one task/start state share it)
    values: Tensor | None = None  # (T,) float: V(s) of the turn's state; needed by `gae` only
    bootstrap: Tensor | None = None  # (E,) float: V(next state) of truncated episodes (unused where terminal)
    step_key: Tensor | None = None  # (T,) long: the state (e.g. prompt) the turn acted in; needed by `gigpo` only
    action_key: Tensor | None = None  # (T,) long: the (state, reply) pair the turn took; set and read by the
    # trainer under `pool_tail` only, by no estimator


class Estimate(NamedTuple):
    advantages: Tensor  # (T,)
    returns: Tensor  # (T,) the value head's targets
    stats: dict[str, float]  # e.g. adv/groups, adv/zero_variance_groups (group estimators only)


Estimator = Callable[..., Estimate]  # (batch: AdvantageBatch, gamma: float, lam: float, scale: bool) -> Estimate
ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, needs_value: bool) -> Callable[[Estimator], Estimator]:
    """Register `fn(batch, gamma, lam, scale) -> Estimate` under `name` (a decorator); `needs_value` says whether
    it reads `batch.values` and `batch.bootstrap` (the trainer then computes the bootstrap values).

    Raises:
        ValueError: `name` is already registered.
    """

    def decorate(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"An advantage estimator named {name!r} is already registered.")
        fn.needs_value = needs_value
        ESTIMATORS[name] = fn
        return fn

    return decorate


def get_estimator(name: str) -> Estimator:
    """The estimator registered as `name` (with its `needs_value` attribute).

    Raises:
        ValueError: no estimator has that name; the message lists the known ones.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"Unknown advantage estimator {name!r}. Known: {', '.join(ESTIMATORS)}.")
    return ESTIMATORS[name]


def names() -> tuple[str, ...]:
    """The registered estimators' names, in registration order."""
    return tuple(ESTIMATORS)


# ---- shared pieces -------------------------------------------------------------------------------------------------
def returns_to_go(rewards: Tensor, episode: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ G_{t+1} within each episode, G = r at an episode's last turn (no bootstrap). (T,) -> (T,).

    Example: rewards [1, 2, 3], episode [0, 0, 1], γ = 0.5 -> [2, 2, 3].
    """
    same = torch.ones_like(rewards)
    same[:-1] = (episode[1:] == episode[:-1]).to(rewards.dtype)  # 0 at an episode's last turn
    out, running = torch.empty_like(rewards), torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * same[t] * running
        out[t] = running
    return out


def episode_returns(returns: Tensor, episode: Tensor, num_episodes: int) -> Tensor:
    """R_e = G at the first turn of episode e. returns, episode: (T,) -> (E,)."""
    first = torch.full((num_episodes,), len(episode), device=episode.device)
    first = first.scatter_reduce(0, episode, torch.arange(len(episode), device=episode.device), "amin")
    return returns[first]


def group_centered(x: Tensor, group: Tensor, scale: bool, leave_one_out: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """x minus its group's mean (/ the group's std + EPS when `scale`; the std is Bessel-corrected), 0 on every
    member of a group whose x are all equal (a group of one included). `leave_one_out` subtracts instead the
    mean of the other members, (n x_i - Σ x) / (n - 1).

    Args:
        x: (N,) float. group: (N,) long ids (any values), or (N, K) rows of ids (a group per distinct row).
    Returns:
        (N,) centered x; per group (in sorted id order): (G,) member counts, (G,) bool "all x equal".
    """
    inverse, n, total = ppo.group_sums(x, group)
    mean = total / n
    high = torch.full_like(n, -torch.inf).scatter_reduce(0, inverse, x, "amax")
    low = torch.full_like(n, torch.inf).scatter_reduce(0, inverse, x, "amin")
    equal = (high - low) <= 1e-6 * (1.0 + torch.maximum(high.abs(), low.abs()))  # float noise of equal returns
    if leave_one_out:
        centered = (n[inverse] * x - total[inverse]) / (n[inverse] - 1).clamp(min=1.0)
    else:
        centered = x - mean[inverse]
        if scale:
            var = torch.zeros_like(n).index_add_(0, inverse, centered**2) / (n - 1).clamp(min=1.0)
            centered = centered / (var.sqrt()[inverse] + EPS)
    centered = torch.where(equal[inverse], torch.zeros_like(centered), centered)
    return centered, n, equal


def pooled_tail(low: Tensor, high: Tensor, key: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Advantages at a low lambda given back, per (state, reply), as much of a higher lambda's as the batch shows
    to be more than noise: an empirical-Bayes shrinkage of the tail D = high - low over groups of equal `key`.

    A_t = low_t + m + w_g (mean_g D - m),  w_g = τ² / (τ² + σ² / n_g),  m = mean D over the batch;
    σ² = the pooled within-group variance of D (Σ (n_g - 1) degrees of freedom), τ² = max(0, Σ_g (mean_g D - m)² /
    (G - 1) - mean_g σ² / n_g) (method of moments). A group's summed advantage (what a whole-batch step sees for its
    identical inputs) is then the high lambda's where its tail is systematic (a cost the value head cannot see, the
    same each time: w -> 1), the low lambda's where the tail is the noise of later draws (w -> 0). With no group of
    two or more (σ² unknown) or a single group, w = 0. A zero-variance tail gives w = 1.

    Args:
        low, high: (T,) advantages of the same turns at the two lambdas. key: (T,) long, a turn's (state, reply) id.
    Returns:
        (T,) advantages; stats adv/tail_weight (w averaged over turns), adv/tail_signal (τ²), adv/tail_noise (σ²).
    """
    tail = high - low
    inverse, n, total = ppo.group_sums(tail, key)
    mean, m, groups = total / n, tail.mean(), len(n)
    dof = float((n - 1).sum())
    if dof == 0 or groups < 2:
        weight = torch.zeros_like(n)
        sigma2 = tau2 = torch.full((), float("nan"))
    else:
        sigma2 = ((tail - mean[inverse]) ** 2).sum() / dof
        tau2 = (((mean - m) ** 2).sum() / (groups - 1) - (sigma2 / n).mean()).clamp(min=0.0)
        denominator = tau2 + sigma2 / n
        weight = torch.where(denominator > 0, tau2 / denominator.clamp(min=torch.finfo(n.dtype).tiny), 1.0)
    advantages = low + m + weight[inverse] * (mean[inverse] - m)
    stats = {"adv/tail_weight": float(weight[inverse].mean()), "adv/tail_signal": float(tau2)}
    return advantages, {**stats, "adv/tail_noise": float(sigma2)}


def _group_stats(n: Tensor, equal: Tensor) -> dict[str, float]:
    return {"adv/groups": float(len(n)), "adv/zero_variance_groups": float(equal.sum())}


# ---- estimators ----------------------------------------------------------------------------------------------------
@register_estimator("gae", needs_value=True)
def gae(batch: AdvantageBatch, gamma: float, lam: float, scale: bool = True) -> Estimate:
    """Generalized Advantage Estimation over the turns of each episode (`ppo.gae`), the value head as baseline.

    A_t = δ_t + γλ(1 - d_t) A_{t+1},  δ_t = r_t + γ(1 - d_t) V_{t+1} - V_t;  R_t = A_t + V_t.
    d = 1 at a terminal episode's last turn; a truncated one continues into V_T = bootstrap[e]. `scale` is unused
    (the trainer whitens gae's advantages itself, `PPOConfig.whiten_advantages`). No stats.

    Raises:
        ValueError: `batch.values` is None.
    """
    if batch.values is None:
        raise ValueError("The gae estimator needs `values` (the value head's V(s) per turn).")
    rewards, values = batch.rewards, batch.values
    advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
    counts = torch.bincount(batch.episode, minlength=len(batch.terminal)).tolist()
    offset = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        dones = torch.zeros(n, device=rewards.device)
        terminal = bool(batch.terminal[e])
        if terminal:
            dones[-1] = 1.0
        if terminal or batch.bootstrap is None:
            last_value = torch.zeros((), device=rewards.device)
        else:
            last_value = batch.bootstrap[e]
        span = slice(offset, offset + n)
        advantages[span], returns[span] = ppo.gae(rewards[span], values[span], dones, last_value, gamma, lam)
        offset += n
    return Estimate(advantages, returns, {})


@register_estimator("grpo", needs_value=False)
def grpo(batch: AdvantageBatch, gamma: float, lam: float = 1.0, scale: bool = True) -> Estimate:
    """GRPO's group-relative advantage (Shao et al. 2024, arXiv:2402.03300), one per episode, on each of its turns.

    A_t = (R_e - mean_{g(e)} R) / (std_{g(e)} R + EPS) for every turn t of episode e;  `scale=False` leaves out the
    division (Dr.GRPO, arXiv:2503.20783). std is Bessel-corrected. Returns: G_t. `lam` is unused.
    Stats: adv/groups, adv/zero_variance_groups.
    """
    returns = returns_to_go(batch.rewards, batch.episode, gamma)
    per_episode = episode_returns(returns, batch.episode, len(batch.group))
    centered, n, equal = group_centered(per_episode, batch.group, scale)
    return Estimate(centered[batch.episode], returns, _group_stats(n, equal))


@register_estimator("rloo", needs_value=False)
def rloo(batch: AdvantageBatch, gamma: float, lam: float = 1.0, scale: bool = True) -> Estimate:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740), per episode.

    A_t = R_e - (Σ_{j ∈ g(e), j ≠ e} R_j) / (n_g - 1) = n_g / (n_g - 1) · (R_e - mean_g R) for every turn t of e;
    0 in a group of one. Returns: G_t. `lam` and `scale` are unused. Stats: adv/groups, adv/zero_variance_groups.
    """
    returns = returns_to_go(batch.rewards, batch.episode, gamma)
    per_episode = episode_returns(returns, batch.episode, len(batch.group))
    centered, n, equal = group_centered(per_episode, batch.group, scale=False, leave_one_out=True)
    return Estimate(centered[batch.episode], returns, _group_stats(n, equal))


@register_estimator("rebn", needs_value=False)
def rebn(batch: AdvantageBatch, gamma: float, lam: float = 1.0, scale: bool = True) -> Estimate:
    """Return batch normalisation (GEM, arXiv:2510.01051): per-turn returns-to-go, whitened over the whole batch.

    A_t = (G_t - mean G) / (std G + EPS), mean and (Bessel-corrected) std over all T turns; 0 everywhere when every
    G is equal (the batch counts as one zero-variance group). Works with any γ, no critic, no groups.
    Returns: G_t. `lam` and `scale` are unused. Stats: adv/groups (1), adv/zero_variance_groups (0 or 1).
    """
    returns = returns_to_go(batch.rewards, batch.episode, gamma)
    everyone = torch.zeros_like(batch.episode)
    centered, n, equal = group_centered(returns, everyone, scale=True)
    return Estimate(centered, returns, _group_stats(n, equal))


@register_estimator("gigpo", needs_value=False)
def gigpo(batch: AdvantageBatch, gamma: float, lam: float = 1.0, scale: bool = True) -> Estimate:
    """Group-in-group policy optimisation (Feng et al. 2025, arXiv:2505.10978): an episode and a step advantage.

    A_t = A^E_t + A^S_t, where A^E_t is `grpo`'s episode advantage and
    A^S_t = (G_t - mean_{s(t)} G) / (std_{s(t)} G + EPS) over the step group s(t): the turns of the same episode
    group with the same `step_key` (the same state, met in several episodes); `scale=False` leaves out both
    divisions. A step group of one, or of equal G, adds 0. The paper's weight ω on A^S is 1 here.
    Returns: G_t. `lam` is unused. Stats: grpo's, adv/step_groups (step groups of at least two turns, the ones
    that can carry a signal) and adv/zero_variance_step_groups (those of them whose G are all equal).

    Raises:
        ValueError: `batch.step_key` is None.
    """
    if batch.step_key is None:
        raise ValueError("The gigpo estimator needs `step_key` (an id of the state each turn acted in).")
    episode_level = grpo(batch, gamma, lam, scale)
    returns = episode_level.returns
    pairs = torch.stack([batch.group[batch.episode], batch.step_key], dim=1)  # (episode group, state) per turn
    step, n, equal = group_centered(returns, pairs, scale)
    shared = n >= 2
    stats = {
        **episode_level.stats,
        "adv/step_groups": float(shared.sum()),
        "adv/zero_variance_step_groups": float((equal & shared).sum()),
    }
    return Estimate(episode_level.advantages + step, returns, stats)
