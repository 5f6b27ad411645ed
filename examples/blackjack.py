"""Teach an LLM to play Blackjack with online RL (PPO on a LoRA adapter), on a laptop CPU.

Smoke run (seconds, tiny random model):  python examples/blackjack.py --model tiny-random --episodes 4 --device cpu
Sanity run (embedded SmolLM2-135M):     python examples/blackjack.py --episodes 5
Longer run:                            python examples/blackjack.py --episodes 400 --sft-warm-start --target-kl 0.05
"""

import argparse
import json
import os
import random
import re
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from tqdm import trange

from llamagym import Agent, PPOConfig, ReplayConfig, load_model_and_tokenizer


class BlackjackAgent(Agent):
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
        words = re.findall(r"\b(hit|stick|stand|stay|stop)\b|\b([01])\b", response.lower())
        if not words:
            return None
        word, digit = words[0]
        return int(digit) if digit else (1 if word == "hit" else 0)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=200, help="episodes to play (default: 200)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name, hub id or local path")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | mps (default: auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="episodes per PPO update")
    parser.add_argument("--lr", type=float, default=2e-4, help="learning rate")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="length of a reply in tokens")
    parser.add_argument("--target-kl", type=float, default=None, help="stop an update early past 1.5x this KL")
    parser.add_argument("--sft-warm-start", action="store_true", help="imitate the best episodes after updates")
    parser.add_argument("--output-dir", default="runs/blackjack", help="where metrics.jsonl and the adapter go")
    parser.add_argument("--wandb", action="store_true", help="log to Weights & Biases (or set WANDB_PROJECT)")
    return parser.parse_args()


def main():
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    run = None
    if args.wandb or os.environ.get("WANDB_PROJECT"):
        import wandb  # only when asked for

        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "llamagym"), config=vars(args))

    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device)
    ppo_config = PPOConfig(
        batch_size=args.batch_size,
        learning_rate=args.lr,
        seed=args.seed,
        target_kl=args.target_kl if args.target_kl is not None else 0.05,
    )
    env = gym.make("Blackjack-v1", natural=False, sab=False)
    agent = BlackjackAgent(
        model,
        tokenizer,
        ppo_config=ppo_config,
        replay_config=ReplayConfig(min_return=1.0),  # imitate won hands only
        generation_config={"max_new_tokens": args.max_new_tokens},
        sft_warm_start=args.sft_warm_start,
        use_target_kl=args.target_kl is not None,
        fallback_action=0,  # stick when a reply names no action
        action_space=env.action_space,
    )

    returns, invalid, start = [], [], time.time()
    progress = trange(args.episodes, desc="blackjack")
    with open(output_dir / "metrics.jsonl", "a") as metrics:
        for episode in progress:
            observation, info = env.reset(seed=args.seed + episode)
            done = False
            while not done:
                action = agent.act(observation)
                observation, reward, terminated, truncated, info = env.step(action)
                agent.assign_reward(reward)
                done = terminated or truncated
            stats = agent.terminate_episode(truncated=truncated and not terminated, final_observation=observation)

            returns.append(stats["env/return"])
            stats.update(episode=episode, elapsed_s=time.time() - start)
            metrics.write(json.dumps(stats) + "\n")
            if run is not None:
                run.log(stats)
            recent = returns[-50:]
            invalid.append(stats["agent/invalid_action_rate"])
            progress.set_postfix(ret=f"{sum(recent) / len(recent):+.2f}", invalid=f"{np.mean(invalid[-50:]):.2f}")

    agent.save(output_dir / "final")
    print(f"mean return over the last {min(50, len(returns))} episodes: {np.mean(returns[-50:]):+.3f}")
    print(f"metrics: {output_dir / 'metrics.jsonl'}  adapter: {output_dir / 'final'}")


if __name__ == "__main__":
    main()
