"""Exploration (`Agent(explore=...)`). In generate mode, with probability `explore` a sampled reply is replaced by a
candidate drawn uniformly, written as the model would write it, played, and trained on as the model's own. In scoring
mode each of C candidates is sampled at least explore / C of the time, so only a settled choice changes."""

from types import SimpleNamespace

import pytest
import torch
from gymnasium import spaces

from llamagym import Agent, PPOConfig
from llamagym.algos.modes import MODES
from llamagym.algos.modes.score import Scored, floored
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


def make_agent(model, tokenizer, lora_config, explore, action_mode="generate", **kwargs):
    config = PPOConfig(batch_size=8, min_batch_turns=0, mini_batch_size=8, ppo_epochs=1, seed=0)
    return NumberAgent(
        model,
        tokenizer,
        "cpu",
        ppo_config=config,
        lora_config=lora_config,
        precision="fp32",
        generation_config={"max_new_tokens": 4, "temperature": 1.0},
        action_mode=action_mode,
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


def test_floored_golden_values():
    torch.testing.assert_close(floored(torch.tensor([0.7, 0.2, 0.1]), 0.05), torch.tensor([0.7, 0.2, 0.1]))
    torch.testing.assert_close(
        floored(torch.tensor([0.98, 0.015, 0.005]), 0.05), torch.tensor([0.9074, 0.0463, 0.0463]), atol=1e-4, rtol=0
    )


def scored_actor(probs: list[float], explore: float):
    """An actor whose score memory already holds the policy `probs` over three one-token candidates of one prompt."""
    memory = {}
    actor = SimpleNamespace(
        policy=SimpleNamespace(sharded=False),
        memory=lambda mode: memory,
        score_cache_size=10,
        score_tokens=1024,
        explore=explore,
    )
    candidates = [[7], [8], [9]]
    key = MODES["score"].key([1, 2], candidates)
    memory[key] = Scored(torch.tensor(probs).log(), torch.tensor(0.0), torch.zeros(4))
    return actor, [[1, 2]], [candidates]


def test_scoring_draws_a_settled_states_other_candidates_at_their_least_share_and_marks_them():
    actor, prompts, candidates = scored_actor([0.998, 0.001, 0.001], explore=0.3)  # least share 0.1 each
    torch.manual_seed(0)
    choices = [MODES["score"].choose(actor, prompts, candidates)[0] for _ in range(3000)]
    counts = torch.bincount(torch.tensor([c.choice for c in choices]), minlength=3) / 3000
    expected = torch.tensor([0.998, 0.1, 0.1]) / 1.198  # 0.833, 0.083, 0.083 (the policy alone: 0.001 each)
    torch.testing.assert_close(counts, expected, atol=0.02, rtol=0)
    assert all(c.explored == (c.choice != 0) for c in choices)
    assert all(c.response_ids == candidates[0][c.choice] for c in choices)


def test_scoring_leaves_a_state_alone_where_every_candidate_keeps_its_share():
    draws = {}
    for explore in (0.0, 0.3):
        actor, prompts, candidates = scored_actor([0.5, 0.3, 0.2], explore)
        torch.manual_seed(0)
        draws[explore] = [MODES["score"].choose(actor, prompts, candidates)[0] for _ in range(200)]
    assert draws[0.3] == draws[0.0]  # the same draws, none marked explored
    assert not any(c.explored for c in draws[0.3])


def test_scoring_agent_reports_its_drawn_share_and_greedy_scoring_never_explores(tokenizer, lora_config):
    torch.manual_seed(0)
    agent = make_agent(build_tiny_model(tokenizer, seed=0), tokenizer, lora_config, 0.99, action_mode="score")
    with agent.evaluating():
        agent.act_batch(list(range(8)))
    assert (agent._drawn, agent._sampled) == (0, 0) and agent.actor.explore == 0.0
    stats, turns = {}, []
    while "ppo/policy_loss" not in stats:
        actions = agent.act_batch(list(range(8)))
        turns += [slot.episode.turns[-1] for slot in agent.slots]
        agent.assign_rewards([float(a == 7) for a in actions])
        drawn, sampled = agent._drawn, agent._sampled
        stats = agent.end_episodes([True] * 8)
    assert all(turn.mode == "score" and turn.choice is not None for turn in turns)
    assert sampled == len(turns) and 0 < drawn < sampled  # the tiny model gives some of the 9 digits under 0.11
    assert stats["agent/explored_rate"] == drawn / sampled
