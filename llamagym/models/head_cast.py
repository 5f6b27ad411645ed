"""The LM head's bf16 weight, cast once instead of on every forward under bf16 autocast.

Autocast keeps the casts it makes only of weights that require grad; a frozen weight is cast again on every call.
The LM head of a small model is the largest frozen matrix it has (SmolLM2-135M: 49152 x 576, a fifth of the
model), and a decoding step multiplies it by one row per reply: on a 2-core CPU with AVX512-BF16 the cast took
most of the head's time (16 rows: 26 ms against 5.6 ms with the weight already in bf16), and with the cast kept
sampled acting ran 1.37x faster (`benchmarks/head_cast.py`). Kept, the bf16 copy gives exactly the numbers autocast's
cast gives (the same rounding of the same weight) and costs its memory once (56 MB there), where autocast allocated
it at every call. Only the head: keeping the casts of every other frozen linear layer too, during a `generate` call
only (their bf16 copies, 212 MB there, given back after it), made sampled acting 1.02x faster on that CPU (their
matrices are small and the products' own time dominates), not worth the memory.
"""

from __future__ import annotations

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
