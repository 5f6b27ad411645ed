"""The per-update cost of the data-parallel reductions, as a share of the update's time (2 gloo ranks on a CPU).

Two ranks (1 torch thread each) update the same tiny-architecture policy on their halves of a batch; every function
of `llamagym.distributed` that the trainer calls is timed (outermost call only, so a reduction made of others counts
once). Before each one a barrier first waits for the other rank, timed apart: the printed ratio is (seconds inside
the collectives, after that wait) / (seconds of `trainer.step`), per update, for the default scored path
(natural-gradient steps, trust region, value refit) and a generate-mode AdamW path; the wait (the ranks' imbalance,
and on a shared CPU the scheduler) is printed beside it.

    python benchmarks/reduction_cost.py --updates 5 --hidden 256
"""

import argparse
import datetime
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
TIMED = ("all_reduce", "all_gather_cat", "all_gather_objects", "all_reduce_grads", "broadcast_", "barrier")
TIMED += ("reduce_number", "reduce_dict", "all_true")


def timed_collectives(module, spent: list[float]) -> None:
    """Wrap the module's collectives: before each outermost call a barrier waits for the other rank (its seconds
    added to spent[1]), then the call's own seconds are added to spent[0]."""
    depth = [0]

    def wrap(fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if depth[0] == 0 and module.is_distributed():
                start = time.perf_counter()
                dist.barrier()
                spent[1] += time.perf_counter() - start
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - start

        return timed

    for name in TIMED:
        setattr(module, name, wrap(getattr(module, name)))


def worker(rank: int, init_file: str, out_dir: str, args) -> None:
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    from peft import LoraConfig

    from llamagym import distributed
    from llamagym.algos.trainer import PPOTrainer
    from llamagym.config import PPOConfig
    from llamagym.models.policy import Policy
    from llamagym.models.tiny_random import build_tiny_model, build_tiny_tokenizer
    from tests.test_update_pinned import episodes

    spent = [0.0, 0.0]  # seconds in collectives, seconds waiting for the other rank before them
    timed_collectives(distributed, spent)
    tokenizer = build_tiny_tokenizer()
    rows = {}
    for name, scored, options in (
        ("score-natural", True, {}),
        ("generate-adamw", False, {"mini_batch_size": 1000}),
    ):
        torch.manual_seed(0)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], bias="none", lora_dropout=0.0)
        model = build_tiny_model(tokenizer, seed=0, hidden_size=args.hidden)
        trainer = PPOTrainer(
            Policy(model, lora, precision="fp32"), PPOConfig(seed=0, **options), tokenizer.pad_token_id
        )
        ratios, waits, update_s = [], [], []
        for update in range(args.warmup + args.updates):
            batch = episodes(scored, seed=update)
            batch = batch[:6] if rank == 0 else batch[6:]
            spent[:] = [0.0, 0.0]
            stats = trainer.step(batch)
            if update >= args.warmup:
                ratios.append(spent[0] / stats["time/update_s"])
                waits.append(spent[1] / stats["time/update_s"])
                update_s.append(stats["time/update_s"])
        rows[name] = {"ratio_median": statistics.median(ratios), "ratio_max": max(ratios), "update_s": update_s}
        rows[name] |= {"ratios": ratios, "wait_median": statistics.median(waits)}
    if rank == 0:
        torch.save(rows, os.path.join(out_dir, "rows.pt"))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=5, help="timed updates per path")
    p.add_argument("--warmup", type=int, default=1, help="untimed updates first")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the 2-layer random Llama")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(os.path.join(out, "rendezvous"), out, args), nprocs=2, join=True)
        rows = torch.load(os.path.join(out, "rows.pt"))
    print(
        f"\nreductions / update time, 2 gloo ranks x 1 thread, 2-layer Llama hidden {args.hidden}, 12 episodes/update"
    )
    for name, row in rows.items():
        update = statistics.median(row["update_s"])
        print(
            f"{name:16s} median {row['ratio_median']:.1%} (max {row['ratio_max']:.1%}) of a {update * 1000:.0f} ms "
            f"update (waiting for the other rank: {row['wait_median']:.1%}); per update: "
            f"{', '.join(f'{r:.1%}' for r in row['ratios'])}"
        )


if __name__ == "__main__":
    main()
