"""Each turn that did better than the batch weighed by 1/(C p), within [1, cap], p its choice's probability among C
candidates (`PPOConfig.inverse_choice_cap`), so a candidate the policy had nearly given up rises further per draw."""

import pytest
import torch

from llamagym.algos import ppo
from llamagym.algos.rollout import Episode, Turn
from llamagym.config import PPOConfig
from tests.test_entropy_floor import trainer
from tests.test_explore import NumberAgent
from tests.test_trust_region import CANDIDATES, PROMPTS, distributions, scored_episodes


def test_inverse_choice_weights_golden_values():
    logprobs, counts = torch.tensor([0.5, 0.25, 0.05, 0.001]).log(), torch.tensor([4, 4, 4, 4])
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0])
    weights = ppo.inverse_choice_weights(logprobs, counts, advantages, 10.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, 1.0, 5.0, 1.0]))
    flipped = ppo.inverse_choice_weights(logprobs, counts, -advantages, 10.0)
    torch.testing.assert_close(flipped, torch.tensor([1.0, 1.0, 1.0, 10.0]))
    two = ppo.inverse_choice_weights(logprobs, torch.tensor([2, 2, 2, 2]), advantages, 100.0)
    torch.testing.assert_close(two, torch.tensor([1.0, 2.0, 10.0, 1.0]))
    torch.testing.assert_close(ppo.inverse_choice_weights(logprobs, counts, advantages, 1.0), torch.ones(4))


def test_the_step_weighs_each_turn_by_the_probability_its_choice_had(lora_config, tokenizer, monkeypatch):
    seen, weigh = [], ppo.inverse_choice_weights

    def spy(logprobs, counts, advantages, cap):
        seen.append((logprobs.clone(), counts, cap))
        return weigh(logprobs, counts, advantages, cap)

    monkeypatch.setattr("llamagym.algos.trainer.ppo.inverse_choice_weights", spy)
    torch.manual_seed(0)
    agent = trainer(lora_config, tokenizer, entropy_floor=None, inverse_choice_cap=50.0)
    before = distributions(agent.policy)
    choices = [0, 1, 0, 1, 0, 1]
    stats = agent.step(scored_episodes([1.0, -1.0, 0.5, -0.5, 1.0, -1.0], choices))
    (logprobs, counts, cap), chosen = seen[0], torch.stack([before[i % 3, k] for i, k in enumerate(choices)])
    torch.testing.assert_close(logprobs, chosen, atol=1e-5, rtol=0)
    assert counts.tolist() == [len(CANDIDATES[i % 3]) for i in range(6)] and cap == 50.0
    assert 1.0 <= stats["adv/choice_weight_max"] <= float(((-chosen).exp() / counts).max()) + 1e-4


def test_a_cap_of_one_steps_as_no_weighting(lora_config, tokenizer):
    after = []
    for cap in (None, 1.0):
        torch.manual_seed(0)
        agent = trainer(lora_config, tokenizer, entropy_floor=None, inverse_choice_cap=cap)
        agent.step(scored_episodes([1.0, -1.0, 0.5, -0.5, 1.0, -1.0], [0, 1, 0, 1, 0, 1]))
        after.append(distributions(agent.policy))
    torch.testing.assert_close(after[0], after[1])


def test_a_rarely_chosen_candidate_that_pays_rises_further_with_the_weights(lora_config, tokenizer):
    """Nine updates settle input 1 on its first candidate (the second costs, the third is never chosen: p under 0.2),
    then one batch draws input 1's third candidate once and it pays: weighed by 1/(C p) it rises further."""
    risen = {}
    for cap in (None, 100.0):
        torch.manual_seed(0)
        agent = trainer(lora_config, tokenizer, entropy_floor=None)
        for _ in range(9):
            agent.step(scored_episodes([1.0, -1.0] * 3, [0, 1] * 3))
        before = distributions(agent.policy)[1].exp()
        assert float(before[2]) < 0.2
        agent.config.inverse_choice_cap = cap
        # input 1: the third candidate once (pays 1), the first twice (pays 0.5); inputs 0 and 2 as before
        agent.step(scored_episodes([1.0, 1.0, -1.0, 1.0, 0.5, -1.0, 1.0, 0.5, -1.0], [0, 2, 1, 0, 0, 1, 0, 0, 1]))
        risen[cap] = float(distributions(agent.policy)[1].exp()[2] / before[2])
    assert risen[None] > 1.0 and risen[100.0] > risen[None] + 0.1  # 1.73 against 1.46


def test_generate_mode_says_the_weights_need_scoring(lora_config, tokenizer, model):
    pairs = enumerate(zip(PROMPTS, CANDIDATES, strict=True))
    episodes = [Episode([Turn(p, c[0], float(i % 2))]) for i, (p, c) in pairs]
    with pytest.raises(ValueError, match=r"inverse_choice_cap=10.0\) weighs each turn .* needs scoring mode"):
        trainer(lora_config, tokenizer, natural_gradient=None, inverse_choice_cap=10.0).step(episodes)
    with pytest.raises(ValueError, match="Set inverse_choice_cap=None"):
        NumberAgent(
            model,
            tokenizer,
            lora_config=lora_config,
            action_mode="generate",
            ppo_config=PPOConfig(inverse_choice_cap=10.0),
        )


@pytest.mark.parametrize("cap", [0.5, 0, -1, float("nan"), "10", True])
def test_a_cap_under_one_says_what_to_pass(cap):
    with pytest.raises(ValueError, match="inverse_choice_cap"):
        PPOConfig(inverse_choice_cap=cap)
