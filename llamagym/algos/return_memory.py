"""Each (state, action)'s returns remembered across batches: a low-noise action value for the turn's advantage.

Why: in a game with chance, one turn's return is mostly luck. A Blackjack hand that sticks ends +1 or -1 by the
dealer's cards, spread by about 0.95 per hand, where the gap between two actions of a state is 0.1-0.3; a batch holds
about 1.6 turns per state, so each state's step is mostly one hand's luck, and the trust region spends its bound on
that noise. Four times the hands per batch learned Blackjack where one time did not (docs/learning-that-holds.md,
fifth and eleventh sessions), at 2.5 times the cost of an update. The states of small games come back batch after
batch, so the returns of the last batches already hold those hands: averaging them costs nothing.

With `PPOConfig(return_memory=d)` (0 < d < 1) a value-based estimator's advantage becomes

    A_t = Q(s_t, a_t) - V(s_t),   Q(s, a) = sum_k d^k S_k(s, a) / sum_k d^k n_k(s, a)

over the batches k = 0 (this one), 1 (the last), ...: S_k and n_k the sum and count of the returns (the estimator's
value targets, the lambda-returns of gae) of the turns that acted a in s in batch k. s is the prompt, a the reply
(the chosen candidate's tokens, or the generated ones), compared exactly. Where a pair was met in this batch only,
Q is its turns' mean return. The value head's baseline V stays what it is; an action's value under an older policy
differs from today's only through the later turns (none after a Blackjack stick), and with a decay of 0.8 the
memory spans about 5 updates, each bounded by the trust region. Pairs whose weight falls below `FLOOR` are dropped,
so the memory holds the pairs of about the last log(FLOOR) / log(d) batches.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

FLOOR = 0.01  # a pair whose decayed count falls below this leaves the memory (about 20 batches at a decay of 0.8)


class ReturnMemory:
    """A decaying per-(state, action) mean of returns over batches (see the module docstring).

    Args:
        decay: d in (0, 1): the weight of the last batch's returns relative to this one's.

    Raises:
        ValueError: `decay` outside (0, 1).
    """

    def __init__(self, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"ReturnMemory needs a decay in (0, 1). Received {decay!r}.")
        self.decay = decay
        self.entries: dict[Hashable, list[float]] = {}  # key -> [decayed count, decayed sum of returns]

    def pool(self, keys: list[Hashable], returns: Tensor) -> tuple[Tensor, dict[str, float]]:
        """Decay what is remembered, add this batch's returns, and give each turn its pair's pooled mean.

        Args:
            keys: one hashable (state, action) key per turn, in the order of `returns`.
            returns: (T,) this batch's returns (value targets).
        Returns:
            (T,) the pooled mean of each turn's key (same dtype and device as `returns`), and stats:
            adv/pooled_count (the mean over turns of their key's decayed count: how many returns each one's Q
            averages) and adv/memory_pairs (pairs remembered).

        Example (decay 0.5): batch 1 keys [a, a, b], returns [1, 0, 2] -> [0.5, 0.5, 2]; batch 2 keys [a], returns
        [1] -> a's count 0.5 x 2 + 1 = 2, sum 0.5 x 1 + 1 = 1.5: [0.75].

        Raises:
            ValueError: `keys` and `returns` differ in length.
        """
        if len(keys) != len(returns):
            raise ValueError(f"ReturnMemory.pool needs one key per return. Received {len(keys)} and {len(returns)}.")
        for key in list(self.entries):
            entry = self.entries[key]
            entry[0] *= self.decay
            entry[1] *= self.decay
            if entry[0] < FLOOR:
                del self.entries[key]
        for key, value in zip(keys, returns.tolist(), strict=True):
            entry = self.entries.setdefault(key, [0.0, 0.0])
            entry[0] += 1.0
            entry[1] += value
        counts = [self.entries[key][0] for key in keys]
        pooled = torch.tensor([self.entries[key][1] / n for key, n in zip(keys, counts)], dtype=returns.dtype)
        stats = {
            "adv/pooled_count": sum(counts) / max(len(counts), 1),
            "adv/memory_pairs": float(len(self.entries)),
        }
        return pooled.to(returns.device), stats

    def state_dict(self) -> dict:
        return {"decay": self.decay, "entries": {key: list(entry) for key, entry in self.entries.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.entries = {key: list(entry) for key, entry in state["entries"].items()}
