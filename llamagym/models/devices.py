"""Device and dtype resolution: "auto" picks cuda, then mps, then cpu; names are checked with a clear error.
Also the CPU's speed at the policy's matrix products (`matmul_gflops`), which a time measured here is read beside."""

from __future__ import annotations

import time

import torch

from .host_memory import bound_onednn_cache

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


def matmul_gflops(precision: str = "auto", size: int = 1024, repeats: int = 5) -> float:
    """This CPU's speed at what a policy computes: GFLOP/s of a `size`-cubed matrix product in the precision the
    policy runs in here (`precision`, resolved as `Agent(precision=...)` resolves it), on torch's threads; the median
    of `repeats` products after one untimed.

    Why: an update is bound by its matrix products (docs/learning-that-holds.md), and one CPU model name covers
    machines far apart (a 2048-cube fp32 product ran at 36 GFLOP/s on an "AMD EPYC" of CPU family 23, 70-97 on ones
    of family 25; this function's 1024-cube one at 43 on the first), so a time or a learning curve measured on a CPU
    is read beside this figure. It takes about 0.1-0.5 s at the default size. Run it in the process that trains, not in
    a parent that forks them (multiprocessing's "fork"): its threads would hang the forked child in OpenMP. In bf16 it
    first bounds oneDNN's primitive cache as a policy would (`host_memory.bound_onednn_cache`): oneDNN reads the bound
    at the process's first bf16 product, and a later policy's could not take effect.

    Raises:
        ValueError: `size` or `repeats` is not an integer >= 1, or `precision` is not one of "auto", "fp32", "bf16".
    """
    for name, value in (("size", size), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` should be an integer >= 1. Received {value!r}.")
    dtype = torch.bfloat16 if resolve_precision(precision, torch.device("cpu")) == "bf16" else torch.float32
    if dtype == torch.bfloat16:  # oneDNN reads its cache's bound at its first product: a policy built later can't
        bound_onednn_cache()
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    seconds = []
    for k in range(repeats + 1):
        start = time.perf_counter()
        torch.mm(a, b)
        if k:  # the first product warms the kernels and caches up
            seconds.append(time.perf_counter() - start)
    seconds.sort()
    return 2 * size**3 / max(seconds[len(seconds) // 2], 1e-9) / 1e9
