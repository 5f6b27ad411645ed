"""Where Blackjack's policy falls short of optimal: its exact sampled policy at every state, along a training run.

A scoring-mode run of the suite's Blackjack (through `learning_suite.py`: the same loop, budget, evaluations and
outputs; every flag of it works here) that, at each evaluation, also asks the latest weights for P(hit) at each of the
280 states (the agent is Markov: the observation is the state) and computes, exactly:

- `sampled`: the sampled policy's expected return, normalised as the greedy one is (0 = random, 1 = optimal);
- `entropy`: its mean entropy over the states hands reach, weighted by how often, as a fraction of ln 2;
- `gap`: the optimal return minus the sampled policy's, per hand. It is the sum over states of how often a hand
  decides there (`reach`), times the probability of the action optimal play does not take (`p_wrong`), times what
  that action costs under optimal play (|Q*(hit) - Q*(stick)|, `cost`);
- `costly`: the states carrying the most of `gap` (the fewest whose shares sum to `COSTLY` of it, at most `MOST`),
  each with P(hit), the optimal action, `reach`, `cost`, its `share` of the gap, and `gain`: Q(hit) - Q(stick) under
  the sampled policy's own play from there on, the gain its advantages estimate. A state whose `gain` has the
  optimal action's sign is one the updates push the right way; one whose sign is wrong is held there by the policy's
  later play;
- `held`: the share of `gap` in states whose `gain` does not favour optimal play's action (the opposite sign, or
  none): held by the policy's later play; the rest lies where its own advantages point the right way;
- `hit`: P(hit) at each of `STATES`, in its order (the whole table, to plot or read again).

    python benchmarks/blackjack_states.py --seeds 86 --budget 600
"""

from __future__ import annotations

import math
import sys

import learning_suite  # beside this file

from llamagym.envs import blackjack as bj
from llamagym.envs.suite import normalised

COSTLY, MOST = 0.5, 10  # `costly` lists states until they carry this share of the gap, or MOST of them
TIE = 1e-9  # a gain this small is no push either way (e.g. hitting a hard 4 when every total after it sticks)


def figures(hit: dict[bj.State, float]) -> dict:
    """The sampled policy's figures (see the module docstring) from its P(hit) at every state."""
    best, optimal_gains = bj.optimal_policy(), bj.optimal_advantages()
    reach, gains = bj.visits(hit), bj.hit_gains(hit)
    references = {name: entry["expected_return"] for name, entry in bj.reference_returns().items()}
    score = bj.exact_return(hit)["expected_return"]
    shares = {}
    for state in bj.STATES:
        p_wrong = 1.0 - hit[state] if best[state] else hit[state]
        shares[state] = reach[state] * p_wrong * abs(optimal_gains[state])
    gap = sum(shares.values())
    pushed = {s: gains[s] > TIE if best[s] else gains[s] < -TIE for s in bj.STATES}  # its own gain favours optimal
    held = sum(share for state, share in shares.items() if not pushed[state])

    def entropy(p: float) -> float:
        return -sum(q * math.log(q) for q in (p, 1.0 - p) if q > 0)

    costly, carried = [], 0.0
    for state in sorted(bj.STATES, key=shares.get, reverse=True):
        if carried >= COSTLY * gap or len(costly) == MOST or shares[state] <= 0:
            break
        carried += shares[state]
        costly.append(
            {
                "state": list(state),
                "p_hit": hit[state],
                "optimal": "hit" if best[state] else "stick",
                "reach": reach[state],
                "cost": abs(optimal_gains[state]),
                "share": shares[state] / gap,
                "gain": gains[state],
            }
        )
    return {
        "sampled": normalised(score, references["uniform random"], references["optimal"]),
        "entropy": sum(reach[s] * entropy(hit[s]) for s in bj.STATES) / sum(reach.values()) / math.log(2),
        "gap": gap,
        "held": held / gap if gap > 0 else 0.0,
        "costly": costly,
        "hit": [hit[state] for state in bj.STATES],
    }


def probe(agent) -> dict:
    """What `learning_suite.py --probe` records at each evaluation of a Blackjack run."""
    found = learning_suite.sampled_probabilities(agent, list(bj.STATES))
    hit = agent.action_names.index("hit")  # the candidates are `action_names`, the same at every state
    return figures({state: float(p[hit]) for state, p in zip(bj.STATES, found, strict=True)})


def describe(probed: dict) -> list[str]:
    """An evaluation's probe in words (`learning_suite.probe_report`): a line, then the costly states in one."""

    def name(state: list[int]) -> str:
        total, dealer, usable = state
        return f"{'soft' if usable else 'hard'} {total} v {dealer}"

    costly = [
        f"{name(c['state'])} ({c['optimal']}): p hit {c['p_hit']:.2f}, share {c['share']:.2f}, gain {c['gain']:+.2f}"
        for c in probed.get("costly", [])
    ]
    carried = sum(c["share"] for c in probed.get("costly", []))
    return [
        f"sampled {probed.get('sampled', math.nan):.3f}, entropy {probed.get('entropy', math.nan):.2f}, gap "
        f"{probed.get('gap', math.nan):.4f}/hand, held by later play {probed.get('held', math.nan):.2f} of it",
        f"      costly ({carried:.2f} of the gap): " + "; ".join(costly),
    ]


learning_suite.PROBES["blackjack"] = probe  # at import: a spawned run's child (--device cuda) registers it too

if __name__ == "__main__":
    sys.exit(learning_suite.probe_main("blackjack", describe, sys.argv[1:]))
