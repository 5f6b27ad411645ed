"""Frozen weights' kept bf16 casts (`llamagym/models/head_cast.py`) against autocast casting them at every call.

`--casts head` (the default) toggles the LM head's cast, kept for the policy's life; `--casts frozen` toggles the other
frozen layers' casts, kept for each `generate` call (`Policy.keep_casts`). Guess-the-number in generate mode, 16 envs:
the prompt batches of the first sampled steps, each chosen sampled (seeded alike, so both sides decode the same
replies), greedy, and by scoring the 16 guesses (scoring mode), with the casts kept and without, alternating; then
PPO updates on one batch of episodes, alternating too (the adapter moves on between them: the same shapes, not the
same weights). It prints the median seconds of each and their ratio: compare the ratios of one run. The policy runs
in bf16 only where the CPU has native bf16 (`python -m llamagym doctor`); in fp32 nothing is cast and the two sides
are the same code.

Quick check (tiny model, seconds):  python benchmarks/head_cast.py --quick
Full benchmark (quiet machine):     python benchmarks/head_cast.py [--casts frozen]
"""

import argparse
import copy
import statistics
import time

import gymnasium as gym
import torch
from learning_suite import cpu_model, make_agent, play_step  # beside this file

from llamagym import PPOConfig, load_model_and_tokenizer
from llamagym.algos.modes import MODES
from llamagym.envs import suite
from llamagym.models.head_cast import keep_head_cast


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="prompt batches timed (one per env step)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per batch and side")
    parser.add_argument("--updates", type=int, default=2, help="timed updates per side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--casts", choices=("head", "frozen"), default="head", help="which kept casts to toggle")
    parser.add_argument("--quick", action="store_true", help="tiny random model, 1 step, 1 repeat, 1 update")
    args = parser.parse_args()
    if args.quick:
        args.model, args.steps, args.repeats, args.updates = "tiny-random", 1, 1, 1
    return args


def alternate(switch, call, repeats: int) -> tuple[float, float]:
    """Median seconds of `call()` without and with the kept casts (`switch(on)` turns them off or on), `repeats`
    times each, alternating."""
    seconds = {False: [], True: []}
    for _ in range(repeats):
        for on in (False, True):
            switch(on)
            start = time.perf_counter()
            call()
            seconds[on].append(time.perf_counter() - start)
    switch(True)
    return statistics.median(seconds[False]), statistics.median(seconds[True])


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    game = suite.get_game("guess_number")
    envs = [gym.make(game.env_id) for _ in range(args.envs)]
    config = PPOConfig(seed=0)
    agent = make_agent(game, model, tokenizer, envs[0].action_space, "generate", PPOConfig(seed=0, batch_size=10**6))
    kept = keep_head_cast(agent.policy.causal_lm())  # the one the policy installed

    def switch(on: bool) -> None:
        if args.casts == "head":
            kept.module.forward = kept if on else kept.forward
        else:
            agent.policy.keep_casts = on

    print(
        f"CPU: {cpu_model()}, {args.threads} threads; model {args.model}; policy in {agent.policy.precision}; "
        f"toggling the {args.casts} casts"
    )
    batches, original = [], MODES["generate"].choose

    def recording(actor, prompts, candidates=None, greedy=False):
        batches.append([list(p) for p in prompts])
        return original(actor, prompts, candidates, greedy)

    seeds = iter(range(2**62))
    observations = [env.reset(seed=next(seeds))[0] for env in envs]

    def reset(i: int):
        return envs[i].reset(seed=next(seeds))[0]

    MODES["generate"].choose = recording  # an instance attribute: the class's method is untouched
    try:
        while len(agent.batch) < config.batch_size or sum(len(e.turns) for e in agent.batch) < config.min_batch_turns:
            play_step(agent, envs, observations, reset)
    finally:
        del MODES["generate"].choose
    print("| what | without (s) | kept (s) | ratio |")
    print("| --- | --- | --- | --- |")
    candidates = [agent.actor.candidate_ids(text) for text in agent.action_candidates(observations[0])]
    ways = (("sampled", "generate", False), ("greedy", "generate", True), ("scored", "score", True))
    for acting, mode, greedy in ways:

        def choose(prompts, mode=mode, greedy=greedy):
            torch.manual_seed(0)  # both sides sample alike
            agent.policy.version += 1  # nothing scored before is taken from acting's memory
            MODES[mode].choose(agent.actor, prompts, [candidates] * len(prompts), greedy)

        plain, with_kept = [], []
        for prompts in batches[: args.steps]:
            a, b = alternate(switch, lambda prompts=prompts: choose(prompts), args.repeats)
            plain.append(a)
            with_kept.append(b)
        a, b = statistics.median(plain), statistics.median(with_kept)
        print(f"| acting, {args.envs} prompts, {acting} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)
    agent.trainer.config = config
    episodes = list(agent.batch)
    agent.trainer.step(copy.deepcopy(episodes))  # warm-up
    turns = sum(len(e.turns) for e in episodes)
    a, b = alternate(switch, lambda: agent.trainer.step(copy.deepcopy(episodes)), args.updates)
    print(f"| PPO update, {len(episodes)} episodes, {turns} turns | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
