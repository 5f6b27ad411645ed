"""Generate mode's acting with the prompts prefilled once each (`Policy.prefill`) against every prompt run whole.

For each game, 16 envs play a few sampled steps to collect the prompts acting meets (the first state's, then a mix),
and the mode's `choose` runs on each batch of prompts with `reuse_prefix` on and off, alternating, sampled (seeded
alike, so both decode the same replies) and greedy. It prints the median seconds per call, the ratio between the
two, and the prompts' tokens against those left to run. Compare the ratios of one run (see README.md).

Quick check (tiny model, seconds):  python benchmarks/generate_prefill.py --quick
Full benchmark (quiet machine):     python benchmarks/generate_prefill.py
"""

import argparse
import statistics
import time

import gymnasium as gym
import torch
from learning_suite import cpu_model  # beside this file

from llamagym import load_model_and_tokenizer
from llamagym.algos.modes import MODES
from llamagym.envs import suite
from llamagym.models.prefill import shared_prefix


def acting_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """`parser`'s arguments, with the flags of a benchmark that times acting on prompt batches (`prompt_batches`)."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="prompt batches per game (one per env step)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per batch, mode and setting")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny random model, 1 step, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.model, args.steps, args.repeats = "tiny-random", 1, 1
    return args


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", default="guess_number,tictactoe", help="comma-separated suite games")
    return acting_args(parser)


def prompt_batches(game, model, tokenizer, args) -> tuple:
    """The agent's actor and the prompt batches its first sampled steps met."""
    envs = [gym.make(game.env_id) for _ in range(args.envs)]
    agent = game.agent_for()(
        model, tokenizer, action_space=envs[0].action_space, action_mode="generate", **game.agent_kwargs
    )
    observations = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
    mode, batches, original = MODES["generate"], [], MODES["generate"].choose

    def recording(actor, prompts, candidates=None, greedy=False):
        batches.append([list(p) for p in prompts])
        return original(actor, prompts, candidates, greedy)

    mode.choose = recording  # an instance attribute: the class's method is untouched
    try:
        for _ in range(args.steps):
            actions = agent.act_batch(observations)
            for i, (env, action) in enumerate(zip(envs, actions, strict=True)):
                observation, _, terminated, truncated, _ = env.step(action)
                observations[i] = env.reset()[0] if terminated or truncated else observation
            agent.assign_rewards([0.0] * len(envs))
            agent.end_episodes([False] * len(envs))
    finally:
        del mode.choose
    return agent.actor, batches


def timed(actor, prompts, reuse: bool, greedy: bool) -> float:
    actor.reuse_prefix = reuse
    torch.manual_seed(0)  # both settings sample alike, so they decode replies of the same lengths
    start = time.perf_counter()
    MODES["generate"].choose(actor, prompts, None, greedy)
    return time.perf_counter() - start


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}, {args.threads} threads; model {args.model}; {args.envs} envs")
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    print("| game | acting | prompt tokens / left to run | s per call, all prompts | prefilled | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.games.split(","):
        actor, batches = prompt_batches(suite.get_game(name), model, tokenizer, args)
        total = sum(len(p) for b in batches for p in b)
        left = 0
        for prompts in batches:  # what prefill runs: the shared prefix once, each distinct prompt's rest once
            distinct = [list(p) for p in dict.fromkeys(map(tuple, prompts))]
            prefix = shared_prefix(distinct)
            left += prefix + sum(len(p) - prefix for p in distinct)
        for greedy in (False, True):
            plain, reused = [], []
            for prompts in batches:
                timed(actor, prompts, True, greedy)  # warm-up
                for _ in range(args.repeats):
                    plain.append(timed(actor, prompts, False, greedy))
                    reused.append(timed(actor, prompts, True, greedy))
            a, b = statistics.median(plain), statistics.median(reused)
            acting = "greedy" if greedy else "sampled"
            print(f"| {name} | {acting} | {total} / {left} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)
        actor.reuse_prefix = True


if __name__ == "__main__":
    main()
