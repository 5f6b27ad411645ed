"""Where rooms' policy goes wrong: its exact sampled policy at every (room, goal), and the greedy walks it sends astray.

A scoring-mode run of the suite's rooms (through `learning_suite.py`: the same loop, budget, evaluations and outputs;
every flag of it works here) that, at each evaluation, also asks the latest weights for their policy over the doors
at every (room, goal) state (the agent is Markov: that pair is all it sees) and computes, by dynamic programming over
the steps used:

- `sampled`: the sampled policy's SPL, normalised as the greedy one is (0 = random, 1 = optimal);
- `greedy`: the latest weights' greedy SPL, normalised (the suite's `latest_normalised`, computed from the table; on a
  bf16 CPU the two can part where doors tie in the table's bf16 reading, the suite's evaluation being in fp32);
- `entropy`: the sampled policy's mean entropy over the states it meets, each as a fraction of ln(its doors);
- `on_shortest`: the share of its choices, weighted by how often it meets each state, that are on a shortest path;
- `errors`: the states where the greedy door is not on a shortest path, each with the door, its probability and
  that of the shortest doors (`p_shortest`), how often sampled play meets the state per episode (`reach`), and the
  tasks whose greedy walk passes there (`tasks`: start, shortest distance, steps taken or None when it never arrives);
- `thin`: the states whose greedy door is right but whose shortest doors have probability under `THIN`.

    python benchmarks/rooms_walks.py --seeds 66 --budget 600 --eval-every 20 --ppo policy_lam=0.5
"""

from __future__ import annotations

import math
import sys

import learning_suite  # beside this file
import numpy as np

from llamagym.envs import rooms

THIN = 0.6
State = tuple[int, int]  # (room, goal)
Policy = dict[State, dict[int, float]]  # state -> {door: probability}


def states(layout: rooms.Layout) -> list[State]:
    n = layout.num_rooms
    return [(room, goal) for goal in range(n) for room in range(n) if room != goal]


def on_shortest(layout: rooms.Layout, room: int, goal: int, door: int) -> bool:
    return layout.distance[door][goal] == layout.distance[room][goal] - 1


def spl(policy: Policy, layout: rooms.Layout, limit: int) -> float:
    """Exact SPL (= expected return) of `policy` over every ordered (start, goal) pair, equally likely.

    W[k][room] = E[1 / T] from `room` with k steps used (T: the step that reaches the goal; 1 / T = 0 when none
    does within `limit`), backwards from W[limit] = 0; the SPL averages d(start, goal) * W[0][start]."""
    n, total = layout.num_rooms, 0.0
    for goal in range(n):
        later = [0.0] * n
        for k in range(limit - 1, -1, -1):
            later = [
                0.0
                if room == goal
                else sum(p * (1 / (k + 1) if door == goal else later[door]) for door, p in policy[room, goal].items())
                for room in range(n)
            ]
        total += sum(layout.distance[start][goal] * later[start] for start in range(n) if start != goal)
    return total / (n * (n - 1))


def occupancy(policy: Policy, layout: rooms.Layout, limit: int) -> dict[State, float]:
    """How often sampled play meets each state per episode (starts uniform over the pairs; a state counts each time a
    door is chosen there)."""
    n = layout.num_rooms
    reach = dict.fromkeys(states(layout), 0.0)
    for goal in range(n):
        mass = np.array([0.0 if room == goal else 1.0 for room in range(n)])  # one episode from each start
        for _ in range(limit):
            moved = np.zeros(n)
            for room in range(n):
                if room != goal and mass[room] > 0:
                    reach[room, goal] += mass[room]
                    for door, p in policy[room, goal].items():
                        moved[door] += mass[room] * p
            moved[goal] = 0.0  # arrived: the episode ends
            mass = moved
    return {state: float(count) / (n * (n - 1)) for state, count in reach.items()}


def greedy(policy: Policy) -> dict[State, int]:
    """The greedy door of each state (ties: the first door, as the evaluator's arg-max)."""
    return {state: max(doors, key=doors.get) for state, doors in policy.items()}


def greedy_walk(doors: dict[State, int], start: int, goal: int, limit: int) -> list[int]:
    """The rooms a greedy walk passes through from `start` (included) until it arrives or runs out of steps."""
    path = [start]
    while path[-1] != goal and len(path) <= limit:
        path.append(doors[path[-1], goal])
    return path


def figures(policy: Policy, num_rooms: int = 8, layout_seed: int = 0, max_steps: int | None = None) -> dict:
    """The figures of the module docstring, from `policy`'s table over every state of the env with these arguments."""
    layout, limit = rooms.settings(num_rooms, layout_seed, max_steps)
    random, optimal = (
        rooms.random_spl(num_rooms, layout_seed, max_steps),
        rooms.optimal_spl(num_rooms, layout_seed, max_steps),
    )
    reach = occupancy(policy, layout, limit)
    doors = greedy(policy)
    walks = {(s, g): greedy_walk(doors, s, g, limit) for s, g in states(layout)}

    def normalised(value: float) -> float:
        return (value - random) / (optimal - random)

    def shortest_p(state: State) -> float:
        return sum(p for door, p in policy[state].items() if on_shortest(layout, *state, door))

    greedy_spl = sum(
        layout.distance[s][g] / (len(path) - 1) if path[-1] == g else 0.0 for (s, g), path in walks.items()
    ) / len(walks)
    choosing = [state for state in reach if len(policy[state]) > 1]
    met = sum(reach[state] for state in choosing)
    entropy = sum(
        reach[state] * -sum(p * math.log(p) for p in policy[state].values() if p > 0) / math.log(len(policy[state]))
        for state in choosing
    )
    errors, thin = [], []
    for state in states(layout):
        door = doors[state]
        if not on_shortest(layout, *state, door):
            tasks = [
                [s, layout.distance[s][g], len(path) - 1 if path[-1] == g else None]
                for (s, g), path in walks.items()
                if g == state[1] and state[0] in path[:-1]
            ]
            errors.append(
                {
                    "state": list(state),
                    "door": door,
                    "p_door": policy[state][door],
                    "p_shortest": shortest_p(state),
                    "reach": reach[state],
                    "tasks": tasks,
                }
            )
        elif shortest_p(state) < THIN:
            thin.append({"state": list(state), "p_shortest": shortest_p(state), "reach": reach[state]})
    return {
        "sampled": normalised(spl(policy, layout, limit)),
        "greedy": normalised(greedy_spl),
        "entropy": entropy / met if met else 0.0,
        "on_shortest": sum(reach[state] * shortest_p(state) for state in reach) / sum(reach.values()),
        "errors": errors,
        "thin": thin,
    }


def sampled_table(agent) -> Policy:
    """The latest weights' policy over the doors at every state, as training samples it
    (`learning_suite.sampled_probabilities`)."""
    layout = rooms.make_layout(agent.num_rooms, agent.layout_seed)
    keys = states(layout)  # each (room, goal) is also the observation
    found = learning_suite.sampled_probabilities(agent, keys)
    return {key: dict(zip(layout.doors[key[0]], p.tolist(), strict=True)) for key, p in zip(keys, found, strict=True)}


def probe(agent) -> dict:
    """What `learning_suite.py --probe` records at each evaluation of a rooms run."""
    return figures(sampled_table(agent), agent.num_rooms, agent.layout_seed)


def describe(probed: dict) -> list[str]:
    """An evaluation's probe in words (`learning_suite.probe_report`): a line, then one per wrong state."""
    thin = [(tuple(t["state"]), round(t["p_shortest"], 2)) for t in probed.get("thin", [])]
    lines = [
        f"from the table {probed.get('greedy', math.nan):.3f}, sampled {probed.get('sampled', math.nan):.3f}, "
        f"entropy {probed.get('entropy', math.nan):.2f}, on shortest {probed.get('on_shortest', math.nan):.2f}; "
        f"thin (state, p shortest): {thin}"
    ]
    for e in probed.get("errors", []):
        lines.append(
            f"      wrong {tuple(e['state'])}: door {e['door']} p {e['p_door']:.2f}, p shortest "
            f"{e['p_shortest']:.2f}, met {e['reach']:.3f}/episode; tasks (start, shortest, steps): "
            f"{[tuple(t) for t in e['tasks']]}"
        )
    return lines


learning_suite.PROBES["rooms"] = probe  # at import: a spawned run's child (--device cuda) registers it too

if __name__ == "__main__":
    sys.exit(learning_suite.probe_main("rooms", describe, sys.argv[1:]))
