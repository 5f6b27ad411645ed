"""What an agent says: its greedy reply in every state of a suite game's exact evaluation, and what its sampled
replies look like (their length, how many name no action, the time a call takes).

Reads an agent saved by `learning_suite.py --keep-agents` (any `Agent.save` of a suite game's agent will do), or the
untrained model without `--agent`:

    python benchmarks/learning_suite.py --games tictactoe --modes generate --seeds 1 --keep-agents --output out
    python benchmarks/greedy_replies.py --game tictactoe --agent out/agents/tictactoe-generate-seed1

Prints markdown: the exact figures of the greedy policy, its replies that name no action (every reply with
`--all`), their lengths, and `--calls` sampled calls on first observations of fresh episodes. Greedy replies come from
the averaged adapter and sampled ones from the latest weights, as in training (`PPOConfig.average_updates`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # learning_suite.py beside this file

from learning_suite import cpu_model, make_agent  # noqa: E402

import llamagym.envs as suite  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--game", required=True, help=f"one of: {', '.join(suite.GAMES)}")
    parser.add_argument("--agent", default=None, help="a saved agent's directory (default: the untrained model)")
    parser.add_argument("--mode", default="generate", choices=["generate", "score"], help="the agent's action mode")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the base model the agent was trained on")
    parser.add_argument("--all", action="store_true", help="list every greedy reply, not only those naming no action")
    parser.add_argument("--calls", type=int, default=4, help="sampled calls, each on --envs first observations")
    parser.add_argument("--envs", type=int, default=16, help="observations per sampled call")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampled calls' episodes and tokens")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    try:
        args.game = suite.get_game(args.game).name
    except KeyError as err:
        parser.error(str(err))
    if args.agent is not None and not Path(args.agent).is_dir():
        parser.error(f"--agent should be a directory written by Agent.save. Received {args.agent!r}.")
    if args.calls < 0 or args.envs < 1:
        parser.error(f"--calls should be >= 0 and --envs >= 1. Received {args.calls} and {args.envs}.")
    return args


def lengths_line(lengths: list[int]) -> str:
    """Median, 90th percentile and longest of token counts, as one line."""
    ordered = sorted(lengths)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"median {statistics.median(ordered):g}, 90th percentile {p90}, longest {ordered[-1]} tokens"


def main(argv=None) -> None:
    args = parse_args(argv)
    import gymnasium as gym
    import torch

    from llamagym import PPOConfig, load_model_and_tokenizer
    from llamagym.agent.choosing import decide

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    game = suite.get_game(args.game)
    model, tokenizer = load_model_and_tokenizer(args.model)
    env = gym.make(game.env_id)
    agent = make_agent(game, model, tokenizer, env.action_space, args.mode, PPOConfig(seed=args.seed))
    if args.agent is not None:
        agent.load(args.agent, restore_rng=False, restore_episodes=False)

    print(f"# {game.name}, {args.mode} mode: {args.agent or 'the untrained model'}\n")
    print(f"- CPU: {cpu_model()}; model: {args.model}; policy in {agent.policy.precision}\n")
    decider = suite.AgentPolicy(agent)
    figures = game.evaluate(decider, **game.env_kwargs)
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}
    print(f"## The greedy policy, evaluated exactly\n\n{shown}\n")
    replies = decider.replies()
    unread = [(key, reply, action, valid) for key, reply, action, valid in replies if not valid]
    print(f"{len(replies)} distinct states asked, {len(unread)} replies naming no action (fallback played).\n")
    print("| state | greedy reply | action | named |\n| --- | --- | --- | --- |")
    for key, reply, action, valid in replies if args.all else unread:
        text = repr(reply).replace("|", "\\|")  # one table row: newlines and control characters escaped
        print(f"| {key} | {text} | {action} | {'yes' if valid else 'no'} |")
    lengths = [len(tokenizer(reply, add_special_tokens=False).input_ids) for _, reply, _, _ in replies]
    print(f"\nGreedy replies' text: {lengths_line(lengths)}.\n")

    if not args.calls:
        return
    print(f"## Sampled replies (latest weights), {args.calls} calls of {args.envs} first observations\n")
    seconds, lengths, unnamed = [], [], 0
    for call in range(args.calls):
        observations = [env.reset(seed=args.seed * 1_000_003 + call * args.envs + i)[0] for i in range(args.envs)]
        start = time.perf_counter()
        decisions = decide(agent, observations, [[] for _ in observations], ["sampled"] * args.envs, greedy=False)
        seconds.append(time.perf_counter() - start)
        lengths += [len(d.reply_ids) for d in decisions]
        unnamed += sum(not d.parsed.valid for d in decisions)
        if call == 0:
            for d in decisions:
                print(f"- {d.reply!r} -> {d.parsed.action}{'' if d.parsed.valid else ' (fallback)'}")
    limit = agent.generation["max_new_tokens"] if args.mode == "generate" else None
    at_limit = f", {sum(n >= limit for n in lengths) / len(lengths):.0%} at the limit ({limit})" if limit else ""
    print(
        f"\n{statistics.mean(seconds):.2f} s a call; replies: {lengths_line(lengths)}{at_limit}; "
        f"{unnamed / len(lengths):.0%} name no action."
    )


if __name__ == "__main__":
    main()
