"""FSDP for the frozen base model: its weights are sharded over the ranks, the adapter and value head stay whole.

With LoRA, almost every weight is frozen: the base model is what fills a GPU, while the adapter is small. So
llamagym shards only the frozen weights, with torch's FSDP2 (`fully_shard`, one unit per transformer layer, one for
the rest of the decoder, one for an untied LM head): each rank holds 1/N of them and gathers a layer's weights just
before it runs. The trainable weights (LoRA, the value head) are FSDP's `ignored_params`: whole on every rank, so
the trainer's own data-parallel reductions (`llamagym.distributed`: gradients, natural-gradient rows, the trust
region, the value refit) work on them exactly as without FSDP. A tied LM head (its weight is the input embedding)
stays whole too, since the trainer calls the head outside the decoder.

`accelerate launch --config_file examples/accelerate/fsdp.yaml` asks for it (ACCELERATE_USE_FSDP in the
environment): `Agent` then calls `shard_frozen_weights`. A model whose *trainable* weights someone else sharded
(FSDP1's wrapper, or `fully_shard` without ignoring them) cannot be trained by this trainer: `check` says so.
"""

from __future__ import annotations

import os

from torch import nn

from .. import distributed
from .checkpointing import transformer_layers

_TRUE = ("1", "true", "yes")


def fsdp_requested() -> bool:
    """Whether the launcher asked for FSDP (`accelerate launch` with `distributed_type: FSDP` sets this)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in _TRUE


def fsdp_activation_checkpointing() -> bool:
    """Whether the launcher's FSDP config has `fsdp_activation_checkpointing: true`."""
    return fsdp_requested() and os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "").lower() in _TRUE


def shard_from_env(policy: nn.Module) -> bool:
    """Shard the policy's frozen weights when the launcher asked for FSDP; returns whether it did.

    Raises:
        ValueError: the accelerate FSDP settings ask for something this path does not do (FSDP1, CPU offload).
    """
    if not fsdp_requested():
        return False
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ValueError(
            f"llamagym shards the frozen base weights with FSDP2; the accelerate config asks for fsdp_version "
            f"{version}. Set `fsdp_version: 2` (see examples/accelerate/fsdp.yaml)."
        )
    if os.environ.get("FSDP_OFFLOAD_PARAMS", "").lower() in _TRUE:
        raise ValueError("`fsdp_offload_params: true` is not supported by llamagym; set it to false.")
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() in _TRUE
    shard_frozen_weights(policy, reshard_after_forward=reshard)
    return True


def shard_frozen_weights(policy: nn.Module, reshard_after_forward: bool = True) -> int:
    """Shard the frozen weights of `policy` (a `Policy`) over every rank with FSDP2; returns the FSDP units made.

    Call it once, after the adapter is added and before the trainer is created (`Agent` does).

    Raises:
        ValueError: not several ranks, a fully fine-tuned policy (every weight trains), or no transformer layers.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not distributed.is_distributed():
        raise ValueError("FSDP needs several ranks: start the script with `accelerate launch` or torchrun.")
    if getattr(policy, "full_finetune", False):
        raise ValueError(
            "FSDP in llamagym shards the frozen base weights of a LoRA policy; with full_finetune every weight trains. "
            "Use LoRA (full_finetune=False), or plain data parallelism (a multi-GPU accelerate config)."
        )
    lm = policy.causal_lm()
    decoder, head = lm.get_decoder(), lm.get_output_embeddings()
    layers = transformer_layers(decoder)
    if not layers:
        raise ValueError(f"FSDP: {type(decoder).__name__} has no transformer layers to shard one by one.")
    device = next(decoder.parameters()).device
    mesh = init_device_mesh(device.type, (distributed.world_size(),))
    keep = {p for p in policy.parameters() if p.requires_grad}
    tied = head is not None and head.weight is decoder.get_input_embeddings().weight
    if tied:
        keep.add(head.weight)
    units = [*layers, decoder] + ([head] if head is not None and not tied else [])
    for module in units:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            ignored_params={p for p in module.parameters() if p in keep},
        )
    # every forward is now a collective, so each must run on every rank: no skipping layers through cached states
    policy.sharded, policy.frozen_cache = True, None
    return len(units)


def check(policy: nn.Module) -> None:
    """Raise a clear `ValueError` when the policy's trainable weights are sharded (FSDP1, or FSDP2 on them)."""
    from torch.distributed.tensor import DTensor

    wrapped = [type(m).__name__ for m in policy.modules() if type(m).__name__ == "FullyShardedDataParallel"]
    sharded = [tuple(p.shape) for p in policy.parameters() if p.requires_grad and isinstance(p, DTensor)]
    if wrapped or sharded:
        raise ValueError(
            "The policy's trainable weights are sharded by FSDP (FSDP1's wrapper, or fully_shard without "
            "ignoring them); llamagym's trainer reduces them itself and needs them whole on every rank. Do not wrap "
            "the model yourself: launch with examples/accelerate/fsdp.yaml (fsdp_version 2), and llamagym shards "
            "only the frozen base weights, or use plain data parallelism (examples/accelerate/multi_gpu.yaml)."
        )


def sharded_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of parameters this rank holds, bytes of the whole parameters): the memory FSDP saves."""
    held = total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held += local.numel() * local.element_size()
        total += p.numel() * p.element_size()
    return held, total
