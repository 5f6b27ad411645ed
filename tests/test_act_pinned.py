"""Today's acting, pinned: a fixed-seed sequence of `act_batch` calls must choose the same replies after a refactor.

Four agents on the tiny model, in float32: sampled generation (named and "auto"), scoring named actions, and
scoring candidates that differ by observation with the top layer alone adapted (so the frozen-layer cache is used,
not the prefix reuse). Each plays five sampled steps over three envs (one slot idle once, episodes ending at
different times, the weights changed once in between so the score cache must be refilled), one greedy step, and a
`predict`. The record is every action, reply and stored turn, and the padded tensors the turns collate to; the
golden digests were computed on the tree before choosing moved into the action modes, the sampled generate cases'
again when generate mode's draw replaced `torch.multinomial` (another random stream; the greedy steps unchanged).
Outputs are exact: the only floats involved are the tiny model's, and a sample flips only if a draw lands within a
rounding error of a boundary.
"""

import hashlib
import json

import gymnasium as gym
import pytest
import torch

from llamagym import Agent, PPOConfig
from llamagym.algos.rollout import collate, collate_scored
from llamagym.models.tiny_random import build_tiny_model


class EchoAgent(Agent):
    def get_system_prompt(self):
        return "Count."

    def format_observation(self, observation):
        return f"at {int(observation)}"

    def extract_action(self, response):
        return len(response) % 3 if len(response) > 2 else None  # short replies fall back (and are counted)


class NamedAgent(EchoAgent):
    action_names = ["stick", "hit me", "double down"]


class ListedAgent(EchoAgent):
    MOVES = {"go north": 0, "go south": 1, "wait a moment": 2}

    def action_candidates(self, observation):
        return ["go north", "go south"] + (["wait a moment"] if int(observation) % 2 else [])

    def extract_action(self, response):
        return self.MOVES.get(response)


CASES = {
    "generate": (EchoAgent, {"action_mode": "generate"}),
    "auto-generate": (EchoAgent, {"action_mode": "auto", "generation_config": {"max_new_tokens": 3}}),
    "score-named": (NamedAgent, {"action_mode": "auto"}),
    "score-listed-frozen-cache": (ListedAgent, {"action_mode": "score", "lora_layers": 1}),
}
OBSERVATIONS = [[0, 1, 2], [3, 1, 4], [5, 9, 2], [2, 6, 5], [0, 1, 2]]


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def turn_record(turn) -> list:
    return [digest(turn.prompt_ids), turn.response_ids, turn.reward, turn.valid, turn.candidates, turn.choice]


def tensors_digest(turns) -> str:
    if turns[0].candidates is None:
        batch = collate(turns, pad_token_id=0)
    else:
        batch = collate_scored(
            [t.prompt_ids for t in turns], [t.candidates for t in turns], [t.choice for t in turns], pad_token_id=0
        )
    return digest([t.flatten().tolist() for t in batch])


def play(case: str, tokenizer, lora_config) -> dict:
    cls, kwargs = CASES[case]
    torch.manual_seed(0)  # the adapter's initialisation
    agent = cls(
        build_tiny_model(tokenizer, seed=0),
        tokenizer,
        ppo_config=PPOConfig(batch_size=100, min_batch_turns=0),
        lora_config=lora_config,
        action_space=gym.spaces.Discrete(3),
        precision="fp32",
        **{"generation_config": {"max_new_tokens": 5}, **kwargs},
    )
    torch.manual_seed(1)  # the sampling
    actions, replies = [], []
    for step, observations in enumerate(OBSERVATIONS):
        active = [True, step != 2, True]
        actions.append(agent.act_batch(observations, active=active))
        replies.append([slot.last_reply for slot in agent.slots])
        agent.assign_rewards([0.5 * step, -1.0, 2.0], active=active)
        agent.end_episodes([step % 2 == 1, step == 4, step == 3])
        if step == 2:  # the weights change (as after an update): cached distributions must not be reused
            with torch.no_grad():
                for p in agent.policy.trainable_parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
            agent.policy.version += 1
    with agent.evaluating():
        actions.append(agent.act_batch([7, 8, 9]))
        replies.append([slot.last_reply for slot in agent.slots])
    actions.append(agent.predict([0, 3, 7, 0]))
    turns = [t for e in agent.batch for t in e.turns] + [t for s in agent.slots for t in s.episode.turns]
    return {
        "actions": actions,
        "replies": digest(replies),
        "turns": digest([turn_record(t) for t in turns]),
        "tensors": tensors_digest(turns),
    }


GOLDEN = {
    "generate": {
        "actions": [[1, 1, 1], [0, 2, 2], [1, 0, 2], [2, 2, 2], [1, 2, 2], [1, 2, 2], [2, 2, 2, 2]],
        "replies": "9a470c02a4919426",
        "turns": "e79be4101460ac3a",
        "tensors": "99d55e6fe707a1f4",
    },
    "auto-generate": {
        "actions": [[0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0, 0]],
        "replies": "6e6cbbbf7b1f36fa",
        "turns": "5a24872feeb9d590",
        "tensors": "d8ec7a42a4decd9a",
    },
    "score-named": {
        "actions": [[0, 2, 0], [2, 2, 0], [0, 0, 2], [1, 2, 1], [2, 1, 1], [1, 1, 1], [1, 1, 1, 1]],
        "replies": "ba64df9fb26dd683",
        "turns": "200c05dbfd6325cd",
        "tensors": "e5e8cd29a99cd5cd",
    },
    "score-listed-frozen-cache": {
        "actions": [[0, 1, 0], [2, 1, 1], [0, 0, 0], [0, 1, 1], [1, 1, 0], [2, 1, 0], [1, 2, 1, 1]],
        "replies": "e5683042024c3d05",
        "turns": "751c2433a3974fc4",
        "tensors": "4596dfe46110de4a",
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fixed_seed_sequence_of_steps_acts_as_before(case, tokenizer, lora_config):
    assert play(case, tokenizer, lora_config) == GOLDEN[case]
