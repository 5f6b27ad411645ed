"""The trust region (each step's KL to the batch's old policy stays under max_kl) and advantage scales that leave a
batch of equal returns near zero, so a solved policy is not moved by value-head noise."""

import math

import numpy as np
import pytest
import torch

from llamagym.algos import ppo
from llamagym.algos import trainer as trainer_module
from llamagym.algos.modes.score import ScoreMode, relative_kl
from llamagym.algos.rollout import Episode, Turn, collate_scored
from llamagym.algos.trainer import PPOTrainer, state_weights
from llamagym.algos.trust_region import TrustRegion, categorical_kl, next_start, step_scale
from llamagym.config import PPOConfig
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model

PROMPTS = [[257, 50, 51, 256, 259], [257, 52, 256, 258, 53, 256, 259], [257, 54, 256, 259]]
CANDIDATES = [[[60, 61, 256], [70, 256]], [[80, 256], [81, 82, 83, 256], [84, 256]], [[60, 256], [61, 256]]]


def test_categorical_kl_golden_value_and_padding():
    p = torch.tensor([0.5, 0.5, 0.0]).log()  # the third entry is padding (-inf), as candidates are padded
    q = torch.tensor([0.9, 0.1, 0.0]).log()
    # 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5 * (-0.587787 + 1.609438) = 0.510826
    assert float(categorical_kl(p, q)) == pytest.approx(0.510826, abs=1e-6)
    assert float(categorical_kl(p, p)) == 0.0


def test_relative_kl_golden_values_per_bit_of_choice():
    old = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]]).log()
    new = torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1], [1.0, 0.0, 0.0, 0.0]]).log()
    # two candidates: nats = bits (0.510826); four: 0.25 (ln(0.25/0.7) + 3 ln 2.5) = 0.429815 nats over 2 bits
    expected = torch.tensor([0.510826, 0.429815 / 2, 0.0])
    count = torch.tensor([2, 4, 1])
    torch.testing.assert_close(relative_kl(old, new, count), expected, atol=1e-6, rtol=0)
    plain = categorical_kl(old, new)[:2]
    torch.testing.assert_close(relative_kl(old, new, count)[:2], plain / torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    "scale, kl, gained, expected",
    [
        (1.0, 0.08, True, math.sqrt(0.9 * 0.02 / 0.08)),  # 4x the bound: the quadratic model's 0.474
        (1.0, 0.03, True, 0.5),  # 1.5x the bound: at most half, so the next try is inside
        (0.5, 2.0, True, 0.05),  # 100x the bound: at least a tenth, so a poor fit still gets there
        (1.0, 0.01, False, 0.5),  # inside the bound, but the surrogate got worse: halve
    ],
)
def test_step_scale_golden_values(scale, kl, gained, expected):
    assert step_scale(scale, kl, max_kl=0.02, gained=gained) == pytest.approx(expected)


@pytest.mark.parametrize(
    "start, scale, kl, expected",
    [
        (1.0, 1.0, 0.005, math.sqrt(0.9 * 0.02 / 0.005)),  # a quarter of the bound used: the quadratic model's 1.897
        (1.0, 1.0, 0.0, 2.0),  # nothing moved (e.g. zero advantages): grow, at most 2x
        (0.2, 0.2, 0.019, 0.2 * math.sqrt(0.9 * 0.02 / 0.019)),  # just inside: about the same
        (0.2, 0.1, 0.2, 0.1),  # 10x the bound at half the start: shrink, at most 2x below the start
        (1.0, 0.01, 0.0003, 0.5),  # halved for its surrogate: the next starts near the last start, not there
        (6.0, 6.0, 0.001, 8.0),  # never beyond 8x the step as computed
    ],
)
def test_next_start_golden_values(start, scale, kl, expected):
    assert next_start(start, scale, kl, max_kl=0.02) == pytest.approx(expected)


def test_the_next_step_starts_where_the_last_accepted_one_suggests():
    w = torch.nn.Parameter(torch.zeros(1))
    region = TrustRegion([w], max_kl=0.02)
    kl = lambda: (float(w.pow(2).sum() / 2), float(w.pow(2).sum() / 2), True)  # noqa: E731
    region.remember()
    with torch.no_grad():
        w += 0.1  # KL 0.005: a quarter of the bound, accepted as taken
    assert region.enforce(kl, lambda: None)["scale"] == 1.0
    assert region.start == pytest.approx(math.sqrt(0.9 * 0.02 / 0.005))
    region.remember()
    start = w.detach().clone()
    with torch.no_grad():
        w += 0.1  # the same step again: first measured at the suggested scale, so it lands at 0.9 x the bound
    result = region.enforce(lambda: (float((w - start).pow(2).sum() / 2),) * 2 + (True,), lambda: None)
    assert result["tries"] == 1.0 and result["kl"] == pytest.approx(0.9 * 0.02)
    torch.testing.assert_close(w.detach() - start, torch.tensor([0.1 * result["scale"]]))


def test_a_step_of_zero_leaves_the_next_start_as_it_was():
    w = torch.nn.Parameter(torch.zeros(1))
    region = TrustRegion([w], max_kl=0.02)
    region.start = 0.3
    for _ in range(3):  # batches of equal returns: advantages 0, a natural step of exactly 0
        region.remember()
        result = region.enforce(lambda: (0.0, 0.0, True), lambda: None)
        assert result["tries"] == 1.0 and result["kl"] == 0.0
    assert region.start == 0.3  # not doubled on every batch (it was, to 2.4 here)
    region.remember()
    with torch.no_grad():
        w += 0.1
    region.enforce(lambda: (float(w.pow(2).sum() / 2),) * 2 + (True,), lambda: None)
    assert region.start == pytest.approx(next_start(0.3, 0.3, (0.03**2) / 2, 0.02))  # a real step still moves it


def test_trust_region_backtracks_a_step_until_it_fits_and_undoes_one_that_never_does():
    w = torch.nn.Parameter(torch.zeros(2))
    region = TrustRegion([w], max_kl=0.02)
    region.remember()
    with torch.no_grad():
        w += torch.tensor([1.0, 0.0])  # the step: a KL of |w|^2 / 2 = 0.5, 25x the bound
    moved = []
    result = region.enforce(
        lambda: (float(w.pow(2).sum() / 2), float(w.pow(2).sum() / 2), True), lambda: moved.append(1)
    )
    assert result["kl"] <= 0.02 and 0 < result["scale"] < 1 and moved
    torch.testing.assert_close(w.detach(), torch.tensor([result["scale"], 0.0]))  # back along the step

    start = w.detach().clone()
    region.remember()
    with torch.no_grad():
        w += 1.0
    result = region.enforce(lambda: (1.0, 1.0, False), lambda: None)  # never fits
    assert result == {"scale": 0.0, "tries": 6.0}
    torch.testing.assert_close(w.detach(), start)  # undone


@pytest.mark.parametrize(
    "kl, kl_max, factor, expected",
    [
        (0.01, 0.05, 5.0, 0.01),  # every input within 5 x 0.02: the mean binds
        (0.01, 0.2, 5.0, 0.04),  # one input at 0.2, twice its bound of 0.1: sized as a mean twice its bound
        (0.01, 0.2, None, 0.01),  # off: the mean alone
    ],
)
def test_binding_kl_golden_values(kl, kl_max, factor, expected):
    region = TrustRegion([torch.nn.Parameter(torch.zeros(1))], max_kl=0.02, input_factor=factor)
    assert region.binding_kl(kl, kl_max) == pytest.approx(expected)


def test_an_input_bound_shrinks_a_step_whose_mean_fits_until_its_largest_input_fits():
    w = torch.nn.Parameter(torch.zeros(4))
    region = TrustRegion([w], max_kl=0.02, input_factor=2.0)  # each input's KL <= 0.04

    def measure():  # four inputs, each with KL w_i^2 / 2; only the first moves
        kl = w.detach().pow(2) / 2
        return float(kl.mean()), float(kl.max()), True

    region.remember()
    with torch.no_grad():
        w += torch.tensor([0.5, 0.0, 0.0, 0.0])  # mean 0.03125 (over its bound), that input 0.125 (3x over its own)
    result = region.enforce(measure, lambda: None)
    assert result["kl_max"] <= 0.04 and result["kl"] <= 0.01 and 0 < result["scale"] < math.sqrt(0.04 / 0.125)
    assert region.start == pytest.approx(next_start(1.0, result["scale"], result["kl_max"] / 2.0, 0.02))
    with pytest.raises(ValueError, match="input_kl_factor"):
        PPOConfig(input_kl_factor=0.5)
    with pytest.raises(ValueError, match="input_kl_factor"):
        PPOConfig(input_kl_factor=5.0, max_kl=None)


def test_repeated_input_weights_golden_values():
    groups = torch.tensor([0, 0, 0, 0, 1, 2, 2])  # input 0 met in four turns, input 1 in one, input 2 in two
    torch.testing.assert_close(ppo.repeated_input_weights(groups, 0.0), torch.ones(7))
    half = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 2**-0.5, 2**-0.5])
    torch.testing.assert_close(ppo.repeated_input_weights(groups, 0.5), half)
    torch.testing.assert_close(ppo.repeated_input_weights(groups, 1.0), torch.tensor([0.25] * 4 + [1.0, 0.5, 0.5]))


def test_state_weights_count_every_rank_and_land_on_the_advantages_device():
    """A rank's weights count its states' turns on every rank (the keys are gathered; this rank holds turns 1-3),
    and are counted on the CPU but multiply advantages on the policy's device (a GPU run failed at its first update
    when they did not move)."""
    keys = torch.tensor([0, 0, 1, 1, 1])
    mine = slice(1, 4)
    torch.testing.assert_close(state_weights(keys, 0.5, mine, torch.device("cpu")), torch.tensor([2, 3, 3]) ** -0.5)
    weights = state_weights(keys, 0.5, mine, torch.device("meta"))
    assert weights.device.type == "meta" and weights.shape == (3,)


def test_running_moments_match_numpy_over_chunks():
    values = np.random.default_rng(0).normal(3.0, 2.0, size=100)
    moments = ppo.RunningMoments()
    for chunk in np.array_split(values, 7):
        moments.update(torch.tensor(chunk))
    assert moments.count == 100 and moments.mean == pytest.approx(values.mean())
    assert moments.std == pytest.approx(values.std())
    again = ppo.RunningMoments()
    again.load_state_dict(moments.state_dict())
    assert again.std == moments.std


def test_scale_advantages_golden_values():
    advantages = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3
    torch.testing.assert_close(ppo.scale_advantages(advantages, "returns", 2.0), torch.tensor([-1.0, -0.5, 0.0, 1.5]))
    torch.testing.assert_close(ppo.scale_advantages(advantages, "none", 2.0), torch.tensor([-2.0, -1.0, 0.0, 3.0]))
    torch.testing.assert_close(ppo.scale_advantages(advantages, "returns", 0.0), torch.tensor([-2.0, -1.0, 0.0, 3.0]))
    whitened = ppo.scale_advantages(advantages, "batch", 2.0)
    assert float(whitened.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(whitened.std()) == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match="one of batch, returns, none"):
        ppo.scale_advantages(advantages, "rank", 1.0)


def test_state_centered_advantages_golden_values():
    advantages, states = torch.tensor([1.0, 2.0, 3.0, 10.0]), torch.tensor([0, 0, 1, 2])
    # state 0's two turns on their mean 1.5; states 1 and 2, alone in the batch, on the batch's mean 4
    torch.testing.assert_close(ppo.state_centered(advantages, states), torch.tensor([-0.5, 0.5, -1.0, 6.0]))
    scaled = ppo.scale_advantages(advantages, "returns", 2.0, states)
    torch.testing.assert_close(scaled, torch.tensor([-0.25, 0.25, -0.5, 3.0]))
    # "batch": the centred values over their std: their mean 1.25, squared deviations 31.25 over 3
    whitened = ppo.scale_advantages(advantages, "batch", 2.0, states)
    torch.testing.assert_close(whitened, torch.tensor([-0.5, 0.5, -1.0, 6.0]) / (31.25 / 3) ** 0.5)


def test_state_centering_rights_a_drawn_action_that_an_overrated_state_made_negative():
    # one state, V 1.01 over returns of at most 1: the sure door (returns 1.0, three draws) and a detour (0.5, once)
    # both come out negative; centred on the batch with a second state's turns, the sure door stays below 0,
    # centred on its state it is above the detour's and above 0
    advantages = torch.tensor([-0.01, -0.01, -0.01, -0.51, 0.3, 0.3])
    states = torch.tensor([0, 0, 0, 0, 1, 1])
    assert float(ppo.scale_advantages(advantages, "none", 1.0)[0]) < 0
    by_state = ppo.scale_advantages(advantages, "none", 1.0, states)
    torch.testing.assert_close(by_state, torch.tensor([0.125, 0.125, 0.125, -0.375, 0.0, 0.0]))


def scored_episodes(rewards, choices, turns=1):
    """One scored turn per reward, `turns` consecutive turns to an episode."""
    steps = [
        Turn(p, c[k], r, candidates=c, choice=k)
        for p, c, r, k in zip(PROMPTS * 4, CANDIDATES * 4, rewards, choices, strict=False)
    ]
    return [Episode(steps[i : i + turns]) for i in range(0, len(steps), turns)]


def distributions(policy):
    with torch.no_grad():
        return policy.score(collate_scored(PROMPTS, CANDIDATES, pad_token_id=256)).logprobs


def update_kl(model, lora_config, tokenizer, rewards, history=(), turns=1, per_input=False, **overrides):
    """The mean KL(before || after) per bit of choice (what the trust region bounds) over the three inputs of one
    whole-batch natural-gradient update on `rewards` (episodes of `turns` turns), after updates on each batch of
    rewards in `history`; with `per_input`, each input's KL (a tensor of 3) instead of their mean."""
    config = PPOConfig(
        **{
            "natural_gradient": True,
            "natural_step": 2.0,
            "mini_batch_size": 64,
            "ppo_epochs": 2,
            "kl_coef": 0.0,
            "adaptive_kl": False,
            **overrides,
        }
    )
    trainer = PPOTrainer(Policy(model, lora_config, precision="fp32"), config, tokenizer.pad_token_id)
    weight = trainer.policy.value_head.linear.weight
    with torch.no_grad():  # a value head that is a little off everywhere, as after any training
        weight.copy_(0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    for earlier in history:
        trainer.step(scored_episodes(earlier, [0, 1, 0, 1, 0, 1], turns))
    before = distributions(trainer.policy)
    stats = trainer.step(scored_episodes(rewards, [0, 1, 0, 1, 0, 1], turns))
    count = torch.tensor([len(c) for c in CANDIDATES])
    kl = relative_kl(before, distributions(trainer.policy), count)
    return (kl if per_input else float(kl.mean())), stats


def per_input_kl_after_one_update(lora_config, tokenizer, power: float | None) -> torch.Tensor:
    """KL(before || after) per bit of choice of each of the three inputs after one natural update on a batch where
    input 0 is met in four turns and inputs 1 and 2 in one each (every turn's reply says what was better)."""
    met = [(0, 0, 1.0), (0, 1, 0.0), (0, 0, 1.0), (0, 1, 0.0), (1, 0, 1.0), (2, 1, 0.0)]  # (input, choice, reward)
    episodes = [Episode([Turn(PROMPTS[i], CANDIDATES[i][k], r, candidates=CANDIDATES[i], choice=k)]) for i, k, r in met]
    config = PPOConfig(natural_gradient=True, natural_step=0.5, max_kl=None, repeated_input_power=power)
    torch.manual_seed(0)  # the same adapter's random start for every power
    policy = Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision="fp32")
    trainer = PPOTrainer(policy, config, tokenizer.pad_token_id)
    before = distributions(policy)
    trainer.step(episodes)
    return relative_kl(before, distributions(trainer.policy), torch.tensor([len(c) for c in CANDIDATES]))


def test_repeated_input_power_shrinks_the_move_of_an_input_met_in_many_turns(lora_config, tokenizer):
    plain = per_input_kl_after_one_update(lora_config, tokenizer, 0.0)
    equal = per_input_kl_after_one_update(lora_config, tokenizer, 1.0)
    assert float(plain.min()) > 0 and float(equal.min()) > 0  # every input moved
    # the input met four times holds the largest share of the plain step; weighed as one input, far less of it
    assert float(equal[0] / equal.sum()) < 0.5 * float(plain[0] / plain.sum())


def test_repeated_input_power_is_a_half_when_scoring_and_off_when_generating_by_default(
    lora_config, tokenizer, monkeypatch
):
    default = per_input_kl_after_one_update(lora_config, tokenizer, None)
    assert torch.equal(default, per_input_kl_after_one_update(lora_config, tokenizer, 0.5))
    monkeypatch.setattr(ScoreMode, "repeated_input_power", 1.0)  # None reads the mode's own value
    pinned = per_input_kl_after_one_update(lora_config, tokenizer, 1.0)
    assert torch.equal(per_input_kl_after_one_update(lora_config, tokenizer, None), pinned)
    generated = [
        Episode([Turn(p, c[0], float(i % 3), candidates=None)])
        for i, (p, c) in enumerate(zip(PROMPTS * 3, CANDIDATES * 3, strict=True))
    ]
    moved = [natural_move(lora_config, tokenizer, generated, power) for power in (None, 0.0, 0.5)]
    assert torch.equal(moved[0], moved[1]) and not torch.equal(moved[0], moved[2])


def natural_move(lora_config, tokenizer, episodes, power: float | None) -> torch.Tensor:
    """The adapter's move (flat) by one natural update on `episodes` from the same random start, at `power`. Natural
    steps follow the advantages' sizes; AdamW's first steps follow only their signs, which a power does not change."""
    torch.manual_seed(0)
    policy = Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision="fp32")
    start = torch.cat([p.detach().flatten() for p in policy.trainable_parameters()])
    config = PPOConfig(natural_gradient=True, natural_step=0.5, max_kl=None, repeated_input_power=power)
    PPOTrainer(policy, config, tokenizer.pad_token_id).step(episodes)
    return torch.cat([p.detach().flatten() for p in policy.trainable_parameters()]) - start


def test_generated_replies_to_one_prompt_count_as_one_state(lora_config, tokenizer):
    """The first prompt answered twice, with two different replies, the others once: every (prompt, reply) input is
    met once, the first state twice. Counted by state, power 1 halves the first prompt's advantages against the
    others' and the step differs from power 0's; counted by input (the reply included), it would be the same."""
    met = [(0, 0, 1.0), (0, 1, 0.0), (1, 0, 1.0), (2, 0, 0.0)]  # (prompt, reply, reward)
    generated = [Episode([Turn(PROMPTS[i], CANDIDATES[i][k], r, candidates=None)]) for i, k, r in met]
    moves = [natural_move(lora_config, tokenizer, generated, power) for power in (0.0, 1.0)]
    assert float((moves[0] - moves[1]).norm()) > 0.05 * float(moves[0].norm())


@pytest.mark.parametrize("scale", ["batch", "returns"])
def test_a_batch_of_equal_returns_does_not_move_the_policy(model, lora_config, tokenizer, scale):
    learning = [[1.0, 0.0, 1.0, 0.0, 0.0, 1.0]]  # returns varied while the game was being learned
    solved = [1.0] * 6  # now every episode earns the same: A = R - V holds only the value head's error
    moved, stats = update_kl(model, lora_config, tokenizer, solved, learning, advantage_scale=scale)
    assert stats["adv/equal_returns"] == 1.0 and stats["ppo/value_loss"] > 0
    assert moved < 1e-9


def test_equal_returns_of_multi_turn_episodes_do_not_move_the_policy(model, lora_config, tokenizer):
    # Episodes of two turns, each paying 1 at the end, undiscounted: every turn's return is 1 (under the default
    # gamma 0.99 the first turn's is 0.99, and the batch is not one of equal returns). With lam = 0.95 the estimator's
    # targets mix in the value head's estimates, which differ by turn, so they are not equal; the batch still says
    # nothing about which action was better, and must not move the policy.
    learning = [[0.0, 1.0, 0.0, 0.0, 0.0, 1.0]]
    solved = [0.0, 1.0] * 3
    moved, stats = update_kl(model, lora_config, tokenizer, solved, learning, turns=2, lam=0.95, gamma=1.0)
    assert stats["adv/return_std"] > 1e-3  # the targets differ: the old test (their spread) did not see this batch
    assert stats["adv/equal_returns"] == 1.0 and moved < 1e-9


@pytest.mark.parametrize("micro", [None, 1])  # micro-batches of one input: their candidate counts differ
def test_trust_region_keeps_each_update_within_max_kl_of_the_old_policy(model, lora_config, tokenizer, micro):
    rewards = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]
    settings = {"natural_step": 8.0, "max_grad_norm": 100.0, "micro_batch_size": micro}
    free, _ = update_kl(model, lora_config, tokenizer, rewards, max_kl=None, **settings)
    bounded, stats = update_kl(model, lora_config, tokenizer, rewards, max_kl=0.01, **settings)
    assert free > 0.02, free  # without a bound the step goes past it
    assert bounded <= 0.01 + 1e-6 and stats["trust/kl"] <= 0.01 and stats["trust/scale"] < 1
    assert stats["trust/kl_max"] >= stats["trust/kl"]


def test_an_input_bound_keeps_each_input_of_an_update_within_its_multiple_of_max_kl(model, lora_config, tokenizer):
    rewards = [2.0, -2.0, 0.1, -0.1, 0.1, -0.1]  # one input pushed hardest
    settings = {"natural_step": 8.0, "max_grad_norm": 100.0, "max_kl": 0.01, "per_input": True}
    moved = {}
    for factor in (None, 1.0):
        torch.manual_seed(0)  # the same adapter's random start for both
        moved[factor], _ = update_kl(model, lora_config, tokenizer, rewards, input_kl_factor=factor, **settings)
    assert moved[None].mean() <= 0.01 + 1e-6 and moved[None].max() > 0.015  # one input 1.5x past
    assert moved[1.0].max() <= 0.01 + 1e-6


def test_an_annealed_step_shrinks_under_the_trust_region_too(model, lora_config, tokenizer):
    # the region sizes each step to its bound (next_start doubles a short step's start), so a rate annealed alone was
    # sized back up to the bound; annealing the bound as the step squared makes the step fall as the schedule says
    rewards = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]
    settings = {"natural_step": 8.0, "max_grad_norm": 100.0, "max_kl": 0.01, "history": [rewards] * 3}
    moved = {}
    for anneal in (0, 4):
        torch.manual_seed(0)  # the same adapter's random start for both
        moved[anneal], stats = update_kl(model, lora_config, tokenizer, rewards, anneal_updates=anneal, **settings)
    assert moved[4] <= 0.01 * 0.25**2 + 1e-6  # sized back up to the bound, it moved 0.0045 (measured)
    assert moved[0] > 0.005  # the same update at full step: its bound binds well above the annealed one
    assert stats["ppo/step_scale"] == 0.25 and stats["trust/bound"] == pytest.approx(0.01 * 0.25**2)
    assert stats["trust/kl"] <= stats["trust/bound"]


def test_forwards_without_gradient_take_more_inputs_within_the_head_row_budget(lora_config, tokenizer, monkeypatch):
    monkeypatch.setattr(trainer_module, "SCORE_TOKENS", 1024)
    trainer = fresh_trainer(lora_config, tokenizer, PPOConfig(micro_batch_size=2))
    groups = torch.tensor([0, 0, 1, 2, 3, 4, 5])  # rows 0 and 1 share an input
    head_rows = torch.tensor([600, 600, 300, 300, 500, 100, 100])
    index = torch.arange(7)
    parts = trainer._micro(groups, index, head_rows)  # inputs 0-1 (900 rows), then 2-5: at least 2, within 1024
    assert [part.tolist() for part in parts] == [[0, 1, 2], [3, 4, 5, 6]]
    assert [part.tolist() for part in trainer._micro(groups, index)] == [[0, 1, 2], [3, 4], [5, 6]]  # with gradient
    # a scored row's head rows are its candidate tokens
    batch = collate_scored([[1, 2], [1]], [[[3], [4, 5]], [[6]]])
    assert ScoreMode().head_rows(batch).tolist() == [3, 1]


def fresh_trainer(lora_config, tokenizer, config: PPOConfig, precision: str = "fp32") -> PPOTrainer:
    """A trainer on a new tiny model (seed 0) with `config`."""
    policy = Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision=precision)
    return PPOTrainer(policy, config, tokenizer.pad_token_id)


def test_generate_mode_takes_natural_steps_without_the_noisy_bound_unless_asked(model, lora_config, tokenizer):
    episodes = [
        Episode([Turn(p, c[0], float(i % 2), candidates=None)])
        for i, (p, c) in enumerate(zip(PROMPTS * 2, CANDIDATES * 2, strict=True))
    ]
    trainer = PPOTrainer(Policy(model, lora_config, precision="fp32"), PPOConfig(), tokenizer.pad_token_id)
    stats = trainer.step(episodes)  # the defaults: natural steps in every mode, the trust region in scoring mode
    assert trainer.policy_optimizer is trainer.natural is not None
    assert "trust/kl" not in stats and "trust/scale" not in stats
    plain = fresh_trainer(lora_config, tokenizer, PPOConfig(natural_gradient=False))
    plain.step(episodes)
    assert plain.policy_optimizer is plain.optimizer
    asked = fresh_trainer(lora_config, tokenizer, PPOConfig(natural_gradient=True, max_kl_generate=True))
    stats = asked.step(episodes)
    assert asked.policy_optimizer is asked.natural is not None and "trust/scale" in stats
    assert asked.natural.grad_dtype == torch.float32
    # a bf16 policy holds generate mode's per-input gradients in bf16, scoring mode's in float32
    low = fresh_trainer(lora_config, tokenizer, PPOConfig(), precision="bf16")
    low.step(episodes)
    assert low.policy_optimizer is low.natural and low.natural.grad_dtype == torch.bfloat16
    scored = [
        Episode([Turn(p, c[0], float(i), candidates=c, choice=0)])
        for i, (p, c) in enumerate(zip(PROMPTS, CANDIDATES, strict=True))
    ]
    low.step(scored)
    assert low.natural.grad_dtype == torch.float32


def test_minibatches_by_default_one_whole_batch_natural_step_two_epochs_of_eight_turns_for_adamw(
    model, lora_config, tokenizer
):
    """The defaults (`mini_batch_size=None`, `ppo_epochs=None`): a natural update is one step over the whole batch
    (a second epoch, from the clipped loss, took back what the first had gained); AdamW takes two epochs of 8-turn
    minibatches. An epoch count that is set is used as it is."""
    generated = [
        Episode([Turn(p, c[0], float(i % 2), candidates=None)])
        for i, (p, c) in enumerate(zip(PROMPTS * 4, CANDIDATES * 4, strict=True))
    ][:10]
    trainer = PPOTrainer(Policy(model, lora_config, precision="fp32"), PPOConfig(), tokenizer.pad_token_id)
    assert trainer.step(generated)["ppo/minibatches"] == 1  # the whole batch once, in generate mode too
    natural = trainer.step(scored_episodes([1.0, 0.0] * 5, [0, 1] * 5))
    assert natural["ppo/minibatches"] == 1  # the whole batch once: one solve over its distinct inputs
    plain = fresh_trainer(lora_config, tokenizer, PPOConfig(natural_gradient=False))
    assert plain.step(generated)["ppo/minibatches"] == 2 * 2  # 2 epochs x (8 + 2 turns): AdamW steps
    trainer.config.ppo_epochs = 3
    assert trainer.step(scored_episodes([1.0, 0.0] * 5, [0, 1] * 5))["ppo/epochs_completed"] == 3
