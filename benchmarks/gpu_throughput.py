"""Env steps/s, PPO update samples/s and peak memory on a chosen device and model: the CPU -> GPU comparison.

The same Blackjack agents, rollout steps and update timing as `rollout_throughput.py` (imported from it), on
`--device cpu|cuda` and any registry model; `--model random:NAME` builds a 1-2B registry architecture with random
weights from a hard-coded config (`llamagym.models.random_weights`: no download; timing only). Peak memory is GPU
memory on CUDA (`torch.cuda.max_memory_allocated`, reset before each row) and this process's peak RSS on a CPU.
Compare a GPU's rows with the same command's rows on a CPU (ratios, as the issue's targets are).

Quick check:  python benchmarks/gpu_throughput.py --quick --model tiny-random --device cpu
On a GPU:     python benchmarks/gpu_throughput.py --device cuda                          (embedded SmolLM2-135M)
              python benchmarks/gpu_throughput.py --device cuda --model random:qwen2-1.5b-instruct
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from rollout_throughput import (
    ScoringBlackjackAgent,
    ShortPromptAgent,
    make_agent,
    print_table,
    rss_gib,
    run_envs,
    take_turns,
    time_update,
)

from llamagym import load_model_and_tokenizer
from llamagym.models.devices import resolve_device
from llamagym.models.random_weights import random_model


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny settings to check the script works")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name, or random:NAME (random weights)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads on a CPU")
    p.add_argument("--envs", type=int, nargs="+", default=[16, 64], help="envs stepped at once (one row each)")
    p.add_argument("--iters", type=int, default=4, help="timed batched steps per row")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=32, help="reply length of the generate rows")
    p.add_argument("--ppo-turns", type=int, default=64, help="turns in each timed PPO update")
    p.add_argument("--lora-layers", type=int, default=8, help="adapted top layers (0 = all)")
    p.add_argument("--gradient-checkpointing", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/gpu_throughput.json")
    args = p.parse_args()
    if args.quick:
        args.envs, args.iters, args.ppo_turns, args.max_new_tokens = [4], 2, 8, 8
    return args


def load(args, device):
    if args.model.startswith("random:"):
        name = args.model.split(":", 1)[1]
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the registry's per-device dtype
        return random_model(name, device=device, dtype=dtype, seed=args.seed)
    return load_model_and_tokenizer(args.model, device=device)


def peak_memory_gib(device) -> float:
    """GPU memory allocated at its peak since the last reset (CUDA), else this process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return rss_gib()[1]


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    start = time.perf_counter()
    model, tokenizer = load(args, device)
    load_s = time.perf_counter() - start
    checkpointed = {"auto": "auto", "on": True, "off": False}[args.gradient_checkpointing]
    layers = min(args.lora_layers, model.config.get_text_config().num_hidden_layers) or None  # 0: every layer
    settings = {"context_turns": 0, "lora_layers": layers, "gradient_checkpointing": checkpointed}
    rollouts, updates, shared = [], [], None
    for mode, cls in (("score", ScoringBlackjackAgent), ("generate", ShortPromptAgent)):
        agent = None
        for n in args.envs:  # one agent per N (each holds N conversations), all on one peft model
            agent = make_agent(
                cls, shared or model, tokenizer, args, precision=args.precision, action_mode=mode, **settings
            )
            shared = agent.policy.model
            reset_peak(device)
            seconds = run_envs(agent, n, args.iters, args)
            median = sorted(seconds)[len(seconds) // 2]
            rollouts.append(
                {"mode": mode, "n_envs": n, "precision": agent.policy.precision, "env_steps": n * len(seconds)}
                | {"median_step_s": median, "env_steps_per_s": n / median, "peak_mem_gib": peak_memory_gib(device)}
            )
        reset_peak(device)
        row = time_update(f"{mode}, from N={args.envs[-1]}", agent, take_turns(agent.batch, args.ppo_turns))
        row.pop("peak_rss_gib")
        updates.append(
            row | {"checkpointing": agent.policy.gradient_checkpointing, "peak_mem_gib": peak_memory_gib(device)}
        )

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"\nllamagym throughput: {args.model} ({params:.2f}B parameters) on {device} ({name})")
    print(f"model load {load_s:.1f} s")
    print(f"{args.threads} torch threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    if args.model.startswith("random:"):
        print("random weights, byte-level tokenizer (prompts longer than the real tokenizer's): timing only")
    if args.quick:
        print("QUICK MODE: tiny settings to check that the script works; these numbers are not the benchmark.")
    memory = "GPU max_memory_allocated" if device.type == "cuda" else "process peak RSS (since start)"
    print_table(f"rollout: env_steps_per_s = N / median seconds of one batched step; peak_mem_gib = {memory}", rollouts)
    print_table("PPO update: samples_per_s = turns / seconds of one trainer.step", updates)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    config = vars(args) | {"device_name": name, "torch": torch.__version__, "load_s": load_s, "params_b": params}
    output.write_text(json.dumps({"config": config, "rollout": rollouts, "ppo_update": updates}, indent=2))
    print(f"\nwrote {output}")


if __name__ == "__main__":
    main()
