"""The log-barrier (`PPOConfig.barrier`): every candidate's log-prob in the objective, so that a candidate the batch
never chose is raised instead of left to sink."""

import math

import pytest
import torch

from llamagym.algos import ppo
from llamagym.algos.rollout import Episode, Turn
from llamagym.config import PPOConfig
from tests.test_entropy_floor import trainer
from tests.test_explore import NumberAgent
from tests.test_trust_region import CANDIDATES, PROMPTS, distributions, scored_episodes


def test_log_barrier_golden_values():
    dists = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]).log()  # the second row: one candidate, then padding
    assert float(ppo.log_barrier(dists, torch.ones(2, 1))) == pytest.approx(-1.7329, abs=1e-4)
    assert float(ppo.log_barrier(dists, torch.tensor([[1.0], [0.0]]))) == pytest.approx(-3.4657, abs=1e-4)
    assert float(ppo.log_barrier(dists, torch.ones(2, 1), torch.tensor([0.5, 1.0]))) == pytest.approx(-0.8664, abs=1e-4)


def test_a_floored_barrier_counts_only_the_candidates_under_its_floor():
    dists = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]).log()
    assert float(ppo.log_barrier(dists, torch.ones(2, 1), floor=0.3)) == pytest.approx(-0.1823, abs=1e-4)
    assert float(ppo.log_barrier(dists, torch.ones(2, 1), floor=0.2)) == 0.0  # every candidate above it: left alone


def test_a_relative_floor_is_a_fraction_of_the_reference_probability():
    dists = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]).log()
    reference = torch.tensor([[0.2, 0.2, 0.6], [1.0, 0.0, 0.0]]).log()  # floors 0.1, 0.1, 0.3: only the third under
    assert float(ppo.log_barrier(dists, torch.ones(2, 1), floor=0.5, reference=reference)) == pytest.approx(
        -0.0912, abs=1e-4
    )
    logits = dists.clone().requires_grad_(True)
    ppo.log_barrier(logits, torch.ones(2, 1), floor=0.5, reference=reference).backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]))  # padding: finite, 0


def test_a_floored_barrier_pulls_up_only_the_candidates_under_its_floor():
    logits = torch.tensor([[3.0, 1.0, -2.0]], requires_grad=True)  # p = (0.8756, 0.1185, 0.0059)
    ppo.log_barrier(torch.log_softmax(logits, -1), torch.ones(1, 1), floor=0.01).backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.8756, -0.1185, 0.9941]]), atol=1e-4, rtol=0)


def test_log_barrier_pulls_each_logit_by_one_minus_c_times_its_probability():
    logits = torch.tensor([[2.0, 0.0, 0.0]], requires_grad=True)  # p = (0.7870, 0.1065, 0.1065)
    ppo.log_barrier(torch.log_softmax(logits, -1), torch.ones(1, 1)).backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-1.3610, 0.6805, 0.6805]]), atol=1e-4, rtol=0)


def settling(lora_config, tokenizer, **ppo_overrides) -> tuple[list[torch.Tensor], list[dict]]:
    """Input 1 of three candidates: the first pays, the second costs, the third is never chosen. Nine updates on the
    same batch (input 1's turns: candidate 1 (-1), then candidate 0 (+1)); input 1's distribution (probabilities)
    and the stats after each."""
    rewards, choices = [1.0, -1.0] * 3, [0, 1] * 3
    torch.manual_seed(0)
    agent = trainer(lora_config, tokenizer, entropy_floor=None, **ppo_overrides)
    seen, stats = [], []
    for _ in range(9):
        stats.append(agent.step(scored_episodes(rewards, choices)))
        seen.append(distributions(agent.policy)[1].exp())
    return seen, stats


def test_the_barrier_keeps_the_candidates_a_settling_policy_leaves_from_sinking(lora_config, tokenizer):
    """As the policy of `settling` settles on the first candidate, the barrier holds the others up (it pulls each
    candidate under 1/3 up, those above down)."""
    after = {}
    for barrier in (0.0, 0.5):
        seen, stats = settling(lora_config, tokenizer, barrier=barrier)
        for step in stats:
            assert (step["ppo/barrier"] < 0) == (barrier > 0) and math.isfinite(step["ppo/loss"])
        after[barrier] = seen[-1]
    assert float(after[0.0][0]) > 0.75 and float(after[0.5][0]) > max(after[0.5][1:])  # both settle on the first
    assert float(after[0.5][2]) > float(after[0.0][2]) + 0.05  # the one never chosen
    assert float(after[0.5][1]) > float(after[0.0][1]) + 0.02  # the one that costs, still drawn now and then


def test_a_floored_barrier_leaves_an_open_policy_alone_and_holds_a_sinking_candidate_up(lora_config, tokenizer):
    """The policy of `settling`, with the barrier acting only under p 0.1: while every candidate is above the floor it
    steps as the policy without a barrier; later the candidate that costs is held up, and the one never chosen (above
    the floor) is not pulled towards 1/3 as the plain barrier pulls it."""
    none, plain, hinge = (
        settling(lora_config, tokenizer, barrier=barrier, barrier_floor=floor)[0]
        for barrier, floor in ((0.0, 0.0), (0.5, 0.0), (0.5, 0.1))
    )
    torch.testing.assert_close(hinge[2], none[2])  # after 3 updates
    hinge, plain, none = hinge[-1], plain[-1], none[-1]
    assert float(hinge[0]) > 0.7 and float(hinge[0]) > float(plain[0])  # it settles, sooner than with the plain one
    assert float(hinge[1]) > float(none[1]) + 0.03  # the one that costs, held up
    assert float(hinge[2]) < float(plain[2]) - 0.1  # the one never chosen, above the floor: left to the evidence


def test_a_relative_floor_waits_until_a_candidate_falls_under_its_share_of_the_reference(lora_config, tokenizer):
    """The policy of `settling`, with the barrier acting only on candidates under a quarter of the reference (adapter
    off) policy's probability: the first updates step as without a barrier (a fixed floor of 0.25 acts from the
    first, where a candidate starts under 0.25), and once the candidate that costs has fallen that far it is held up."""
    none = settling(lora_config, tokenizer)[0]
    seen, stats = settling(lora_config, tokenizer, barrier=0.5, barrier_floor=0.25, barrier_relative=True)
    fixed = settling(lora_config, tokenizer, barrier=0.5, barrier_floor=0.25)[1]
    assert fixed[0]["ppo/barrier"] < 0 and [step["ppo/barrier"] for step in stats[:4]] == [0.0] * 4
    torch.testing.assert_close(seen[3], none[3])
    assert stats[-1]["ppo/barrier"] < 0 and float(seen[-1][0]) > 0.75  # it acts, and the policy still settles
    assert float(seen[-1][1]) > float(none[-1][1]) + 0.01  # the one that costs, held up


def test_a_batch_of_equal_returns_takes_no_barrier_step(lora_config, tokenizer):
    torch.manual_seed(0)
    agent = trainer(lora_config, tokenizer, barrier=0.5, entropy_floor=None)
    before = distributions(agent.policy)
    stats = agent.step(scored_episodes([1.0] * 6, [0, 1, 0, 1, 0, 1]))
    assert stats["adv/equal_returns"] == 1.0
    torch.testing.assert_close(distributions(agent.policy), before)


def test_generate_mode_says_the_barrier_needs_scoring(lora_config, tokenizer):
    pairs = enumerate(zip(PROMPTS, CANDIDATES, strict=True))
    episodes = [Episode([Turn(p, c[0], float(i % 2))]) for i, (p, c) in pairs]
    with pytest.raises(ValueError, match=r"barrier=0.5\) is a log-barrier over candidates: it needs scoring mode"):
        trainer(lora_config, tokenizer, natural_gradient=None, barrier=0.5).step(episodes)


def test_an_agent_in_generate_mode_says_the_barrier_needs_scoring(model, tokenizer, lora_config):
    with pytest.raises(ValueError, match="it needs scoring mode"):
        NumberAgent(
            model, tokenizer, lora_config=lora_config, action_mode="generate", ppo_config=PPOConfig(barrier=0.5)
        )


def test_a_negative_barrier_says_what_to_pass():
    with pytest.raises(ValueError, match="barrier"):
        PPOConfig(barrier=-0.1)


def test_a_barrier_floor_out_of_range_or_without_a_barrier_says_what_to_pass():
    with pytest.raises(ValueError, match=r"barrier_floor.*\[0, 1\)"):
        PPOConfig(barrier=0.02, barrier_floor=1.0)
    with pytest.raises(ValueError, match="Set barrier"):
        PPOConfig(barrier_floor=0.01)
    with pytest.raises(ValueError, match="Set barrier_floor"):
        PPOConfig(barrier=0.02, barrier_relative=True)
