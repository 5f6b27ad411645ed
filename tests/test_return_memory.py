import pytest
import torch

from llamagym.algos.return_memory import FLOOR, ReturnMemory
from llamagym.algos.rollout import Episode, Turn
from llamagym.algos.trainer import PPOTrainer
from llamagym.config import PPOConfig
from llamagym.models.policy import Policy


def test_pooled_means_golden_over_two_batches():
    memory = ReturnMemory(0.5)
    pooled, stats = memory.pool(["a", "a", "b"], torch.tensor([1.0, 0.0, 2.0]))
    assert pooled.tolist() == [0.5, 0.5, 2.0]  # this batch only: each pair's mean
    assert stats == {"adv/pooled_count": pytest.approx(5 / 3), "adv/memory_pairs": 2.0}
    pooled, stats = memory.pool(["a", "c"], torch.tensor([1.0, -1.0]))
    # a: count 0.5 x 2 + 1 = 2, sum 0.5 x 1 + 1 = 1.5; b decayed to 0.5 x (1, 2), not met; c new
    assert pooled.tolist() == [0.75, -1.0]
    assert memory.entries == {"a": [2.0, 1.5], "b": [0.5, 1.0], "c": [1.0, -1.0]}
    assert stats == {"adv/pooled_count": 1.5, "adv/memory_pairs": 3.0}


def test_a_pair_not_met_for_long_leaves_the_memory():
    memory = ReturnMemory(0.5)
    memory.pool(["old"], torch.tensor([3.0]))
    batches = 0
    while "old" in memory.entries:
        memory.pool(["new"], torch.tensor([0.0]))
        batches += 1
    assert 0.5**batches < FLOOR <= 0.5 ** (batches - 1)  # dropped as its decayed count passed below the floor


def test_memory_state_round_trips_and_bad_arguments_say_what_to_do():
    memory = ReturnMemory(0.8)
    memory.pool([(1, 2), (1, 2)], torch.tensor([1.0, 0.0]))
    other = ReturnMemory(0.8)
    other.load_state_dict(memory.state_dict())
    assert other.entries == memory.entries and other.entries is not memory.entries
    with pytest.raises(ValueError, match="one key per return"):
        memory.pool(["a"], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"decay in \(0, 1\)"):
        ReturnMemory(1.0)


@pytest.mark.parametrize("value", [1.0, -0.1])
def test_return_memory_is_validated(value):
    with pytest.raises(ValueError, match=r"`return_memory` should be a number in \[0, 1\)"):
        PPOConfig(return_memory=value)


def test_return_memory_needs_a_value_based_estimator():
    with pytest.raises(ValueError, match="advantage='gae'"):
        PPOConfig(return_memory=0.8, advantage="grpo")


def test_the_trainer_takes_each_turns_pooled_return_minus_its_value(model, lora_config, tokenizer, monkeypatch):
    config = PPOConfig(
        return_memory=0.5, gamma=1.0, lam=1.0, whiten_advantages=False, natural_gradient=False, max_kl=None,
        mini_batch_size=2, ppo_epochs=1, value_refit=None, repeated_input_power=0.0, average_updates=0,
    )
    trainer = PPOTrainer(Policy(model, lora_config, precision="fp32"), config, tokenizer.pad_token_id)
    seen = {}

    def capture(data, equal):
        seen["advantages"], seen["values"] = data.advantages.clone(), data.old_values.clone()
        return {}

    monkeypatch.setattr(trainer, "_entropy_bonus", capture)
    same = ([1, 2, 3], [4, 5])  # one (prompt, reply) pair, met twice in the first batch and once in the second
    first = [Episode([Turn(*same, reward=1.0)]), Episode([Turn(*same, reward=0.0)]), Episode([Turn([7, 8], [9], 2.0)])]
    stats = trainer.step(first)
    assert torch.allclose(seen["advantages"], torch.tensor([0.5, 0.5, 2.0]) - seen["values"], atol=1e-5)
    assert stats["adv/memory_pairs"] == 2.0
    trainer.step([Episode([Turn(*same, reward=1.0)])])
    assert torch.allclose(seen["advantages"], torch.tensor([0.75]) - seen["values"], atol=1e-5)  # (0.5 + 1) / 2
    restored = PPOTrainer(Policy(model, lora_config, precision="fp32"), config, tokenizer.pad_token_id)
    restored.load_state_dict(trainer.state_dict())  # a resumed run pools what the interrupted one remembered
    assert restored.return_memory.entries == trainer.return_memory.entries
