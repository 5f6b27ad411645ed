"""Prompts prefilled once each (`models/prefill.py`): the same generation as running every prompt, for less work."""

import pytest
import torch

from llamagym.algos.modes.generate import sampling_config
from llamagym.algos.rollout import left_pad
from llamagym.models.policy import Policy
from llamagym.models.prefill import prefill
from tests.envs import YesNoAgent

PAD, END = 256, 256
SHORT = [257, 50, 51, 52, 256, 258, 60, 256, 259]
LONG = [257, 50, 51, 52, 256, 258, 61, 62, 63, 256, 259]
OTHER = [257, 50, 51, 52, 256, 258, 64, 65, 256, 259]


def last_logits(policy, input_ids, attention_mask, cache=None):
    """The logits that predict each row's first new token, as `generate`'s first step computes them."""
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    if cache is not None:
        input_ids, positions = input_ids[:, -1:], positions[:, -1:]
    with torch.no_grad(), policy.autocast():
        out = policy.causal_lm()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, past_key_values=cache
        )
    return out.logits[:, -1].float()


@pytest.mark.parametrize(
    "prompts",
    [
        [SHORT, LONG, SHORT, OTHER, LONG, SHORT],  # repeated prompts of different lengths
        [LONG, LONG, LONG],  # one distinct prompt: only its last token is left to run
        [[257, 259], [257, 259, 60]],  # one prompt is its shared prefix plus its last token
    ],
)
def test_prefilled_rows_predict_what_the_plain_left_padded_prompts_predict(model, lora_config, prompts):
    policy = Policy(model, lora_config)
    rows = prefill(policy.causal_lm().get_decoder(), prompts, PAD)
    assert rows.cache is not None and rows.cache.get_seq_length() == rows.input_ids.shape[1] - 1
    for ids, mask, prompt in zip(rows.input_ids, rows.attention_mask, prompts, strict=True):
        assert ids[mask.bool()].tolist() == prompt  # every row holds its prompt, pads only where masked
    plain_ids, plain_mask = left_pad(prompts, PAD)
    expected = last_logits(policy, plain_ids, plain_mask)
    torch.testing.assert_close(last_logits(policy, *rows), expected, atol=1e-5, rtol=1e-5)


def test_prompts_that_share_no_first_token_are_left_padded_without_a_cache(model, lora_config):
    policy = Policy(model, lora_config)
    prompts = [[50, 51], [60, 61, 62]]
    rows = prefill(policy.causal_lm().get_decoder(), prompts, PAD)
    assert rows.cache is None
    plain = left_pad(prompts, PAD)
    assert torch.equal(rows.input_ids, plain[0]) and torch.equal(rows.attention_mask, plain[1])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_greedy_replies_are_the_same_with_and_without_the_prefilled_cache(model, lora_config, precision):
    policy = Policy(model, lora_config, precision=precision)
    prompts = [SHORT, LONG, SHORT, OTHER, LONG]
    config = sampling_config(8, 1.0, True, PAD, {END})
    plain_ids, plain_mask = left_pad(prompts, PAD)
    plain = policy.generate(plain_ids, plain_mask, generation_config=config)[:, plain_ids.shape[1] :]
    rows = policy.prefill(prompts, PAD)
    cached = policy.generate(rows.input_ids, rows.attention_mask, generation_config=config, past_key_values=rows.cache)
    assert torch.equal(cached[:, rows.input_ids.shape[1] :], plain)


def test_the_agent_acts_alike_with_the_prefix_reused_or_not(model, tokenizer):
    agent = YesNoAgent(model, tokenizer, action_mode="generate", generation_config={"max_new_tokens": 4})
    observations = [0, 1, 0, 2, 1, 0]
    reused = agent.predict(observations)
    agent.actor.reuse_prefix = False
    assert agent.predict(observations) == reused
