"""Exploration in generate mode: with probability `explore` a sampled reply is replaced by a candidate drawn
uniformly, written as the model would write it, played, and trained on as the model's own."""

import pytest
import torch
from gymnasium import spaces

from llamagym import Agent, PPOConfig
from llamagym.algos.rollout import Turn, collate
from llamagym.models.tiny_random import build_tiny_model

NUMBERS = [str(n) for n in range(1, 10)]


class NumberAgent(Agent):
    """Replies a digit 1..9; the candidates list all nine (generate mode writes its own reply)."""

    def get_system_prompt(self):
        return "Reply with one digit."

    def format_observation(self, observation):
        return f"round {observation}"

    def action_candidates(self, observation):
        return NUMBERS

    def extract_action(self, response):
        digits = [c for c in response if c.isdigit() and c != "0"]
        return int(digits[-1]) if digits else None


def make_agent(model, tokenizer, lora_config, explore, **kwargs):
    config = PPOConfig(batch_size=8, min_batch_turns=0, mini_batch_size=8, ppo_epochs=1, seed=0)
    return NumberAgent(
        model,
        tokenizer,
        "cpu",
        ppo_config=config,
        lora_config=lora_config,
        precision="fp32",
        generation_config={"max_new_tokens": 4, "temperature": 1.0},
        action_mode="generate",
        fallback_action=1,
        sft_warm_start=False,
        explore=explore,
        **kwargs,
    )


def test_drawn_replies_are_candidates_written_as_the_model_writes_them_and_played(model, tokenizer, lora_config):
    agent = make_agent(model, tokenizer, lora_config, explore=0.99)
    torch.manual_seed(0)
    actions = agent.act_batch(list(range(8)))
    turns = [slot.episode.turns[-1] for slot in agent.slots]
    assert [slot.last_reply for slot in agent.slots] == [str(a) for a in actions]  # every reply drawn (seeded)
    for action, turn in zip(actions, turns, strict=True):
        assert turn.response_ids == agent.actor.candidate_ids(str(action))  # chat-template tokens, end token last
        assert turn.valid and turn.finished and turn.candidates is None and turn.mode == "generate"
    assert len(set(actions)) > 1  # drawn uniformly, not one candidate


def test_the_models_own_replies_are_the_same_with_exploration_on_or_off(tokenizer, lora_config):
    replies = {}
    for explore in (0.0, 0.5):
        torch.manual_seed(0)  # the same adapter (lora_config's is random) on the same model
        agent = make_agent(build_tiny_model(tokenizer, seed=0), tokenizer, lora_config, explore)
        torch.manual_seed(0)
        agent.act_batch(list(range(8)))
        replies[explore] = [slot.episode.turns[-1].response_ids for slot in agent.slots]
    own = [k for k, ids in enumerate(replies[0.5]) if ids != agent.actor.candidate_ids(agent.slots[k].last_reply)]
    assert 0 < len(own) < 8  # about half were drawn
    assert [replies[0.5][k] for k in own] == [replies[0.0][k] for k in own]


def test_greedy_acting_and_predict_never_explore(tokenizer, lora_config):
    agents = []
    for explore in (0.99, 0.0):
        torch.manual_seed(0)
        agents.append(make_agent(build_tiny_model(tokenizer, seed=0), tokenizer, lora_config, explore))
    explorer, plain = agents
    assert explorer.predict(list(range(8))) == plain.predict(list(range(8)))
    with explorer.evaluating():
        explorer.act_batch(list(range(8)))
    assert (explorer._drawn, explorer._sampled) == (0, 0)


def test_a_drawn_reply_that_pays_is_reinforced(model, tokenizer, lora_config):
    """The tiny model never writes "7"; drawn, it pays, and one update raises its log-prob."""
    agent = make_agent(model, tokenizer, lora_config, explore=0.9)
    played = set()

    def logprob_of_seven() -> float:
        prompt = agent.formatter.prompt_ids(agent.get_system_prompt(), [{"role": "user", "content": "round 0"}])[0]
        with torch.no_grad():
            out = agent.policy(*collate([Turn(prompt, agent.actor.candidate_ids("7"))], agent.pad_token_id))
        return float(out.logprobs.sum())

    before = logprob_of_seven()
    torch.manual_seed(0)
    stats = {}
    while "ppo/policy_loss" not in stats:
        actions = agent.act_batch([0] * 8)
        agent.assign_rewards([float(a == 7) for a in actions])
        played.update(actions)
        stats = agent.end_episodes([True] * 8)
    assert 7 in played  # a drawn "7" was played and paid
    assert 0.7 < stats["agent/explored_rate"] < 1.0
    assert logprob_of_seven() > before + 0.01


def test_drawn_action_names_map_to_their_index(model, tokenizer, lora_config):
    class NamedAgent(NumberAgent):
        action_names = ["stay", "go"]

        def action_candidates(self, observation):  # the names, but generate mode writes a reply
            return list(self.action_names)

        def extract_action(self, response):
            return None  # only a drawn name can be read, by its index

    agent = NamedAgent(
        model,
        tokenizer,
        "cpu",
        lora_config=lora_config,
        precision="fp32",
        action_mode="generate",
        fallback_action=0,
        action_space=spaces.Discrete(2),
        explore=0.99,
    )
    torch.manual_seed(0)
    actions = agent.act_batch(list(range(8)))
    assert actions == [["stay", "go"].index(slot.last_reply) for slot in agent.slots]
    assert all(slot.episode.turns[-1].valid for slot in agent.slots)


@pytest.mark.parametrize("explore", [-0.1, 1.0, True, "0.1", float("nan")])
def test_a_wrong_rate_says_what_to_pass(model, tokenizer, lora_config, explore):
    with pytest.raises(ValueError, match=r"`explore` should be a number in \[0, 1\)"):
        make_agent(model, tokenizer, lora_config, explore)


def test_exploring_without_candidates_says_what_to_do(model, tokenizer, lora_config):
    class Unlisted(NumberAgent):
        def action_candidates(self, observation):
            return None

    agent = Unlisted(model, tokenizer, "cpu", lora_config=lora_config, action_mode="generate", explore=0.1)
    with pytest.raises(ValueError, match="explore=0.1 draws replies from action_candidates, which returned None"):
        agent.act(0)
    assert agent.episode.turns == []  # nothing recorded
