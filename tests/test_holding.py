"""Held inputs (`PPOConfig.hold_batches`): the held output, the solve with held rows, the memory of recent
batches' inputs, and the trainer's step that moves a held input less."""

import math
import pickle

import pytest
import torch

from llamagym.algos.holding import HeldInputs, held_outputs
from llamagym.algos.modes import MODES
from llamagym.algos.modes.score import relative_kl
from llamagym.algos.natural_gradient import natural_coefficients
from llamagym.algos.rollout import Episode, Turn
from llamagym.algos.trainer import PPOTrainer
from llamagym.config import PPOConfig
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model
from tests.test_trust_region import CANDIDATES, PROMPTS, distributions


def test_held_outputs_golden_values_and_their_gradient_is_the_held_direction():
    logprobs = torch.tensor([[0.75, 0.25, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]).log().requires_grad_()
    y = held_outputs(logprobs)
    p3 = torch.tensor([0.2, 0.3, 0.5])
    expected = (torch.tensor([0.0, 0.0, 1.0]) - p3) @ p3.log()
    torch.testing.assert_close(y, torch.tensor([0.25 * math.log(3), 0.0, float(expected)]))
    y.sum().backward()
    torch.testing.assert_close(logprobs.grad[0], torch.tensor([0.25, -0.25, 0.0]))  # padding gets no gradient
    torch.testing.assert_close(logprobs.grad[2], torch.tensor([-0.2, -0.3, 0.5]))


def test_natural_coefficients_with_a_held_row_golden_values():
    gram, targets = torch.tensor([[1.0, 0.9], [0.9, 1.0]]), torch.ones(2)
    alone = natural_coefficients(gram[:1, :1], targets[:1], 0.1)
    torch.testing.assert_close(alone, torch.tensor([1 / 1.1]))  # moves the other input by 0.9 x 0.909 = 0.818
    held = natural_coefficients(gram, targets, 0.1, held=1)
    torch.testing.assert_close(held, torch.tensor([2.75, -2.25]))
    torch.testing.assert_close(gram @ held, torch.tensor([0.725, 0.225]))  # the held input moves 0.225, not 0.818
    only_held = natural_coefficients(gram, targets, 0.1, held=2)  # nothing to move: no step
    assert torch.equal(only_held, torch.zeros(2))


def turn(i, choice=0, reward=0.0):
    return Turn(PROMPTS[i], CANDIDATES[i][choice], reward, candidates=CANDIDATES[i], choice=choice, mode="score")


def test_held_inputs_are_the_last_batches_inputs_not_in_this_one_each_once():
    held, score = HeldInputs(2), MODES["score"]
    held.add(score, [turn(0), turn(1)])
    held.add(score, [turn(1, choice=2), turn(2)])  # input 1 again (the input is the prompt and its candidates)
    assert [t.prompt_ids for t in held.others(score, [turn(2)])] == [PROMPTS[1], PROMPTS[0]]  # most recent first
    held.add(score, [turn(2)])  # the first batch is forgotten
    assert [t.prompt_ids for t in held.others(score, [turn(2)])] == [PROMPTS[1]]
    assert held.others(MODES["generate"], [turn(2)]) == []  # another mode's inputs are not its
    resumed = HeldInputs(2)  # as a checkpoint restores it
    resumed.load_state_dict(pickle.loads(pickle.dumps(held.state_dict())))
    resumed.add(score, [turn(0)])
    held.add(score, [turn(0)])
    assert [t.prompt_ids for t in resumed.others(score, [])] == [t.prompt_ids for t in held.others(score, [])]


def kl_after_update(lora_config, tokenizer, hold: int) -> tuple[torch.Tensor, dict]:
    """Each input's KL(before || after) per bit of choice over one whole-batch update on inputs 0 and 1, after an
    update on input 2 alone; with `hold`, input 2 is held in the second."""
    config = PPOConfig(natural_gradient=True, natural_step=0.5, max_kl=None, hold_batches=hold, seed=0)
    torch.manual_seed(0)  # the same adapter's random start for both
    policy = Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision="fp32")
    trainer = PPOTrainer(policy, config, tokenizer.pad_token_id)
    trainer.step([Episode([turn(2, 0, 1.0)]), Episode([turn(2, 1, 0.0)])])
    before = distributions(policy)
    stats = trainer.step([Episode([turn(0, 0, 1.0)]), Episode([turn(0, 1, 0.0)]), Episode([turn(1, 2, 1.0)])])
    return relative_kl(before, distributions(policy), torch.tensor([len(c) for c in CANDIDATES])), stats


def test_a_held_input_moves_less_while_the_batch_still_moves(lora_config, tokenizer):
    free, free_stats = kl_after_update(lora_config, tokenizer, hold=0)
    held, stats = kl_after_update(lora_config, tokenizer, hold=1)
    assert stats["hold/inputs"] == 1.0 and "hold/inputs" not in free_stats
    assert held[2] < 0.01 * free[2], (held, free)  # to first order it would not move (measured: 0.0073 -> 1e-6)
    assert held[:2].sum() > 0.8 * free[:2].sum(), (held, free)


def test_hold_batches_asks_for_natural_steps_with_a_message(model, lora_config, tokenizer):
    with pytest.raises(ValueError, match="hold_batches"):
        PPOConfig(hold_batches=-1)
    with pytest.raises(ValueError, match="natural_gradient=None"):
        PPOConfig(hold_batches=2, natural_gradient=False)
    policy = Policy(model, full_finetune=True)  # no natural step to hold with
    with pytest.raises(ValueError, match="hold_batches=0"):
        PPOTrainer(policy, PPOConfig(hold_batches=2), tokenizer.pad_token_id)
    natural = PPOTrainer(
        Policy(build_tiny_model(tokenizer, seed=0), lora_config), PPOConfig(), tokenizer.pad_token_id
    ).natural
    with pytest.raises(ValueError, match="data-parallel"):  # the optimizer itself refuses, whoever drives it
        natural.expect(inputs=2, turns=2, keys=torch.arange(2), held=1)


def test_generate_mode_holds_nothing_and_says_so_once(model, lora_config, tokenizer, caplog):
    policy = Policy(model, lora_config, precision="fp32")
    trainer = PPOTrainer(policy, PPOConfig(hold_batches=2), tokenizer.pad_token_id)
    episodes = [Episode([Turn(p, c[0], r)]) for p, c, r in zip(PROMPTS, CANDIDATES, [1.0, 0.0, 0.5], strict=True)]
    with caplog.at_level("WARNING", logger="llamagym.algos.trainer"):
        stats = [trainer.step(episodes) for _ in range(2)]
    assert [s["hold/inputs"] for s in stats] == [0.0, 0.0]
    assert sum("holds scored inputs only" in r.message for r in caplog.records) == 1
