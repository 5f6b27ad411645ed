"""Data-parallel training: who this process is, how many there are, and the collectives an update needs.

Every function is an exact no-op in one process (it returns its input, untouched), so the single-process path
computes bit for bit what it did before data parallelism existed. Under a launcher (`accelerate launch`,
`torchrun`) each process is one rank of a `torch.distributed` process group; `init_from_env()` joins the group
such a launcher describes (WORLD_SIZE > 1 in the environment), and does nothing otherwise: a group is never
created implicitly outside a launcher. A group created by the caller (or by `accelerate.PartialState()`) is used
as it is. See docs/scaling.md.

A collective that fails (a rank died, or did not arrive within the group's timeout) raises `DistributedError`,
which says so and that the last checkpoint is intact: checkpoints are written atomically, before an update starts.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0  # how long a rank waits for the others at a collective (LLAMAGYM_DIST_TIMEOUT overrides)


class DistributedError(RuntimeError):
    """A collective failed: another rank died, or did not reach it within the process group's timeout."""


def is_distributed() -> bool:
    """Whether this process is one of several ranks of an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's rank, from 0 (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def is_main() -> bool:
    """Whether this is rank 0, the one that writes checkpoints and metrics."""
    return rank() == 0


def init_from_env(backend: str | None = None, timeout_s: float | None = None) -> bool:
    """Join the process group a launcher describes (WORLD_SIZE > 1, RANK, MASTER_ADDR, MASTER_PORT), once.

    Returns whether this process is now one of several ranks. Without WORLD_SIZE > 1 nothing is initialised. The
    backend is nccl when CUDA is available (each rank then uses GPU LOCAL_RANK), else gloo; `timeout_s` (default:
    env LLAMAGYM_DIST_TIMEOUT, else 600 s) bounds how long a collective waits for a dead or stuck rank.
    """
    if dist.is_available() and dist.is_initialized():
        return is_distributed()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_available():
        raise DistributedError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run one process.")
    cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if timeout_s is None:
        timeout_s = float(os.environ.get("LLAMAGYM_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    dist.init_process_group(backend or ("nccl" if cuda else "gloo"), timeout=datetime.timedelta(seconds=timeout_s))
    return True


@contextmanager
def _collective(what: str):
    """Turn a failed collective into a `DistributedError` that says what happened and what to do."""
    try:
        yield
    except DistributedError:
        raise
    except Exception as error:  # gloo/nccl raise RuntimeError or DistBackendError subclasses
        raise DistributedError(
            f"rank {rank()} of {world_size()}: the collective '{what}' failed ({type(error).__name__}: {error}). "
            "Another rank died or did not reach it within the process group's timeout; this update is abandoned "
            "and the last checkpoint is intact. Check the other ranks' logs, then restart every rank with --resume."
        ) from error


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The elementwise sum (or "max", "min") of `tensor` over the ranks, as a new tensor; `tensor` itself in one
    process."""
    if not is_distributed():
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    out = tensor.detach().clone()
    with _collective(f"all_reduce {op}"):
        dist.all_reduce(out, op=ops[op])
    return out


def reduce_number(value: float, op: str = "sum") -> float:
    """A Python number reduced over the ranks (float64); `value` itself in one process."""
    if not is_distributed():
        return value
    return float(all_reduce(torch.tensor([float(value)], dtype=torch.float64, device=_device()), op)[0])


def reduce_dict(values: dict[str, float], op: str = "sum") -> dict[str, float]:
    """Each entry reduced over the ranks in one collective; the same keys on every rank (sorted)."""
    if not is_distributed() or not values:
        return values
    keys = sorted(values)
    reduced = all_reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_device()), op)
    return dict(zip(keys, reduced.tolist(), strict=True))


def all_true(flag: bool) -> bool:
    """Whether `flag` holds on every rank."""
    return reduce_number(float(bool(flag)), "min") > 0.5 if is_distributed() else flag


def all_gather_cat(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(every rank's `tensor` concatenated along dim 0 in rank order, each rank's dim-0 size). The ranks' sizes
    may differ; the other dims must agree. In one process: (`tensor`, [its size])."""
    if not is_distributed():
        return tensor, [tensor.shape[0]]
    with _collective("all_gather sizes"):
        counts = [torch.zeros(1, dtype=torch.long, device=tensor.device) for _ in range(world_size())]
        dist.all_gather(counts, torch.tensor([tensor.shape[0]], device=tensor.device))
    sizes = [int(c) for c in counts]
    padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor.detach()
    parts = [torch.empty_like(padded) for _ in sizes]
    with _collective("all_gather"):
        dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)]), sizes


def all_gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order ([obj] in one process)."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    with _collective("all_gather_object"):
        dist.all_gather_object(out, obj)
    return out


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the parameters' `.grad` over the ranks in place (DDP's all-reduce, as one flat buffer). A parameter with
    a gradient on some rank gets zeros where it had none; one with none anywhere keeps None."""
    if not is_distributed() or not params:
        return
    present = all_reduce(torch.tensor([float(p.grad is not None) for p in params], device=params[0].device), "max")
    live = [p for p, has in zip(params, present.tolist(), strict=True) if has]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not live:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in live])
    with _collective("all_reduce gradients"):
        dist.all_reduce(flat)
    offset = 0
    for p in live:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def broadcast_(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite the tensors in place with rank `src`'s (e.g. freshly initialised weights)."""
    if not is_distributed():
        return
    with torch.no_grad(), _collective("broadcast"):
        for tensor in tensors:
            dist.broadcast(tensor.data, src=src)


def barrier() -> None:
    """Wait until every rank is here."""
    if is_distributed():
        with _collective("barrier"):
            dist.barrier()


def checksum(params: list[torch.Tensor]) -> float:
    """A float64 fingerprint of the parameters' values (sum of |x| weighted by position) for sync checks."""
    total = 0.0
    for i, p in enumerate(params):
        x = p.detach().double().flatten()
        total += float((x * torch.linspace(1.0, 2.0, x.numel(), dtype=torch.float64, device=x.device)).sum()) * (i + 1)
    return total


def assert_in_sync(params: list[torch.Tensor]) -> None:
    """Raise `DistributedError` unless every rank holds bit-identical parameters (a debugging and test check)."""
    if not is_distributed():
        return
    sums = all_gather_objects(checksum(params))
    if len(set(sums)) != 1:
        raise DistributedError(f"the ranks' parameters differ (checksums {sums}): the data-parallel update diverged.")


def _device() -> torch.device:
    """Where this rank's collectives' small tensors live: its GPU under nccl, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
