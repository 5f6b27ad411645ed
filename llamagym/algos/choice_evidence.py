"""Evidence, counted across updates, that a choice pays in its state: the gate of the inverse-choice weights.

Why: the inverse-choice weights (`ppo.inverse_choice_weights`) push a choice the policy had nearly given up as far per
draw as it paid. On guess-the-number every turn they weighed kept the policy soft (docs/learning-that-holds.md,
eighty-eighth session): a rare guess pays at once when it happens to be the secret, and one draw cannot tell a better
choice from a lucky one. Several draws of the same choice in the same state can; a batch rarely holds them for a rare
choice, so they are counted across updates.

The measure: for each (state, choice) pair, decayed sums over updates of its draws' advantages, S, and of their
squares, Q (each update multiplies both by `decay`, then adds its own draws), and

    z = S / sqrt(1 + Q).

z is below sqrt(n) for n draws (Cauchy-Schwarz), so one draw never reaches 1 whatever it paid; against a threshold
of 1.2, two equal draws pass when each paid 1.13 or more, three when each paid 0.56 or more (advantages whitened,
about unit scale); draws that disagree in sign cancel in S and add up in Q. Without the 1 it is the self-normalised
sum, a rising function of the draws' t-statistic; the 1 is one unit of prior variance. A pair whose decayed count of
draws falls under `FORGET` is dropped, so the table holds the pairs of the last hundred or so updates.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

DECAY = 0.95  # per update: a draw's weight halves in about 14 updates
FORGET = 1e-3  # a pair whose decayed count of draws falls under this is dropped (about 135 updates after a lone draw)


def evidence_scores(sums: Tensor, squares: Tensor) -> Tensor:
    """z = S / sqrt(1 + Q): the evidence that a pair's draws paid, from the sums of their advantages and squares.

    Example: one draw paying 3 -> 3 / sqrt(10) = 0.949; three draws paying 1 -> 3 / sqrt(4) = 1.5; draws paying
    3, -1, -1 -> 1 / sqrt(12) = 0.289.
    """
    return sums / torch.sqrt(1.0 + squares)


class ChoiceEvidence:
    """Per (state, choice) pair, decayed sums over updates of its draws' advantages and of their squares.

    Args:
        decay: what each update keeps of the sums before it adds its own draws, in (0, 1].
    """

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self.table: dict[Hashable, list[float]] = {}  # pair -> [count, sum, sum of squares], decayed

    def update(self, pairs: Sequence[Hashable], advantages: Tensor) -> Tensor:
        """Decay every pair, add this batch's draws (one per entry of `pairs`, its advantage in `advantages`), and
        return (N,) each draw's pair's z (`evidence_scores`), this batch's draws included."""
        if len(pairs) != len(advantages):
            raise ValueError(f"{len(pairs)} pairs and {len(advantages)} advantages: one advantage per pair's draw.")
        for pair in list(self.table):
            entry = self.table[pair]
            entry[:] = [value * self.decay for value in entry]
            if entry[0] < FORGET:
                del self.table[pair]
        values = advantages.detach().double().cpu().tolist()
        for pair, value in zip(pairs, values, strict=True):
            entry = self.table.setdefault(pair, [0.0, 0.0, 0.0])
            entry[0], entry[1], entry[2] = entry[0] + 1.0, entry[1] + value, entry[2] + value * value
        sums = torch.tensor([self.table[pair][1] for pair in pairs], dtype=torch.float64)
        squares = torch.tensor([self.table[pair][2] for pair in pairs], dtype=torch.float64)
        return evidence_scores(sums, squares).to(advantages.device, torch.float32)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "table": [(pair, list(entry)) for pair, entry in self.table.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        self.table = {pair: list(entry) for pair, entry in state["table"]}
