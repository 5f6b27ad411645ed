"""Advantage estimators (llamagym.algos.estimators): golden values computed by hand on small batches."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from llamagym.algos import estimators, ppo
from llamagym.algos.estimators import EPS, AdvantageBatch
from llamagym.config import PPOConfig


def batch_of(episodes, groups, terminal=None, values=None, bootstrap=None, step_key=None) -> AdvantageBatch:
    """Flat tensors from per-episode reward lists."""
    rewards = [r for rs in episodes for r in rs]
    index = [e for e, rs in enumerate(episodes) for _ in rs]
    return AdvantageBatch(
        rewards=torch.tensor(rewards),
        episode=torch.tensor(index),
        terminal=torch.tensor(terminal if terminal is not None else [True] * len(episodes)),
        group=torch.tensor(groups),
        values=torch.tensor(values) if values is not None else None,
        bootstrap=torch.tensor(bootstrap) if bootstrap is not None else None,
        step_key=torch.tensor(step_key) if step_key is not None else None,
    )


def test_returns_to_go_restart_at_each_episode():
    rewards, episode = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1])
    assert estimators.returns_to_go(rewards, episode, 0.5).tolist() == [2.0, 2.0, 3.0]  # 1 + 0.5 x 2; 2; 3


# Six episodes, gamma 0.5. Group 0: returns 0 + 0.5 x 1 = 0.5, 0, 1 (mean 0.5, Bessel std 0.5); group 1: one
# episode (return 2); group 2: two equal returns (1, 1). Per-turn returns-to-go: [0.5, 1 | 0, 0 | 1 | 2 | 1 | 1].
GROUPED = ([[0.0, 1.0], [0.0, 0.0], [1.0], [2.0], [1.0], [1.0]], [0, 0, 0, 1, 2, 2])
RETURNS = [0.5, 1.0, 0.0, 0.0, 1.0, 2.0, 1.0, 1.0]


def test_grpo_scaled_divides_each_groups_deviation_by_its_std_and_zeroes_flat_groups():
    adv, ret, stats = estimators.grpo(batch_of(*GROUPED), gamma=0.5)
    unit = 0.5 / (0.5 + EPS)  # deviation 0.5 over std 0.5
    assert_close(adv, torch.tensor([0.0, 0.0, -unit, -unit, unit, 0.0, 0.0, 0.0]))  # every turn gets its episode's
    assert ret.tolist() == RETURNS
    assert stats == {"adv/groups": 3.0, "adv/zero_variance_groups": 2.0}  # the group of one and the equal pair


def test_grpo_unscaled_is_the_return_minus_the_group_mean():
    adv, _, _ = estimators.grpo(batch_of(*GROUPED), gamma=0.5, scale=False)
    assert adv.tolist() == [0.0, 0.0, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]


def test_rloo_subtracts_the_others_mean_and_gives_a_group_of_one_zero():
    adv, ret, stats = estimators.rloo(batch_of(*GROUPED), gamma=0.5)
    # group 0: 0.5 - (0 + 1)/2 = 0; 0 - (0.5 + 1)/2 = -0.75; 1 - (0.5 + 0)/2 = 0.75
    assert adv.tolist() == [0.0, 0.0, -0.75, -0.75, 0.75, 0.0, 0.0, 0.0]
    assert ret.tolist() == RETURNS and stats["adv/zero_variance_groups"] == 2.0


def test_rebn_normalises_discounted_returns_to_go_over_the_batch():
    # gamma 0.5: G = [0 + 0.5 x 1, 1 | 1] = [0.5, 1, 1]; mean 5/6, deviations [-1/3, 1/6, 1/6],
    # Bessel variance (1/9 + 1/36 + 1/36) / 2 = 1/12
    adv, ret, stats = estimators.rebn(batch_of([[0.0, 1.0], [1.0]], [0, 1]), gamma=0.5)
    std = math.sqrt(1 / 12) + EPS
    assert_close(adv, torch.tensor([-1 / 3 / std, 1 / 6 / std, 1 / 6 / std]))
    assert ret.tolist() == [0.5, 1.0, 1.0]
    assert stats == {"adv/groups": 1.0, "adv/zero_variance_groups": 0.0}  # groups are ignored: the batch is one


def test_rebn_of_equal_returns_is_zero_and_counted():
    adv, _, stats = estimators.rebn(batch_of([[1.0], [1.0]], [0, 1]), gamma=1.0)
    assert adv.tolist() == [0.0, 0.0] and stats["adv/zero_variance_groups"] == 1.0


# gigpo: one group of three 2-turn episodes, gamma 1. States: all start in s0; then s1, s2, s1.
# Returns-to-go: e0 [1, 1], e1 [0, 0], e2 [0, 0]; episode returns [1, 0, 0] (mean 1/3).
GIGPO = batch_of([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]], [0, 0, 0], step_key=[0, 1, 0, 2, 0, 1])


def test_gigpo_adds_a_step_advantage_within_turns_from_the_same_state():
    adv, ret, stats = estimators.gigpo(GIGPO, gamma=1.0, scale=False)
    # episode advantages [2/3, -1/3, -1/3]; step groups: s0 {e0: 1, e1: 0, e2: 0} -> [2/3, -1/3, -1/3],
    # s1 {e0: 1, e2: 0} -> [1/2, -1/2], s2 {e1} alone -> 0
    expected = [2 / 3 + 2 / 3, 2 / 3 + 1 / 2, -1 / 3 - 1 / 3, -1 / 3 + 0.0, -1 / 3 - 1 / 3, -1 / 3 - 1 / 2]
    assert_close(adv, torch.tensor(expected))
    assert ret.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert stats == {
        "adv/groups": 1.0,
        "adv/zero_variance_groups": 0.0,
        "adv/step_groups": 2.0,  # s0 and s1; s2 has one turn
        "adv/zero_variance_step_groups": 0.0,
    }


def test_gigpo_scaled_divides_both_parts_by_their_groups_std():
    adv, _, _ = estimators.gigpo(GIGPO, gamma=1.0, scale=True)
    third = 1 / (math.sqrt(1 / 3) + EPS) / 3  # episode returns [1, 0, 0]: Bessel std sqrt(1/3); s0 the same
    half = 0.5 / (math.sqrt(0.5) + EPS)  # s1 {1, 0}: Bessel std sqrt(1/2)
    expected = [4 * third, 2 * third + half, -2 * third, -third, -2 * third, -third - half]
    assert_close(adv, torch.tensor(expected))


def test_gigpo_step_groups_stay_within_an_episode_group():
    # the same state in two episode groups: not compared (the two tasks differ), so the step advantage is 0
    batch = batch_of([[1.0], [0.0]], [0, 1], step_key=[7, 7])
    adv, _, stats = estimators.gigpo(batch, gamma=1.0)
    assert adv.tolist() == [0.0, 0.0] and stats["adv/step_groups"] == 0.0


def test_gigpo_on_one_step_episodes_from_one_state_doubles_grpo():
    batch = batch_of([[1.0], [0.0], [0.0]], [0, 0, 0], step_key=[3, 3, 3])
    assert_close(estimators.gigpo(batch, 1.0).advantages, 2 * estimators.grpo(batch, 1.0).advantages)


def test_gae_reproduces_the_per_episode_ppo_gae_path_with_a_truncated_episode():
    # e0 terminal: rewards [0, 1], values [0.5, 0.2]; e1 truncated: reward 0, value 0.4, V(next state) = 1.
    batch = batch_of([[0.0, 1.0], [0.0]], [0, 0], [True, False], [0.5, 0.2, 0.4], [0.0, 1.0])
    adv, ret, stats = estimators.gae(batch, gamma=0.9, lam=0.8)
    # e0: A_1 = 1 - 0.2 = 0.8; A_0 = (0 + 0.9 x 0.2 - 0.5) + 0.9 x 0.8 x 0.8 = 0.256. e1: 0 + 0.9 x 1 - 0.4 = 0.5
    assert_close(adv, torch.tensor([0.256, 0.8, 0.5]))
    assert_close(ret, torch.tensor([0.756, 1.0, 0.9]))
    assert stats == {}
    # bit for bit the trainer's former path: ppo.gae per episode, done at a terminal end, bootstrap on truncation
    a0, r0 = ppo.gae(batch.rewards[:2], batch.values[:2], torch.tensor([0.0, 1.0]), torch.zeros(()), 0.9, 0.8)
    a1, r1 = ppo.gae(batch.rewards[2:], batch.values[2:], torch.zeros(1), batch.bootstrap[1], 0.9, 0.8)
    assert torch.equal(adv, torch.cat([a0, a1])) and torch.equal(ret, torch.cat([r0, r1]))


def test_gae_without_values_raises_and_gigpo_without_step_keys_raises():
    with pytest.raises(ValueError, match="gae estimator needs `values`"):
        estimators.gae(batch_of([[1.0]], [0]), 1.0, 0.95)
    with pytest.raises(ValueError, match="gigpo estimator needs `step_key`"):
        estimators.gigpo(batch_of([[1.0]], [0]), 1.0)


# pooled_tail: tail D = high - low per turn, groups by (state, reply) key
def test_pooled_tail_gives_back_each_groups_shrunk_mean_tail():
    # D = (2, 0 | -1, -1 | 3), n = (2, 2, 1): group means (1, -1, 3), m = 0.6; sigma2 = (1 + 1) / 2 = 1;
    # tau2 = (0.4^2 + 1.6^2 + 2.4^2) / 2 - (1/2 + 1/2 + 1) / 3 = 4.24 - 2/3; w = tau2 / (tau2 + 1/n)
    low, key = torch.tensor([0.5, -0.5, 0.0, 1.0, 0.0]), torch.tensor([7, 7, 3, 3, 9])
    adv, stats = estimators.pooled_tail(low, low + torch.tensor([2.0, 0.0, -1.0, -1.0, 3.0]), key)
    tau2 = 4.24 - 2 / 3
    w2, w1 = tau2 / (tau2 + 0.5), tau2 / (tau2 + 1.0)  # 0.877250, 0.781341
    expected = [0.5 + 0.6 + 0.4 * w2, -0.5 + 0.6 + 0.4 * w2, 0.6 - 1.6 * w2, 1.6 - 1.6 * w2, 0.6 + 2.4 * w1]
    assert_close(adv, torch.tensor(expected))
    assert_close(adv, torch.tensor([1.45090, 0.45090, -0.80360, 0.19640, 2.47522]), atol=1e-5, rtol=0)
    assert stats["adv/tail_signal"] == pytest.approx(tau2) and stats["adv/tail_noise"] == pytest.approx(1.0)
    assert stats["adv/tail_weight"] == pytest.approx((4 * w2 + w1) / 5)


def test_pooled_tail_keeps_a_systematic_tail_and_drops_a_noisy_one():
    low = torch.zeros(5)
    systematic = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5])  # the same within each group: the high lambda's, whole
    adv, stats = estimators.pooled_tail(low, systematic, torch.tensor([0, 0, 1, 1, 2]))
    assert_close(adv, systematic)
    assert stats["adv/tail_weight"] == 1.0
    noisy = torch.tensor([1.0, -1.0, 1.0, -1.0])  # group means equal: nothing but noise, the low lambda's (+ m = 0)
    adv, stats = estimators.pooled_tail(low[:4], noisy, torch.tensor([0, 0, 1, 1]))
    assert adv.tolist() == [0.0] * 4 and stats["adv/tail_weight"] == 0.0


def test_pooled_tail_without_a_repeated_group_keeps_the_low_lambda_shifted_by_the_mean_tail():
    adv, stats = estimators.pooled_tail(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 5.0]), torch.tensor([0, 1]))
    assert adv.tolist() == [3.0, 4.0] and stats["adv/tail_weight"] == 0.0  # + m = 2: whitening removes it
    assert math.isnan(stats["adv/tail_noise"])


def test_equal_returns_up_to_float_noise_count_as_a_zero_variance_group():
    adv, _, stats = estimators.grpo(batch_of([[1.0], [1.0 + 1e-7], [0.0], [1.0]], [0, 0, 1, 1]), 1.0)
    assert adv[:2].tolist() == [0.0, 0.0] and stats["adv/zero_variance_groups"] == 1.0


def test_registry_lists_the_builtins_and_says_which_need_a_value_head():
    assert estimators.names() == ("gae", "grpo", "rloo", "rebn", "gigpo")
    assert [estimators.get_estimator(n).needs_value for n in estimators.names()] == [True, False, False, False, False]


def test_unknown_estimator_error_lists_the_known_names():
    with pytest.raises(ValueError, match=r"Unknown advantage estimator 'ppo'\. Known: gae, grpo, rloo, rebn, gigpo"):
        estimators.get_estimator("ppo")
    with pytest.raises(ValueError, match=r"`advantage` should be one of gae, grpo, rloo, rebn, gigpo"):
        PPOConfig(advantage="ppo")


def test_registering_a_new_estimator_makes_it_configurable_and_a_duplicate_name_raises():
    @estimators.register_estimator("zero", needs_value=False)
    def zero(batch, gamma, lam, scale=True):
        return estimators.Estimate(torch.zeros_like(batch.rewards), batch.rewards, {})

    try:
        assert estimators.get_estimator("zero") is zero and not zero.needs_value
        assert PPOConfig(advantage="zero").advantage == "zero"
        with pytest.raises(ValueError, match="'zero' is already registered"):
            estimators.register_estimator("zero", needs_value=False)(zero)
    finally:
        del estimators.ESTIMATORS["zero"]


def test_by_default_a_longer_walk_to_the_same_reward_returns_less():
    # A move into a wall (the first turn of episode 0) changes nothing; the goal pays 1 at the end of both episodes.
    # Undiscounted, the wall's turn returns exactly what a step toward the goal does, and a greedy policy that prefers
    # it loops for ever (FrozenLake, docs/learning-that-holds.md, forty-third session). The default discount tells
    # them apart: 0.99^2 for the walk with the wall against 0.99 for the straight one.
    rewards, episode = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 1, 1])
    returns = estimators.returns_to_go(rewards, episode, PPOConfig().gamma)
    assert_close(returns, torch.tensor([0.99**2, 0.99, 1.0, 0.99, 1.0]))
    assert_close(estimators.returns_to_go(rewards, episode, 1.0), torch.ones(5))
