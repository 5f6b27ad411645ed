"""The learning suite: every game x {score, generate} x seeds, trained with llamagym's defaults, evaluated exactly.

Each run builds the game's ready agent with exactly what `Agent(...)` and `PPOConfig(seed=seed)` give by default
(only the game's hooks differ), plays `--num-envs` envs side by side for `--budget` seconds of training (and at
least `--min-updates` updates), and evaluates the greedy policy exactly before, every `--eval-every` training seconds,
and at the end (evaluation time is not counted in the budget). Each run is a child process, so its peak RSS is its
own.

Quick check (about a minute, tiny random model):  python benchmarks/learning_suite.py --quick
The benchmark (hours at the default budget):       python benchmarks/learning_suite.py
An experiment (overrides are printed and saved):   python benchmarks/learning_suite.py --games rooms \
                                                       --modes score --ppo mini_batch_size=4096 --agent lora_layers=8
On a GPU (the targets are set on 2 CPU cores; runs side by side share it well):  ... --device cuda

Writes `--output`/results.json (after every run, with each update's statistics), results.md (the table),
<game>.png (normalised score against training time, one line per mode and seed) and
<game>-<mode>-seed<seed>-updates.png (what each update did: returns and their spread, entropy, KL moved).
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import llamagym.envs as suite
from llamagym.evaluation import save_json
from llamagym.models.devices import cpu_precision_note, matmul_gflops

THRESHOLDS = (0.5, 0.8)
# per-update statistics kept in results.json, to see what an update did when a curve breaks
LOGGED = (
    "env/batch_return", "adv/return_std", "adv/raw_std", "adv/returns_running_std", "adv/equal_returns",
    "ppo/entropy", "ppo/approx_kl", "ppo/clipfrac", "ppo/value_loss", "ppo/explained_variance", "ppo/grad_norm",
    "ppo/value_refit_ev", "trust/tries", "adv/groups", "adv/zero_variance_groups", "adv/step_groups",
    "ppo/distinct_turns", "ppo/num_turns", "trust/kl", "trust/kl_max", "trust/scale", "trust/undone", "kl/ref",
    "time/update_s", "agent/batch_invalid_action_rate", "agent/batch_cut_reply_rate", "adv/cut_capped",
    "ppo/entropy_fraction", "ppo/entropy_floor_coef", "ppo/entropy_floor_turns", "memory/trims", "agent/explored_rate",
    "adv/evidence", "trust/bound", "ppo/barrier", "adv/tail_weight", "adv/tail_signal", "adv/tail_noise",
    "ppo/turn_value_range", "adv/choice_weight_max", "adv/choice_weighed",
)  # fmt: skip
# game name -> probe(agent) -> dict, recorded at each evaluation under --probe (registered by other benchmarks)
PROBES: dict = {}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", default="all", help=f"comma-separated, or all: {', '.join(suite.GAMES)}")
    parser.add_argument("--modes", default="score,generate", help="comma-separated action modes")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--budget", type=float, default=600.0, help="training seconds per run (evaluation excluded)")
    parser.add_argument("--eval-every", type=float, default=60.0, help="training seconds between evaluations")
    parser.add_argument(
        "--min-updates", type=int, default=0, help="train past the budget until this many updates (--quick: 1)"
    )
    parser.add_argument("--num-envs", type=int, default=16, help="envs played side by side (one forward per step)")
    parser.add_argument(
        "--group-size", type=int, default=1, help="K envs start each episode from the same seed (GRPO-style groups)"
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name, hub id or local path")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--device", default="cpu", help="cpu (the targets' machine) | cuda | auto")
    parser.add_argument("--ppo", nargs="*", default=[], metavar="KEY=VALUE", help="PPOConfig overrides")
    parser.add_argument("--agent", nargs="*", default=[], metavar="KEY=VALUE", help="Agent(...) overrides")
    parser.add_argument(
        "--replay", nargs="*", default=[], metavar="KEY=VALUE", help="ReplayConfig overrides (the SFT warm-start)"
    )
    parser.add_argument(
        "--keep-agents",
        action="store_true",
        help="save each run's final agent (Agent.save) under OUTPUT/agents/<game>-<mode>-seed<seed>, to probe later",
    )
    parser.add_argument("--output", default="benchmarks/results/learning_suite", help="output folder")
    parser.add_argument(
        "--trainer",
        default="llamagym",
        choices=["llamagym", "trl", "both"],
        help="trl: TRL's GRPOTrainer through llamagym.integrations.trl (mode generate-trl; pip install -e .[trl]); "
        "both: each game through both, same budget",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="at each evaluation also record the game's probe (PROBES: what another benchmark registers, e.g. "
        "guess_number_states.py) in the curve's points, as `probe`",
    )
    parser.add_argument(
        "--also-average",
        default="",
        metavar="H[,H...]",
        help="also evaluate greedy policies of the adapter averaged over these numbers of updates, on the same run "
        "(curve: avg<H>_normalised and avg<H>_invalid; compares PPOConfig.average_updates without training twice)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, 1 seed, 3 s and 1 update per run: checks it all works"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.seeds, args.budget, args.eval_every, args.num_envs = "tiny-random", "0", 3.0, 1e9, 4
        args.min_updates = max(args.min_updates, 1)  # a slow or shared device still shows an update
        args.output = args.output if args.output != parser.get_default("output") else args.output + "_quick"
    args.games = list(suite.GAMES) if args.games == "all" else [suite.get_game(g).name for g in args.games.split(",")]
    args.modes = args.modes.split(",")
    try:
        args.also_average = [int(h) for h in args.also_average.split(",") if h.strip()]
    except ValueError:
        parser.error(f"--also-average takes comma-separated integers >= 1. Received {args.also_average!r}.")
    if any(h < 1 for h in args.also_average):
        parser.error(f"--also-average takes comma-separated integers >= 1. Received {args.also_average}.")
    bad = [m for m in args.modes if m not in ("score", "generate")]
    if bad:
        parser.error(f"--modes should name score and/or generate. Received {', '.join(bad)}.")
    if args.trainer != "llamagym":  # learning_suite_trl.py runs it; the adapter plays in generate mode
        args.modes = ([] if args.trainer == "trl" else args.modes) + ["generate-trl"]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    unprobed = [g for g in args.games if g not in PROBES]
    if args.probe and unprobed:
        known = ", ".join(PROBES) or "none"
        parser.error(f"--probe: no probe is registered for {', '.join(unprobed)} (registered: {known}).")
    if args.group_size < 1:
        parser.error(f"--group-size should be an integer >= 1. Received {args.group_size}.")
    if args.min_updates < 0:
        parser.error(f"--min-updates should be an integer >= 0. Received {args.min_updates}.")
    args.overrides = {
        "ppo": _pairs(parser, "--ppo", args.ppo),
        "agent": _pairs(parser, "--agent", args.agent),
        "replay": _pairs(parser, "--replay", args.replay),
    }
    from llamagym import PPOConfig, ReplayConfig
    from llamagym.models.devices import resolve_device

    for key, config in (("ppo", PPOConfig), ("replay", ReplayConfig)):
        try:
            config(**args.overrides[key])
        except (TypeError, ValueError) as err:
            parser.error(f"--{key}: {err}")
    try:
        resolve_device(args.device)
    except ValueError as err:
        parser.error(f"--device: {err}")
    return args


def _pairs(parser, flag: str, items: list[str]) -> dict:
    """KEY=VALUE strings -> dict; values are Python literals where they parse (2e-4, True, None), else strings."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"{flag} takes KEY=VALUE pairs. Received {item!r}.")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), as `lscpu | grep 'Model name'` prints it, with its x86
    family and model numbers where /proc/cpuinfo gives them: one name covers CPUs of different speeds here ("AMD
    EPYC" is family 25 model 17, Zen 4, and family 26, Zen 5, whose bf16 training is about twice as fast).
    `cpuinfo`: the file's text (read from /proc when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine()
    if fields.get("cpu family", "").isdigit() and fields.get("model", "").isdigit():
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def peak_rss_gib() -> float:
    """This process's peak resident memory (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def group_seed(run_seed: int, env: int, episode: int, num_envs: int, group_size: int) -> int:
    """The seed of env `env`'s `episode`-th episode when envs play in groups of `group_size`: envs env // group_size
    == g share it on their same-numbered episodes, so they start alike and form one group (the agent groups episodes
    by their first observation); every (group, episode) pair gets its own seed."""
    groups = -(-num_envs // group_size)
    return run_seed * 1_000_003 + episode * groups + env // group_size


def make_agent(game, model, tokenizer, action_space, mode: str, ppo_config, **overrides):
    """The game's agent on `model`, acting in `mode`, with the game's agent settings and then `overrides`."""
    kwargs = {**game.agent_kwargs, **overrides}
    return game.agent_for()(
        model, tokenizer, action_space=action_space, action_mode=mode, ppo_config=ppo_config, **kwargs
    )


def play_step(agent, envs, observations: list, reset) -> tuple[dict, list[bool]]:
    """One step of the user's loop over every env: act, step, hand the rewards and ends of episodes to the agent.
    `observations` is updated in place; a finished env's next one is `reset(i)`. Returns the agent's stats (an
    update's when the step completed a batch) and which envs finished."""
    actions = agent.act_batch(observations)
    results = [env.step(action) for env, action in zip(envs, actions, strict=True)]
    agent.assign_rewards([r[1] for r in results])
    dones = [r[2] or r[3] for r in results]
    stats = agent.end_episodes(
        dones, truncated=[r[3] and not r[2] for r in results], final_observations=[r[0] for r in results]
    )
    for i, done in enumerate(dones):
        observations[i] = reset(i) if done else results[i][0]
    return stats, dones


def train(game_name: str, mode: str, seed: int, args) -> dict:
    """One run: the user's loop over N envs with the game's agent, exact evaluations on the way."""
    import random

    import gymnasium as gym
    import torch
    from tqdm import tqdm

    from llamagym import PPOConfig, ReplayConfig, load_model_and_tokenizer
    from llamagym.algos.averaging import WeightAverage

    torch.set_num_threads(args.threads)
    cpu_gflops = matmul_gflops()  # here, not in the parent: a fork after its threads ran would hang in OpenMP
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    game = suite.get_game(game_name)
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device)
    envs = [gym.make(game.env_id) for _ in range(args.num_envs)]
    ppo_config = PPOConfig(**{"seed": seed, **args.overrides["ppo"]})
    agent_kwargs = dict(args.overrides["agent"])
    if args.overrides["replay"]:
        agent_kwargs["replay_config"] = ReplayConfig(**args.overrides["replay"])
    agent = make_agent(game, model, tokenizer, envs[0].action_space, mode, ppo_config, **agent_kwargs)

    curve, clock = [], {"train": 0.0, "eval": 0.0, "updates": 0, "episodes": 0}
    also = {h: WeightAverage(agent.trainer.lm_params, h) for h in args.also_average}  # --also-average

    def record():
        start = time.perf_counter()
        figures = suite.evaluate(game, agent)
        point = {k: clock[k] for k in ("train", "updates", "episodes")}
        point.update(normalised=figures["normalised"], score=figures["score"], invalid=figures.get("invalid_rate"))
        average = agent.trainer.average
        if average is not None and average.mean is not None:  # side by side: the greedy policy of the latest weights
            with agent.trainer.latest_weights():
                latest = suite.evaluate(game, agent)
            point.update(
                latest_normalised=latest["normalised"],
                latest_score=latest["score"],
                latest_invalid=latest.get("invalid_rate"),
            )
        if args.probe:  # latest weights, as sampled (the benchmark that registered it says what it records)
            point["probe"] = PROBES[game_name](agent)
        for horizon, other in also.items():
            if other.mean is not None:
                with agent.trainer.greedy_average(other):
                    averaged = suite.evaluate(game, agent)
                point[f"avg{horizon}_normalised"] = averaged["normalised"]
                point[f"avg{horizon}_invalid"] = averaged.get("invalid_rate")
        clock["eval"] += time.perf_counter() - start
        curve.append(point)
        return figures

    record()
    next_seed, played = seed * 1_000_003, [0] * len(envs)

    def reset(i: int):
        nonlocal next_seed
        if args.group_size > 1:
            episode_seed = group_seed(seed, i, played[i], len(envs), args.group_size)
        else:  # one fresh seed per episode, in the order episodes start
            episode_seed, next_seed = next_seed, next_seed + 1
        played[i] += 1
        return envs[i].reset(seed=episode_seed)[0]

    observations = [reset(i) for i in range(len(envs))]
    update_s, invalid_train, log, last_eval = [], [], [], 0.0
    progress = tqdm(
        total=round(args.budget), desc=f"{game_name}/{mode}/seed {seed}", unit="s", leave=False, mininterval=5
    )
    while clock["train"] < args.budget or clock["updates"] < args.min_updates:
        start = time.perf_counter()
        stats, dones = play_step(agent, envs, observations, reset)
        clock["train"] += time.perf_counter() - start
        clock["episodes"] += sum(dones)
        if "ppo/policy_loss" in stats:
            clock["updates"] += 1
            for other in also.values():
                other.update()
            update_s.append(stats["time/update_s"])
            invalid_train.append(stats["agent/batch_invalid_action_rate"])
            log.append({"train": clock["train"], **{key: stats[key] for key in LOGGED if key in stats}})
        progress.set_postfix(updates=clock["updates"], score=f"{curve[-1]['normalised']:.2f}", refresh=False)
        progress.update(min(round(clock["train"]), progress.total) - progress.n)  # redraws every `mininterval` s
        if clock["train"] - last_eval >= args.eval_every and clock["train"] < args.budget:
            record()
            last_eval = clock["train"]
    progress.close()
    final = record()
    if args.keep_agents:  # the running episodes are dropped: the saved agent is the trained one, ready to probe
        agent.abort_episodes()
        agent.save(Path(args.output) / "agents" / f"{game.name}-{mode}-seed{seed}")
    s_per_update = float(np.mean(update_s)) if update_s else None
    result = run_record(game, mode, seed, curve, final, clock, invalid_train, s_per_update, log)
    result["cpu_gflops"] = cpu_gflops
    if model.device.type == "cuda":
        result.update(
            device=torch.cuda.get_device_name(model.device), peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30
        )
    return result


def run_record(game, mode: str, seed: int, curve, final: dict, clock: dict, invalid_train, s_per_update, log) -> dict:
    """One run's entry in results.json: its scores (before, best, final, time to each threshold), its cost and its
    curve and per-update log (`curve`: the evaluations; `final`: the last one's figures; `clock`: train and eval
    seconds, updates, episodes)."""
    scores = [p["normalised"] for p in curve]
    return {
        "game": game.name,
        "mode": mode,
        "seed": seed,
        "measure": game.measure,
        "before": scores[0],
        "best": max(scores),
        "final": scores[-1],
        # the greedy policy of the latest weights, evaluated beside the averaged one (PPOConfig.average_updates)
        "final_latest": curve[-1].get("latest_normalised"),
        **{f"t{int(th * 100)}": next((p["train"] for p in curve if p["normalised"] >= th), None) for th in THRESHOLDS},
        "invalid_train": invalid_train[-1] if invalid_train else None,
        "invalid_final": final.get("invalid_rate"),
        "updates": clock["updates"],
        "episodes": clock["episodes"],
        "s_per_update": s_per_update,
        "train_s": clock["train"],
        "eval_s": clock["eval"],
        "peak_rss_gib": peak_rss_gib(),
        "final_figures": final,
        "curve": curve,
        "updates_log": log,
    }


def _child(connection, game_name, mode, seed, args):
    try:
        if mode == "generate-trl":
            from learning_suite_trl import train_trl

            connection.send(train_trl(game_name, seed, args, run_record))
        else:
            connection.send(train(game_name, mode, seed, args))
    except BaseException as err:  # report any failure to the parent, which records it and goes on
        connection.send({"game": game_name, "mode": mode, "seed": seed, "error": f"{err!r}\n{traceback.format_exc()}"})
    finally:
        connection.close()


def run_in_child(game_name: str, mode: str, seed: int, args) -> dict:
    """`train` in a fresh child process (forked where possible: the imports are already done; spawned for a GPU,
    which a forked child cannot use once a parent touched it)."""
    fork = args.device == "cpu" and "fork" in mp.get_all_start_methods()
    context = mp.get_context("fork" if fork else "spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(send, game_name, mode, seed, args))
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:  # the child died without a word (killed, out of memory)
        result = {"game": game_name, "mode": mode, "seed": seed, "error": "the run's process died"}
    process.join()
    if process.exitcode and "error" not in result:
        result["error"] = f"exit code {process.exitcode}"
    return result


def _fmt(value, spec=".2f", none="-") -> str:
    return none if value is None else format(value, spec)


def markdown(runs: list[dict], header: dict) -> str:
    lines = [
        "# Learning suite",
        "",
        *(f"- {key}: {value}" for key, value in header.items()),
        "",
        "Normalised scores (0 = uniform random play, 1 = optimal), exact evaluations of the greedy policy. "
        "t50/t80: training seconds to first reach 0.5/0.8. invalid: share of unparsable replies in the last "
        "update's batch (generate mode). latest: the final greedy policy of the latest weights instead of their "
        "average over the last updates (`PPOConfig.average_updates`; - when off). GFLOP/s: the CPU's speed at the "
        "policy's matrix products, measured as the run started (`matmul_gflops`).",
        "",
        "| game | mode | seed | before | best | final | latest | t50 (s) | t80 (s) | invalid | updates | s/update "
        "| RSS (GiB) | GFLOP/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['game']} | {r['mode']} | {r['seed']} | failed: {r['error'].splitlines()[0][:80]} |")
            continue
        invalid = _fmt(r["invalid_train"]) if r["mode"].startswith("generate") else "-"
        lines.append(
            f"| {r['game']} | {r['mode']} | {r['seed']} | {r['before']:.2f} | {r['best']:.2f} | {r['final']:.2f} "
            f"| {_fmt(r.get('final_latest'))} | {_fmt(r['t50'], '.0f')} | {_fmt(r['t80'], '.0f')} | {invalid} "
            f"| {r['updates']} "
            f"| {_fmt(r['s_per_update'], '.1f')} | {r['peak_rss_gib']:.2f} | {_fmt(r.get('cpu_gflops'), '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], game_name: str, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    styles = ["-", "--", ":", "-."]
    for r in runs:
        if r["game"] != game_name or "error" in r:
            continue
        xs = [p["train"] / 60 for p in r["curve"]]
        ys = [p["normalised"] for p in r["curve"]]
        color = {"score": "C0", "generate": "C1"}.get(r["mode"], "C2")
        ax.plot(xs, ys, marker="o", ms=3, color=color, ls=styles[r["seed"] % 4], label=f"{r['mode']}, seed {r['seed']}")
    ax.axhline(0, color="grey", lw=1, ls=":")
    ax.axhline(1, color="grey", lw=1, ls=":")
    ax.set_xlabel("training time (min)")
    ax.set_ylabel("normalised score (0 random, 1 optimal)")
    ax.set_title(game_name)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=110)


def plot_updates(run: dict, path: Path) -> None:
    """What each update did, against training time: the batch's return and its spread, the entropy, the KL the
    update moved the policy by (trust region), how much of the return variance the value head explained (before
    the update: on returns it had not seen), and the greedy policy's normalised score at each evaluation."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(5, 1, sharex=True)
    log = run["updates_log"]
    panels = [
        (("normalised",), run["curve"], "greedy score (0 random, 1 optimal)"),
        (("env/batch_return", "adv/return_std", "adv/raw_std"), log, "batch return, spreads"),
        (("ppo/entropy",), log, "entropy"),
        (("trust/kl", "trust/kl_max", "ppo/approx_kl"), log, "KL(old || new)"),
        (("ppo/explained_variance",), log, "value head: explained variance"),
    ]
    for ax, (keys, rows, label) in zip(axes, panels, strict=True):
        for key in keys:
            points = [(r["train"] / 60, r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", ms=3, label=key)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("training time (min)")
    fig.suptitle(f"{run['game']}, {run['mode']}, seed {run['seed']}")
    fig.savefig(path, dpi=100)


def main(argv=None):
    args = parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    header = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "CPU": f"{cpu_model()} ({os.cpu_count()} cores; {args.threads} torch threads per run; {cpu_precision_note()})",
        "model": args.model,
        "device": args.device,
        "budget": f"{args.budget:g} training seconds per run, evaluation every {args.eval_every:g} s",
        "envs": args.num_envs,
        "group_size": args.group_size,
        "overrides": args.overrides if any(args.overrides.values()) else "none (the defaults)",
    }
    print("\n".join(f"{k}: {v}" for k, v in header.items()), flush=True)
    runs = []
    for game_name in args.games:
        for mode in args.modes:
            for seed in args.seeds:
                start = time.time()
                result = run_in_child(game_name, mode, seed, args)
                runs.append(result)
                if "error" in result:
                    print(f"{game_name}/{mode}/seed {seed}: FAILED {result['error']}", flush=True)
                else:
                    print(
                        f"{game_name}/{mode}/seed {seed}: before {result['before']:.2f} best {result['best']:.2f} "
                        f"final {result['final']:.2f}, {result['updates']} updates, "
                        f"{time.time() - start:.0f} s wall",
                        flush=True,
                    )
                save_json(output / "results.json", {"header": header, "runs": runs})
                if "error" not in result and result["updates_log"]:
                    plot_updates(result, output / f"{game_name}-{mode}-seed{seed}-updates.png")
        plot(runs, game_name, output / f"{game_name}.png")
    table = markdown(runs, header)
    (output / "results.md").write_text(table)
    print(table)
    failed = [r for r in runs if "error" in r]
    return 1 if failed else 0


def sampled_probabilities(agent, observations: list) -> list[np.ndarray]:
    """The latest weights' probabilities over each observation's candidates (`agent.action_candidates`), as training
    samples them (scoring mode's distributions), from prompts of the observation alone (a Markov agent's): what a
    probe reads. The random state and the acting memory are left as they were."""
    import torch

    mode, actor, system = agent.mode, agent.actor, agent.get_system_prompt()
    prompts = [
        agent.formatter.prompt_ids(system, [{"role": "user", "content": agent.format_observation(obs)}])[0]
        for obs in observations
    ]
    candidates = [[actor.candidate_ids(text) for text in agent.action_candidates(obs)] for obs in observations]
    memory = actor.memory(mode)
    kept, rng = set(memory), torch.get_rng_state()
    mode.choose(actor, prompts, candidates, greedy=False)
    torch.set_rng_state(rng)
    pairs = zip(prompts, candidates, strict=True)
    found = [memory[mode.key(prompt, ids)].logprobs.exp().numpy() for prompt, ids in pairs]
    for key in set(memory) - kept:  # what acting computes in its own batches, not the probe's
        del memory[key]
    return found


def probe_report(path: Path, describe) -> str:
    """One line per run of `path` (a results.json), then one per evaluation: the suite's greedy figures followed by
    `describe(probe)`'s first line; its further lines after it (a probe benchmark's report)."""
    lines = []
    for run in json.loads(Path(path).read_text())["runs"]:
        lines.append(f"seed {run['seed']}: final {run.get('final')}")
        for point in run.get("curve", []):
            first, *more = describe(point.get("probe", {}))
            latest = point.get("latest_normalised", float("nan"))
            lines.append(
                f"  {point['train']:6.0f} s, {point['updates']:4d} updates: greedy {point['normalised']:.3f} "
                f"(latest {latest:.3f}), {first}"
            )
            lines.extend(more)
    return "\n".join(lines)


def probe_main(game_name: str, describe, argv: list[str]) -> int:
    """`main` on one game in scoring mode with its registered probe (`PROBES`), then `probe_report` with `describe`
    printed: what a probe benchmark runs as a script (guess_number_states.py, rooms_walks.py)."""
    argv = ["--games", game_name, "--modes", "score", "--probe", *argv]
    args = parse_args(argv)
    if args.modes != ["score"]:
        name = Path(sys.argv[0]).name
        sys.exit(f"{name} reads scoring mode's distributions: run it with --modes score (the default).")
    code = main(argv)
    print(probe_report(Path(args.output) / "results.json", describe))
    return code


if __name__ == "__main__":
    sys.exit(main())
