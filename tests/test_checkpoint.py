"""Crash-safe checkpoints: atomic swap, recovery after a kill mid-swap, clear errors for torn or foreign ones."""

import json
import os
import random

import pytest
import torch

from llamagym import Agent, PPOConfig
from llamagym.agent.checkpoint import MANIFEST, STATE_FILE, CheckpointError, resolve_checkpoint
from llamagym.models.tiny_random import build_tiny_model


class OneStepAgent(Agent):
    def get_system_prompt(self):
        return "Go."

    def format_observation(self, observation):
        return str(observation)

    def extract_action(self, response):
        return 0


@pytest.fixture
def agent(tokenizer, lora_config):
    torch.manual_seed(0)
    agent = OneStepAgent(
        build_tiny_model(tokenizer),
        tokenizer,
        ppo_config=PPOConfig(batch_size=2, min_batch_turns=0),
        lora_config=lora_config,
        generation_config={"max_new_tokens": 2},
        sft_warm_start=True,
    )
    for episode in range(2):
        agent.act(episode)
        agent.assign_reward(1.0)
        agent.terminate_episode()
    return agent


def fresh(tokenizer, lora_config):
    return OneStepAgent(
        build_tiny_model(tokenizer, seed=1),
        tokenizer,
        lora_config=lora_config,
        generation_config={"max_new_tokens": 2},
        sft_warm_start=True,
    )


def test_round_trip_restores_weights_trainer_replay_counters_rng_and_extra(agent, tokenizer, lora_config, tmp_path):
    random.seed(7)
    agent.save(tmp_path / "ckpt", extra={"returns": [1.0, -1.0]})
    expected = random.random()
    other = fresh(tokenizer, lora_config)
    assert other.load(tmp_path / "ckpt") == {"returns": [1.0, -1.0]}
    assert random.random() == expected  # the RNG continues where it was saved
    assert other.trainer.num_updates == 1 and len(other.trainer.replay) == len(agent.trainer.replay)
    for (name, a), b in zip(agent.policy.state_dict().items(), other.policy.state_dict().values(), strict=True):
        if "lora_" in name or name.startswith("value_head"):
            assert torch.equal(a, b), name
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert manifest["base_model"] and manifest["llamagym_version"] and STATE_FILE in manifest["files"]


def test_saving_again_replaces_the_checkpoint_and_leaves_no_temporaries(agent, tmp_path):
    agent.save(tmp_path / "ckpt")
    agent.save(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_kill_between_the_two_renames_still_finds_a_whole_checkpoint(agent, tmp_path):
    agent.save(tmp_path / "ckpt")
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.old-1-1")  # the old one moved aside, the new one not yet in place
    assert resolve_checkpoint(tmp_path / "ckpt") == tmp_path / ".ckpt.old-1-1"


@pytest.mark.skipif(os.name != "posix", reason="processes are probed with os.kill(pid, 0)")
def test_a_save_removes_what_killed_writers_left_and_nothing_of_live_ones(agent, tmp_path):
    dead = 2**22 + 1  # above Linux's largest pid_max: no process has it
    for name in (f".ckpt.tmp-{dead}-abc", f".ckpt.old-{dead}-1", ".ckpt.tmp-1-live"):  # pid 1 always runs
        (tmp_path / name).mkdir()
    agent.save(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.tmp-1-live", "ckpt"]


def test_a_torn_temporary_directory_is_never_taken(agent, tmp_path):
    agent.save(tmp_path / "ckpt")
    torn = tmp_path / ".ckpt.tmp-abc"
    torn.mkdir()
    (torn / STATE_FILE).write_bytes(b"half")  # no manifest: the write never finished
    assert resolve_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / MANIFEST).unlink(), "not a complete llamagym checkpoint"),
        (lambda d: (d / MANIFEST).write_text("{"), "corrupt"),
        (lambda d: (d / STATE_FILE).write_bytes((d / STATE_FILE).read_bytes()[:100]), "damaged: state.pt"),
        (lambda d: (d / "value_head.safetensors").unlink(), "damaged: value_head.safetensors"),
    ],
)
def test_damaged_checkpoints_fail_with_a_message_that_names_the_problem(
    agent, tokenizer, lora_config, tmp_path, damage, message
):
    agent.save(tmp_path / "ckpt")
    damage(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=message):
        fresh(tokenizer, lora_config).load(tmp_path / "ckpt")


def test_a_checkpoint_of_another_model_or_a_newer_format_is_refused(agent, tokenizer, lora_config, tmp_path):
    agent.save(tmp_path / "ckpt")
    manifest_path = tmp_path / "ckpt" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "base_model": "phi-2"}))
    with pytest.raises(CheckpointError, match="phi-2"):
        fresh(tokenizer, lora_config).load(tmp_path / "ckpt")
    manifest_path.write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(CheckpointError, match="Upgrade llamagym"):
        fresh(tokenizer, lora_config).load(tmp_path / "ckpt")


def test_missing_checkpoint_says_so(tokenizer, lora_config, tmp_path):
    with pytest.raises(CheckpointError, match="No checkpoint"):
        fresh(tokenizer, lora_config).load(tmp_path / "nothing")


def two_env_agent(tokenizer, lora_config, seed):
    torch.manual_seed(seed)  # the adapter's init: the loaded checkpoint must overwrite it
    return OneStepAgent(
        build_tiny_model(tokenizer),
        tokenizer,
        ppo_config=PPOConfig(batch_size=3, min_batch_turns=0, mini_batch_size=4),
        lora_config=lora_config,
        generation_config={"max_new_tokens": 2},
    )


def finish_and_train(agent):
    agent.act_batch([2, 12])
    agent.assign_rewards([1.0, 1.0])
    stats = agent.end_episodes([True, True])  # the batch is full: one PPO update
    return json.dumps({k: v for k, v in stats.items() if not k.startswith("time/")}, sort_keys=True)


def test_running_and_untrained_episodes_survive_a_checkpoint_and_continue_identically(tokenizer, lora_config, tmp_path):
    agent = two_env_agent(tokenizer, lora_config, seed=0)
    agent.act_batch([0, 10])
    agent.assign_rewards([1.0, 2.0])
    agent.end_episodes([False, True])  # env 1's episode waits in the batch; env 0's goes on
    agent.act_batch([1, 11])
    agent.assign_rewards([0.5, 0.0])
    agent.save(tmp_path / "ckpt")
    resumed = two_env_agent(tokenizer, lora_config, seed=1)
    resumed.load(tmp_path / "ckpt")
    assert resumed.slots == agent.slots and resumed.batch == agent.batch and len(resumed.episode.turns) == 2
    expected = finish_and_train(agent)
    resumed.load(tmp_path / "ckpt")  # again: the RNG is global, and `agent` has just drawn from it
    assert finish_and_train(resumed) == expected
    for (name, a), b in zip(agent.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_without_restore_episodes_the_running_ones_are_dropped_and_the_batch_kept(tokenizer, lora_config, tmp_path):
    agent = two_env_agent(tokenizer, lora_config, seed=0)
    agent.act_batch([0, 10])
    agent.assign_rewards([1.0, 2.0])
    agent.end_episodes([False, True])
    agent.save(tmp_path / "ckpt")
    resumed = two_env_agent(tokenizer, lora_config, seed=0)
    resumed.load(tmp_path / "ckpt", restore_episodes=False)
    assert resumed.batch == agent.batch and len(resumed.slots) == 1 and resumed.episode.turns == []
    assert resumed.slots[0].number == agent.episode_count  # numbering goes on after the checkpoint's episodes


def test_a_checkpoint_from_before_the_modules_moved_still_loads(tokenizer, lora_config, tmp_path, monkeypatch):
    import sys

    from llamagym.algos import rollout

    agent = two_env_agent(tokenizer, lora_config, seed=0)
    agent.act_batch([0, 10])
    agent.assign_rewards([1.0, 2.0])
    agent.end_episodes([False, True])
    agent.save(tmp_path / "ckpt")
    # rewrite it as llamagym 0.2 did: its episodes pickled as llamagym.rollout.Episode / Turn, format 1
    state = torch.load(tmp_path / "ckpt" / STATE_FILE, weights_only=False)
    with monkeypatch.context() as old:
        old.setitem(sys.modules, "llamagym.rollout", rollout)
        for cls in (rollout.Episode, rollout.Turn):
            old.setattr(cls, "__module__", "llamagym.rollout")
        torch.save(state, tmp_path / "ckpt" / STATE_FILE)
    assert b"llamagym.rollout" in (tmp_path / "ckpt" / STATE_FILE).read_bytes()
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    manifest["files"][STATE_FILE] = (tmp_path / "ckpt" / STATE_FILE).stat().st_size
    (tmp_path / "ckpt" / MANIFEST).write_text(json.dumps({**manifest, "format": 1, "llamagym_version": "0.2.0"}))
    resumed = two_env_agent(tokenizer, lora_config, seed=1)
    resumed.load(tmp_path / "ckpt")
    assert resumed.slots == agent.slots and resumed.batch == agent.batch
    assert type(resumed.batch[0]) is rollout.Episode


class TwoChoiceAgent(OneStepAgent):
    action_names = ["stick", "hit"]  # scoring mode: the trust region measures each step


def test_what_acting_remembers_of_the_weights_survives_a_checkpoint(tokenizer, lora_config, tmp_path):
    """After an update acting takes the trust region's measure of the batch's inputs, whose last bits differ from
    what acting would compute: without it a resumed run acts on other numbers than the uninterrupted one."""
    torch.manual_seed(0)
    config = PPOConfig(batch_size=2, min_batch_turns=0)
    agent = TwoChoiceAgent(build_tiny_model(tokenizer), tokenizer, ppo_config=config, lora_config=lora_config)
    for observation, reward in ((0, 1.0), (1, -1.0)):
        agent.act(observation)
        agent.assign_reward(reward)
        agent.terminate_episode()
    remembered = agent.actor.memory_state()["memory"]["score"]
    assert remembered  # the update handed its measure to acting
    agent.save(tmp_path / "ckpt")
    other = TwoChoiceAgent(build_tiny_model(tokenizer, seed=1), tokenizer, ppo_config=config, lora_config=lora_config)
    other.load_state_dict(agent.state_dict())  # other weights: what acting remembered is not theirs, and not taken
    assert other.actor.memory_state() == {}
    other.load(tmp_path / "ckpt")
    restored = other.actor.memory_state()["memory"]["score"]
    assert restored.keys() == remembered.keys()
    for key, entry in remembered.items():
        assert all(torch.equal(a, b) for a, b in zip(entry, restored[key], strict=True))
    other.policy.version += 1  # the weights changed: the memory is stale, and neither used nor saved
    assert other.actor.memory_state() == {}
