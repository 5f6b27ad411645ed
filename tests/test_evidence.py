"""The share of a batch's policy push its episodes agree on (`algos/evidence.py`), and the opt-in bound it sizes."""

import math

import pytest
import torch

from llamagym.algos.evidence import evidence_fraction, turn_pushes
from llamagym.config import PPOConfig
from tests.test_trust_region import update_kl

HALF = torch.tensor([0.5, 0.5]).log()


def pushes(advantages, choices, logprobs=HALF):
    return turn_pushes(torch.tensor(advantages), torch.tensor(choices), logprobs.expand(len(advantages), -1))


def test_turn_pushes_golden_values_and_padded_candidates():
    push = turn_pushes(torch.tensor([2.0]), torch.tensor([0]), torch.tensor([[0.25, 0.75]]).log())
    assert push[0].tolist() == pytest.approx([1.5, -1.5])
    padded = torch.tensor([[0.5, 0.5, 0.0]]).log()  # a turn with two candidates in a batch whose widest has three
    assert turn_pushes(torch.tensor([1.0]), torch.tensor([1]), padded)[0].tolist() == pytest.approx([-0.5, 0.5, 0.0])


@pytest.mark.parametrize(
    ("advantages", "expected"),
    [([1.0, 1.0], 1.0), ([1.0, 0.0], 0.0), ([1.0, -1.0], 0.0), ([0.0, 0.0], 0.0)],
)
def test_evidence_of_two_episodes_in_one_state(advantages, expected):
    """Both episodes push alike: all evidence; one pushes (one sample), or they disagree, or nothing moves: none."""
    push = pushes(advantages, [0, 0])
    assert evidence_fraction(push, torch.tensor([0, 0]), torch.tensor([0, 1]), 2) == pytest.approx(expected)


def test_k_of_e_episodes_agreeing_give_one_minus_the_noise_share():
    """k of E episodes push one state alike, the others not at all: 1 - (E - k) / (k (E - 1))."""

    def agreeing(e: int, k: int) -> float:
        push = pushes([1.0] * k + [0.0] * (e - k), [0] * e)
        return evidence_fraction(push, torch.zeros(e, dtype=torch.long), torch.arange(e), e)

    assert agreeing(4, 2) == pytest.approx(2 / 3)  # golden: 1 - 2 / (2 * 3)
    assert agreeing(8, 1) == pytest.approx(0.0)  # one episode alone: no evidence
    for e, k in [(8, 4), (32, 3)]:
        assert agreeing(e, k) == pytest.approx(1 - (e - k) / (k * (e - 1)))


def test_states_are_summed_before_the_share_and_an_episodes_turns_in_one_state_add_up():
    # state 0: both episodes push (0.5, -0.5): |c|^2 2, no noise; state 1: episode 0 alone: |c|^2 0.5, noise 0.5
    two_states = evidence_fraction(
        pushes([1.0, 1.0, 1.0], [0, 0, 0]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), 2
    )
    assert two_states == pytest.approx(1 - 0.5 / 2.5)
    # episode 0 pushes state 0 both ways (its turns cancel), episode 1 once: one episode's push, no evidence
    cancelled = evidence_fraction(
        pushes([1.0, -1.0, 1.0], [0, 0, 0]), torch.tensor([0, 0, 0]), torch.tensor([0, 0, 1]), 2
    )
    assert cancelled == pytest.approx(0.0)
    # an episode with no turn in the state counts: three episodes, two pushing alike (2 of 3: 1 - 1/4)
    counted = evidence_fraction(pushes([1.0, 1.0], [0, 0]), torch.tensor([0, 0]), torch.tensor([0, 2]), 3)
    assert counted == pytest.approx(0.75)
    assert evidence_fraction(pushes([1.0], [0]), torch.tensor([0]), torch.tensor([0]), 1) == 0.0  # no spread


def test_evidence_kl_needs_a_trust_region_and_a_floor_in_the_unit_interval():
    for floor in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="evidence_kl"):
            PPOConfig(evidence_kl=floor)
    with pytest.raises(ValueError, match="Set max_kl"):
        PPOConfig(evidence_kl=0.1, max_kl=None)
    assert PPOConfig().evidence_kl is None


def test_every_scored_update_reports_its_evidence_and_the_opt_in_bound_scales_with_it(model, lora_config, tokenizer):
    rewards = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]
    settings = {"natural_step": 8.0, "max_grad_norm": 100.0, "max_kl": 0.01}
    torch.manual_seed(0)  # the same adapter's random start for both
    plain_kl, plain = update_kl(model, lora_config, tokenizer, rewards, **settings)
    assert 0.0 <= plain["adv/evidence"] <= 1.0 and "trust/bound" not in plain
    torch.manual_seed(0)
    moved, stats = update_kl(model, lora_config, tokenizer, rewards, evidence_kl=0.05, **settings)
    assert stats["adv/evidence"] == plain["adv/evidence"]  # the same batch, the same measure
    bound = 0.01 * max(stats["adv/evidence"], 0.05)
    assert math.isclose(stats["trust/bound"], bound) and moved <= bound + 1e-6 and stats["trust/kl"] <= bound
    assert bound < 0.01 and moved < plain_kl  # this batch's episodes disagree in part: a shorter step
