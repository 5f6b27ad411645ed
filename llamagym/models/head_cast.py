"""Frozen weights' bf16 casts, kept instead of made again on every forward under bf16 autocast.

Autocast keeps the casts it makes only of weights that require grad; a frozen weight is cast again on every call.
Kept, a bf16 copy gives exactly the numbers autocast's cast gives (the same rounding of the same weight) and costs
its memory once where autocast allocated it at every call. Two uses:
- The LM head, kept for the policy's life (`keep_head_cast`): a small model's largest frozen matrix (SmolLM2-135M:
  49152 x 576, a fifth of the model), multiplied by one row per reply at every decoding step. On a 2-core CPU with
  AVX512-BF16 the cast took most of the head's time (16 rows: 26 ms against 5.6 ms with the weight already in bf16),
  and with it kept sampled acting ran 1.37x faster (`benchmarks/head_cast.py`, AMD Zen 4).
- Every other frozen linear layer, kept for one `generate` call and given back after it (`casts_kept`; 212 MB on
  SmolLM2-135M). Where bf16 products are fast their casts are most of a decoding step: sampled acting ran 1.33x faster
  on an Intel Xeon with AMX (`--casts frozen`, sixty-seventh session), 1.02x on Zen 4, whose half-width bf16 units
  leave the products' own time dominant. An update, not acting, sets a run's peak memory: on that Xeon a
  guess-the-number run's generate calls peaked at 2.01 GiB with the copies, its updates at 2.50.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class KeptCast:
    """`module`'s forward, with its frozen fp32 weight cast to bf16 once while bf16 autocast is on.

    The copy is made again when the weight changes (a load, `Tensor.copy_`: its version moves). Off autocast, or
    for a weight that trains (autocast keeps that cast itself) or is not fp32, the module's own forward runs.
    """

    def __init__(self, module: nn.Linear):
        self.module, self.forward = module, module.forward
        self.key: tuple | None = None
        self.weight: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module.weight
        device = x.device.type
        if (
            weight.requires_grad
            or weight.dtype != torch.float32
            or not torch.is_autocast_enabled(device)
            or torch.get_autocast_dtype(device) != torch.bfloat16
        ):
            return self.forward(x)
        key = (weight.data_ptr(), weight._version, weight.device)
        if key != self.key:  # the old copy goes first: never two at once (an FSDP unit's weight moves each forward)
            self.weight = None
            self.weight, self.key = weight.detach().to(torch.bfloat16), key
        return F.linear(x, self.weight, self.module.bias)  # autocast casts x (and a bias) as it would have


def keep_head_cast(model: nn.Module) -> KeptCast | None:
    """Give `model`'s output embedding (a plain `nn.Linear`) a `KeptCast` forward; returns it, or None when the
    head is something else (left as it is)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return None
    if isinstance(head.forward, KeptCast):
        return head.forward
    head.forward = KeptCast(head)
    return head.forward


@contextmanager
def casts_kept(model: nn.Module) -> Iterator[None]:
    """Inside, every frozen plain `nn.Linear` of `model` keeps its bf16 cast under bf16 autocast (`KeptCast`); on exit
    their own forwards come back and the copies go. Layers that already keep theirs (the head) are left alone."""
    kept = [
        m
        for m in model.modules()
        if type(m) is nn.Linear and not m.weight.requires_grad and not isinstance(m.forward, KeptCast)
    ]
    own = [m.__dict__.get("forward") for m in kept]  # an instance forward set by someone else (a hook) goes back too
    for module in kept:
        module.forward = KeptCast(module)
    try:
        yield
    finally:
        for module, forward in zip(kept, own, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
