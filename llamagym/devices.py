"""Device and dtype resolution: "auto" picks cuda, then mps, then cpu; names are checked with a clear error."""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """Turn "auto" / "cpu" / "cuda[:N]" / "mps" into a `torch.device` that exists on this machine.

    Raises:
        ValueError: the name is not a device, or names an accelerator this machine does not have.
    """
    if isinstance(device, torch.device):
        return device
    name = "auto" if device is None else str(device).strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    kind = name.split(":")[0]
    if kind not in DEVICE_CHOICES:
        raise ValueError(f"`device` should be one of {', '.join(DEVICE_CHOICES)} (or cuda:N). Received {device!r}.")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"`device` {device!r} was requested but CUDA is not available on this machine "
            f"(torch {torch.__version__}). Use --device cpu or --device auto."
        )
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"`device` {device!r} was requested but MPS is not available. Use --device cpu or auto.")
    return torch.device(name)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map "float32" / "bf16" / a torch dtype to a torch dtype, with a clear error for anything else."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"`dtype` should be one of {', '.join(DTYPES)}. Received {dtype!r}.") from None
