"""The LM head's bf16 cast, kept: the same numbers as autocast's cast at every call, made again when the weight
changes, and only under bf16 autocast for a frozen fp32 weight."""

import torch
from torch import nn

from llamagym.models.head_cast import KeptCast, keep_head_cast
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_the_kept_cast_gives_autocasts_own_numbers_and_follows_the_weight(tokenizer):
    model = build_tiny_model(tokenizer, seed=0).requires_grad_(False)
    head = model.get_output_embeddings()
    kept = keep_head_cast(model)
    x = torch.randn(5, head.in_features, generator=torch.Generator().manual_seed(0))
    with autocast():
        out = head(x)
        copy = kept.weight
        assert copy is not None and copy.dtype == torch.bfloat16
        assert torch.equal(out, nn.Linear.forward(head, x))  # what autocast casting at the call gives, exactly
        head(x)
        assert kept.weight is copy  # kept, not cast again
        with torch.no_grad():
            head.weight.mul_(1.5)  # a load or an in-place change moves the weight's version
        assert torch.equal(head(x), nn.Linear.forward(head, x))
        assert kept.weight is not copy
    assert torch.equal(head(x), x @ head.weight.T)  # off autocast: plain fp32
    assert keep_head_cast(model) is kept  # installed once


def test_a_head_that_trains_is_left_to_autocast(tokenizer):
    model = build_tiny_model(tokenizer, seed=0)
    head = model.get_output_embeddings().requires_grad_(True)
    kept = keep_head_cast(model)
    x = torch.randn(3, head.in_features)
    with autocast():
        head(x).sum().backward()
    assert kept.weight is None and head.weight.grad is not None


def test_the_policy_keeps_its_heads_cast(tokenizer, lora_config):
    policy = Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision="bf16")
    assert isinstance(policy.causal_lm().get_output_embeddings().forward, KeptCast)
