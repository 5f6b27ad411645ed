"""Frozen weights' bf16 casts, kept: the same numbers as autocast's cast at every call, made again when the weight
changes, and only under bf16 autocast for a frozen fp32 weight; the head's for good, the other layers' for a
`generate` call."""

import torch
from torch import nn

from llamagym.models.head_cast import KeptCast, casts_kept, keep_head_cast
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


def test_generate_keeps_the_frozen_layers_casts_for_the_call_and_replies_as_autocast_does(tokenizer, lora_config):
    torch.manual_seed(0)
    policy = Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision="bf16")
    frozen = [m for m in policy.model.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    head = policy.causal_lm().get_output_embeddings()
    layer = frozen[0]
    seen = []
    layer.register_forward_hook(lambda m, args, out: seen.append(isinstance(m.forward, KeptCast) and m.forward.weight))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    out = {}
    for keep in (True, False):
        policy.keep_casts = keep
        seen.clear()
        generated = policy.generate(
            ids, torch.ones_like(ids), max_new_tokens=5, do_sample=False, output_scores=True,
            return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=None,
        )  # fmt: skip
        out[keep] = generated.sequences, torch.stack(generated.scores)
        assert len(seen) == 5 and all(isinstance(w, torch.Tensor) for w in seen) == keep  # one cast, kept for all
        assert all(w is seen[0] for w in seen)
        assert all("forward" not in m.__dict__ for m in frozen if m is not head)  # the copies given back
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])


def test_casts_kept_puts_back_a_forward_set_by_someone_else(tokenizer):
    model = build_tiny_model(tokenizer, seed=0).requires_grad_(False)
    layer = model.get_decoder().layers[0].mlp.up_proj
    hooked = layer.forward
    layer.forward = hooked  # an instance forward, as a wrapper would set
    with casts_kept(model):
        assert isinstance(layer.forward, KeptCast) and layer.forward.forward == hooked
    assert layer.__dict__["forward"] is hooked
