"""Teach an LLM to play Blackjack with online RL (PPO on a LoRA adapter), on a laptop CPU.

The agent (`BlackjackAgent` of `llamagym/envs/blackjack.py`) sees its hand in words and answers "stick" or "hit".
By default it scores those two replies (one forward pass for all envs) instead of generating free text;
`--action-mode generate` samples and parses replies the way the original LlamaGym did. Its greedy policy is a table
over 280 states, so the run ends with the *exact* expected return of that policy (no sampling noise), beside the
optimal one. It trains with the library's defaults, as the README's quickstart does (`PPOConfig()`, `Agent(...)`, the
model's registry entry); each learning flag below, when given, changes that one setting.

Smoke run (seconds, tiny random model):  python examples/blackjack.py --model tiny-random --episodes 8 --device cpu
Sanity run (embedded SmolLM2-135M):     python examples/blackjack.py --episodes 5
Full run (see the README's Results):     python examples/blackjack.py --seed 0
Continue a stopped or killed run:        python examples/blackjack.py --seed 0 --resume
Data-parallel, 2 processes (docs/scaling.md):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/blackjack.py --model tiny-random --episodes 64
    --batch-size 16 --device cpu   (each rank plays its own hands; --batch-size is per rank; rank 0 writes the outputs)
    The same under FSDP (the frozen base sharded): accelerate launch --config_file examples/accelerate/fsdp.yaml ...
    (every rank evaluates: each forward pass is then a collective)
(checkpoints hold the envs mid-hand and the agent's running episodes: the resumed run matches an uninterrupted one)
"""

import argparse
import json
import random

import gymnasium as gym
import numpy as np
import torch
from tqdm import tqdm

from llamagym import PPOConfig, ReplayConfig, distributed, load_model_and_tokenizer
from llamagym.envs.blackjack import (
    STATES,
    BlackjackAgent,  # its prompts, reply parsing and action names; context_turns = 0 (Markov, evaluable exactly)
    exact_return,
    optimal_policy,
    policy_table,
    reference_returns,
)
from llamagym.envs.blackjack_plot import plot_blackjack_policy
from llamagym.evaluation import sampled_return, save_json
from llamagym.plots import plot_learning_curve
from llamagym.run_log import RunLog


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=20000, help="hands to play (default: 20000)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name, hub id or local path")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | mps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-envs", type=int, default=32, help="envs played at once (one forward pass each step)")
    # the learning settings: unset (None), each is the library's default (PPOConfig, Agent, the model's registry entry)
    parser.add_argument("--batch-size", type=int, help="hands per PPO update (default: 32 hands and >= 128 turns)")
    parser.add_argument("--lr", type=float, help="learning rate of the LoRA adapter and value head")
    parser.add_argument("--ent-coef", type=float, help="entropy bonus")
    parser.add_argument(
        "--natural-gradient",
        action=argparse.BooleanOptionalAction,
        help="PPO steps in function space, per state (the default with LoRA); --no-natural-gradient = AdamW",
    )
    parser.add_argument("--target-kl", type=float, help="also stop an update past 1.5x this KL")
    parser.add_argument("--lora-layers", type=int, help="adapt the top N layers only (0 = all)")
    parser.add_argument(
        "--sft-warm-start",
        action=argparse.BooleanOptionalAction,
        help="imitate won hands after each update (the default in generate mode)",
    )
    parser.add_argument("--action-mode", choices=["score", "generate"], default="score")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="reply length in generate mode")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--output-dir", default="runs/blackjack", help="metrics, checkpoint, evaluation, plots")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="updates between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue exactly from OUTPUT_DIR/checkpoint")
    parser.add_argument("--max-updates", type=int, default=0, help="stop (checkpointed) after N updates; 0 = no limit")
    parser.add_argument("--eval-only", action="store_true", help="evaluate (and plot) the checkpoint, no training")
    parser.add_argument("--eval-episodes", type=int, default=0, help="also play N greedy hands (95%% CI)")
    parser.add_argument("--eval-every", type=int, default=5, help="log the exact return every N updates (0 = off)")
    parser.add_argument("--wandb", action="store_true", help="log to Weights & Biases (also when WANDB_PROJECT set)")
    return parser.parse_args()


def greedy_table(agent):
    """The greedy action in each of the 280 states (batched greedy passes, nothing recorded)."""
    return dict(zip(STATES, agent.predict(STATES), strict=True))


def evaluate(agent, args, output_dir, returns, name="eval"):
    """Exact expected return of the greedy policy, optional sampled check; rank 0 writes the JSON and both pictures.

    Every rank computes it (the same table): with the base sharded (FSDP) each forward pass is a collective.
    """
    table = greedy_table(agent)
    result = {"exact": exact_return(table), "references": reference_returns(), "episodes_trained": len(returns)}
    if not distributed.is_main():
        return result
    if args.eval_episodes:
        env = gym.make("Blackjack-v1", natural=False, sab=False)

        def play(seed):
            observation, _ = env.reset(seed=seed)
            total, done = 0.0, False
            while not done:
                observation, reward, terminated, truncated, _ = env.step(table[tuple(int(x) for x in observation)])
                total, done = total + reward, terminated or truncated
            return total

        result["sampled"] = sampled_return(play, args.eval_episodes, seed=10**6)
    save_json(output_dir / f"{name}.json", result)
    references = {k: v["expected_return"] for k, v in result["references"].items()}
    if returns:
        window = max(50, len(returns) // 15)  # a hand's return is -1, 0 or 1: average enough to see a trend
        plot_learning_curve(returns, output_dir / "learning_curve.png", window=window, references=references)
    plot_blackjack_policy(policy_table(table), policy_table(optimal_policy()), output_dir / "policy.png")
    return result


def make_agent(args) -> BlackjackAgent:
    """The model of `--model` with a LoRA adapter, trained with the library's defaults and the flags that were set."""
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device)
    chosen = {
        "batch_size": args.batch_size,
        "min_batch_turns": 0 if args.batch_size else None,  # --batch-size counts hands, whatever their turns
        "learning_rate": args.lr,
        "ent_coef": args.ent_coef,
        "natural_gradient": args.natural_gradient,
        "target_kl": args.target_kl,
    }
    lora_layers = "auto" if args.lora_layers is None else min(args.lora_layers, model.config.num_hidden_layers) or None
    return BlackjackAgent(
        model,
        tokenizer,
        ppo_config=PPOConfig(seed=args.seed, **{key: value for key, value in chosen.items() if value is not None}),
        replay_config=ReplayConfig(min_return=1.0),  # when imitating (--sft-warm-start): won hands only
        generation_config={"max_new_tokens": args.max_new_tokens},
        sft_warm_start=args.sft_warm_start,
        use_target_kl=args.target_kl is not None,
        action_mode=args.action_mode,
        precision=args.precision,
        lora_layers=lora_layers,  # the backward pass stops at the lowest adapted layer
        fallback_action=0,  # stick when a generated reply names no action
        action_space=gym.make("Blackjack-v1", natural=False, sab=False).action_space,
    )


def resume(agent, run, missing_ok: bool = False) -> dict:
    """The loop's state from OUTPUT_DIR/checkpoint, the agent resumed with it; {} if there is none and `missing_ok`."""
    state = run.load(agent, missing_ok=missing_ok)
    if state:
        print(f"resumed from {run.checkpoint}: {len(state.get('returns', []))} episodes, {run.updates} updates")
    return state


def envs_to_play(args, agent, state: dict, episodes_done: int):
    """(envs, observations, next seed): the checkpoint's envs mid-hand, with their RNGs, as the agent's running
    episodes left them (an exact resume); else new ones, reset with seeds from SEED * 10**7 + episodes_done."""
    if "envs" in state:
        return state["envs"], state["observations"], state["next_seed"]
    agent.abort_episodes()  # no envs to continue the running episodes with (a fresh run: a no-op)
    envs = [gym.make("Blackjack-v1", natural=False, sab=False) for _ in range(min(args.num_envs, args.episodes))]
    seed = args.seed * 10**7 + distributed.rank() * 10**6 + episodes_done  # each rank plays its own hands
    return envs, [e.reset(seed=seed + i)[0] for i, e in enumerate(envs)], seed + len(envs)


def exact_eval(agent, every: int, update: int) -> dict:
    """Every `every` updates (0 = never): the exact expected return of the greedy policy, as a metrics entry."""
    if not every or update % every:
        return {}
    value = exact_return(greedy_table(agent))["expected_return"]
    if distributed.is_main():
        tqdm.write(f"update {update}: exact return of the greedy policy {value:+.4f}")
    return {"eval/exact_return": value}


def report(result, episodes: int, updates: int, wall: float, output_dir) -> None:
    """The run in a few lines: its size, the greedy policy's exact return beside the references, its outputs."""
    exact = result["exact"]
    print(f"episodes {episodes}, updates {updates}, wall {wall / 60:.1f} min")
    print(
        f"exact expected return of the greedy policy: {exact['expected_return']:+.4f} "
        f"(win {exact['win']:.1%}, draw {exact['draw']:.1%}, loss {exact['loss']:.1%})"
    )
    for name, ref in result["references"].items():
        print(f"  reference {name:>15}: {ref['expected_return']:+.4f}")
    print(f"outputs in {output_dir}: metrics.jsonl, eval.json, learning_curve.png, policy.png, checkpoint/")


def main():
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    run = RunLog(args.output_dir, wandb=args.wandb, config=vars(args))  # joins a launcher's ranks, if any
    main_rank, ranks = distributed.is_main(), distributed.world_size()
    pause_after = args.max_updates  # a user's limit: the run stops checkpointed, to be continued with --resume
    if ranks > 1 and not args.max_updates:  # every rank must make as many updates: count updates, not hands
        defaults = PPOConfig()  # a default batch is 32 hands and at least 128 turns: count it as 128 hands
        per_update = args.batch_size or max(defaults.batch_size, defaults.min_batch_turns)
        args.max_updates = max(1, args.episodes // per_update)
    agent = make_agent(args)
    state = resume(agent, run, missing_ok=not args.resume) if args.resume or args.eval_only else {}
    returns, invalid = state.get("returns", []), state.get("invalid", [])  # per hand: its return, its invalid replies
    if args.eval_only:
        print(json.dumps(evaluate(agent, args, run.dir, returns)["exact"], indent=2))
        return run.close()
    if not returns:  # on every rank (see evaluate); rank 0 writes and prints
        before = evaluate(agent, args, run.dir, returns, name="eval_before")["exact"]["expected_return"]
        if main_rank:
            print(f"exact expected return before training: {before:+.4f}")
    envs, obs, next_seed = envs_to_play(args, agent, state, len(returns))

    # ---- the RL loop: N envs side by side, one batched forward pass per step ----
    run.start()
    progress = tqdm(total=args.episodes, initial=len(returns), desc="blackjack", disable=not main_rank)
    stopped = False
    while (len(returns) < args.episodes or ranks > 1) and not stopped:
        actions = agent.act_batch(obs)
        results = [e.step(a) for e, a in zip(envs, actions, strict=True)]  # (obs, reward, terminated, truncated, info)
        agent.assign_rewards([r[1] for r in results])
        stats = agent.end_episodes([r[2] or r[3] for r in results], truncated=[r[3] and not r[2] for r in results])
        returns += [e.episode_return for e in agent.ended_episodes]
        invalid += [e.invalid_rate for e in agent.ended_episodes]
        for i, (observation, _, terminated, truncated, _) in enumerate(results):
            obs[i] = observation
            if terminated or truncated:
                obs[i], next_seed = envs[i].reset(seed=next_seed)[0], next_seed + 1
        progress.update(len(agent.ended_episodes))

        if "ppo/policy_loss" in stats:  # the batch was full: an update ran
            stats.update(episodes=len(returns), running_return=float(np.mean(returns[-200:])))
            stats.update(exact_eval(agent, args.eval_every, update=run.updates + 1))
            run.log(stats)
            progress.set_postfix(ret=f"{stats['running_return']:+.3f}", invalid=f"{np.mean(invalid[-200:]):.2f}")
            stopped = 0 < args.max_updates <= run.updates
            if run.updates % args.checkpoint_every == 0 or stopped:  # after the resets: envs and episodes agree
                run.save(agent, returns=returns, invalid=invalid, envs=envs, observations=obs, next_seed=next_seed)
    if not stopped and agent.batch:  # a last, partial batch (e.g. a 5-hand sanity run): trained on, logged
        run.log({**agent.train(), "episodes": len(returns)})
    progress.close()
    if stopped and pause_after:
        if main_rank:
            print(f"stopped after {run.updates} updates ({len(returns)} episodes); continue with --resume")
        return run.close()

    wall = run.elapsed
    if not stopped:  # a stopped run saved its checkpoint with its last update
        run.save(agent, returns=returns, invalid=invalid, envs=envs, observations=obs, next_seed=next_seed)
    result = evaluate(agent, args, run.dir, returns)
    if main_rank:
        report(result, len(returns), run.updates, wall, run.dir)
    run.close(final={"eval/exact_return": result["exact"]["expected_return"]})


if __name__ == "__main__":
    main()
