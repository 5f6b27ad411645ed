"""Gradient checkpointing (`Policy(gradient_checkpointing=True)`): the same update, fewer saved activations.

The updates are the pinned ones of `test_update_pinned` (natural-gradient steps on scored turns, AdamW on generated
ones), with LoRA on both layers of the tiny model or on the top one only (the frozen-layer cache then feeds it).
"""

import pytest
import torch

from llamagym.algos.trainer import PPOTrainer
from llamagym.config import PPOConfig
from llamagym.envs.blackjack import BlackjackAgent
from llamagym.models import checkpointing
from llamagym.models.policy import Policy
from llamagym.models.registry import MODELS, ModelSpec
from llamagym.models.tiny_random import build_tiny_model
from tests.test_update_pinned import episodes


def policy(tokenizer, lora_config, checkpointed: bool, lora_layers=None) -> Policy:
    torch.manual_seed(0)
    model = build_tiny_model(tokenizer, seed=0)
    return Policy(model, lora_config, precision="fp32", lora_layers=lora_layers, gradient_checkpointing=checkpointed)


def update(tokenizer, lora_config, checkpointed: bool, scored: bool, lora_layers) -> list[torch.Tensor]:
    """The trainable parameters (LoRA and value head) after two updates."""
    p = policy(tokenizer, lora_config, checkpointed, lora_layers)
    assert (p.frozen_cache is not None) == (lora_layers == 1)  # the cache feeds the checkpointed top layer
    trainer = PPOTrainer(p, PPOConfig(seed=0), tokenizer.pad_token_id)
    for seed in range(2):
        trainer.step(episodes(scored, seed=seed))
    return [x.detach().clone() for x in p.trainable_parameters()]


@pytest.mark.parametrize("lora_layers", [None, 1], ids=["all-layers", "top-layer-frozen-cache"])
@pytest.mark.parametrize("scored", [True, False], ids=["score-natural", "generate-adamw"])
def test_an_update_with_checkpointing_equals_one_without(tokenizer, lora_config, scored, lora_layers):
    plain = update(tokenizer, lora_config, False, scored, lora_layers)
    checkpointed = update(tokenizer, lora_config, True, scored, lora_layers)
    start = policy(tokenizer, lora_config, False, lora_layers).trainable_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(plain, start, strict=True))  # the update moved them
    assert len(plain) == len(checkpointed)
    for a, b in zip(checkpointed, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _training_forward(p: Policy):
    """One training forward and backward of generated turns: the bytes autograd saved, and the MLP runs."""
    ids = torch.randint(3, 250, (4, 12), generator=torch.Generator().manual_seed(0))
    attention, response = torch.ones_like(ids), torch.zeros_like(ids)
    response[:, 8:] = 1
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    calls = []
    mlp = p.causal_lm().get_decoder().layers[-1].mlp
    handle = mlp.register_forward_pre_hook(lambda *args: calls.append(1))  # a replay may stop before it ends
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = p(ids, attention, response, value_index=torch.full((4,), 7))
        (out.logprobs.sum() + out.values.sum()).backward()
    finally:
        handle.remove()
    return sum(saved), len(calls)


def test_checkpointing_saves_fewer_activations_and_recomputes_the_layer(tokenizer, lora_config):
    plain_bytes, plain_calls = _training_forward(policy(tokenizer, lora_config, False))
    checkpointed = policy(tokenizer, lora_config, True)
    bytes_, calls = _training_forward(checkpointed)
    assert calls == 2 * plain_calls == 2  # the backward pass ran the top layer's MLP again
    assert bytes_ < 0.6 * plain_bytes
    checkpointing.disable(checkpointed.causal_lm())
    assert not any(checkpointing.is_enabled(layer) for layer in checkpointing.transformer_layers(checkpointed))
    assert _training_forward(checkpointed) == (plain_bytes, plain_calls)


def test_only_the_training_layers_are_checkpointed(tokenizer, lora_config):
    p = policy(tokenizer, lora_config, True, lora_layers=1)
    layers = p.causal_lm().get_decoder().layers
    assert [checkpointing.is_enabled(layer) for layer in layers] == [False, True]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_value_is_a_clear_error(tokenizer, lora_config, value):
    with pytest.raises(ValueError, match="`gradient_checkpointing` should be True or False"):
        Policy(build_tiny_model(tokenizer), lora_config, gradient_checkpointing=value)
    with pytest.raises(ValueError, match="`gradient_checkpointing` should be True, False or 'auto'"):
        BlackjackAgent(build_tiny_model(tokenizer), tokenizer, lora_config=lora_config, gradient_checkpointing=value)
    fields = {k: v for k, v in vars(MODELS["tiny-random"]).items() if k != "gradient_checkpointing"}
    with pytest.raises(ValueError, match="ModelSpec `gradient_checkpointing` should be True or False"):
        ModelSpec(**fields, gradient_checkpointing=value)


def test_a_model_without_transformer_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="GradientCheckpointingLayer.*gradient_checkpointing=False"):
        checkpointing.enable(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_the_registry_turns_it_on_for_the_1b_models_and_auto_follows_it(tokenizer, lora_config, restore_models):
    on = {name for name, spec in MODELS.items() if spec.gradient_checkpointing}
    large = {"tinyllama-1.1b-chat", "phi-2", "phi-3-mini-4k-instruct", "smollm-1.7b-instruct", "qwen2-1.5b-instruct"}
    assert on == large
    for setting, expected in ((False, False), (True, True)):
        model = build_tiny_model(tokenizer)
        model.llamagym_spec = ModelSpec(
            **{k: v for k, v in vars(MODELS["tiny-random"]).items() if k != "gradient_checkpointing"},
            gradient_checkpointing=setting,
        )
        agent = BlackjackAgent(model, tokenizer)  # gradient_checkpointing="auto"
        assert agent.policy.gradient_checkpointing is expected
        assert checkpointing.is_enabled(agent.policy.causal_lm().get_decoder().layers[-1]) is expected
    agent = BlackjackAgent(build_tiny_model(tokenizer), tokenizer, lora_config=lora_config, gradient_checkpointing=True)
    assert agent.policy.gradient_checkpointing
