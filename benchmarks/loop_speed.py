"""A training loop's time per batch, acting and updating apart, of this checkout against another, side by side.

Each side runs in its own process with its tree first on PYTHONPATH: the learning suite's loop (`--game`, scoring
mode, 16 envs, the embedded model, the library's defaults, seed `--seed`) until `--updates` updates are done, and
prints the seconds spent acting (everything in the loop but `trainer.step`) and updating (`time/update_s`) for
each batch. On a CPU that runs fp32 both sides compute the same numbers to the last bits and play the same batches
(check the printed batch returns), so the times compare like for like. The sides alternate `--rounds` times, so
drift of the machine falls on both; the figures are the ratios of the mean times per batch.

    git worktree add /tmp/old <commit>   # or: git archive <commit> | tar -x -C /tmp/old
    python benchmarks/loop_speed.py --against /tmp/old --game guess_number
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(game_name: str, seed: int, updates: int, threads: int) -> None:
    """One side: the loop until `updates` updates; prints one JSON line of per-batch seconds and returns."""
    import random

    import gymnasium as gym
    import numpy as np
    import torch
    from learning_suite import make_agent, play_step  # beside this file

    import llamagym.envs as suite
    from llamagym import PPOConfig, load_model_and_tokenizer

    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    game = suite.get_game(game_name)
    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct", device="cpu")
    envs = [gym.make(game.env_id) for _ in range(16)]
    agent = make_agent(game, model, tokenizer, envs[0].action_space, "score", PPOConfig(seed=seed))
    seeds = iter(range(seed * 1_000_003, 2**62))  # one fresh seed per episode, in the order episodes start

    def reset(i: int):
        return envs[i].reset(seed=next(seeds))[0]

    observations = [reset(i) for i in range(len(envs))]
    acting, updating, returns = [], [], []
    loop = 0.0
    while len(updating) < updates:
        start = time.perf_counter()
        stats, _ = play_step(agent, envs, observations, reset)
        loop += time.perf_counter() - start
        if "ppo/policy_loss" in stats:
            updating.append(stats["time/update_s"])
            acting.append(loop - stats["time/update_s"])
            returns.append(stats["env/batch_return"])
            loop = 0.0
    print("RESULT", json.dumps({"acting": acting, "updating": updating, "returns": returns}), flush=True)


def side(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, __file__, "--child", "--game", args.game, "--seed", str(args.seed)]
    cmd += ["--updates", str(args.updates), "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line.split(" ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, help="the other checkout's root (holding llamagym/)")
    parser.add_argument("--game", default="guess_number", help="a suite game (llamagym.envs.suite)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="times each side runs, alternating")
    parser.add_argument("--updates", type=int, default=6, help="updates (batches) per run")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return measure(args.game, args.seed, args.updates, args.threads)
    if args.against is None or not (args.against / "llamagym").is_dir():
        parser.error("--against should name another checkout's root, the folder that holds its llamagym/.")
    from learning_suite import cpu_model  # beside this file

    from llamagym.models.devices import cpu_precision_note

    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, {args.threads} torch threads, {cpu_precision_note()}")
    print(f"{args.game}, seed {args.seed}, {args.updates} batches per run; seconds per batch, acting | updating")
    times = {name: {"acting": [], "updating": []} for name in ("this", "other")}
    for _ in range(args.rounds):
        for name, tree in (("other", args.against), ("this", ROOT)):
            result = side(tree, args)
            for key in ("acting", "updating"):
                times[name][key] += result[key]
            acting, updating = (" ".join(f"{s:.2f}" for s in result[key]) for key in ("acting", "updating"))
            print(f"{name:>5} ({tree}): acting {acting} | updating {updating}")
            print(f"{'':>5} batch returns {' '.join(f'{r:.4f}' for r in result['returns'])}")
    mean = {name: {key: sum(v) / len(v) for key, v in part.items()} for name, part in times.items()}
    for key in ("acting", "updating"):
        this, other = mean["this"][key], mean["other"][key]
        print(f"mean {key}: this {this:.2f} s, other {other:.2f} s; this / other = {this / other:.3f}")
    this, other = (sum(mean[name].values()) for name in ("this", "other"))
    print(f"mean batch (acting + updating): this {this:.2f} s, other {other:.2f} s; this / other = {this / other:.3f}")


if __name__ == "__main__":
    main()
