"""Polyak averaging: the greedy policy acts with the adapter's average over the last updates, sampling with the
current weights."""

import pytest
import torch

from llamagym import PPOConfig
from llamagym.algos.averaging import WeightAverage, average_weight
from llamagym.algos.modes import MODES
from llamagym.envs import AgentPolicy
from tests.envs import CountingEnv, YesNoAgent


@pytest.mark.parametrize(
    "count, horizon, expected",
    [(1, 10, 1.0), (4, 10, 1.0), (5, 10, 0.5), (8, 10, 0.5), (9, 10, 1 / 3), (36, 10, 1 / 9), (40, 10, 0.1), (7, 1, 1)],
)
def test_average_weight_golden_values(count, horizon, expected):
    assert average_weight(count, horizon) == expected


def test_average_weight_rejects_no_update_and_no_horizon():
    with pytest.raises(ValueError, match="count >= 1 and horizon >= 1"):
        average_weight(0, 10)


def test_the_average_spans_the_latest_quarter_then_the_horizon_and_is_lent_only_inside_swapped():
    w = torch.nn.Parameter(torch.zeros(2))
    average = WeightAverage([w], horizon=2)
    with average.swapped():  # no update yet: the weights themselves
        torch.testing.assert_close(w.detach(), torch.zeros(2))
    # four updates: a quarter of them is one, the latest (7); then over two: 7 + (9 - 7) / 2 = 8, 8 + (11 - 8) / 2 = 9.5
    for value in (1.0, 3.0, 5.0, 7.0, 9.0, 11.0):
        with torch.no_grad():
            w.fill_(value)
        average.update()
        if average.count == 4:
            torch.testing.assert_close(average.mean[0], torch.full((2,), 7.0))
    assert average.count == 6
    with average.swapped():
        torch.testing.assert_close(w.detach(), torch.full((2,), 9.5))
    torch.testing.assert_close(w.detach(), torch.full((2,), 11.0))
    with pytest.raises(RuntimeError, match="inside"), average.swapped():
        raise RuntimeError("inside")
    torch.testing.assert_close(w.detach(), torch.full((2,), 11.0))  # restored after an error too

    again = WeightAverage([w], horizon=2)
    again.load_state_dict(average.state_dict())
    assert again.count == 6
    torch.testing.assert_close(again.mean[0], torch.full((2,), 9.5))


def trained(model, tokenizer, lora_config) -> YesNoAgent:
    """An agent after five updates, averaging over 3 (the latest two: a quarter of five, rounded up)."""
    config = PPOConfig(
        batch_size=2, min_batch_turns=0, average_updates=3, natural_gradient=False, max_kl=None, learning_rate=0.05
    )
    agent = YesNoAgent(model, tokenizer, "cpu", ppo_config=config, lora_config=lora_config, precision="fp32")
    env = CountingEnv(length=2)
    for _ in range(10):  # five updates
        observation, done = env.reset()[0], False
        while not done:
            observation, reward, terminated, truncated, _ = env.step(agent.act(observation))
            agent.assign_reward(reward + float(observation % 2))
            done = terminated or truncated
        agent.terminate_episode()
    return agent


def test_greedy_acting_scores_with_the_average_and_sampling_with_the_current_weights(model, tokenizer, lora_config):
    agent = trained(model, tokenizer, lora_config)
    average = agent.trainer.average
    assert average.count == 5
    scores = agent.actor.memory(MODES["score"])  # one dict, emptied at the next act whenever the weights changed
    agent.predict([0])
    (greedy,) = (scored.logprobs for scored in scores.values())
    agent.predict([0], greedy=False)  # sampled, from the same fresh context
    (sampled,) = (scored.logprobs for scored in scores.values())
    assert not torch.allclose(greedy, sampled)  # the average is not the latest weights
    with agent.trainer.latest_weights():  # greedy acting with the latest weights, as the benchmark compares them
        agent.predict([0])
        (latest,) = (scored.logprobs for scored in scores.values())
    torch.testing.assert_close(latest, sampled)
    assert agent.trainer.average is average
    with average.swapped():  # the average lent by hand: sampling with it scores what greedy acting scored
        agent.policy.version += 1
        agent.predict([0], greedy=False)
        (by_hand,) = (scored.logprobs for scored in scores.values())
    torch.testing.assert_close(greedy, by_hand)


def test_an_evaluation_lends_the_average_once_for_all_its_chunks(model, tokenizer, lora_config):
    agent = trained(model, tokenizer, lora_config)
    weights = [p.detach().clone() for p in agent.trainer.average.params]
    version = agent.policy.version
    agent.predict([0, 1, 2, 3, 4], chunk=2)  # three chunks
    assert agent.policy.version == version + 2  # lent in and given back once: the chunks share the cached scores
    AgentPolicy(agent, chunk=2)([[0], [1], [2]])  # the suite's evaluator, likewise
    assert agent.policy.version == version + 4
    for p, before in zip(agent.trainer.average.params, weights, strict=True):
        torch.testing.assert_close(p.detach(), before, atol=0, rtol=0)  # the latest weights are back


def test_greedy_average_lends_another_average_for_greedy_acting_and_gives_the_trainers_back(
    model, tokenizer, lora_config
):
    agent = trained(model, tokenizer, lora_config)
    own = agent.trainer.average
    latest = WeightAverage(own.params, horizon=1)  # kept by the caller: after every update, the latest weights
    latest.update()
    scores = agent.actor.memory(MODES["score"])
    agent.predict([0], greedy=False)
    (sampled,) = (scored.logprobs for scored in scores.values())
    with agent.trainer.greedy_average(latest):
        assert agent.trainer.average is latest
        agent.predict([0])
        (lent,) = (scored.logprobs for scored in scores.values())
    torch.testing.assert_close(lent, sampled)  # an average over one update is the latest weights
    assert agent.trainer.average is own
    agent.predict([0])
    (greedy,) = (scored.logprobs for scored in scores.values())
    assert not torch.allclose(greedy, sampled)  # the trainer's own average is back
