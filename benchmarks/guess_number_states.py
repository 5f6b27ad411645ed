"""Where guess-the-number's policy goes wrong: its exact sampled policy at every state, along a training run.

A scoring-mode run of the suite's guess-the-number (through `learning_suite.py`: the same loop, budget, evaluations
and outputs; every flag of it works here) that, at each evaluation, also asks the latest weights for their policy over
the 16 guesses at every state play can reach (an interval and the guesses left: the agent is Markov) and computes, by
dynamic programming over those states:

- `sampled`: the sampled policy's success rate, normalised as the greedy one is (0 = random, 1 = optimal);
- `entropy`: its mean entropy over the states it visits, as a fraction of ln 16;
- `on_optimal`: the share of its choices, weighted by how often it meets each state, that an optimal policy could make;
- `errors`: the states of the latest weights' greedy play where its guess is not optimal, each with how many secrets
  pass there (`reach`), the guess and its probability, the sampled policy's own value of that guess and of its best
  one (`q_guess`, `q_best`: does the policy's later play make the better guess look better?), and the probability of
  the optimal guesses (`p_optimal`).

The sixty-third session's notebook section (docs/learning-that-holds.md) reads four runs this way.

    python benchmarks/guess_number_states.py --seeds 39 --budget 600 --eval-every 60
"""

from __future__ import annotations

import math
import sys

import learning_suite  # beside this file
import numpy as np

from llamagym.envs import guess_number
from llamagym.envs.guess_number import references

N, K = 16, 5  # the suite's size of the game
Key = tuple[int, int, int]  # (low, high, guesses left): the interval still possible, as the player sees it


def reachable(n: int = N, k: int = K) -> list[Key]:
    """Every state play can reach from (1, n, k), whatever is guessed, ordered by guesses left (fewest first)."""
    seen, todo = set(), [(1, n, k)]
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        for guess in range(1, n + 1):
            todo += [following for _, _, following in outcomes(key, guess) if following is not None]
    return sorted(seen, key=lambda key: (key[2], key))


def outcomes(key: Key, guess: int) -> list[tuple[float, float, Key | None]]:
    """(probability, reward, next state or None once the game is over) of guessing `guess` in state `key`
    (`guess_number.outcomes`, with states as keys)."""
    found = guess_number.outcomes(*key, guess)
    return [(p, reward, None if nxt is None else (nxt.low, nxt.high, nxt.left)) for p, reward, nxt in found]


def action_values(policy: dict[Key, np.ndarray] | None, keys: list[Key], n: int = N):
    """(V, Q): each state's success probability under `policy` (state -> probabilities of guesses 1..n), and each
    guess's there, followed by `policy`; with `policy=None`, the optimal ones (V = max over guesses of Q)."""
    values, q = {}, {}
    for key in keys:  # fewest guesses left first: every next state is done
        q[key] = np.array(
            [sum(p * (r + (values[nxt] if nxt else 0.0)) for p, r, nxt in outcomes(key, g)) for g in range(1, n + 1)]
        )
        values[key] = float(q[key].max() if policy is None else policy[key] @ q[key])
    return values, q


def occupancy(policy: dict[Key, np.ndarray], keys: list[Key], n: int = N, k: int = K) -> dict[Key, float]:
    """How often the sampled `policy` meets each state in one game (the start: 1)."""
    reach = dict.fromkeys(keys, 0.0)
    reach[(1, n, k)] = 1.0
    for key in reversed(keys):  # most guesses left first: every earlier state is done
        for g in range(1, n + 1):
            for p, _, nxt in outcomes(key, g):
                if nxt is not None:
                    reach[nxt] += reach[key] * policy[key][g - 1] * p
    return reach


def greedy_errors(policy: dict[Key, np.ndarray], keys: list[Key], n: int = N, k: int = K, q=None) -> list[dict]:
    """The states of `policy`'s greedy play whose guess is not optimal (see the module docstring); `q`: the policy's
    action values over `keys` when the caller has them."""
    q = action_values(policy, keys, n)[1] if q is None else q
    best, q_star = action_values(None, keys, n)
    errors, todo = [], [((1, n, k), 1.0)]
    while todo:
        key, reach = todo.pop()
        guess = int(policy[key].argmax()) + 1
        optimal = q_star[key] >= best[key] - 1e-9
        if not optimal[guess - 1]:
            errors.append(
                {
                    "state": list(key),
                    "reach": reach * n,
                    "guess": guess,
                    "p_guess": float(policy[key][guess - 1]),
                    "q_guess": float(q[key][guess - 1]),
                    "q_best": float(q[key].max()),
                    "p_optimal": float(policy[key][optimal].sum()),
                }
            )
        todo += [(nxt, reach * p) for p, _, nxt in outcomes(key, guess) if nxt is not None]
    return errors


def figures(policy: dict[Key, np.ndarray], keys: list[Key], n: int = N, k: int = K) -> dict:
    """The sampled policy's figures (see the module docstring) from its table over `keys`."""
    values, q = action_values(policy, keys, n)
    best, q_star = action_values(None, keys, n)
    reach = occupancy(policy, keys, n, k)
    total = sum(reach.values())
    entropy = sum(reach[s] * -float(policy[s] @ np.log(np.clip(policy[s], 1e-30, None))) for s in keys)
    on_optimal = sum(reach[s] * float(policy[s][q_star[s] >= best[s] - 1e-9].sum()) for s in keys)
    refs = references(n, k)
    return {
        "sampled": (values[(1, n, k)] - refs["random"]) / (refs["optimal"] - refs["random"]),
        "entropy": entropy / total / math.log(n),
        "on_optimal": on_optimal / total,
        "errors": greedy_errors(policy, keys, n, k, q),
    }


def sampled_table(agent, keys: list[Key], n: int = N) -> dict[Key, np.ndarray]:
    """The latest weights' policy over guesses 1..n at every state of `keys`, as training samples it
    (`learning_suite.sampled_probabilities`)."""
    found = learning_suite.sampled_probabilities(agent, [(n, *key) for key in keys])
    return dict(zip(keys, found, strict=True))


def probe(agent) -> dict:
    """What `learning_suite.py --probe` records at each evaluation of a guess-the-number run."""
    keys = reachable()
    return figures(sampled_table(agent, keys), keys)


def describe(probed: dict) -> list[str]:
    """An evaluation's probe in words (`learning_suite.probe_report`)."""
    wrong = [(tuple(e["state"]), e["guess"], round(e["p_guess"], 2), round(e["p_optimal"], 2)) for e in
             probed.get("errors", [])]  # fmt: skip
    return [
        f"sampled {probed.get('sampled', math.nan):.3f}, entropy {probed.get('entropy', math.nan):.2f}, on optimal "
        f"{probed.get('on_optimal', math.nan):.2f}; wrong (state, guess, p, p optimal): {wrong}"
    ]


learning_suite.PROBES["guess_number"] = probe  # at import: a spawned run's child (--device cuda) registers it too

if __name__ == "__main__":
    sys.exit(learning_suite.probe_main("guess_number", describe, sys.argv[1:]))
