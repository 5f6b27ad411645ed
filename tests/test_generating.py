"""Generate mode's acting memory: what sampling computed for a reply is the update's old policy for that turn."""

import pytest
import torch

from llamagym import Agent, PPOConfig
from llamagym.algos.modes import MODES
from llamagym.algos.rollout import Episode, Turn, collate
from llamagym.algos.trainer import PPOTrainer
from llamagym.models.policy import Policy
from tests.envs import watch_old_outputs


class TextAgent(Agent):
    def get_system_prompt(self):
        return "Answer 0 or 1."

    def format_observation(self, observation):
        return f"step {observation}"

    def extract_action(self, response):
        return 1 if response[:1].isalpha() else 0


def make_agent(model, tokenizer, lora_config, **kwargs):
    config = PPOConfig(batch_size=2, min_batch_turns=0, mini_batch_size=2, ppo_epochs=1, seed=0)
    agent = TextAgent(
        model,
        tokenizer,
        "cpu",
        ppo_config=config,
        lora_config=lora_config,
        precision="fp32",
        generation_config={"max_new_tokens": 6, "temperature": 0.7},
        action_mode="generate",
        **kwargs,
    )
    with torch.no_grad():  # the head starts at zero: random weights, so that values differ and their checks can fail
        agent.policy.value_head.linear.weight.normal_(generator=torch.Generator().manual_seed(0))
    return agent


@pytest.mark.parametrize("reuse_prefix", [True, False])
def test_sampling_remembers_each_replys_log_probs_and_value_as_the_update_computes_them(
    model, tokenizer, lora_config, reuse_prefix
):
    agent = make_agent(model, tokenizer, lora_config)
    agent.actor.reuse_prefix = reuse_prefix
    torch.manual_seed(0)
    agent.act_batch([0, 1, 2, 0])
    turns = [slot.episode.turns[-1] for slot in agent.slots]
    memory = agent.actor.memory(MODES["generate"])
    assert len(memory) == len({(tuple(t.prompt_ids), tuple(t.response_ids)) for t in turns})
    policy = agent.policy
    with torch.no_grad():
        out = policy(*collate(turns, agent.pad_token_id))
    for i, turn in enumerate(turns):
        kept = memory[(tuple(turn.prompt_ids), tuple(turn.response_ids))]
        start = len(turn.prompt_ids)
        expected = out.logprobs[i, start : start + len(turn.response_ids)]
        torch.testing.assert_close(kept.logprobs, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(kept.value, out.values[i], atol=1e-5, rtol=0)


def test_greedy_replies_are_not_remembered_and_a_weight_change_forgets_the_sampled_ones(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config)
    agent.predict([0, 1])
    assert agent.actor.memory(MODES["generate"]) == {}
    agent.act(0)
    assert len(agent.actor.memory(MODES["generate"])) == 1
    agent.policy.version += 1
    assert agent.actor.memory(MODES["generate"]) == {}


def test_in_bf16_nothing_is_remembered_the_update_computes_its_old_outputs(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config)
    agent.policy.precision = "bf16"  # decoding steps and the update's forward then differ by more than rounding
    agent.act(0)
    assert agent.actor.memory(MODES["generate"]) == {}


def test_an_update_takes_the_old_outputs_sampling_computed_and_runs_only_the_turns_it_lacks(
    model, tokenizer, lora_config, monkeypatch
):
    agent = make_agent(model, tokenizer, lora_config)
    compared, rows_run = watch_old_outputs(monkeypatch)
    torch.manual_seed(0)
    for observations in ([0, 1], [2, 3]):
        for observation in observations:
            agent.act(observation)
            agent.assign_reward(float(observation))
        if observations[-1] == 3:  # the last turn's reply is forgotten (as an evicted or older one would be)
            turn = agent.episode.turns[-1]
            del agent.actor.memory(MODES["generate"])[(tuple(turn.prompt_ids), tuple(turn.response_ids))]
        stats = agent.terminate_episode()
    assert "ppo/policy_loss" in stats
    ((recalled, fresh, used),) = compared
    assert recalled.known.tolist() == [True, True, True, False] and rows_run[0] == 1  # only the forgotten turn ran
    for old, new in zip(fresh, used, strict=True):  # log-probs, values, (no distributions), the value head's inputs
        if old is not None:
            torch.testing.assert_close(new, old, atol=1e-5, rtol=0)


def test_turns_built_by_hand_are_computed_by_the_update(model, lora_config):
    turns = [Turn([1, 2, 3], [4, 5], reward=1.0), Turn([1, 2], [6], reward=1.0)]
    recalled = MODES["generate"].recall({}, turns, collate(turns, 0))
    assert recalled.known.tolist() == [False, False] and recalled.features is None
    trainer = PPOTrainer(Policy(model, lora_config), PPOConfig(batch_size=1, min_batch_turns=0), 0)
    assert "ppo/policy_loss" in trainer.step([Episode(turns)], acted=lambda mode: {})
