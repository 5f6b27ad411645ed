"""The entropy floor: an entropy bonus that grows only while the sampled choices' entropy is below a floor."""

import math

import pytest
import torch

from llamagym.algos import ppo
from llamagym.algos.modes.score import entropy_fraction
from llamagym.algos.rollout import Episode, Turn
from llamagym.algos.trainer import PPOTrainer
from llamagym.config import PPOConfig
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model
from tests.test_trust_region import CANDIDATES, PROMPTS, distributions, scored_episodes, update_kl


def test_entropy_fraction_golden_values():
    rows = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.9, 0.1, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1], [1.0, 0.0, 0.0, 0.0]])
    fraction = entropy_fraction(rows.log(), torch.tensor([2, 2, 4, 1]))
    assert fraction.tolist() == pytest.approx([1.0, 0.4690, 0.6784, 0.0], abs=1e-4)


def test_the_floor_weight_rises_below_the_floor_falls_above_it_and_never_goes_negative():
    floor = ppo.EntropyFloor(0.3, 0.002)
    weights = [floor.update(h) for h in (0.5, 0.1, 0.1, 0.29, 0.3, 0.9, 0.9, float("nan"))]
    assert weights == pytest.approx([0.0, 0.002, 0.004, 0.006, 0.004, 0.002, 0.0, 0.0])
    other = ppo.EntropyFloor(0.3, 0.002)
    other.load_state_dict(ppo.EntropyFloor(0.3, 0.002).state_dict() | {"value": 0.006})
    assert other.update(0.1) == pytest.approx(0.008)


def test_the_floor_weighs_only_the_turns_below_it():
    floor = ppo.EntropyFloor(0.3, 0.002)
    floor.update(0.1), floor.update(0.1)
    weights = floor.weights(torch.tensor([0.1, 0.29, 0.3, 0.9]))
    torch.testing.assert_close(weights, torch.tensor([0.004, 0.004, 0.0, 0.0]))


def trainer(lora_config, tokenizer, **overrides):
    config = PPOConfig(**{"natural_gradient": True, "natural_step": 2.0, "max_grad_norm": 100.0, **overrides})
    model = build_tiny_model(tokenizer, seed=0)
    return PPOTrainer(Policy(model, lora_config, precision="fp32"), config, tokenizer.pad_token_id)


def mean_fraction(policy):
    count = torch.tensor([len(c) for c in CANDIDATES])
    return float(entropy_fraction(distributions(policy), count).mean())


def test_below_the_floor_the_bonus_grows_and_raises_the_entropy_a_step_leaves(lora_config, tokenizer):
    rewards, choices = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], [0, 1, 0, 1, 0, 1]
    after = {}
    for floor in (None, 0.999):  # the tiny model's choices are near uniform: 0.999 is above them
        torch.manual_seed(0)
        agent = trainer(lora_config, tokenizer, entropy_floor=floor, entropy_floor_step=0.5)
        stats = agent.step(scored_episodes(rewards, choices))
        after[floor] = mean_fraction(agent.policy)
        if floor is None:
            assert "ppo/entropy_floor_coef" not in stats and agent.ent_coef == 0.0
        else:
            assert stats["ppo/entropy_fraction"] < 0.999 and stats["ppo/entropy_floor_coef"] == 0.5
            assert agent.ent_coef == 0.5
            assert agent.step(scored_episodes(rewards, choices))["ppo/entropy_floor_coef"] == 1.0
            state = agent.state_dict()
            restored = trainer(lora_config, tokenizer, entropy_floor=floor, entropy_floor_step=0.5)
            restored.load_state_dict(state)
            assert restored.entropy_floor.value == 1.0
    assert after[0.999] > after[None] + 1e-4


def test_the_bonus_leaves_the_choices_above_the_floor_alone(lora_config, tokenizer):
    """With the floor between the inputs' entropies, the bonus weighs the turns of the inputs below it only: a choice
    still open is not pulled toward even odds (which flips the greedy action of near-tied states)."""
    rewards, choices = [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], [0, 1, 0, 1, 0, 1]
    torch.manual_seed(0)
    probe = trainer(lora_config, tokenizer)
    count = torch.tensor([len(c) for c in CANDIDATES])
    fractions = entropy_fraction(distributions(probe.policy), count)  # the three inputs', before any step
    floor = float(fractions.max()) - 1e-4  # the most open input is above it, the batch's mean below it
    assert float(fractions.min()) < float(fractions.mean()) < floor
    torch.manual_seed(0)
    agent = trainer(lora_config, tokenizer, entropy_floor=floor, entropy_floor_step=0.5, ent_coef=0.01)
    stats = agent.step(scored_episodes(rewards, choices))
    below = (fractions < floor).float().repeat(2)  # the batch's six turns go through the three inputs twice
    torch.testing.assert_close(agent._entropy_weights, 0.01 + 0.5 * below)
    assert stats["ppo/entropy_floor_turns"] == pytest.approx(float(below.mean()))
    assert 0 < stats["ppo/entropy_bonus"] < 0.01 * stats["ppo/entropy"] + 0.5 * stats["ppo/entropy"]


def test_generate_mode_has_no_floor(lora_config, tokenizer):
    pairs = enumerate(zip(PROMPTS, CANDIDATES, strict=True))
    episodes = [Episode([Turn(p, c[0], float(i % 2))]) for i, (p, c) in pairs]
    stats = trainer(lora_config, tokenizer, natural_gradient=None).step(episodes)
    assert "ppo/entropy_floor_coef" not in stats and math.isfinite(stats["ppo/loss"])
    # a configured bonus still applies, and the trust region's check measures it as the loss did
    bound = trainer(lora_config, tokenizer, max_kl_generate=True, ent_coef=0.1).step(episodes)
    assert "trust/scale" in bound and math.isfinite(bound["ppo/loss"]) and bound["ppo/entropy"] > 0


def test_a_batch_of_equal_returns_takes_no_entropy_step_either(model, lora_config, tokenizer):
    learning = [[1.0, 0.0, 1.0, 0.0, 0.0, 1.0]]
    moved, stats = update_kl(model, lora_config, tokenizer, [1.0] * 6, learning, entropy_floor=0.999)
    assert stats["ppo/entropy_floor_coef"] > 0 and stats["adv/equal_returns"] == 1.0
    assert moved < 1e-9
