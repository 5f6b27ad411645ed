"""What `update_speed.py` and `loop_speed.py` share: this checkout against another, each side in its own process
with its tree first on PYTHONPATH, on one CPU."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parser(description: str) -> argparse.ArgumentParser:
    """The options both benchmarks take (`--against`, `--rounds`, `--threads`; `--child` runs one side)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", type=Path, help="the other checkout's root (holding llamagym/)")
    p.add_argument("--rounds", type=int, default=2, help="times each side runs, alternating")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments; outside a child, `--against` must name a checkout."""
    args = p.parse_args()
    if not args.child and (args.against is None or not (args.against / "llamagym").is_dir()):
        p.error("--against should name another checkout's root, the folder that holds its llamagym/.")
    return args


def run_side(script: str, tree: Path, arguments: list[str], tag: str) -> str:
    """Run `script --child arguments` with `tree` first on PYTHONPATH; the rest of its output line starting `tag`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, script, "--child", *arguments], env=env, capture_output=True, text=True, check=True
    )
    line = next(line for line in out.stdout.splitlines() if line.startswith(tag))
    return line[len(tag) :].strip()


def cpu_line(threads: int) -> str:
    """The CPU the sides ran on, the precision its policy runs in, and its speed at the policy's matrix products on
    `threads` threads (measured here in the parent: the sides are `subprocess` children, fork + exec, which its
    OpenMP threads do not reach)."""
    import torch
    from learning_suite import cpu_model  # beside this file

    from llamagym.models.devices import cpu_precision_note, matmul_gflops

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        speed = f"{matmul_gflops():.0f} GFLOP/s at the policy's matrix products"
    finally:
        torch.set_num_threads(before)
    return f"CPU: {cpu_model()}, {os.cpu_count()} cores, {threads} torch threads, {cpu_precision_note()}, {speed}"
