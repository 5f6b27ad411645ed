"""PPO update speed of this checkout against another one, measured side by side (a refactor must not slow it).

Each side runs in its own process with its tree first on PYTHONPATH: it plays Blackjack with the embedded model in
scoring mode until a default batch is collected (32 episodes and at least `PPOConfig().min_batch_turns` turns: about
140; the same episodes on both sides: acting is seeded), then times `trainer.step` on copies of them (`--warmup`
untimed, `--updates` timed). Before each update the batch's inputs are scored with the current weights, untimed, as
acting scores them in a training loop, and a checkout whose update takes the old outputs from acting (`trainer.step(...,
acted=)`, 493dd44 and later) is given them: an upper bound on what that saves, since in a loop the turns acted before
the last update are run again. The sides alternate `--rounds` times, so drift of the machine falls on both; the figure
is the ratio of the mean update times.

    git worktree add /tmp/old <commit>   # or: git archive <commit> | tar -x -C /tmp/old
    python benchmarks/update_speed.py --against /tmp/old
"""

import copy
import inspect
import time
from pathlib import Path

from side_by_side import ROOT, cpu_line, parse, parser, run_side  # beside this file


def measure(updates: int, warmup: int, threads: int) -> None:
    """One side: collect a default batch of scored Blackjack episodes, time the updates, print one line of seconds."""
    import gymnasium as gym
    import numpy as np
    import torch
    from learning_suite import make_agent, play_step  # beside this file

    import llamagym.envs as suite
    from llamagym import PPOConfig, load_model_and_tokenizer
    from llamagym.algos.modes import MODES

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    np.random.seed(0)
    game = suite.get_game("blackjack")
    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct", device="cpu")
    envs = [gym.make(game.env_id) for _ in range(16)]
    never = PPOConfig(seed=0, batch_size=10**6)  # never trains while collecting
    agent = make_agent(game, model, tokenizer, envs[0].action_space, "score", never)
    seeds = iter(range(2**62))  # one fresh seed per episode, in the order episodes start

    def reset(i: int):
        return envs[i].reset(seed=next(seeds))[0]

    observations = [reset(i) for i in range(len(envs))]
    least = getattr(PPOConfig(), "min_batch_turns", 0)  # a checkout older than batches counted in turns: 0

    def collected() -> int:
        return sum(len(episode.turns) for episode in agent.batch)

    while len(agent.batch) < 32 or collected() < least:
        play_step(agent, envs, observations, reset)
    episodes = list(agent.batch)
    turns = [turn for episode in episodes for turn in episode.turns]
    recalls = "acted" in inspect.signature(agent.trainer.step).parameters
    seconds = []
    for k in range(warmup + updates):
        # what acting computes for these inputs with the current weights (untimed; greedy: no random draws)
        MODES["score"].choose(agent.actor, [t.prompt_ids for t in turns], [t.candidates for t in turns], greedy=True)
        start = time.perf_counter()
        agent.trainer.step(copy.deepcopy(episodes), **({"acted": agent.actor.memory} if recalls else {}))
        if k >= warmup:
            seconds.append(time.perf_counter() - start)
    print("SECONDS", sum(len(e.turns) for e in episodes), *seconds, flush=True)


def side(tree: Path, args) -> tuple[int, list[float]]:
    arguments = ["--updates", str(args.updates), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    turns, *seconds = run_side(__file__, tree, arguments, "SECONDS").split()
    return int(turns), [float(s) for s in seconds]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--updates", type=int, default=5, help="timed updates per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed updates per run first")
    args = parse(p)
    if args.child:
        return measure(args.updates, args.warmup, args.threads)
    print(cpu_line(args.threads))
    times = {"this": [], "other": []}
    for _ in range(args.rounds):
        for name, tree in (("other", args.against), ("this", ROOT)):
            turns, seconds = side(tree, args)
            times[name] += seconds
            print(f"{name:>5} ({tree}): {turns} turns, update seconds {' '.join(f'{s:.2f}' for s in seconds)}")
    this, other = (sum(times[k]) / len(times[k]) for k in ("this", "other"))
    print(f"mean update: this {this:.2f} s, other {other:.2f} s; this / other = {this / other:.3f}")


if __name__ == "__main__":
    main()
