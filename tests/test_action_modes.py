"""A new action mode is one file: a mode defined here, registered, acts and trains through the public seam.

`SumScoreMode` scores candidates by their summed token log-probs instead of the mean (no length normalisation):
one method over `ScoreMode`, no library file edited. The agent chooses with it, the turns name it, and the trainer
evaluates them with it.
"""

import pytest
import torch

from llamagym import Agent, PPOConfig
from llamagym.algos.modes import MODES, ActionMode, ScoreMode, mode_of, register_mode
from llamagym.algos.rollout import Turn, collate


class SumScoreMode(ScoreMode):
    """The softmax of each candidate's summed token log-probs: a long reply is less likely for being long."""

    name = "score-sum"

    def __init__(self):
        self.calls = 0

    def candidate_logits(self, totals, lengths):
        self.calls += 1
        return totals


class ReplyAgent(Agent):
    action_names = ["yes", "nay"]  # as long as each other: the sum is the mean times that length, a sharper softmax

    def get_system_prompt(self):
        return "Answer."

    def format_observation(self, observation):
        return f"step {observation}"

    def extract_action(self, response):
        return None  # named actions are read by index, never parsed


@pytest.fixture
def sum_mode():
    mode = register_mode(SumScoreMode())
    yield mode
    del MODES[mode.name]


def loglikelihoods(policy, prompt, candidates):
    """(C,) each candidate's summed token log-probs after `prompt`, one plain forward per candidate."""
    batch = collate([Turn(prompt, c) for c in candidates], pad_token_id=0)
    with torch.no_grad():
        logprobs = policy(*batch).logprobs
    return logprobs.sum(-1)


def test_a_mode_defined_in_a_test_file_acts_and_trains_through_the_public_seam(sum_mode, model, tokenizer, lora_config):
    torch.manual_seed(0)
    config = PPOConfig(batch_size=2, min_batch_turns=0, seed=0)
    agent = ReplyAgent(
        model,
        tokenizer,
        ppo_config=config,
        lora_config=lora_config,
        generation_config={"temperature": 1.0},  # the plain forward below divides by it; scoring does not
        action_mode="score-sum",
        precision="fp32",
    )
    assert agent.mode is sum_mode

    # acting: the distribution is the softmax of the summed log-likelihoods, not of their means
    agent.act(0)
    turn = agent.episode.turns[0]
    assert turn.mode == "score-sum" and turn.response_ids == turn.candidates[turn.choice]
    totals = loglikelihoods(agent.policy, turn.prompt_ids, turn.candidates)
    lengths = torch.tensor([len(c) for c in turn.candidates], dtype=torch.float32)
    acted = agent.actor.memory(sum_mode)[ScoreMode.key(turn.prompt_ids, turn.candidates)].logprobs
    torch.testing.assert_close(acted, torch.log_softmax(totals, -1), atol=1e-5, rtol=0)
    assert not torch.allclose(acted, torch.log_softmax(totals / lengths, -1), atol=1e-3)

    # training: the trainer finds the mode from the turns and evaluates them with it
    before = {name: p.detach().clone() for name, p in agent.policy.named_parameters()}
    agent.assign_reward(0.0)
    agent.act(1)
    agent.assign_reward(1.0)
    assert "ppo/policy_loss" not in agent.terminate_episode()
    for observation, reward in [(2, 0.0), (3, -1.0)]:  # other states: the returns do not cancel per input
        agent.act(observation)
        agent.assign_reward(reward)
    calls = sum_mode.calls
    stats = agent.terminate_episode()  # the batch is full: one update
    assert sum_mode.calls > calls  # the update's old, reference and new outputs came through the mode
    assert "ppo/policy_loss" in stats and all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    moved = [n for n, p in agent.policy.named_parameters() if not torch.equal(p, before[n])]
    assert any("lora_" in n for n in moved) and all("lora_" in n or "value_head" in n for n in moved)


def test_the_trainer_asks_the_mode_the_turns_name(sum_mode):
    candidates = [[3], [4, 5]]
    summed = Turn([1, 2], [3], candidates=candidates, choice=0, mode="score-sum")
    assert mode_of([summed]) is sum_mode
    assert mode_of([Turn([1, 2], [3], candidates=candidates, choice=0)]) is MODES["score"]  # unnamed: built-in
    with pytest.raises(ValueError, match="different action modes"):
        mode_of([summed, Turn([1, 2], [3], candidates=candidates, choice=0, mode="score")])
    with pytest.raises(ValueError, match="not registered"):
        mode_of([Turn([1, 2], [3], mode="beam")])


def test_register_mode_refuses_a_taken_name_and_a_mode_missing_a_method(sum_mode, model, tokenizer):
    with pytest.raises(ValueError, match="is already registered"):
        register_mode(SumScoreMode())
    with pytest.raises(ValueError, match="means the agent's choice"):
        register_mode(type("AutoMode", (SumScoreMode,), {"name": "auto"})())

    class Unfinished(ActionMode):
        name = "unfinished"

    with pytest.raises(TypeError, match="abstract"):
        Unfinished()
    with pytest.raises(ValueError, match="auto, generate, score, score-sum"):
        ReplyAgent(model, tokenizer, action_mode="beam")
