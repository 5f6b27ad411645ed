"""A training loop's time per batch, acting and updating apart, of this checkout against another, side by side.

Each side runs in its own process with its tree first on PYTHONPATH: the learning suite's loop (`--game`, `--mode`
(scoring by default), 16 envs, the embedded model, the library's defaults, seed `--seed`, `--precision` as the
agent's) until `--updates` updates are done, and prints the seconds spent acting (everything in the loop but
`trainer.step`) and updating (`time/update_s`) for each batch. In fp32 (a CPU without native bf16, or `--precision
fp32`) both sides compute the same numbers to the last bits (or to rounding, for a change that reorders sums) and
play the same batches (check the printed batch returns), so the times compare like for like. The sides alternate
`--rounds` times, so drift of the machine falls on both; the figures are the ratios of the mean times per batch.

    git worktree add /tmp/old <commit>   # or: git archive <commit> | tar -x -C /tmp/old
    python benchmarks/loop_speed.py --against /tmp/old --game guess_number
    python benchmarks/loop_speed.py --against /tmp/old --game guess_number --mode generate --updates 2
    python benchmarks/loop_speed.py --against /tmp/old --mode generate --precision fp32   # an fp32 CPU's path
"""

import json
import time
from pathlib import Path

from side_by_side import ROOT, cpu_line, parse, parser, run_side  # beside this file


def measure(game_name: str, mode: str, seed: int, updates: int, threads: int, precision: str) -> None:
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
    config = PPOConfig(seed=seed)
    agent = make_agent(game, model, tokenizer, envs[0].action_space, mode, config, precision=precision)
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
    arguments = ["--game", args.game, "--mode", args.mode, "--seed", str(args.seed), "--updates", str(args.updates)]
    arguments += ["--precision", args.precision]
    return json.loads(run_side(__file__, tree, [*arguments, "--threads", str(args.threads)], "RESULT"))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--game", default="guess_number", help="a suite game (llamagym.envs.suite)")
    p.add_argument("--mode", default="score", choices=["score", "generate"], help="the agent's action mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--updates", type=int, default=6, help="updates (batches) per run")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"], help="the policy's (Agent)")
    args = parse(p)
    if args.child:
        return measure(args.game, args.mode, args.seed, args.updates, args.threads, args.precision)
    print(cpu_line(args.threads))
    print(f"{args.game}, {args.mode} mode, seed {args.seed}, precision {args.precision}, {args.updates} batches a run;")
    print("seconds per batch:")
    print("acting | updating")
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
