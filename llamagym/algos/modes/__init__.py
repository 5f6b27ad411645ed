"""Action modes: how the policy's actions are chosen and trained on, one file each.

- `generate.py` `GenerateMode` ("generate"): an action is a sampled reply, trained token by token (`Policy.forward`)
- `score.py`    `ScoreMode` ("score"): an action is one of a list of candidate replies, chosen from the softmax of
                their length-normalised log-likelihoods and trained as that choice, all scored in one pass
                (`Policy.score`)

A mode is a stateless strategy object (SB3's `make_proba_distribution`): the agent asks its mode to choose, the
trainer asks the turns' mode (`mode_of`) to collate and evaluate them; neither asks which mode it holds. Every
turn records the name of the mode that took it (`Turn.mode`), so the trainer finds that mode in `MODES`.

**A new mode is one file**: a subclass of `ActionMode` that fills in the abstract methods below, registered with
`register_mode(MyMode())`; the agent then acts with it through `Agent(..., action_mode="my-mode")`. Shapes: N turns
(or prompts), P the rows of a part of a batch, T the action positions per turn, C the most candidates of a row.

Acting (no gradient; token ids in, token ids out, no text):

- `choose(actor, prompts, candidates, greedy) -> list[Choice]`: one `Choice(response_ids, choice)` per prompt.
  `prompts` are N lists of prompt token ids (chat template applied, ending with the assistant header);
  `candidates` are N lists of candidate replies' token ids when the mode `takes_candidates`, else None. `actor`
  (see `Acting`) holds the policy, padding and end-of-turn ids, the sampling and scoring settings, and
  `actor.memory(self)`, a dict the mode may keep between calls that is emptied whenever the policy's outputs may
  have changed (weights, temperature, precision). Sampling uses torch's global generator.

Training (`Policy` outputs; everything per turn is computed once per distinct input):

- `input_key(turn) -> tuple`: what the model sees of a turn; turns with equal keys get equal outputs.
- `collate(turns, pad_token_id, device) -> batch`: the turns' padded tensors (any NamedTuple of (N, ...) tensors).
- `action_mask(batch) -> (N, T)` float: which action log-probs count.
- `evaluate(policy, batch, part, first, inverse, with_entropy, watch, reference) -> Evaluation`: the policy's
  outputs on rows `part` (P,) of `batch`: log-probs and mask (P, T), values (P,), entropy (P, T) or None,
  distributions (P, C) or None. Rows `part[first]` are run and `inverse` spreads them back over `part`.
- `kl(data, part, now) -> (P,)`: KL(old || now) per turn of rows `part`, the old outputs being `data`'s.
- `empty_distributions(batch) -> (N, C) or None`: a table for the old policy's distributions, if the mode has them.
- `recall(memory, turns, batch) -> Recalled or None` (optional): the old policy's outputs that acting already
  computed with the current weights and kept in `memory` (its `actor.memory(self)`), so that the update runs only
  the rest; None (the default) computes them all.
- `remember(memory, turns, dists, values, features)` (optional): keep in `memory` (for `choose`) outputs the
  trainer computed for `turns`' inputs with the weights acting will use next (the trust region's measure of the
  accepted step): the next batch's acting then runs only inputs the last batch did not have. The default keeps none.

Class attributes: `name` (its key in `MODES`, recorded on its turns), `takes_candidates` (`choose` needs
candidate replies: the agent asks its `action_candidates` hook), `exact_kl` (the KL of `kl` is exact, so
natural-gradient steps and the trust region are used by default), `cache_rounds` (for how many updates an input's
frozen-layer states stay cached unused, `FrozenLayerCache.next_round`: more where inputs come back in later batches)
and `repeated_input_power` (`PPOConfig.repeated_input_power` when that is None: how much the turns of a state (a
prompt) met many times in a batch are weighed down; 0, every turn alike, unless measured otherwise for the mode).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Protocol

import torch

from ..rollout import Turn, UpdateBatch, numbered


class Choice(NamedTuple):
    """What a mode chose for one prompt, as its turn will store it."""

    response_ids: list[int]  # the reply's token ids (the chosen candidate's, when choosing among candidates)
    choice: int | None = None  # the index of the chosen candidate, or None when there were no candidates
    explored: bool = False  # drawn by exploration (`Acting.explore`) where the policy itself gives it less


class Acting(Protocol):
    """What a mode acts with: the agent's `Actor` (`agent/choosing.py`)."""

    policy: Any  # the `Policy` to act with
    pad_token_id: int
    eos_ids: set[int]  # tokens that end a reply
    generation: dict  # sampling settings: max_new_tokens, temperature
    reuse_prefix: bool  # run the prompts' shared first tokens once per forward (generating: each distinct prompt once)
    score_tokens: int  # scoring: candidate tokens per forward (each costs a vocabulary-wide row of logits)
    score_cache_size: int  # scoring: distinct inputs remembered between weight updates
    explore: float  # scoring: sample each of C candidates with probability at least explore / C (`floored`)

    def memory(self, mode: ActionMode) -> dict:
        """`mode`'s own dict, kept between calls and emptied whenever the policy's outputs may have changed."""


class Evaluation(NamedTuple):
    """The current policy's outputs on some rows of an update's batch, one row per turn."""

    logprobs: torch.Tensor  # (P, T) log-probs of the actions (T = 1 for a choice among candidates)
    mask: torch.Tensor  # (P, T) float: which of them count
    values: torch.Tensor  # (P,) V(s)
    entropy: torch.Tensor | None  # (P, T) the policy's entropy there, when asked for
    dists: torch.Tensor | None  # (P, C) log-probs of every candidate (scoring), else None


class Recalled(NamedTuple):
    """The old policy's outputs acting computed for an update's turns (`ActionMode.recall`); 0 where not `known`."""

    known: torch.Tensor  # (N,) bool: acting computed this row's input with the current weights
    logprobs: torch.Tensor  # (N, T) log-probs of the actions
    values: torch.Tensor  # (N,) V(s)
    dists: torch.Tensor | None  # (N, C) log-probs of every candidate (scoring), else None
    features: torch.Tensor | None  # (N, H) the value head's inputs, None when no row is known


class ActionMode(ABC):
    """How an action is chosen and trained on; the module docstring is the contract."""

    name: str = ""
    exact_kl: bool = False
    takes_candidates: bool = False  # `choose` needs candidate replies: the agent asks its `action_candidates` hook
    cache_rounds: int = 1  # updates an input's frozen-layer states stay cached unused (1: inputs seldom come back)
    repeated_input_power: float = 0.0  # `PPOConfig.repeated_input_power` when it is None (measured per mode)

    # ---- acting ----------------------------------------------------------------------------------------------
    @abstractmethod
    def choose(
        self, actor: Acting, prompts: list[list[int]], candidates: list[list[list[int]]] | None, greedy: bool
    ) -> list[Choice]:
        """One `Choice` per prompt: sampled from the policy, or its most likely action when `greedy`."""

    # ---- training --------------------------------------------------------------------------------------------
    @abstractmethod
    def input_key(self, turn: Turn) -> tuple:
        """What the model sees of `turn`: turns with the same key get the same log-probs and values."""

    @abstractmethod
    def collate(self, turns: list[Turn], pad_token_id: int, device: torch.device | str = "cpu"):
        """The turns' padded tensors (a `TurnBatch` or a `ScoreBatch`)."""

    @abstractmethod
    def action_mask(self, batch) -> torch.Tensor:
        """(N, T) float mask of the action log-probs of a collated batch."""

    def head_rows(self, batch) -> torch.Tensor:
        """(N,) the positions of each row of a collated batch whose vocabulary-wide logits its evaluation computes
        (the LM head's rows, the largest tensors of a forward without gradient); by default its action tokens."""
        return self.action_mask(batch).sum(1)

    @abstractmethod
    def evaluate(
        self,
        policy,
        batch,
        part: torch.Tensor,
        first: torch.Tensor,
        inverse: torch.Tensor,
        with_entropy: bool = False,
        watch=None,
        reference: bool = False,
    ) -> Evaluation:
        """The policy's outputs on rows `part` of `batch`, computed once per distinct input: rows `part[first]`
        are run and `inverse` spreads them back over `part`. `watch` (a `RowGradients.watch`) is given the
        per-input outputs the loss is computed from."""

    @abstractmethod
    def kl(self, data: UpdateBatch, part: torch.Tensor, now: Evaluation) -> torch.Tensor:
        """(P,) KL(old || now) per turn of rows `part`, the old policy's outputs being `data`'s: what the trust
        region bounds (`PPOConfig.max_kl`), in the mode's own unit."""

    def entropy_fraction(self, data: UpdateBatch) -> torch.Tensor | None:
        """(N,) each turn's entropy under the batch's old policy as a fraction of the most its choice can have (what
        `PPOConfig.entropy_floor` holds up), or None when the mode's choice has no such bound (generating: the
        vocabulary's entropy per token says little about how varied the actions are)."""
        return None

    def empty_distributions(self, batch) -> torch.Tensor | None:
        """An (N, C) table for the old policy's distributions over the candidates, or None when there are none."""
        return None

    def recall(self, memory: dict, turns: list[Turn], batch) -> Recalled | None:
        """The old policy's outputs for `turns` (collated as `batch`) that acting computed with the current weights
        and kept in `memory` (`actor.memory(self)`), or None when the mode keeps none (then the trainer computes
        them all)."""
        return None

    def remember(
        self, memory: dict, turns: list[Turn], dists: torch.Tensor, values: torch.Tensor, features: torch.Tensor
    ) -> None:
        """Keep in `memory` (`actor.memory(self)`) the outputs of the current weights on `turns`' inputs, as `choose`
        would have computed them: the distributions (N, C), values (N,) and the value head's inputs (N, H). The
        default keeps nothing (acting then computes them when it meets the inputs)."""
        return None

    def distinct_inputs(self, turns: list[Turn]) -> torch.Tensor:
        """(N,) id of each turn's model input (`input_key`), numbered by first appearance: equal ids mean equal
        log-probs and values. Small observation spaces repeat inputs often (Blackjack has 280 states)."""
        return numbered([self.input_key(turn) for turn in turns])


from .generate import GenerateMode  # noqa: E402  (the modes subclass ActionMode)
from .score import ScoreMode  # noqa: E402

MODES: dict[str, ActionMode] = {"generate": GenerateMode(), "score": ScoreMode()}


def register_mode(mode: ActionMode) -> ActionMode:
    """Add `mode` to `MODES` under `mode.name` (then `Agent(..., action_mode=mode.name)` acts with it).

    Raises:
        ValueError: the name is empty, "auto" or already taken.
    """
    if not isinstance(mode, ActionMode) or not mode.name:
        raise ValueError(f"`mode` should be an ActionMode instance with a `name`. Received {mode!r}.")
    if mode.name in MODES or mode.name == "auto":
        taken = "means the agent's choice" if mode.name == "auto" else "is already registered"
        raise ValueError(f"The action mode name {mode.name!r} {taken}; choose another name.")
    MODES[mode.name] = mode
    return mode


def _recorded_mode(turn: Turn) -> str:
    # Turns built by hand or saved before turns named their mode: the two built-in modes, told apart by candidates.
    if turn.mode is not None:
        return turn.mode
    return "generate" if turn.candidates is None else "score"


def mode_of(turns: list[Turn]) -> ActionMode:
    """The mode the turns were taken in (`Turn.mode`); all turns must share one.

    Raises:
        ValueError: the turns mix modes, or name one that is not registered.
    """
    names = {_recorded_mode(turn) for turn in turns}
    if len(names) != 1:
        listed = ", ".join(sorted(names))
        raise ValueError(
            f"A batch mixes generated and scored turns, or turns of different action modes ({listed}); "
            "keep one action mode per agent."
        )
    name = names.pop()
    if name not in MODES:
        raise ValueError(f"The turns were taken in action mode {name!r}, which is not registered (`register_mode`).")
    return MODES[name]


__all__ = [
    "MODES",
    "Acting",
    "ActionMode",
    "Choice",
    "Evaluation",
    "GenerateMode",
    "Recalled",
    "ScoreMode",
    "mode_of",
    "register_mode",
]
