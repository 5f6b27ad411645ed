"""Golden values, identities and masking properties of the PPO math in `llamagym.algos.ppo` (CPU, milliseconds)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from llamagym.algos.ppo import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    approx_kl,
    entropy_from_logits,
    explained_variance,
    gae,
    kl_exceeded,
    kl_penalty,
    linear_anneal,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    ridge_refit,
    token_logprobs,
    value_loss,
)

T64 = torch.float64


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=T64)


def random_episode(seed: int, shape=(4, 7)) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(shape, generator=g, dtype=T64)
    values = torch.randn(shape, generator=g, dtype=T64)
    dones = (torch.rand(shape, generator=g) < 0.3).to(T64)
    last_value = torch.randn(shape[:-1], generator=g, dtype=T64)
    return rewards, values, dones, last_value


def discounted_returns_minus_values(rewards, values, dones, last_value, gamma):
    """Reference for λ = 1 written as a plain Python loop over a single row."""
    out, running = [], last_value
    for r, d in zip(reversed(rewards.tolist()), reversed(dones.tolist()), strict=True):
        running = r + gamma * (1 - d) * running
        out.append(running)
    return torch.tensor(out[::-1], dtype=T64) - values


# --- GAE ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rewards, values, dones, last_value, gamma, expected",
    [
        # rlax multistep_test.py, λ = 1, no episode end: A_4 = -0.5 + 0.99·(-1) - (-1) = -0.49, and so on backwards.
        (
            t(0, 0, 1, 0, -0.5),
            t(1, 4, -3, -2, -1),
            t(0, 0, 0, 0, 0),
            -1.0,
            0.99,
            t(-1.45118, -4.4557, 2.5396, 0.5249, -0.49),
        ),
        # rlax, λ = 1, episode ends at t = 3 (rlax discount_t[3] = 0): steps 0-3 earn return 0, so A_t = -V_t;
        # step 4 starts a new episode and bootstraps from last_value: A_4 = 1 + 0.9·(-1) - 5 = -4.9.
        (t(0, 0, 0, 0, 1), t(-3, -2, -1, 0, 5), t(0, 0, 0, 1, 0), -1.0, 0.9, t(3, 2, 1, 0, -4.9)),
    ],
)
def test_gae_matches_rlax_golden_values(rewards, values, dones, last_value, gamma, expected):
    advantages, returns = gae(rewards, values, dones, torch.tensor(last_value, dtype=T64), gamma, lam=1.0)
    assert_close(advantages, expected, atol=1e-4, rtol=0)
    assert_close(returns, advantages + values)


@pytest.mark.parametrize("seed", range(3))
def test_gae_lambda_one_is_discounted_return_minus_value(seed):
    rewards, values, dones, last_value = random_episode(seed)
    advantages, _ = gae(rewards, values, dones, last_value, gamma=0.9, lam=1.0)
    for row in range(rewards.shape[0]):
        ref = discounted_returns_minus_values(rewards[row], values[row], dones[row], last_value[row].item(), 0.9)
        assert_close(advantages[row], ref)


@pytest.mark.parametrize("seed", range(3))
def test_gae_lambda_zero_is_td_error(seed):
    rewards, values, dones, last_value = random_episode(seed)
    next_values = torch.cat([values[:, 1:], last_value[:, None]], dim=-1)
    td_error = rewards + 0.9 * (1 - dones) * next_values - values
    advantages, _ = gae(rewards, values, dones, last_value, gamma=0.9, lam=0.0)
    assert_close(advantages, td_error)


def test_gae_ignores_last_value_on_termination_and_bootstraps_on_truncation():
    rewards, values = t(1, 0, 2), t(0.5, -1, 3)
    for last_done, should_matter in [(1.0, False), (0.0, True)]:
        dones = t(0, 0, last_done)
        a, _ = gae(rewards, values, dones, torch.tensor(0.0, dtype=T64), gamma=0.9, lam=0.95)
        b, _ = gae(rewards, values, dones, torch.tensor(100.0, dtype=T64), gamma=0.9, lam=0.95)
        assert (not torch.equal(a, b)) == should_matter


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_gae_batched_equals_per_row(lam):
    rewards, values, dones, last_value = random_episode(0)
    batched, batched_returns = gae(rewards, values, dones, last_value, gamma=0.99, lam=lam)
    for row in range(rewards.shape[0]):
        adv, ret = gae(rewards[row], values[row], dones[row], last_value[row], gamma=0.99, lam=lam)
        assert_close(batched[row], adv)
        assert_close(batched_returns[row], ret)


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_gae_right_padding_leaves_real_steps_unchanged_and_padded_steps_zero(lam):
    rewards, values, dones = t(0.5, 0, 1), t(0.2, -0.4, 0.3), t(0, 0, 1)
    last_value = torch.tensor(7.0, dtype=T64)
    ref, _ = gae(rewards, values, dones, last_value, gamma=0.9, lam=lam)
    pad = torch.zeros(2, dtype=T64)
    padded, padded_returns = gae(
        torch.cat([rewards, pad]), torch.cat([values, pad]), torch.cat([dones, pad + 1]), last_value, 0.9, lam
    )
    assert_close(padded[:3], ref)
    assert_close(padded[3:], pad)
    assert_close(padded_returns[3:], pad)


def test_gae_truncated_episode_padded_with_folded_bootstrap_equals_bootstrapping():
    rewards, values, dones = t(0.5, 0, 1), t(0.2, -0.4, 0.3), t(0, 0, 0)
    v_boot, gamma = 2.0, 0.9
    ref, _ = gae(rewards, values, dones, torch.tensor(v_boot, dtype=T64), gamma, lam=0.95)
    folded = torch.cat([rewards[:-1], rewards[-1:] + gamma * v_boot, torch.zeros(2, dtype=T64)])
    padded, _ = gae(
        folded, torch.cat([values, torch.zeros(2, dtype=T64)]), t(0, 0, 1, 1, 1), torch.tensor(0.0), gamma, 0.95
    )
    assert_close(padded[:3], ref)


# --- log-probs and entropy ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 5, 11), (6, 11)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_from_logits_equals_float32_log_softmax_gather(shape, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(shape, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, shape[-1], shape[:-1], generator=g)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    out = logprobs_from_logits(logits, tokens)
    assert out.dtype == torch.float32 and out.shape == tokens.shape
    assert_close(out, ref)


def test_token_logprobs_golden_values_at_a_temperature():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])  # at T = 0.5: probabilities (0.1, 0.9) and (0.5, 0.5)
    logprobs, entropy = token_logprobs(logits, torch.tensor([1, 0]), temperature=0.5, with_entropy=True)
    assert_close(logprobs, torch.tensor([math.log(0.9), math.log(0.5)]))
    assert_close(entropy, torch.tensor([-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)), math.log(2.0)]))
    assert token_logprobs(logits, torch.tensor([1, 0]))[1] is None


@pytest.mark.parametrize("with_entropy", [False, True])
def test_token_logprobs_gradients_in_chunks_are_exact(with_entropy):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 7, generator=g, dtype=torch.float64) * 2).requires_grad_()
    tokens = torch.randint(0, 7, (5,), generator=g)

    def outputs(x):
        logprobs, entropy = token_logprobs(x, tokens, temperature=0.7, with_entropy=with_entropy, chunk=2)
        return (logprobs, entropy) if with_entropy else logprobs

    assert torch.autograd.gradcheck(outputs, (logits,))
    plain = logits.detach().float().requires_grad_()
    mine = logits.detach().float().requires_grad_()
    weights = torch.randn(2, 5, generator=g)
    ref = (logprobs_from_logits(plain / 0.7, tokens), entropy_from_logits(plain / 0.7))
    out = token_logprobs(mine, tokens, 0.7, True, chunk=2)
    (weights[0] @ ref[0] + weights[1] @ ref[1]).backward()
    (weights[0] @ out[0] + weights[1] @ out[1]).backward()
    assert_close(out[0], ref[0])
    assert_close(out[1], ref[1])
    assert_close(mine.grad, plain.grad)


def test_token_logprobs_golden_values_of_tokens_sharing_a_row():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # probabilities (0.25, 0.75)
    logprobs, _ = token_logprobs(logits, torch.tensor([1, 0]), rows=torch.tensor([0, 0]))
    assert_close(logprobs, torch.tensor([math.log(0.75), math.log(0.25)]))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_token_logprobs_of_shared_rows_equal_those_of_repeated_rows(with_entropy):
    """Tokens predicted at one position share its row: values and gradients as if the row were repeated."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 7, generator=g, dtype=torch.float64) * 2).requires_grad_()
    rows = torch.tensor([2, 0, 2, 2, 3, 0])  # row 1 predicts nothing
    tokens = torch.randint(0, 7, (6,), generator=g)

    def shared(x):
        out = token_logprobs(x, tokens, 0.7, with_entropy, chunk=3, rows=rows)
        return out if with_entropy else out[0]

    assert torch.autograd.gradcheck(shared, (logits,))
    weights = torch.randn(2, 6, generator=g, dtype=torch.float64)
    repeated, mine = logits.detach().clone().requires_grad_(), logits.detach().clone().requires_grad_()
    ref = token_logprobs(repeated[rows], tokens, 0.7, True, chunk=3)
    out = token_logprobs(mine, tokens, 0.7, True, chunk=3, rows=rows)
    (weights[0] @ ref[0] + weights[1] @ ref[1]).backward()
    (weights[0] @ out[0] + weights[1] @ out[1]).backward()
    assert_close(out[0], ref[0])
    assert_close(out[1], ref[1])
    assert_close(mine.grad, repeated.grad)
    assert mine.grad[1].abs().max() == 0


def test_token_logprobs_keeps_only_the_logits_given_for_the_backward_pass():
    logits = torch.randn(6, 50, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logprobs, entropy = token_logprobs(logits, torch.zeros(6, dtype=torch.long), with_entropy=True, chunk=4)
    wide = [t for t in saved if t.dim() == 2]
    assert len(wide) == 1 and wide[0].dtype == torch.bfloat16  # the logits themselves: no float32 copy is kept
    (logprobs.sum() + entropy.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.isfinite().all()


def test_entropy_from_logits_is_log_vocab_for_uniform_and_zero_for_one_hot():
    uniform = torch.zeros(2, 3, 8)
    assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(8)))
    peaked = torch.tensor([[0.0, 1e4, 0.0]])
    assert_close(entropy_from_logits(peaked), torch.zeros(1))


# --- masked statistics ----------------------------------------------------------------------------------------------


def test_masked_mean_over_all_and_per_dim_and_all_zero_mask_is_finite():
    x, mask = t(1, 2, 3, 100), t(1, 1, 1, 0)
    assert_close(masked_mean(x, mask), torch.tensor(2.0, dtype=T64))
    rows, row_mask = torch.tensor([[1.0, 3.0], [5.0, 9.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert_close(masked_mean(rows, row_mask, dim=-1), torch.tensor([2.0, 5.0]))
    assert_close(masked_mean(x, torch.zeros(4, dtype=T64)), torch.tensor(0.0, dtype=T64))
    assert_close(masked_mean(torch.full((4,), float("inf")), torch.zeros(4)), torch.tensor(0.0))


def test_masked_var_matches_torch_var_on_masked_elements():
    x, mask = t(1, 2, 4, -50), t(1, 1, 1, 0)
    assert_close(masked_var(x, mask), torch.var(x[:3]))
    assert_close(masked_var(x, mask, unbiased=False), torch.var(x[:3], unbiased=False))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_gives_unit_variance_on_masked_elements(shift_mean):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, generator=g, dtype=T64) * 5 + 2
    mask = (torch.rand(3, 6, generator=g) < 0.6).to(T64)
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    expected_mean = torch.tensor(0.0, dtype=T64) if shift_mean else masked_mean(x, mask)
    assert_close(masked_mean(out, mask), expected_mean)
    assert_close(masked_var(out, mask), torch.tensor(1.0, dtype=T64))
    assert torch.all(out[mask == 0] == 0)


@pytest.mark.parametrize("n", [0, 1])
def test_masked_whiten_raises_below_two_elements(n):
    mask = torch.zeros(4)
    mask[:n] = 1
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(torch.randn(4), mask)


# --- KL estimators --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_is_zero_when_policy_equals_reference(kind):
    logprobs = torch.randn(3, 5)
    assert torch.all(kl_penalty(logprobs, logprobs.clone(), kind) == 0)


def test_kl_penalty_estimators_match_their_formulas():
    logprobs, ref_logprobs = t(-1.0, -2.0), t(-1.5, -0.5)
    d = ref_logprobs - logprobs
    assert_close(kl_penalty(logprobs, ref_logprobs, "k1"), logprobs - ref_logprobs)
    assert_close(kl_penalty(logprobs, ref_logprobs, "k2"), 0.5 * d**2)
    assert_close(kl_penalty(logprobs, ref_logprobs, "k3"), torch.exp(d) - 1 - d)


@pytest.mark.parametrize("scale", [1e-8, 1e-4, 1.0, 10.0])
def test_kl_penalty_k3_is_never_negative(scale):
    g = torch.Generator().manual_seed(0)
    logprobs = torch.randn(10_000, generator=g)
    ref_logprobs = logprobs + scale * torch.randn(10_000, generator=g)
    assert torch.all(kl_penalty(logprobs, ref_logprobs, "k3") >= 0)


def test_kl_penalty_unknown_kind_raises_and_lists_kinds():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


def test_approx_kl_is_exactly_zero_on_policy_and_positive_off_policy():
    logprobs, mask = torch.randn(2, 6), torch.ones(2, 6)
    assert approx_kl(logprobs, logprobs.clone(), mask) == 0
    assert approx_kl(logprobs + 0.1 * torch.randn(2, 6), logprobs, mask) > 0


@pytest.mark.parametrize(
    "value, target, expected", [(1.0, None, False), (0.0, 0.0, False), (0.149, 0.1, False), (0.151, 0.1, True)]
)
def test_kl_exceeded_is_false_without_target_and_uses_factor_one_and_a_half(value, target, expected):
    assert kl_exceeded(value, target) is expected


def test_kl_exceeded_respects_custom_factor():
    assert kl_exceeded(0.25, 0.1, factor=2.0) and not kl_exceeded(0.15, 0.1, factor=2.0)


@pytest.mark.parametrize(
    "update, anneal_updates, expected", [(0, 0, 1.0), (7, 0, 1.0), (0, 4, 1.0), (1, 4, 0.75), (4, 4, 0.0), (6, 4, 0.0)]
)
def test_linear_anneal_falls_from_one_to_zero_and_is_one_when_off(update, anneal_updates, expected):
    assert linear_anneal(update, anneal_updates) == expected


# --- policy loss ----------------------------------------------------------------------------------------------------


def test_policy_loss_on_policy_is_minus_mean_advantage_with_no_clipping():
    g = torch.Generator().manual_seed(0)
    logprobs, advantages = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) < 0.7).float()
    loss, clipfrac = policy_loss(logprobs, logprobs.clone(), advantages, mask, clip_coef=0.2)
    assert_close(loss, -masked_mean(advantages, mask))
    assert clipfrac == 0
    assert approx_kl(logprobs, logprobs.clone(), mask) == 0


@pytest.mark.parametrize(
    "advantage, log_ratio, zero_grad",
    [
        (1.0, math.log(1.5), True),  # A > 0, r > 1 + ε: clipped, adverse side
        (-1.0, math.log(0.5), True),  # A < 0, r < 1 - ε: clipped, adverse side
        (1.0, math.log(0.5), False),  # A > 0, r < 1 - ε: the unclipped term is the max, gradient flows
        (-1.0, math.log(1.5), False),  # A < 0, r > 1 + ε: same
        (1.0, math.log(1.1), False),  # inside the trust region
        (-1.0, math.log(0.9), False),
    ],
)
def test_policy_loss_gradient_is_zero_only_when_clipped_on_the_adverse_side(advantage, log_ratio, zero_grad):
    logprobs = torch.tensor([log_ratio], requires_grad=True)
    loss, clipfrac = policy_loss(logprobs, torch.zeros(1), torch.tensor([advantage]), torch.ones(1), clip_coef=0.2)
    loss.backward()
    assert (logprobs.grad.abs().item() == 0) == zero_grad
    assert clipfrac.item() == float(abs(math.exp(log_ratio) - 1) > 0.2)


def test_policy_loss_clip_higher_widens_only_the_upper_bound():
    # ratios 1.5, 0.5, 1.25 with A = 1, -1, 1; ε = 0.2, ε_high = 0.28: per-token losses max(-A r, -A clip(r)) are
    # -min(1.5, 1.28) = -1.28, max(0.5, 0.8) = 0.8, -1.25 (inside [0.8, 1.28]); symmetric: -1.2, 0.8, -1.2
    logprobs = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.25)], dtype=T64)
    advantages, mask = torch.tensor([1.0, -1.0, 1.0], dtype=T64), torch.ones(3, dtype=T64)
    loss, clipfrac = policy_loss(logprobs, torch.zeros(3, dtype=T64), advantages, mask, 0.2, clip_coef_high=0.28)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.25) / 3)
    assert clipfrac.item() == pytest.approx(2 / 3)  # 1.25 is no longer clipped
    loss, clipfrac = policy_loss(logprobs, torch.zeros(3, dtype=T64), advantages, mask, 0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.2) / 3) and clipfrac.item() == 1.0


# two replies, on-policy (per-token loss -A): row 0 has 3 tokens with A = 1, 2, 3, row 1 one token with A = 6
AGG_ADV = torch.tensor([[1.0, 2.0, 3.0], [6.0, 99.0, 99.0]])
AGG_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "how, max_length, expected",
    [
        ("token_mean", None, -(1 + 2 + 3 + 6) / 4),  # every token weighs the same
        ("sequence_mean", None, (-2 - 6) / 2),  # reply means -2 and -6, then their mean
        ("dr_grpo", 3, (-6 - 6) / 2 / 3),  # reply sums -6 and -6 over the constant 3, then their mean
        ("dr_grpo", 4, (-6 - 6) / 2 / 4),  # the constant is the batch's longest reply, maybe not in this minibatch
    ],
)
def test_policy_loss_aggregations_golden_values(how, max_length, expected):
    logprobs = torch.zeros(2, 3)
    loss, _ = policy_loss(logprobs, logprobs.clone(), AGG_ADV, AGG_MASK, 0.2, aggregation=how, max_length=max_length)
    assert loss.item() == pytest.approx(expected)


def test_aggregate_loss_rejects_an_unknown_kind_and_dr_grpo_without_a_length():
    with pytest.raises(ValueError, match="one of token_mean, sequence_mean, dr_grpo. Received 'sum'"):
        aggregate_loss(AGG_ADV, AGG_MASK, "sum")
    with pytest.raises(ValueError, match="needs `max_length` >= 1"):
        aggregate_loss(AGG_ADV, AGG_MASK, "dr_grpo")


def test_policy_loss_ignores_huge_values_under_mask_zero():
    g = torch.Generator().manual_seed(0)
    logprobs, old, adv = (torch.randn(2, 6, generator=g) for _ in range(3))
    mask = torch.ones(2, 6)
    mask[:, 4:] = 0

    def run(lp, ol, ad):
        lp = lp.clone().requires_grad_(True)
        loss, clipfrac = policy_loss(lp, ol, ad, mask, clip_coef=0.2)
        loss.backward()
        return loss, clipfrac, lp.grad, approx_kl(lp.detach(), ol, mask)

    huge = mask == 0
    ref = run(logprobs, old, adv)
    out = run(logprobs.masked_fill(huge, 1e9), old.masked_fill(huge, -1e9), adv.masked_fill(huge, 1e9))
    for a, b in zip(ref, out, strict=True):
        assert torch.isfinite(b).all()
        assert_close(a, b)


# --- value loss and explained variance ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, old_value, ret, clip_coef, expected_loss, expected_clipfrac",
    [
        (1.0, 0.0, 1.0, None, 0.0, 0.0),  # unclipped: ½ (1 - 1)²
        (1.0, 0.0, 3.0, None, 2.0, 0.0),  # unclipped: ½ (1 - 3)²
        (1.0, 0.0, 1.0, 0.2, 0.32, 1.0),  # clipped V = 0.2 is further from R: ½ max(0, 0.8²)
        (1.0, 0.0, -1.0, 0.2, 2.0, 0.0),  # clipped V = 0.2 is closer to R: ½ max(2², 1.2²)
        (0.1, 0.0, 1.0, 0.2, 0.405, 0.0),  # inside the clip range: plain ½ (0.1 - 1)²
    ],
)
def test_value_loss_hand_cases(value, old_value, ret, clip_coef, expected_loss, expected_clipfrac):
    loss, clipfrac = value_loss(t(value), t(old_value), t(ret), t(1.0), clip_coef)
    assert_close(loss, torch.tensor(expected_loss, dtype=T64))
    assert_close(clipfrac, torch.tensor(expected_clipfrac, dtype=T64))


@pytest.mark.parametrize("clip_coef", [None, 0.2])
def test_value_loss_ignores_huge_values_under_mask_zero(clip_coef):
    values, old_values, returns, mask = t(0.5, 1.0, 1e9), t(0.4, 0.0, -1e9), t(1.0, 2.0, 1e9), t(1, 1, 0)
    values.requires_grad_(True)
    loss, _ = value_loss(values, old_values, returns, mask, clip_coef)
    loss.backward()
    ref, _ = value_loss(values[:2], old_values[:2], returns[:2], mask[:2], clip_coef)
    assert_close(loss, ref)
    assert values.grad[2] == 0


def test_explained_variance_is_one_for_perfect_zero_for_mean_and_nan_for_constant_returns():
    returns, mask = t(1, 2, 3, 4, 99), t(1, 1, 1, 1, 0)
    assert_close(explained_variance(returns.clone(), returns, mask), torch.tensor(1.0, dtype=T64))
    assert_close(explained_variance(torch.full_like(returns, 2.5), returns, mask), torch.tensor(0.0, dtype=T64))
    assert torch.isnan(explained_variance(t(0, 0), t(5, 5), t(1, 1)))


# --- KL controllers -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "current_kl, expected",
    [
        (6.0, 0.1),  # on target: no change
        (60.0, 0.1 * (1 + 0.2 * 10 / 100)),  # far above target: step clipped at +20 %
        (6.6, 0.1 * (1 + 0.1 * 10 / 100)),  # 10 % above target: proportional
        (5.4, 0.1 * (1 - 0.1 * 10 / 100)),  # 10 % below target
        (0.0, 0.1 * (1 - 0.2 * 10 / 100)),  # far below target: step clipped at -20 %
    ],
)
def test_adaptive_kl_controller_moves_toward_target_with_clipped_step(current_kl, expected):
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=100)
    ctl.update(current_kl, n_steps=10)
    assert ctl.value == pytest.approx(expected)


def test_kl_controllers_round_trip_state_dict_and_fixed_never_moves():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(12.0, n_steps=50)
    fresh = AdaptiveKLController(0.1, target=6.0, horizon=100)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value != 0.1
    fixed = FixedKLController(0.05)
    fixed.update(100.0, n_steps=1000)
    assert fixed.value == 0.05 and fixed.state_dict() == {"value": 0.05}


def test_adaptive_kl_controller_rejects_non_positive_target():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=100)


def test_ridge_refit_golden_values():
    features, targets = torch.tensor([[1.0], [2.0]]), torch.tensor([1.0, 2.0])
    zero_w, zero_b = torch.zeros(1, 1), torch.zeros(1)
    weight, bias = ridge_refit(features, targets, zero_w, zero_b, damping=0.0)  # plain least squares: y = x
    torch.testing.assert_close((weight, bias), (torch.tensor([[1.0]]), torch.tensor([0.0])))
    # X = [[1, 1], [2, 1]]: X^T X = [[5, 3], [3, 2]], trace 7, so damping 2/7 gives lam = 1 (per entry of w);
    # (X^T X + I) delta = X^T y = [5, 3]  ->  delta = [[6, 3], [3, 3]]^-1 [5, 3] = [2/3, 1/3]
    weight, bias = ridge_refit(features, targets, zero_w, zero_b, damping=2 / 7)
    torch.testing.assert_close((weight, bias), (torch.tensor([[2 / 3]]), torch.tensor([1 / 3])))
    # pulled toward the current head: a head that already fits stays exactly where it is
    weight, bias = ridge_refit(features, targets, torch.tensor([[1.0]]), torch.tensor([0.0]), damping=5.0)
    torch.testing.assert_close((weight, bias), (torch.tensor([[1.0]]), torch.tensor([0.0])))
