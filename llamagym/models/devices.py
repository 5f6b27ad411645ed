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


PRECISIONS = ("auto", "fp32", "bf16")


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix maths is native here: CUDA with bf16, or a CPU with AVX512-BF16 or AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
        return bool((check is not None and check()) or (amx is not None and amx()))
    return False


def resolve_precision(precision: str, device: torch.device) -> str:
    """ "auto" -> "bf16" where bf16 is native on `device` (1.5-2.5x faster on such CPUs), else "fp32"."""
    if precision not in PRECISIONS:
        raise ValueError(f"`precision` should be one of {', '.join(PRECISIONS)}. Received {precision!r}.")
    if precision == "auto":
        return "bf16" if fast_bf16(device) else "fp32"
    if precision == "bf16" and device.type == "mps":
        raise ValueError("`precision`='bf16' is not supported on MPS. Use 'fp32' or 'auto'.")
    return precision


def cpu_precision_note() -> str:
    """The precision the policy runs in on this CPU by default (`precision="auto"`) and why: CPUs sold under one
    model name differ here (an AMD EPYC with AVX512-BF16 runs bf16, one with AVX2 only runs fp32, about 2.7x slower
    per update), so a time measured on a CPU is read beside this."""
    if resolve_precision("auto", torch.device("cpu")) == "bf16":
        return "policy in bf16 (native here: AVX512-BF16 or AMX)"
    return "policy in fp32 (no native bf16 here: no AVX512-BF16 or AMX)"
