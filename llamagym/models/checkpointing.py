"""Gradient (activation) checkpointing of the transformer layers that train: less memory, one more forward.

A training forward keeps every layer's intermediate activations for the backward pass. With checkpointing on, a
layer keeps only its input; the backward pass runs the layer's forward again to get the rest (torch's
non-reentrant `torch.utils.checkpoint`). For 1-2B models this is what lets a LoRA update of a useful batch fit one
GPU; on SmolLM2-135M (CPU, 16 x 175 tokens) it cut an update's memory from 5.2 to 3.1 GiB for 15% more time
(docs/design.md §5).

We do not use transformers' `gradient_checkpointing_enable`: it checkpoints only in `train()` mode, and the policy
always runs in `eval()` (dropout off, so old, reference and new log-probs come from one computation path). Instead
each layer that holds a trainable weight gets a `forward` that checkpoints whenever autograd records: the PPO
forward passes. Acting, old/reference log-probs and generation run under `no_grad` and are unchanged. Layers below
the adapter (`lora_layers`) need nothing: no tensor in them requires a gradient, so they keep no activations.
The natural-gradient hooks see each adapter layer's forward once (they record only inside the trainer's
`recording()` block, before the backward pass that recomputes), so their per-input gradients are unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_CACHE_KWARGS = ("past_key_values", "layer_past")  # the backward replay must not write a KV cache a second time


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated transformer blocks (transformers' `GradientCheckpointingLayer`s), outermost first."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [m for m in layers if not any(m is not o and _contains(o, m) for o in layers)]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def enable(model: nn.Module) -> int:
    """Checkpoint every transformer layer of `model` that holds a trainable parameter; returns how many.

    Call it after the trainable parameters are set (the LoRA adapter added). Calling it again is harmless.

    Raises:
        ValueError: the model has no transformers decoder layers to checkpoint, or none of them trains.
    """
    layers = transformer_layers(model)
    if not layers:
        raise ValueError(
            f"`gradient_checkpointing` needs a transformers model whose decoder layers subclass "
            f"GradientCheckpointingLayer; {type(model).__name__} has none. Set gradient_checkpointing=False."
        )
    training = [layer for layer in layers if any(p.requires_grad for p in layer.parameters())]
    if not training:
        raise ValueError(
            "`gradient_checkpointing` is on but no transformer layer has a trainable weight (nothing to save "
            "memory on). Set gradient_checkpointing=False."
        )
    for layer in training:
        if not is_enabled(layer):
            layer.forward = functools.partial(_checkpointed, layer, type(layer).forward)
    return len(training)


def disable(model: nn.Module) -> None:
    """Undo `enable`: every layer runs its plain forward again."""
    for layer in transformer_layers(model):
        if is_enabled(layer):
            del layer.forward


def is_enabled(layer: nn.Module) -> bool:
    """Whether `enable` set this layer's checkpointed forward."""
    forward = vars(layer).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed


def _checkpointed(layer: nn.Module, forward, *args, **kwargs):
    """The layer's forward, checkpointed when autograd records and some input or weight can take a gradient."""
    if not torch.is_grad_enabled():
        return forward(layer, *args, **kwargs)
    for key in _CACHE_KWARGS:
        if kwargs.get(key) is not None:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return checkpoint(forward, layer, *args, use_reentrant=False, **kwargs)
