"""Reward goes up: PPO on the tiny model learns a bandit, and credit flows back across turns.

"Action 1" is a reply that starts with an ASCII letter, any other reply is action 0. The untrained model's chance of
action 1 depends on the prompt (0.21 after "go", 0.36 after "first"): each test computes it exactly from the first
token's sampling distribution and asks for a rise well above it. Updates are the library's default for LoRA (one
natural step on the whole batch). Each test takes a few seconds on one core. The bandit and the credit test run with
every advantage estimator: all episodes start from the same observation, so a batch is one group for grpo, rloo and
gigpo (the default grouping by first prompt).
"""

import pytest
import torch
from peft import LoraConfig

from llamagym import Agent, PPOConfig
from llamagym.models.tiny_random import build_tiny

pytestmark = pytest.mark.slow

BATCH, UPDATES = 16, 40
ESTIMATORS = ["gae", "grpo", "rloo", "rebn", "gigpo"]


class LetterAgent(Agent):
    def get_system_prompt(self):
        return "Pick."

    def format_observation(self, observation):
        return observation

    def extract_action(self, response):
        return 1 if response[:1].isascii() and response[:1].isalpha() else 0


def bandit_config(advantage="gae") -> PPOConfig:
    """Batches of BATCH episodes (however short), the default step (one natural step on the whole batch), no KL."""
    return PPOConfig(
        batch_size=BATCH,
        min_batch_turns=0,
        learning_rate=1e-2,
        kl_coef=0.0,
        adaptive_kl=False,
        gamma=1.0,
        lam=0.95,
        advantage=advantage,
        cap_cut_replies=False,  # one-letter replies, cut at max_new_tokens=1 by design
    )


def make_agent(max_new_tokens=1, advantage="gae"):
    torch.manual_seed(0)
    model, tokenizer = build_tiny(seed=0)
    config = bandit_config(advantage)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], bias="none", lora_dropout=0.0)
    return LetterAgent(
        model, tokenizer, ppo_config=config, lora_config=lora, generation_config={"max_new_tokens": max_new_tokens}
    )


def run(agent, episode_fn):
    """Mean of the tracked quantity per batch (one entry per PPO update)."""
    curve, window = [], []
    for _ in range(BATCH * UPDATES):
        window.append(episode_fn(agent))
        if "ppo/policy_loss" in agent.terminate_episode():
            curve.append(sum(window) / len(window))
            window = []
    print("per-update curve:", [round(x, 2) for x in curve])
    return curve


def chance_of_action_1(agent, observation) -> float:
    """The untrained agent's exact chance of action 1 at `observation`: its first token's sampling distribution
    (softmax of the logits / temperature), summed over the tokens whose text `extract_action` reads as 1."""
    ids, _ = agent.formatter.prompt_ids(agent.get_system_prompt(), [{"role": "user", "content": observation}])
    with torch.no_grad():
        logits = agent.policy.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    probs = torch.softmax(logits / agent.generation["temperature"], dim=-1)
    decode = agent.tokenizer.decode
    ones = [t for t in range(len(probs)) if agent.extract_action(decode([t], skip_special_tokens=True)) == 1]
    return float(probs[ones].sum())


def assert_learned(curve, chance):
    last = sum(curve[-5:]) / 5
    assert chance < 0.4, f"the task should start far from solved (chance {chance:.2f})"
    assert last > 0.6 and last > chance + 0.3, f"last five batches {last:.2f}, chance {chance:.2f}"


@pytest.mark.parametrize("advantage", ESTIMATORS)
def test_one_step_bandit_reward_rises_well_above_chance(advantage):
    def episode(agent):
        reward = float(agent.act("go") == 1)
        agent.assign_reward(reward)
        return reward

    agent = make_agent(advantage=advantage)
    chance = chance_of_action_1(agent, "go")
    assert_learned(run(agent, episode), chance)


@pytest.mark.parametrize("advantage", ESTIMATORS)
def test_final_reward_teaches_the_first_turns_choice(advantage):
    def episode(agent):
        first = agent.act("first")
        agent.assign_reward(0.0)  # no reward yet: only the end of the episode says whether turn 1 was right
        agent.act("second")
        agent.assign_reward(float(first == 1))
        return float(first == 1)

    agent = make_agent(advantage=advantage)
    chance = chance_of_action_1(agent, "first")
    assert_learned(run(agent, episode), chance)


class NamedAgent(LetterAgent):
    action_names = ["left", "right"]


def test_scoring_mode_learns_the_rewarded_named_action():
    torch.manual_seed(0)
    model, tokenizer = build_tiny(seed=0)
    config = bandit_config()  # gamma, lam and the estimator as PPOConfig's defaults
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], bias="none", lora_dropout=0.0)
    agent = NamedAgent(model, tokenizer, ppo_config=config, lora_config=lora, action_mode="score")

    def episode(agent):
        reward = float(agent.act("go") == 1)  # "right" is action 1
        agent.assign_reward(reward)
        return reward

    curve = run(agent, episode)
    assert sum(curve[-5:]) / 5 > 0.9 and sum(curve[-5:]) / 5 > curve[0] + 0.2
