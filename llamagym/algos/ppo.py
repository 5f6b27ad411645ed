"""PPO math as pure tensor functions: log-probs, masked statistics, GAE, KL estimators, clipped losses.

Conventions: time is the last dim; `mask` is a float {0, 1} tensor with 1 on response tokens; `dones[..., t] = 1`
means the episode ended at step t. Only the KL controllers and `RunningMoments` keep state.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log π(token) = logit[token] - logsumexp(logits) in float32: bf16 log-probs are off by up to 0.2 nats.

    Args:
        logits: (B, T, V) or (N, V). tokens: (B, T) or (N,), integer ids.
    Returns:
        (B, T) or (N,) float32 log-probabilities.
    """
    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = -Σ_v p_v log p_v over the last (vocabulary) dim, in float32. (..., V) -> (...). Logits must be finite."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int = 64,
    rows: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`logprobs_from_logits` and `entropy_from_logits` of softmax(logits / temperature), for a backward pass that
    keeps only the logits as given (bf16 under autocast) instead of several float32 copies of them.

    Vocabulary-wide rows are the largest tensors of an update (190 KiB each in float32 for a 49k vocabulary). Here
    the float32 work runs `chunk` rows at a time, forward and backward, in blocks of one size (which the C allocator
    reuses instead of fragmenting its heap), and the backward pass recomputes the softmax from the kept logits and
    log-sum-exp: d log π(t)/dz = onehot(t) - p, dH/dz = -p (log p + H), each divided by the temperature.

    Args:
        logits: (U, V), any float dtype.
        tokens: (N,) integer ids.
        rows: (N,) the row of `logits` each token is predicted from, when tokens share rows (the first tokens of a
            scored state's candidates are all predicted at its last prompt token): each row's vocabulary-wide work
            is then done once. None: token k from row k (U = N).
    Returns:
        (N,) float32 log-probabilities, and (N,) float32 entropies or None (float64 for float64 logits).

    Example: logits [[0, log 3]] at rows (0, 0) for tokens (1, 0): log-probs (log 0.75, log 0.25).
    """
    if rows is None:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
    logprobs, entropy = _TokenLogprobs.apply(logits, tokens, rows, float(temperature), bool(with_entropy), int(chunk))
    return logprobs, entropy if with_entropy else None


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, rows, temperature, with_entropy, chunk):
        u, work = logits.shape[0], torch.promote_types(logits.dtype, torch.float32)  # float64 stays float64
        lse = logits.new_empty(u, dtype=work)
        entropy = logits.new_empty(u if with_entropy else 0, dtype=work)
        for part in _chunks(u, chunk):
            z = logits[part].to(work)
            z = z / temperature if temperature != 1.0 else z
            lse[part] = torch.logsumexp(z, dim=-1)
            if with_entropy:
                logp = z - lse[part].unsqueeze(-1)
                entropy[part] = -(logp.exp() * logp).sum(-1)
        picked = logits[rows, tokens].to(work)
        logprobs = (picked / temperature if temperature != 1.0 else picked) - lse[rows]
        ctx.save_for_backward(logits, tokens, rows, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        entropy_out = entropy[rows] if with_entropy else entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_out)
        return logprobs, entropy_out

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, tokens, rows, lse, entropy = ctx.saved_tensors
        u, work = logits.shape[0], lse.dtype
        grad_logprobs = grad_logprobs.to(work)
        # a row's gradient: its tokens' one-hots, less its softmax times the sum of their gradients
        weight = lse.new_zeros(u).index_add_(0, rows, grad_logprobs)
        weight_h = lse.new_zeros(u).index_add_(0, rows, grad_entropy.to(work)) if entropy.numel() else None
        grad = torch.empty_like(logits)  # autograd passes zeros, not None, for an output that was not used
        for part in _chunks(u, ctx.chunk):
            z = logits[part].to(work)
            logp = (z / ctx.temperature if ctx.temperature != 1.0 else z) - lse[part].unsqueeze(-1)
            p = logp.exp()
            g = -p * weight[part].unsqueeze(-1)
            mine = (rows >= part.start) & (rows < part.start + z.shape[0])
            g.index_put_((rows[mine] - part.start, tokens[mine]), grad_logprobs[mine], accumulate=True)
            if weight_h is not None:
                g -= weight_h[part].unsqueeze(-1) * p * (logp + entropy[part].unsqueeze(-1))
            grad[part] = (g / ctx.temperature if ctx.temperature != 1.0 else g).to(grad.dtype)
        return grad, None, None, None, None, None


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, n, size)]


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ mask·x / Σ mask over `dim` (all dims if None); 0, not NaN, where the mask is all zero.

    Masked-out entries are selected away (not multiplied by 0), so inf/NaN there cannot leak in, forward or backward.
    """
    x = torch.where(mask.bool(), x, 0.0)
    if dim is None:
        return x.sum() / mask.sum().clamp(min=1.0)
    return x.sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries of `x` (a scalar tensor); Bessel-corrected when `unbiased`.

    Raises:
        ValueError: `unbiased` with fewer than 2 masked elements (SB3 #325). The check syncs with the device.
    """
    count = mask.sum()
    if unbiased and count < 2:
        raise ValueError(f"An unbiased variance needs at least 2 masked elements. Received {int(count)}.")
    var = masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    return var * count / (count - 1) if unbiased else var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries; masked-out entries become 0.

    With `shift_mean=False` the mean is kept (only the scale changes), as in TRL.

    Raises:
        ValueError: fewer than 2 masked elements, where the variance is undefined (raised by `masked_var`).
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8) + (0.0 if shift_mean else mean)
    return torch.where(mask.bool(), whitened, 0.0)


def gae(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438).

    A_t = δ_t + γλ(1 - d_t) A_{t+1},  δ_t = r_t + γ(1 - d_t) V_{t+1} - V_t,  with V_T = last_value.

    Pass detached values (or call under `torch.no_grad()`): advantages and returns are targets, not graph nodes.
    Right padding with reward 0, value 0, done 1 leaves the real steps unchanged and gives advantage 0, provided the
    real part ends with done 1. To pad a truncated episode, fold its bootstrap into the last reward
    (r_last += γ·V_boot) and set done 1: the advantages are the same as bootstrapping from `last_value`.

    Args:
        rewards, values, dones: (..., T). dones[..., t] = 1 if the episode ended at step t.
        last_value: (...). V after step T-1; unused where dones[..., -1] = 1.
        gamma: discount γ in [0, 1]. lam: GAE λ in [0, 1] (0: one-step TD error; 1: Monte Carlo return - V).
    Returns:
        advantages, returns: (..., T); returns = advantages + values.
    """
    not_dones = 1.0 - dones.to(values.dtype)
    next_value = torch.as_tensor(last_value, dtype=values.dtype, device=values.device)
    next_advantage = torch.zeros_like(values[..., -1])
    steps = []
    for t in reversed(range(values.shape[-1])):
        delta = rewards[..., t] + gamma * not_dones[..., t] * next_value - values[..., t]
        next_advantage = delta + gamma * lam * not_dones[..., t] * next_advantage
        steps.append(next_advantage)
        next_value = values[..., t]
    advantages = torch.stack(steps[::-1], dim=-1)
    return advantages, advantages + values


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π (Schulman 2020, "Approximating KL divergence").

    With d = ref_logprobs - logprobs: k1 = -d (unbiased, can be < 0); k2 = d²/2; k3 = (e^d - 1) - d (unbiased, ≥ 0).
    Shapes are elementwise (any shape); reduce with `masked_mean` or a masked sum.

    Raises:
        ValueError: `kind` is not one of "k1", "k2", "k3".
    """
    d = ref_logprobs - logprobs
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return torch.expm1(d) - d  # expm1 keeps tiny d ≥ 0 where exp(d) - 1 - d rounds negative
    raise ValueError(f"`kind` should be one of k1, k2, k3. Received {kind!r}.")


LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "dr_grpo")


def aggregate_loss(losses: Tensor, mask: Tensor, how: str = "token_mean", max_length: int | None = None) -> Tensor:
    """Reduce per-token losses (N, T) to a scalar over the masked tokens.

    "token_mean": Σ mask·l / Σ mask (every token weighs the same, so long replies weigh more);
    "sequence_mean": (1/N) Σ_i (Σ_t mask·l / Σ_t mask) (every reply weighs the same);
    "dr_grpo": (1/N) Σ_i Σ_t mask·l / max_length, a constant normaliser (Dr.GRPO, arXiv:2503.20783), so a reply's
    weight does not depend on its own length.

    Raises:
        ValueError: an unknown `how`, or "dr_grpo" without a `max_length` >= 1.
    """
    if how == "token_mean":
        return masked_mean(losses, mask)
    if how == "sequence_mean":
        return masked_mean(losses, mask, dim=-1).mean()
    if how == "dr_grpo":
        if max_length is None or max_length < 1:
            raise ValueError(f"dr_grpo aggregation needs `max_length` >= 1. Received {max_length!r}.")
        return torch.where(mask.bool(), losses, 0.0).sum(-1).mean() / max_length
    raise ValueError(f"`how` should be one of {', '.join(LOSS_AGGREGATIONS)}. Received {how!r}.")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_coef: float,
    clip_coef_high: float | None = None,
    aggregation: str = "token_mean",
    max_length: int | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), by default a token-level masked mean.

    l = max(-A·r, -A·clip(r, 1 - ε, 1 + ε_high)),  r = exp(logprobs - old_logprobs),  ε = clip_coef,
    ε_high = clip_coef_high (DAPO's clip-higher, arXiv:2503.14476) or ε when None; L = `aggregate_loss(l, mask,
    aggregation, max_length)`.

    Args:
        logprobs, old_logprobs, advantages, mask: same shape, e.g. (B, T).
    Returns:
        loss: scalar. clipfrac: scalar, token mean of r outside [1 - ε, 1 + ε_high] (no grad).
    """
    keep = mask.bool()
    ratio = torch.where(keep, logprobs - old_logprobs, 0.0).exp()  # exp of a huge padded log-ratio would be inf
    advantages = torch.where(keep, advantages, 0.0)
    high = clip_coef if clip_coef_high is None else clip_coef_high
    losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip_coef, 1.0 + high))
    if clip_coef_high is None:
        clipped = (ratio.detach() - 1.0).abs() > clip_coef
    else:
        clipped = (ratio.detach() > 1.0 + high) | (ratio.detach() < 1.0 - clip_coef)
    clipfrac = masked_mean(clipped.to(ratio.dtype), mask)
    return aggregate_loss(losses, mask, aggregation, max_length), clipfrac


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_coef: float | None
) -> tuple[Tensor, Tensor]:
    """Value loss ½·mean_mask max((V - R)², (clip(V, V_old ± ε) - R)²), as in PPO2 / CleanRL; ½·MSE if ε is None.

    Args:
        values, old_values, returns, mask: same shape (any, e.g. (N,) with an all-ones mask).
        clip_coef: ε, or None for no clipping.
    Returns:
        loss: scalar. clipfrac: scalar, fraction of masked entries where the clipped term is the larger (0 if None).
    """
    unclipped = (values - returns) ** 2
    if clip_coef is None:
        return 0.5 * masked_mean(unclipped, mask), torch.zeros((), dtype=unclipped.dtype, device=unclipped.device)
    clipped = (old_values + (values - old_values).clamp(-clip_coef, clip_coef) - returns) ** 2
    clipfrac = masked_mean((clipped.detach() > unclipped.detach()).to(unclipped.dtype), mask)
    return 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask), clipfrac


def scale_advantages(advantages: Tensor, how: str, returns_std: float, states: Tensor | None = None) -> Tensor:
    """Center advantages on their mean and divide them by a scale: this batch's std ("batch", classic whitening),
    `returns_std` ("returns": the spread of every return seen so far; 1 while all were equal) or 1 ("none").
    With `states` (each turn's state id), center each turn on its state's turns instead (`state_centered`).

    "batch" turns any spread into unit advantages: when a solved policy makes every return equal, what is left is
    value-head noise, which it blows up into full-size steps. "returns" keeps that noise as small as it is.

    Raises:
        ValueError: fewer than 2 advantages ("batch" needs a spread), or an unknown `how`.
    """
    if how not in ("batch", "returns", "none"):
        raise ValueError(f"`how` should be one of batch, returns, none. Received {how!r}.")
    if how == "batch" and states is None:
        return masked_whiten(advantages, torch.ones_like(advantages))
    centered = advantages - advantages.mean() if states is None else state_centered(advantages, states)
    if how == "batch":
        return centered * torch.rsqrt(masked_var(centered, torch.ones_like(centered)) + 1e-8)
    scale = returns_std if how == "returns" and returns_std > 1e-6 else 1.0  # below: float noise of equal returns
    return centered / scale


def state_centered(advantages: Tensor, states: Tensor) -> Tensor:
    """(N,) each advantage less the mean of its state's advantages (equal ids in `states`: the trainer passes each
    turn's prompt id), or less the batch's mean where its state has no other turn in the batch.

    A value head that overrates a state (V above every return seen from it) gives every action drawn there a
    negative advantage, the most drawn one most often: centred on the batch, a sampled step then moves probability
    off the action the policy is sure of to ones it did not draw. Centred on its state, an action is judged against
    the other actions drawn in the same state, and the value head's error there cancels.

    Example: advantages [1, 2, 3, 10], states [0, 0, 1, 2] -> [-0.5, 0.5, -1, 6] (states 1 and 2: the mean 4).
    """
    inverse, n, total = group_sums(advantages, states)
    return torch.where(n[inverse] >= 2, advantages - (total / n)[inverse], advantages - advantages.mean())


def group_sums(x: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(each member's group index (N,), per group in sorted id order: member counts (G,), sums of x (G,)).
    group: (N,) ids, or (N, K) rows of ids (a group per distinct row)."""
    ids, inverse = torch.unique(group, dim=0, return_inverse=True)
    n = torch.zeros(len(ids), dtype=x.dtype, device=x.device).index_add_(0, inverse, torch.ones_like(x))
    return inverse, n, torch.zeros_like(n).index_add_(0, inverse, x)


def repeated_input_weights(groups: Tensor, power: float) -> Tensor:
    """(N,) weight of each turn: n**-power, n the number of turns in the same state (equal ids in `groups`: the
    trainer passes each turn's prompt id).

    0 weighs every turn alike. A state met in many turns (the first state of every episode of a game) otherwise
    carries a target that many times the size of a state met once: its sampling noise alone can move what shared
    weights do everywhere else. 0.5 gives each state's rows equal noise (a sum of n noisy terms grows as sqrt(n));
    1 gives each state equal weight, however often it was met.
    """
    counts = torch.bincount(groups)
    return counts[groups].to(torch.float32).pow(-power)


def inverse_choice_weights(logprobs: Tensor, counts: Tensor, advantages: Tensor, cap: float) -> Tensor:
    """(N,) weight of each turn's advantage: 1 / (C p), between 1 and `cap`, where the advantage is positive, 1
    elsewhere; p = exp(`logprobs`), the probability the policy that acted gave the choice it drew, one of C
    (`counts`) candidates.

    Why: a sampled step moves a drawn choice's logit by about its advantage times (1 - p), so a choice the policy has
    nearly given up (p 0.01) climbs a little per draw however much better it did, and it is drawn once in a hundred
    visits: a state can hold a wrong choice for tens of updates after the right one has been tried (guess the number,
    docs/learning-that-holds.md). Weighing the turn by 1 / p is the softmax's Fisher inverse (the natural policy
    gradient in the choice's own coordinates, Kakade 2001: a logit moves by its own advantage, however likely it was).
    Here it is counted from the uniform share 1 / C, so a choice the policy still draws at its share or more steps as
    before, and `cap` bounds what one rare draw, a noisy estimate, can ask. Only choices that did better than the batch
    are weighed (as clip-higher raises only the upper clip): a rare choice that did worse is rare already, and pushing
    it down harder would spend the step's bound on nothing. Measured, an experiment: on guess-the-number the sampled
    policy never sharpened (docs/learning-that-holds.md, "Eighty-eighth session"); the reading, not measured: a guess
    under its share pays at once when it happens to be the secret, and the weights multiply those lucky hits.

    Example: 4 candidates, probabilities [0.5, 0.25, 0.05, 0.001], advantages [1, 1, 1, -1], cap 10 -> [1, 1, 5, 1].
    """
    weights = (torch.exp(-logprobs.float()) / counts).clamp(min=1.0, max=cap)
    return torch.where(advantages > 0, weights, torch.ones_like(weights))


def ridge_refit(
    features: Tensor, targets: Tensor, weight: Tensor, bias: Tensor, damping: float
) -> tuple[Tensor, Tensor]:
    """A linear head (weight, bias) refit to `targets` by least squares, pulled toward its current values.

    Solves min_w |X w - y|^2 + lam |w - w0|^2 over w = (weight, bias), X = (features, 1), in float64, with
    lam = damping x trace(X^T X) / (H + 1): directions the batch's features vary much along are fit to it, the
    others keep what earlier batches taught. The closed form of what many small value-loss steps approach.

    Args:
        features: (N, H) inputs of the head; targets: (N,) returns; weight: (1, H); bias: (1,).
    Returns:
        (weight, bias) with the shapes and dtype of the inputs.

    Example: features [[1], [2]], targets [1, 2], w0 = b0 = 0, damping 0 -> weight [[1]], bias [0].
    """
    x = torch.cat([features.double(), features.new_ones(len(features), 1, dtype=torch.float64)], dim=1)
    w0 = torch.cat([weight.double().flatten(), bias.double()])
    gram = x.T @ x
    lam = damping * torch.trace(gram) / gram.shape[0]
    eye = torch.eye(gram.shape[0], dtype=torch.float64, device=gram.device)
    delta = torch.linalg.solve(gram + lam * eye, x.T @ (targets.double() - x @ w0))
    w = (w0 + delta).to(weight.dtype)
    return w[:-1].view_as(weight), w[-1:].view_as(bias)


def approx_kl(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """k3 estimate of KL(π_old || π), as in CleanRL: mean_mask (r - 1) - log r, r = exp(logprobs - old_logprobs).

    Exactly 0 when logprobs == old_logprobs. A statistic for early stopping: pass detached tensors.
    """
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, 0.0)
    return masked_mean(torch.expm1(log_ratio) - log_ratio, mask)


def kl_exceeded(approx_kl: float, target_kl: float | None, factor: float = 1.5) -> bool:
    """Target-KL early stop, checked per minibatch before the optimizer step (SB3): approx_kl > factor·target_kl."""
    return target_kl is not None and approx_kl > factor * target_kl


def linear_anneal(update: int, anneal_updates: int) -> float:
    """Step-size factor of the update that follows `update` finished ones: 1 at first, falling linearly over
    `anneal_updates` updates (the last gets 1/anneal_updates) to 0 after them (CleanRL's `--anneal-lr`); always 1
    when `anneal_updates` is 0."""
    if anneal_updates == 0:
        return 1.0
    return max(0.0, 1.0 - update / anneal_updates)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[R - V] / Var[R] over masked entries: 1 is perfect, 0 is as good as a constant, < 0 worse.

    Returns a scalar tensor; NaN when Var[R] = 0 (undefined), as in Stable-Baselines3.
    """
    var_returns = masked_var(returns, mask, unbiased=False)
    ev = 1.0 - masked_var(returns - values, mask, unbiased=False) / var_returns
    return torch.where(var_returns == 0, torch.nan, ev)


class FixedKLController:
    """A constant KL coefficient `value`; `update` does nothing. The base of `AdaptiveKLController`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, §2.2) that steers the measured KL to `target`.

    β ← β · (1 + clip(KL / target - 1, -0.2, 0.2) · n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"`target` and `horizon` should be > 0. Received target={target}, horizon={horizon}.")
        super().__init__(init_kl_coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def log_barrier(
    dists: Tensor,
    mask: Tensor,
    weights: Tensor | None = None,
    floor: float = 0.0,
    reference: Tensor | None = None,
) -> Tensor:
    """The mean over turns (`mask` (N, 1)) of each turn's sum of log-probs over its candidates (`dists` (N, C),
    -inf = padding), times the turn's weight (`weights` (N,), None = 1): a log-barrier that keeps every candidate's
    probability above 0. With `floor` f > 0 each candidate counts min(ln p - ln f, 0) instead: a hinge that acts only
    on the candidates under f, so a candidate is held near f (not pulled towards 1/C) and a turn whose candidates are
    all above f is left alone. With `reference` (N, C), another policy's log-probs of the same candidates (the
    untrained model's), the floor is f times that policy's probability: min(ln p - ln f - ln p_ref, 0), so a
    candidate is held only once it has fallen under f times where that policy put it.

    Its gradient on a turn's logit z_a is 1 - C p_a: every candidate the policy gives less than 1/C is pulled up by
    about 1 whether or not it was sampled, the likely ones down. Added to a policy-gradient objective with weight b, a
    candidate whose advantage is A < 0 settles where p A + b (1 - C p) = 0, p = b / (C b - A), about b / |A|: never 0,
    so a choice given up early can come back when the evidence turns (log-barrier regularisation of softmax policy
    gradient: Agarwal et al. 2020, arXiv:1908.00261). Greedy play, the arg-max, is unchanged by it. With a floor the
    gradient is [p_a < f] - C_f p_a, C_f the number of candidates under f: those pulled up by about 1, every
    candidate pushed down by its share of them.

    Examples: one turn (0.5, 0.25, 0.25): ln 0.5 + 2 ln 0.25 = -3.4657; with a padded row (ln 1, -inf) beside it, the
    mean is (-3.4657 + 0) / 2 = -1.7329; weighed 0.5 and 1, -0.8664. With f = 0.3 only the two 0.25s count,
    2 ln(0.25 / 0.3) = -0.3646, and the mean -0.1823. With f = 0.5 relative to a reference (0.2, 0.2, 0.6): only the
    third is under its floor 0.3, ln(0.25 / 0.3) = -0.1823, and the mean -0.0912.
    """
    padding = torch.isinf(dists)
    if floor > 0:
        floors = math.log(floor) if reference is None else reference.masked_fill(padding, 0.0) + math.log(floor)
        logs = (dists - floors).clamp(max=0.0)
    else:
        logs = dists
    total = logs.masked_fill(padding, 0.0).sum(-1, keepdim=True)
    if weights is not None:
        total = total * weights.unsqueeze(-1)
    return masked_mean(total, mask)


class EntropyFloor:
    """An entropy bonus that switches itself on when the sampled policy's entropy falls below a floor.

    A policy that turns near-deterministic before it has learned stops sampling the actions it would learn from:
    Blackjack's "hit" fell to a few percent of turns everywhere, low totals included, and the policy stayed at
    stick-always (docs/learning-that-holds.md, "Twelfth session"). The floor is a constraint on the mean entropy,
    with its multiplier adapted as a Lagrangian's (SAC's learned temperature, Haarnoja et al. 2018,
    arXiv:1812.05905; step by step as Skywork-OR1's adaptive entropy control, arXiv:2505.22312): each update the
    bonus's weight `value` rises by `step` while the entropy is below `floor` and falls by `step` (never below 0)
    while it is above, so it is 0 whenever the policy keeps its entropy by itself.

    Entropy is counted as a fraction of the most a choice can have (entropy / ln(number of options)), so one floor
    means the same for a choice of 2 and of 16.

    The bonus applies only to the turns whose own entropy is below the floor (`weights`): it keeps a choice the
    policy has settled from becoming certain and leaves alone the choices still open, which a bonus on every turn
    pulls toward even odds. A learned policy may rightly be surer than a floor: then the constraint cannot be met,
    the weight keeps rising, and the bonus unsettles what was learned (Blackjack's policies slid from their best in a
    run's last minutes under a floor of 0.3, and held under 0.1, `PPOConfig.entropy_floor`'s default, which is
    still above where a policy that stopped exploring goes: docs/learning-that-holds.md, "Twenty-fifth session").

    Examples (floor 0.3, step 0.002): value 0 -> update(0.1) -> 0.002 -> update(0.1) -> 0.004 -> update(0.5) -> 0.002;
    value 0 -> update(0.5) -> 0 (it never goes negative). At value 0.004, weights of fractions (0.1, 0.29, 0.3, 0.9)
    are (0.004, 0.004, 0, 0).
    """

    def __init__(self, floor: float, step: float) -> None:
        self.floor, self.step, self.value = floor, step, 0.0

    def update(self, entropy: float) -> float:
        """Adapt the weight to this batch's mean entropy fraction (NaN: unchanged) and return it."""
        if entropy < self.floor:
            self.value += self.step
        elif entropy >= self.floor:
            self.value = max(0.0, self.value - self.step)
        return self.value

    def weights(self, fraction: Tensor) -> Tensor:
        """(N,) the bonus's weight on each turn, from its entropy fraction (N,): `value` below the floor, else 0."""
        return (fraction < self.floor).to(fraction.dtype) * self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class RunningMoments:
    """Mean and standard deviation of every value seen so far (Chan et al.'s parallel update of Welford's method).

    The scale of returns for `PPOConfig(advantage_scale="returns")`: unlike one batch's spread, it does not fall to
    0 when a solved policy makes every return of a batch equal.
    """

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: Tensor) -> None:
        values = values.detach().double().flatten()
        n = values.numel()
        if n == 0:
            return
        mean, m2 = float(values.mean()), float(((values - values.mean()) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """Population standard deviation (0 before two values)."""
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
