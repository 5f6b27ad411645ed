"""Score mode: an action is one of a list of candidate replies, chosen and trained as one choice among them.

Its input is the prompt with every candidate (whichever was chosen), packed into one sequence and scored in one
pass (`Policy.score`, `rollout.ScoreBatch`). The policy is the softmax over the candidates of `candidate_logits`,
their length-normalised log-likelihoods (TWOSOME); a subclass that changes that one method is a new mode. Its
log-prob is the chosen candidate's, and the KL to the batch's policy is exact over the candidates: natural steps
and the trust region run by default. Acting scores each distinct input once per policy version and remembers it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ... import distributed
from ...models.policy import length_normalised
from ...models.prefill import shared_prefix
from ..rollout import ScoreBatch, Turn, UpdateBatch, collate_scored
from ..trust_region import categorical_kl
from . import ActionMode, Choice, Evaluation, Recalled

# candidate tokens (rows of the LM head's vocabulary-wide logits) per forward without gradient, acting's
# (`Actor.score_tokens`) and the trust region's measures: 64 prompts x 21 candidates in one pass took arithmetic's
# evaluation from 0.95 to 2.85 GiB
SCORE_TOKENS = 1024


class Scored(NamedTuple):
    """What acting computed for one input, remembered until the weights change (`actor.memory`)."""

    logprobs: torch.Tensor  # (C,) the policy over the input's candidates
    value: torch.Tensor  # () V(s) at the last prompt token
    features: torch.Tensor  # (H,) the value head's input there (what the value refit regresses on)


class ScoreMode(ActionMode):
    name = "score"
    exact_kl = True
    takes_candidates = True
    cache_rounds = 4  # a game's observations come back, not in every batch: kept through four updates unused
    repeated_input_power = 0.5  # a frequent state's turns weigh 1/sqrt(count) each (docs/learning-that-holds.md)

    @staticmethod
    def key(prompt_ids: list[int], candidates: list[list[int]]) -> tuple:
        """The input of a prompt with its candidates (the training side's `input_key`, the acting side's cache key)."""
        return tuple(prompt_ids), tuple(map(tuple, candidates))

    def candidate_logits(self, totals: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(N, C) the softmax's logits from each candidate's summed token log-probs and its token count (N, C):
        their mean, so that a long reply is not less likely for being long (TWOSOME, arXiv:2401.14151)."""
        return length_normalised(totals, lengths)

    # ---- acting ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def choose(self, actor, prompts, candidates, greedy=False) -> list[Choice]:
        """The chosen candidate of each prompt: sampled from the policy, or its arg-max when greedy.

        Each distinct (prompt, candidates) input is scored once per policy version and remembered as `Scored`
        (`actor.memory`): envs in the same state, now or later in the rollout, reuse its distribution until the
        weights (or the precision) change, and the update takes its old outputs from there (`recall`). Inputs are
        scored in forwards of at most `actor.score_tokens` candidate tokens.
        """
        scores = actor.memory(self)
        keys = [self.key(p, c) for p, c in zip(prompts, candidates, strict=True)]
        missing = list(dict.fromkeys(key for key in keys if key not in scores))
        if len(scores) + len(missing) > actor.score_cache_size:
            scores.clear()
        parts = token_chunks(missing, lambda key: sum(map(len, key[1])), actor.score_tokens)
        sharded = actor.policy.sharded
        if sharded:  # each forward is a collective: as many as the rank with the most to score
            lacking = int(distributed.reduce_number(len(parts), "max")) - len(parts)
            parts += [[self.key(prompts[0], candidates[0])]] * lacking
        for part in parts:
            todo = [list(key[0]) for key in part]
            batch = collate_scored(
                todo,
                [[list(c) for c in key[1]] for key in part],
                pad_token_id=actor.pad_token_id,
                device=actor.policy.device,
            )
            # with the frozen-layer cache, the cache runs the rows' shared first tokens once itself; sharded, the
            # prefix's extra forward would be a collective that other ranks may not run
            reuse = actor.reuse_prefix and len(todo) > 1 and actor.policy.frozen_cache is None and not sharded
            prefix = shared_prefix(todo) if reuse else 0
            out = actor.policy.score(batch, prefix=prefix, candidate_logits=self.candidate_logits)
            logprobs, values, features = out.logprobs.float().cpu(), out.values.float().cpu(), out.features.cpu()
            for i, key in enumerate(part):
                scores[key] = Scored(logprobs[i, : len(key[1])], values[i], features[i])
        choices = []
        for cands, key in zip(candidates, keys, strict=True):
            probs = scores[key].logprobs.exp()
            least = 0.0 if greedy else actor.explore / len(probs)
            if greedy:
                c = int(probs.argmax())
            elif least:
                c = int(torch.multinomial(floored(probs, least), 1))
            else:
                c = int(torch.multinomial(probs, 1))
            choices.append(Choice(cands[c], c, bool(probs[c] < least)))
        return choices

    # ---- training --------------------------------------------------------------------------------------------
    def input_key(self, turn: Turn) -> tuple:
        """The prompt and every candidate, whichever was chosen."""
        return self.key(turn.prompt_ids, turn.candidates)

    def collate(self, turns: list[Turn], pad_token_id: int, device: torch.device | str = "cpu") -> ScoreBatch:
        prompts, candidates, choices = (
            [t.prompt_ids for t in turns],
            [t.candidates for t in turns],
            [t.choice for t in turns],
        )
        return collate_scored(prompts, candidates, choices, pad_token_id, device)

    def action_mask(self, batch: ScoreBatch) -> torch.Tensor:
        """One slot per turn: its choice."""
        return torch.ones((batch.input_ids.shape[0], 1), device=batch.input_ids.device)

    def head_rows(self, batch: ScoreBatch) -> torch.Tensor:
        """Every candidate token of the row (a scored state's log-probs are its candidates')."""
        return (batch.owner >= 0).sum(1)

    def evaluate(self, policy, batch, part, first, inverse, with_entropy=False, watch=None, reference=False):
        """The chosen candidates' log-probs (P, 1); the distributions are every candidate's (P, C), and the
        entropy is over the candidates (always computed: it is cheap)."""
        rows = ScoreBatch(*(t[part[first]] for t in batch))
        out = policy.score(rows, reference=reference, candidate_logits=self.candidate_logits)
        if watch is not None:
            watch(out.logprobs)
        logprobs = out.logprobs[inverse]
        chosen = logprobs.gather(1, batch.choice[part][:, None])
        entropy = categorical_entropy(logprobs).unsqueeze(-1)
        return Evaluation(chosen, torch.ones_like(chosen), out.values[inverse], entropy, logprobs)

    def recall(self, memory: dict, turns: list[Turn], batch: ScoreBatch) -> Recalled:
        """The outputs `choose` remembered for the turns' inputs (`memory`: `actor.memory(self)`, so computed with
        the current weights): an update's old policy where acting already ran it. Rows whose input is not there
        (acted before the last weight change, or evicted) are left for the trainer to compute."""
        found = [memory.get(self.input_key(turn)) for turn in turns]
        known = torch.tensor([entry is not None for entry in found], dtype=torch.bool)
        n, width = len(turns), int(batch.num_candidates.max())
        dists = torch.full((n, width), -math.inf)
        values, features = torch.zeros(n), None
        for i, entry in enumerate(found):
            if entry is None:
                continue
            if features is None:
                features = torch.zeros(n, entry.features.shape[-1])
            dists[i, : len(entry.logprobs)] = entry.logprobs
            values[i], features[i] = entry.value, entry.features.float()
        device = batch.input_ids.device
        dists = dists.to(device)
        chosen = dists.gather(1, batch.choice[:, None]).masked_fill(~known.to(device)[:, None], 0.0)
        features = None if features is None else features.to(device)
        return Recalled(known.to(device), chosen, values.to(device), dists, features)

    def remember(self, memory: dict, turns: list[Turn], dists, values, features) -> None:
        """Each turn's input with its outputs (`Scored`, on the CPU as `choose` keeps them): the next batch's acting
        takes them instead of scoring the input again."""
        dists, values, features = dists.float().cpu(), values.float().cpu(), features.cpu()
        for i, turn in enumerate(turns):
            memory[self.input_key(turn)] = Scored(dists[i, : len(turn.candidates)], values[i], features[i])

    def entropy_fraction(self, data: UpdateBatch) -> torch.Tensor:
        """Exact over the candidates, divided by the log of their number (`entropy_fraction`)."""
        return entropy_fraction(data.old_dists, data.batch.num_candidates)

    def empty_distributions(self, batch: ScoreBatch) -> torch.Tensor:
        """As wide as the batch's most candidates (a micro-batch may have fewer), -inf (probability 0) elsewhere."""
        width = int(batch.num_candidates.max())
        return torch.full((batch.input_ids.shape[0], width), -math.inf, device=batch.input_ids.device)

    def kl(self, data: UpdateBatch, part: torch.Tensor, now: Evaluation) -> torch.Tensor:
        """Exact over the candidates, per bit of the choice: divided by log2 of the input's number of candidates.

        Learning an input moves its policy from near uniform to near one candidate, KL log(C) nats away, so a bound
        in plain nats lets a two-way choice be learned in a quarter of the updates a 16-way one needs (measured:
        guess-the-number's 16 guesses crept under a bound that held Blackjack's hit/stick, and a 5x larger bound
        learned them but made Blackjack's policy deterministic too early). Per bit, a choice of two is bound as in
        plain nats, and every input is learned in about as many updates.
        """
        old = data.old_dists[part, : now.dists.shape[1]]
        return relative_kl(old, now.dists, data.batch.num_candidates[part])


def floored(probs: torch.Tensor, least: float) -> torch.Tensor:
    """(C,) the distribution acting samples from: each of `probs` (C,) raised to at least `least`, renormalised.

    Exploration aimed where the policy is sure: a state whose candidates all keep `least` already is sampled as the
    policy says, and one that has settled on a candidate still draws each other one about `least` of the time, so a
    better choice the policy gave up early can be drawn, and learned, again (guess-the-number's runs that stop short
    hold a state's guess at p 0.98 with the better one at p 0.005: docs/learning-that-holds.md, sixty-third session).

    Examples: (0.7, 0.2, 0.1) floored at 0.05: unchanged; (0.98, 0.015, 0.005) at 0.05: (0.98, 0.05, 0.05) / 1.08 =
    (0.9074, 0.0463, 0.0463).
    """
    raised = probs.clamp_min(least)
    return raised / raised.sum()


def entropy_fraction(logp: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(N,) entropy of each row of log-probabilities (-inf = padding) divided by the log of its `count` (N,)
    candidates: 1 for uniform, 0 for one certain candidate (and for a row of one candidate).

    Examples: (0.5, 0.5): 1.0; (0.9, 0.1): 0.4690; (0.7, 0.1, 0.1, 0.1) over 4: 0.6784.
    """
    return categorical_entropy(logp) / torch.log(count.clamp_min(2).to(logp.dtype))


def categorical_entropy(logp: torch.Tensor) -> torch.Tensor:
    """(...) entropy in nats of each row of log-probabilities over the last dim (-inf = padding, contributes 0)."""
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)


def relative_kl(old: torch.Tensor, new: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(N,) KL(old || new) of each row of log-probabilities over its `count` (N,) candidates, divided by log2 of
    that number (-inf entries are padding; a row of one candidate has KL 0).

    Examples: old uniform over 2, new (0.9, 0.1): 0.5108 (nats = per bit); old uniform over 4, new (0.7, 0.1, 0.1,
    0.1): 0.4298 nats / 2 = 0.2149.
    """
    return categorical_kl(old, new) / torch.log2(count.clamp_min(2).to(old.dtype))


def token_chunks(items: list, size: Callable[[Any], int], budget: int, least: int = 1) -> list[list]:
    """`items` in order, cut into consecutive chunks of at most `budget` by `size`, each of at least `least` items
    whatever their size (the last may have fewer); with `least` 1 an item larger than the budget is a chunk alone.

    Examples: ([3, 4, 2, 9, 1], budget 7) -> [[3, 4], [2], [9], [1]]; with least 2 -> [[3, 4], [2, 9], [1]]."""
    chunks, total = [], 0
    for item in items:
        n = size(item)
        if not chunks or (len(chunks[-1]) >= least and total + n > budget):
            chunks.append([])
            total = 0
        chunks[-1].append(item)
        total += n
    return chunks
