"""How much of a detour's cost GAE hands the detour, at each lambda, in the suite's rooms: exact, no model.

Rooms pays d(start, goal) / steps at the goal, so a detour costs reward that is only paid at the end, and the prompt
shows (room, goal), not the steps used: the best value head a prompt can have prices the room after a detour as it
prices the same room on a shortest walk. A bootstrapped advantage (low lambda) leans on that head, so the detour's cost
reaches the detour only through the (gamma * lambda)^k tail to the reward. This computes it exactly, by dynamic
programming over the full state (room, goal, start, steps used: `rooms.State`, stepped by `rooms.walk`), for a policy
that takes a shortest-path door with probability 1 - eps and a uniformly drawn door with probability eps:

- `prompt head`: the best function of (room, goal), the on-policy occupancy-weighted mean of the true values (the
  value a head fit to Monte-Carlo returns tends to), with the time limit bootstrapped from it as the trainer does;
- `prompt + turn head`: the best head of the form f(room, goal) + b[steps used] (visit-weighted least squares of
  the true values, the least-norm one), what a value head of the prompt with a value per turn index can be at best
  (`PPOConfig.turn_values`); the time limit bootstraps from f(room, goal) + b[limit], b[limit] never fit (0);
- `full-state head`: the true value of the full state (0 once time is up), for which GAE's expected advantage is
  Q - V at every lambda.

Each figure is the credit gap: GAE's expected advantage of the shortest doors minus that of the other doors, as a
fraction of the true gap Q(shortest) - Q(detour), averaged over the states the policy visits (weighted by visits).
The eighty-second and eighty-fourth sessions' notebook sections (docs/learning-that-holds.md) read it.

    python benchmarks/lambda_credit.py
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch

from llamagym.envs import rooms

Full = rooms.State  # (room, goal, start, steps used): everything the reward hangs on


class House:
    """The suite's rooms game as exact tables under the eps-greedy policy of shortest paths."""

    def __init__(self, num_rooms: int = 8, layout_seed: int = 0, eps: float = 0.1, gamma: float = 0.99):
        self.layout, self.limit = rooms.settings(num_rooms, layout_seed)
        self.eps, self.gamma = eps, gamma
        n = self.layout.num_rooms
        pairs = [(r, g) for r, g in itertools.product(range(n), repeat=2) if r != g]
        self.states = [Full(r, g, s, k) for r, g in pairs for s in range(n) if s != g for k in range(self.limit)]
        self.backwards = sorted(self.states, key=lambda s: -s.steps)  # a state's successors (one step more) first
        self.values, self.q = self._true_values()
        self.visits = self._visits()

    def policy(self, room: int, goal: int) -> dict[int, float]:
        """Door -> probability: a shortest-path door (uniformly) with 1 - eps, any door (uniformly) with eps."""
        doors = self.layout.doors[room]
        shortest = [a for a in doors if self.is_shortest(room, goal, a)]
        return {a: (1 - self.eps) * (a in shortest) / len(shortest) + self.eps / len(doors) for a in doors}

    def is_shortest(self, room: int, goal: int, door: int) -> bool:
        return self.layout.distance[door][goal] < self.layout.distance[room][goal]

    def outcome(self, state: Full, door: int) -> tuple[float, Full | None, bool]:
        """(reward, next state or None when the episode ends at the goal, whether it ended on the time limit)."""
        after, reward, terminated, truncated = rooms.walk(self.layout, state, door, self.limit)
        return reward, None if terminated else after, truncated

    def _true_values(self) -> tuple[dict[Full, float], dict[tuple[Full, int], float]]:
        values, q = {}, {}
        for state in self.backwards:
            for door in self.policy(*state[:2]):
                reward, after, timed_out = self.outcome(state, door)
                q[state, door] = reward if after is None or timed_out else self.gamma * values[after]
            values[state] = sum(p * q[state, door] for door, p in self.policy(*state[:2]).items())
        return values, q

    def _visits(self) -> dict[Full, float]:
        """Expected visits of each state per episode, (start, goal) uniform over the ordered pairs of rooms."""
        visits = dict.fromkeys(self.states, 0.0)
        n = self.layout.num_rooms
        for start, goal in itertools.product(range(n), repeat=2):
            if start != goal:
                visits[Full(start, goal, start, 0)] += 1 / (n * (n - 1))
        for state in reversed(self.backwards):
            for door, p in self.policy(*state[:2]).items():
                _, after, timed_out = self.outcome(state, door)
                if after is not None and not timed_out:
                    visits[after] += visits[state] * p
        return visits

    def prompt_head(self) -> Callable[[Full], float]:
        """The best value head of (room, goal): the visit-weighted mean of the true values of its full states."""
        total, weight = {}, {}
        for state, visits in self.visits.items():
            total[state[:2]] = total.get(state[:2], 0.0) + visits * self.values[state]
            weight[state[:2]] = weight.get(state[:2], 0.0) + visits
        head = {key: total[key] / weight[key] if weight[key] > 0 else 0.0 for key in total}
        return lambda state: head[state[:2]]

    def turn_head(self) -> Callable[[Full], float]:
        """The best head f(room, goal) + b[steps used]: visit-weighted least squares over the visited states, the
        least-norm solution (f and b share a constant); b[limit], for the time limit's bootstrap, is never fit: 0."""
        visited = [state for state, visits in self.visits.items() if visits > 0]
        pairs = {key: i for i, key in enumerate(sorted({state[:2] for state in self.states}))}
        rows = torch.zeros(len(visited), len(pairs) + self.limit + 1, dtype=torch.float64)
        for row, state in enumerate(visited):
            rows[row, pairs[state[:2]]] = rows[row, len(pairs) + state.steps] = 1.0
        weight = torch.tensor([self.visits[state] for state in visited], dtype=torch.float64).sqrt()
        values = torch.tensor([self.values[state] for state in visited], dtype=torch.float64)
        fit = torch.linalg.lstsq(rows * weight[:, None], (values * weight)[:, None], driver="gelsd").solution
        coef = fit.squeeze(-1).tolist()
        return lambda state: coef[pairs[state[:2]]] + coef[len(pairs) + state.steps]

    def full_state_head(self) -> Callable[[Full], float]:
        """The true value of the full state; 0 once the time limit is reached (nothing more can be paid)."""
        return lambda state: self.values[state] if state.steps < self.limit else 0.0

    def expected_gae(self, head: Callable[[Full], float], lam: float) -> dict[tuple[Full, int], float]:
        """E[GAE advantage] of each (state, door) under the policy: the TD error plus gamma * lam times the next
        state's expected advantage; a timed-out episode bootstraps from the head's value of its next state."""
        advantage, expected = {}, {}
        for state in self.backwards:
            for door in self.policy(*state[:2]):
                reward, after, timed_out = self.outcome(state, door)
                if after is None:
                    gae = reward - head(state)
                else:
                    gae = reward + self.gamma * head(after) - head(state)  # the TD error, then the later ones'
                    if not timed_out:
                        gae += self.gamma * lam * expected[after]
                advantage[state, door] = gae
            expected[state] = sum(p * advantage[state, door] for door, p in self.policy(*state[:2]).items())
        return advantage

    def credit(self, advantage: dict[tuple[Full, int], float]) -> float:
        """Visit-weighted gap of `advantage` between shortest and other doors, as a fraction of the true gap."""
        got = true = 0.0
        for state, visits in self.visits.items():
            doors = list(self.policy(*state[:2]))
            short = [a for a in doors if self.is_shortest(*state[:2], a)]
            other = [a for a in doors if a not in short]
            if visits == 0 or not other:
                continue
            got += visits * (_mean(advantage[state, a] for a in short) - _mean(advantage[state, a] for a in other))
            true += visits * (_mean(self.q[state, a] for a in short) - _mean(self.q[state, a] for a in other))
        return got / true


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rooms", type=int, default=8, help="rooms in the house (the suite's: 8)")
    parser.add_argument("--layout-seed", type=int, default=0, help="which house (the suite's: 0)")
    parser.add_argument("--gamma", type=float, default=0.99, help="the discount (PPOConfig.gamma)")
    parser.add_argument("--eps", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="share of uniform doors")
    parser.add_argument("--lams", type=float, nargs="+", default=[0.0, 0.5, 0.8, 0.95, 1.0], help="GAE lambdas")
    args = parser.parse_args(argv)
    print("Credit gap at each lambda: E[GAE advantage] of shortest doors minus other doors, over the true gap.\n")
    print("| eps | head | " + " | ".join(f"lambda {lam:g}" for lam in args.lams) + " |")
    print("| --- | --- |" + " --- |" * len(args.lams))
    for eps in args.eps:
        house = House(args.rooms, args.layout_seed, eps, args.gamma)
        heads = (
            ("prompt", house.prompt_head()),
            ("prompt + turn", house.turn_head()),
            ("full state", house.full_state_head()),
        )
        for name, head in heads:
            figures = [house.credit(house.expected_gae(head, lam)) for lam in args.lams]
            print(f"| {eps:g} | {name} | " + " | ".join(f"{f:.3f}" for f in figures) + " |")


if __name__ == "__main__":
    main()
