"""Rollout and PPO-update throughput of llamagym on Blackjack-v1, side by side with the older sequential loop.

One process measures: (a) the older library's loop (one env, sampled 32-token replies, fp32); (b) batched generation;
(c) scoring the action names; (d) PPO updates; (e) peak RSS; (f) GFLOP/s of the scoring forward against a plain
matmul; (g) every ratio to (a), checked against the issue's targets. Compare ratios from one run (see README.md).

Quick check (about a minute):  python benchmarks/rollout_throughput.py --quick
Full benchmark (quiet machine): python benchmarks/rollout_throughput.py
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import torch

from llamagym import Agent, PPOConfig, load_model_and_tokenizer
from llamagym.algos.rollout import collate_scored

BLACKJACK = {"id": "Blackjack-v1", "natural": False, "sab": False}  # no time limit: episodes never truncate


class BlackjackAgent(Agent):
    """The older library's kind of prompt (long, and the whole conversation is kept); generate mode parses."""

    def get_system_prompt(self) -> str:
        return (
            "You are an expert blackjack player. Each turn you see your hand total, the dealer's visible card and "
            "whether you hold a usable ace. Reply with one word: hit (take a card) or stick (stop)."
        )

    def format_observation(self, observation) -> str:
        player_sum, dealer_card, usable_ace = observation
        ace = "You have a usable ace." if usable_ace else "You have no usable ace."
        return f"Your hand totals {player_sum}. The dealer shows {dealer_card}. {ace} Hit or stick?"

    def extract_action(self, response: str):
        text = response.lower()
        return 1 if "hit" in text else 0 if "stick" in text else None


class ShortPromptAgent(BlackjackAgent):
    """The prompts of examples/blackjack.py: short, and (with context_turns=0) the current hand only."""

    def get_system_prompt(self) -> str:
        return "Blackjack. Answer hit or stick."

    def format_observation(self, observation) -> str:
        player_sum, dealer_card, usable_ace = observation
        return f"Total {player_sum}{' (usable ace)' if usable_ace else ''}, dealer {dealer_card}. Hit or stick?"


class ScoringBlackjackAgent(ShortPromptAgent):
    action_names = ["stick", "hit"]  # Blackjack-v1: 0 = stick, 1 = hit


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny settings to check the script works (about a minute)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name (default: the embedded model)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"], help="of modes (b)-(d), (f)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="reply length of the generate modes")
    p.add_argument("--steps", type=int, default=16, help="timed steps of the one-env runs (baseline, scoring N=1)")
    p.add_argument("--iters", type=int, default=4, help="timed batched steps of the N>1 runs")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before each timed run")
    p.add_argument("--ppo-turns", type=int, default=64, help="turns in the PPO updates of (d)")
    p.add_argument("--sharing-turns", type=int, default=256, help="turns in the updates of (h)")
    p.add_argument("--repeats", type=int, default=7, help="repeats of the forward and matmul timings (median)")
    p.add_argument("--lora-layers", type=int, default=8, help="adapted top layers of modes (b)-(d), as the example")
    p.add_argument("--rss-updates", type=int, default=3, help="updates of the training run whose peak RSS is (e)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/rollout_throughput.json", help="where the JSON goes")
    args = p.parse_args()
    args.generate_n, args.score_n = [16, 64], [1, 16, 64]
    if args.quick:
        args.generate_n, args.score_n = [4, 8], [1, 4, 8]
        args.steps, args.iters, args.ppo_turns, args.repeats, args.rss_updates = 2, 2, 8, 3, 1
    return args


def make_agent(cls, model, tokenizer, args, *, precision, action_mode, **settings):
    """An agent that only collects: its batch_size is unreachable, so we call `trainer.step` ourselves."""
    return cls(
        model,
        tokenizer,
        # mini_batch_size: our defaults; two epochs for every agent (the default's one epoch for natural steps would
        # halve the scoring update's work, and samples/s would no longer compare like with like)
        ppo_config=PPOConfig(batch_size=10**9, seed=args.seed, ppo_epochs=2),
        generation_config={"max_new_tokens": args.max_new_tokens},
        fallback_action=0,
        action_space=gym.make(**BLACKJACK).action_space,
        action_mode=action_mode,
        precision=precision,
        **settings,
    )


def run_envs(agent, n, iters, args):
    """Step n real Blackjack envs with `act_batch`, resetting finished ones; the seconds of each timed step.

    One step = act_batch for the n envs + env.step + assign_rewards + end_episodes; it counts as n env steps.
    """
    envs = [gym.make(**BLACKJACK) for _ in range(n)]
    observations = [env.reset(seed=args.seed + i)[0] for i, env in enumerate(envs)]
    seconds = []
    for it in range(args.warmup + iters):
        start = time.perf_counter()
        actions = agent.act_batch(observations)
        rewards, dones = [], []
        for i, env in enumerate(envs):
            observations[i], reward, terminated, truncated, _ = env.step(actions[i])
            rewards.append(reward)
            dones.append(terminated or truncated)
            if dones[-1]:
                observations[i], _ = env.reset()
        agent.assign_rewards(rewards)
        agent.end_episodes(dones)
        if it >= args.warmup:
            seconds.append(time.perf_counter() - start)
    agent.end_episodes([True] * n, truncated=[True] * n)  # keep the open hands too, as cut-off episodes
    return seconds


def run_baseline(agent, args):
    """The older llamagym loop: one env, act -> env.step -> assign_reward, terminate_episode when a hand ends."""
    env = gym.make(**BLACKJACK)
    observation, _ = env.reset(seed=args.seed)
    seconds = []
    for it in range(args.warmup + args.steps):
        start = time.perf_counter()
        observation, reward, terminated, truncated, _ = env.step(agent.act(observation))
        agent.assign_reward(reward)
        if terminated or truncated:
            agent.terminate_episode()
            observation, _ = env.reset()
        if it >= args.warmup:
            seconds.append(time.perf_counter() - start)
    if agent.episode.turns:
        agent.terminate_episode(truncated=True)  # keep the open hand too, as a cut-off episode
    return seconds


def rollout_row(mode, agent, n, seconds):
    """A table row; the median is over the timed (batched) steps."""
    median = statistics.median(seconds)
    row = {"mode": mode, "n_envs": n, "precision": agent.policy.precision, "env_steps": n * len(seconds)}
    return row | {"median_step_s": median, "env_steps_per_s": n / median, "peak_rss_gib": rss_gib()[1]}


def take_turns(episodes, k):
    """Whole episodes from the front of `episodes` until they hold at least k turns (or run out)."""
    chosen, turns = [], 0
    for episode in episodes:
        if turns >= k:
            break
        chosen.append(episode)
        turns += len(episode.turns)
    return chosen


def time_update(name, agent, episodes):
    """One PPO update after a warm-up update on (up to) 2 episodes; samples/s = turns / seconds of trainer.step."""
    if not episodes:
        raise RuntimeError(f"{name}: no finished episode to train on; raise --steps / --iters.")
    agent.trainer.step(episodes[:2])  # warm-up: first-call costs (optimizer state, kernels)
    stats = agent.trainer.step(episodes)
    cfg, turns, seconds = agent.ppo_config, int(stats["ppo/num_turns"]), stats["time/update_s"]
    row = {"mode": name, "turns": turns, "distinct": int(stats["ppo/distinct_turns"]), "ppo_epochs": cfg.ppo_epochs}
    row["mini_batch_size"] = cfg.mini_batch_size
    row |= {"precision": agent.policy.precision, "update_s": seconds, "samples_per_s": turns / seconds}
    return row | {"peak_rss_gib": rss_gib()[1]}


def time_sharing(agent, episodes):
    """(h) The same update with the repeated-input savings off, then on, side by side (see README, Training)."""
    from llamagym.algos.modes import ActionMode

    share, cache = ActionMode.distinct_inputs, agent.policy.frozen_cache
    rows = []
    for label, on in (
        ("off: every turn computed, all layers", False),
        ("on: distinct inputs, frozen-layer cache", True),
    ):
        if not on:
            ActionMode.distinct_inputs = lambda self, turns: torch.arange(len(turns))
            agent.policy.frozen_cache = None
        elif cache is not None:
            cache.clear()  # a cold cache: in a run, acting has usually filled it already
        try:
            row = time_update(f"(h) sharing {label}", agent, episodes)
        finally:
            ActionMode.distinct_inputs, agent.policy.frozen_cache = share, cache
        rows.append(row)
    rows[1]["x_off"] = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    rows[0]["x_off"] = 1.0
    return rows


def median_seconds(fn, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def matmul_gflops(dtype, repeats, size=2048):
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size**3 / median_seconds(lambda: a @ b, repeats) / 1e9


def scoring_forward_gflops(agent, turns, repeats):
    """Achieved GFLOP/s of one `policy.score` forward over the scored `turns` (packed prompt + candidates).

    FLOPs = 2 x (non-embedding parameters, LoRA included) x (real tokens, padding excluded)
          + 2 x hidden x vocab x (candidate positions: the LM head runs only there).
    Attention-score FLOPs (QK^T and AV, ~2-3% at these lengths) are not counted, so this is a lower bound.
    """
    policy = agent.policy
    decoder = policy.causal_lm().get_decoder()
    embedding = {id(p) for p in decoder.get_input_embeddings().parameters()}
    params = sum(p.numel() for p in decoder.parameters() if id(p) not in embedding)
    vocab, hidden = policy.causal_lm().get_output_embeddings().weight.shape
    prompts, candidates = [t.prompt_ids for t in turns], [t.candidates for t in turns]
    batch = collate_scored(prompts, candidates, pad_token_id=agent.pad_token_id, device=policy.device)
    tokens = sum(len(p) + sum(len(c) for c in cands) for p, cands in zip(prompts, candidates, strict=True))
    head_positions = int((batch.owner >= 0).sum())
    flops = 2 * params * tokens + 2 * hidden * vocab * head_positions
    cache, policy.frozen_cache = policy.frozen_cache, None  # every layer really runs: the FLOPs counted above
    try:
        with torch.no_grad():
            seconds = median_seconds(lambda: policy.score(batch), repeats, warmup=1)
    finally:
        policy.frozen_cache = cache
    return {
        "rows": len(turns),
        "tokens": tokens,
        "padded_tokens": batch.input_ids.numel(),
        "lm_head_positions": head_positions,
        "non_embedding_params": params,
        "gflop": flops / 1e9,
        "median_s": seconds,
        "gflops": flops / seconds / 1e9,
    }


def training_run_rss(args) -> dict:
    """Peak RSS (GiB) of `examples/blackjack.py` training for `--rss-updates` updates, in a child process."""
    example = Path(__file__).resolve().parents[1] / "examples" / "blackjack.py"
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            str(example),
            "--model",
            args.model,
            "--episodes",
            "100000",
            "--max-updates",
            str(args.rss_updates),
            "--output-dir",
            out,
            "--precision",
            args.precision,
        ]
        subprocess.run(command, check=True, capture_output=True, text=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # Linux reports KiB
    return {"training_run_peak_rss_gib": peak, "training_run_updates": args.rss_updates}


def rss_gib():
    """(current, peak) resident set size of this process in GiB (Linux: /proc/self/statm, and ru_maxrss in KiB)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def print_table(title, rows):
    """The rows' keys are the columns (as in the JSON); floats with 2 decimals."""
    cells = [list(rows[0])] + [
        [v if isinstance(v, str) else f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    print(f"\n{title}")
    for line in cells:
        print(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        )


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    loadavg = [os.getloadavg()[0]]
    # (e) first, while this process is small: Linux carries a process's RSS high-water mark across exec, so a
    # child started after the models below are loaded would report this process's peak as its own.
    memory = training_run_rss(args)
    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    load_s = time.perf_counter() - start
    memory["rss_after_load_gib"] = rss_gib()[0]

    # (a) the baseline: the older library's loop, fp32, one env, 32-token sampled replies, 8 episodes per update.
    # Every agent below wraps this one peft model: one copy of the weights; the reference is the adapter disabled.
    baseline = make_agent(BlackjackAgent, model, tokenizer, args, precision="fp32", action_mode="generate")
    rollouts = [rollout_row("(a) baseline", baseline, 1, run_baseline(baseline, args))]
    updates = [time_update(f"(a) baseline, {len(baseline.batch[:8])} episodes", baseline, baseline.batch[:8])]

    # (b) batched generation, (c) scoring the action names, with the example's settings: short Markov prompts
    # (context_turns=0) and LoRA on the top 8 layers. That adapter needs its own copy of the model; every agent
    # below shares it. One agent per N (each holds N conversations).
    ours, _ = load_model_and_tokenizer(args.model, device="cpu")
    agents, shared = {}, None
    settings = {"context_turns": 0, "lora_layers": args.lora_layers}
    for mode, cls, sizes in (
        ("generate", ShortPromptAgent, args.generate_n),
        ("score", ScoringBlackjackAgent, args.score_n),
    ):
        for n in sizes:
            # later agents reuse the first one's peft model (already adapted on the top layers)
            agent = make_agent(
                cls, shared or ours, tokenizer, args, precision=args.precision, action_mode=mode, **settings
            )
            shared = agent.policy.model
            seconds = run_envs(agent, n, args.steps if n == 1 else args.iters, args)
            rollouts.append(rollout_row(f"({'b' if mode == 'generate' else 'c'}) {mode}", agent, n, seconds))
            agents[mode, n] = agent
    n_gen, n_score = max(args.generate_n), max(args.score_n)

    # (d) PPO updates on about --ppo-turns turns collected above, in each mode.
    for mode, n in (("score", n_score), ("generate", n_gen)):
        agent = agents[mode, n]
        updates.append(time_update(f"(d) {mode}, from N={n}", agent, take_turns(agent.batch, args.ppo_turns)))

    # (h) the same scoring update without and with the repeated-input savings
    scorer = agents["score", n_score]
    sharing = time_sharing(scorer, take_turns(scorer.batch, args.sharing_turns))

    # (e) the training run's peak RSS was measured first (see above); this process holds no reference copy.
    all_agents = [baseline, *agents.values()]
    memory["reference_copies"] = sum(a.policy.reference_model is not None for a in all_agents)

    # (f) the scoring forward vs a plain matmul of the same precision.
    forward = scoring_forward_gflops(scorer, [t for e in scorer.batch for t in e.turns][:n_score], args.repeats)
    matmul = {
        name: matmul_gflops(dtype, args.repeats) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    forward |= {"precision": scorer.policy.precision, "matmul_gflops": matmul[scorer.policy.precision]}
    forward["ratio_to_matmul"] = forward["gflops"] / forward["matmul_gflops"]
    loadavg.append(os.getloadavg()[0])

    # (g) ratios to the baseline, and the targets.
    for row in rollouts:
        row["x_baseline"] = row["env_steps_per_s"] / rollouts[0]["env_steps_per_s"]
    for row in updates:
        row["x_baseline"] = row["samples_per_s"] / updates[0]["samples_per_s"]
    steps = {(r["mode"][4:], r["n_envs"]): r["x_baseline"] for r in rollouts}
    targets = [
        (f"scoring N={n_score} env steps/s, x baseline", ">=", 50, steps["score", n_score]),
        (f"batched generation N={n_gen} env steps/s, x baseline", ">=", 5, steps["generate", n_gen]),
        ("PPO update samples/s, scoring mode, x baseline", ">=", 10, updates[1]["x_baseline"]),
        ("PPO update samples/s, generate mode, x baseline", ">=", 10, updates[2]["x_baseline"]),
        ("peak RSS of a training run (example), GiB", "<", 2, memory["training_run_peak_rss_gib"]),
        ("scoring forward GFLOP/s / same-precision matmul", ">=", 0.4, forward["ratio_to_matmul"]),
    ]
    targets = [
        {
            "target": what,
            "need": f"{op} {need:g}",
            "got": got,
            "result": "PASS" if (got >= need if op == ">=" else got < need) else "SHORT",
        }
        for what, op, need, got in targets
    ]

    # ---- report ----
    print(f"\nllamagym rollout throughput: {args.model} on Blackjack-v1 (natural=False, sab=False)")
    print(
        f"{args.threads} torch threads on {os.cpu_count()} cores, torch {torch.__version__}, model load {load_s:.1f} s"
    )
    print(f"load average before {loadavg[0]:.1f}, after {loadavg[1]:.1f} (above ~0.5 before: the CPU was shared)")
    print(f"precision: baseline fp32 (as the older library); the rest {args.precision} -> {scorer.policy.precision}")
    if args.quick:
        print("QUICK MODE: tiny settings to check that the script works; these numbers are not the benchmark.")
    print_table("(a)-(c) rollout: env_steps_per_s = N / median seconds of one (batched) step", rollouts)
    print_table("(a),(d) PPO update: samples_per_s = turns / seconds of one trainer.step", updates)
    print(f"every update runs ppo_epochs = {updates[0]['ppo_epochs']}, the baseline's too")
    print(
        f"\n(e) peak RSS of examples/blackjack.py training {memory['training_run_updates']} updates in its own "
        f"process: {memory['training_run_peak_rss_gib']:.2f} GiB (reference copies of the model: "
        f"{memory['reference_copies']}; the reference is the adapter disabled). This process holds two models "
        f"and {len(all_agents)} agents, so its own peak_rss_gib column is not a training run's."
    )
    print(
        f"(f) scoring forward, {forward['precision']}: {forward['rows']} rows, {forward['tokens']} tokens, "
        f"{forward['lm_head_positions']} LM-head positions, {forward['gflops']:.0f} GFLOP/s = "
        f"{forward['ratio_to_matmul']:.0%} of the {forward['precision']} matmul"
    )
    print(f"    plain 2048^3 matmul: fp32 {matmul['fp32']:.0f} GFLOP/s, bf16 {matmul['bf16']:.0f} GFLOP/s")
    print_table("(g) the issue's targets", targets)
    print_table("(h) one scoring update, repeated-input savings off / on (distinct_turns of num_turns)", sharing)

    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    config = vars(args) | {"torch": torch.__version__, "cores": os.cpu_count(), "load_s": load_s, "loadavg": loadavg}
    result = {"config": config, "rollout": rollouts, "ppo_update": updates, "memory": memory}
    result |= {"scoring_forward": forward, "matmul_gflops": matmul, "targets": targets, "sharing": sharing}
    output.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {output}")


if __name__ == "__main__":
    main()
