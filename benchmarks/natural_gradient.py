"""How fast can the LoRA policy fit Blackjack's optimal table when the advantages are known exactly?

This isolates the optimiser from the noise of reinforcement learning. Both runs start from the same fresh adapter
of the embedded default model with the Blackjack example's prompts and settings (scoring mode, LoRA on the top 8
layers), and follow the exact policy-gradient objective over all 280 states,

    J = mean_s pi(hit | s) * (Q*(s, hit) - Q*(s, stick)),

side by side: the trainer's AdamW at the example's learning rate, and the natural-gradient step of
`llamagym.algos.natural_gradient` with the example's step size, damping and norm clip. It prints, every few steps,
J, the exact expected return of the greedy policy, and how many of the 280 states agree with the optimal action.

    python benchmarks/natural_gradient.py            # 30 steps each (about 6 minutes on 2 cores)
    python benchmarks/natural_gradient.py --steps 3  # checks that the script works
"""

import argparse
import json
import time
from pathlib import Path

import gymnasium as gym
import torch

from llamagym import load_model_and_tokenizer
from llamagym.agent.choosing import decide
from llamagym.algos.natural_gradient import RowGradients, natural_direction, subtract_flat
from llamagym.algos.rollout import collate_scored
from llamagym.envs.blackjack import STATES, BlackjackAgent, exact_return, optimal_advantages, optimal_policy


def run(method, args, gains, best):
    model, tokenizer = load_model_and_tokenizer(args.model)
    agent = BlackjackAgent(  # the example's agent: its prompts, action names and context_turns = 0
        model,
        tokenizer,
        lora_layers=args.lora_layers,
        action_space=gym.make("Blackjack-v1").action_space,
    )
    policy = agent.policy
    decisions = [decide(agent, [s], [[]], ["bench"], True)[0] for s in STATES]
    batch = collate_scored([d.prompt for d in decisions], [d.candidates for d in decisions])
    advantage = torch.tensor([gains[s] for s in STATES])
    params = [p for n, p in policy.named_parameters() if "lora_" in n and p.requires_grad]
    adam = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rows = RowGradients(policy, params)
    history, start = [], time.perf_counter()
    for step in range(args.steps + 1):
        with rows.recording(), policy.autocast():
            out = policy.score(batch)
            rows.watch(out.logprobs)
        p_hit = out.logprobs[:, 1].float().exp()
        greedy = {s: int(p > 0.5) for s, p in zip(STATES, p_hit.tolist(), strict=True)}
        record = {
            "step": step,
            "objective": float((p_hit * advantage).mean().detach()),
            "exact_return": exact_return(greedy)["expected_return"],
            "agree": sum(greedy[s] == best[s] for s in STATES),
            "seconds": round(time.perf_counter() - start, 1),
        }
        history.append(record)
        if step % args.every == 0 or step == args.steps:
            print(f"{method:8s} {json.dumps(record)}", flush=True)
        if step == args.steps:
            break
        loss = -(p_hit * advantage).mean()
        loss.backward()
        grads, targets = rows.take()
        if method == "adamw":
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            adam.step()
        else:
            step_vector, _ = natural_direction(
                grads, targets, args.damping, args.step * len(STATES), args.max_grad_norm
            )
            subtract_flat(params, step_vector)
        adam.zero_grad(set_to_none=True)
        policy.version += 1
    return history


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="print every N steps")
    parser.add_argument("--lora-layers", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (round 1's Blackjack example)")
    parser.add_argument("--step", type=float, default=1.0, help="natural-gradient step (round 1's Blackjack example)")
    parser.add_argument("--damping", type=float, default=0.03, help="natural-gradient relative damping")
    parser.add_argument("--max-grad-norm", type=float, default=0.3, help="step-norm clip (round 1's Blackjack example)")
    parser.add_argument("--output", default="benchmarks/results/natural_gradient.json")
    args = parser.parse_args()
    gains, best = optimal_advantages(), optimal_policy()
    results = {"args": vars(args), "optimal_agree": len(STATES)}
    for method in ("adamw", "natural"):
        torch.manual_seed(0)  # the same fresh adapter for both
        results[method] = run(method, args, gains, best)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
    for method in ("adamw", "natural"):
        last = results[method][-1]
        print(
            f"{method:8s} after {last['step']} steps: exact return {last['exact_return']:+.4f}, "
            f"{last['agree']}/280 states optimal, {last['seconds']:.0f} s"
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
