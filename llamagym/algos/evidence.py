"""How much of a batch's policy step is evidence: the share of its per-state push that episodes agree on.

Why: the trust region sizes every step to its bound, whatever the batch holds. On a game with chance in every move
(FrozenLake on slippery ice, docs/learning-that-holds.md, sixty-first session) a batch of 32 episodes holds one
success or none; that one episode's moves get large advantages, and the step pushes each state it passed toward the
move it happened to make as far as a batch of many agreeing successes would. The policy then settles within 40-120
updates on whatever the first lucky episodes did.

The measure: in scoring mode each turn t pushes its state's log-probs along x_t = A_t (e_{a_t} - p_t) (the gradient
of A log p(a) with respect to the logits; A_t the turn's advantage as the loss uses it, p_t the batch policy's
distribution over the candidates). A state's push is the sum c_s of its turns' x_t, and it is a sum over the batch's
E episodes, which are independent draws: c_s = sum_e c_se. Its noise is estimated from how much the episodes
disagree, E/(E-1) * sum_e |c_se - c_s/E|^2, and what is left of |c_s|^2 is the part the episodes agree on (the
positive-part James-Stein estimate of the push's squared size). Summed over states,

    evidence = max(0, 1 - noise / sum_s |c_s|^2)

is 0 for a batch whose every state's push comes from one episode (nothing says another episode would push the
same way), near 1 when many episodes push each state alike, and 1 - 1/k when k episodes push alike and the rest
not at all.

Measured (sixty-second session, one seed each, 10 minutes): most batches of every game carry almost none of it (means
0.014-0.063 a batch), Blackjack's because each of its states is met by about one episode a batch. Sizing the bound by
it (`PPOConfig(evidence_kl=0.05)`) lifted the slippery lake from 0.049 to 0.153 but starved Blackjack (0.678, against
0.89-0.97 on the defaults): a game of many states learns by adding small noisy steps whose noise cancels across
updates. So it is logged on every scored update of one process (`adv/evidence`; data-parallel, only when asked,
as it takes two collectives) and sizes the bound only when asked.
"""

from __future__ import annotations

import torch
from torch import Tensor


def turn_pushes(advantages: Tensor, choice: Tensor, logprobs: Tensor) -> Tensor:
    """(N, C) x_t = A_t (e_{a_t} - p_t): how each turn pushes its state's candidate logits.

    Args:
        advantages: (N,) each turn's advantage, as the policy loss weighs it.
        choice: (N,) long, the index of the candidate each turn chose.
        logprobs: (N, C) the batch policy's log-probs of each turn's candidates (-inf where a turn has fewer).

    Example: A = 2, choice 0 of two candidates at probabilities (0.25, 0.75): (1.5, -1.5).
    """
    probs = torch.nan_to_num(logprobs.double().exp(), nan=0.0)
    onehot = torch.nn.functional.one_hot(choice.long(), probs.shape[1]).double()
    return advantages.double()[:, None] * (onehot - probs)


def evidence_fraction(push: Tensor, state: Tensor, episode: Tensor, num_episodes: int) -> float:
    """The share of the batch's per-state push that its episodes agree on, in [0, 1] (see the module docstring).

    Args:
        push: (N, C) each turn's push (`turn_pushes`; zero columns past a turn's candidates).
        state: (N,) long, each turn's state id (equal ids: the same state).
        episode: (N,) long, each turn's episode index in 0..num_episodes-1.
        num_episodes: E, the batch's episodes (those with no turn in a state count as pushing it by 0).
    Returns:
        0.0 when there is no push at all (every advantage 0) or a single episode (no spread to measure noise by).

    Examples (one state, candidate 0 of 2 at probability 0.5, two episodes): both push with A = +1: 1.0; one does
    (the other's A is 0): 0.0; they push opposite ways (A = +1 and -1): 0.0.
    """
    if num_episodes < 2 or len(push) == 0:
        return 0.0
    pairs, inverse = torch.unique(state.long() * num_episodes + episode.long(), return_inverse=True)
    per_pair = push.new_zeros(len(pairs), push.shape[1]).index_add_(0, inverse, push)  # c_se, one row per pair met
    per_state = push.new_zeros(int(state.max()) + 1, push.shape[1]).index_add_(0, pairs // num_episodes, per_pair)
    total = float(per_state.pow(2).sum())
    if total <= 0.0:
        return 0.0
    e = num_episodes
    noise = e / (e - 1) * (float(per_pair.pow(2).sum()) - total / e)
    return min(1.0, max(0.0, 1.0 - noise / total))
