"""Generate mode's draw: each row's token by one uniform number against the cumulative probabilities, the
distribution softmax(logits / temperature), taken by a greedy `generate` call's argmax."""

import math

import torch

from llamagym.algos.modes.generate import InverseCdfDraw, draw_tokens
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model


def test_draw_tokens_golden_values():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]])).expand(5, 3)
    uniform = torch.tensor([0.0, 0.0999, 0.1001, 0.3001, 0.9999])
    assert draw_tokens(logits, 1.0, uniform).tolist() == [0, 0, 1, 2, 2]
    # temperature 0.5 squares the odds: [1, 3] -> [1, 9]
    tempered = torch.tensor([[0.0, math.log(3.0)]]).expand(2, 2)
    assert draw_tokens(tempered, 0.5, torch.tensor([0.099, 0.101])).tolist() == [0, 1]


def test_a_token_of_probability_zero_is_never_drawn():
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")]]).expand(4, 5)
    assert draw_tokens(logits, 1.0, torch.tensor([0.0, 0.4999, 0.5, 0.9999])).tolist() == [1, 1, 3, 3]


def test_draws_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([[1.0, -0.5, 0.3, 2.0, -2.0, 0.0]])
    draws = 40000
    torch.manual_seed(0)
    tokens = draw_tokens(logits.expand(draws, 6), 0.7, torch.rand(draws, dtype=torch.float64))
    frequencies = torch.bincount(tokens, minlength=6) / draws
    torch.testing.assert_close(frequencies, torch.softmax(logits[0] / 0.7, -1), atol=0.01, rtol=0)


def test_a_greedy_generate_call_with_the_draw_samples_by_the_seed(tokenizer, lora_config):
    torch.manual_seed(0)
    policy = Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision="fp32")
    ids = torch.tensor([[5, 6, 7, 8]] * 8)

    def replies(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return policy.generate(
            ids, torch.ones_like(ids), max_new_tokens=4, do_sample=False, logits_processor=[InverseCdfDraw(1.0)],
            pad_token_id=tokenizer.pad_token_id, eos_token_id=None,
        )[:, 4:]  # fmt: skip

    first = replies(0)
    assert torch.equal(first, replies(0))  # the seed fixes the draws
    assert not torch.equal(first, replies(1))
    assert len({tuple(row) for row in first.tolist()}) > 1  # rows of one prompt draw apart: not greedy
