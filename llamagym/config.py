"""Flat, validated settings for PPO (`PPOConfig`) and the SFT warm-start replay (`ReplayConfig`).

Each field has one comment. Every value is checked in `__post_init__`, and a bad one raises a `ValueError`
that names the field, the value received and what is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

KL_ESTIMATORS = ("k1", "k2", "k3")
ADVANTAGE_SCALES = ("batch", "returns", "none")
ADVANTAGE_CENTERS = ("batch", "state")
LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "dr_grpo")


def _check(ok: bool, name: str, value, accepted: str) -> None:
    if not ok:
        raise ValueError(f"`{name}` should be {accepted}. Received {value!r}.")


def _check_fields(config, rules: dict[str, tuple]) -> None:
    """Apply `rules` (field -> (predicate, accepted-text)); reject NaN/inf floats on every numeric field."""
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float):
            _check(math.isfinite(value), f.name, value, "a finite number")
        if f.name in rules:
            predicate, accepted = rules[f.name]
            _check(predicate(value), f.name, value, accepted)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class PPOConfig:
    """PPO hyperparameters, with defaults that learn small models on a CPU (paper names, see docs/design.md §3)."""

    learning_rate: float = 2e-4  # AdamW step size for the LoRA adapter (and the value head, unless set below)
    value_learning_rate: float | None = None  # AdamW step size for the value head; None = learning_rate
    batch_size: int = 32  # episodes collected before each PPO update
    min_batch_turns: int = 128  # and at least this many turns (replies): short episodes fill larger batches; 0 = off
    mini_batch_size: int | None = None  # turns per optimizer step; None = whole batch for natural steps, 8 for AdamW
    micro_batch_size: int | None = 8  # distinct inputs per forward/backward within a step (bounds memory); None = all
    ppo_epochs: int | None = None  # passes over the batch per update; None = 1 for whole-batch natural steps
    # (scoring mode), 2 for AdamW steps
    gamma: float = 0.99  # discount across the turns of an episode: < 1 makes a shorter way to the same reward worth
    # more, so a move that changes nothing (a wall) is worse than progress and a solved greedy policy does not loop
    lam: float = 0.95  # GAE lambda (1 = Monte-Carlo return, 0 = one-step TD)
    policy_lam: float | None = None  # gae: the policy's advantages at this lambda, the value head's targets (and the
    # returns' scale) at `lam` (decoupled GAE, as VAPO's); None = `lam` for both; an experiment, not a default. Keep it
    # high where the reward hangs on what the prompt does not show (rooms' steps used): a head that cannot see it hands
    # a bad move little of its cost at a low lambda (benchmarks/lambda_credit.py)
    pool_tail: bool = False  # with policy_lam set: give back, per (prompt, reply) of the batch, as much of the rest
    # of the `lam` advantage as the batch shows is more than noise (estimators.pooled_tail); an experiment
    advantage: str = "gae"  # advantage estimator (llamagym.algos.estimators): gae (value head), or critic-free grpo,
    # rloo, rebn, gigpo; those ignore whiten_advantages (they center their own), the value head still trains
    group_std_scaling: bool = True  # grpo/gigpo: divide by the group's return std (False = Dr.GRPO's unscaled)
    clip_coef: float = 0.2  # PPO ratio clip range
    clip_coef_high: float | None = None  # upper clip 1 + clip_coef_high (DAPO's clip-higher); None = clip_coef
    loss_aggregation: str = "token_mean"  # policy loss over tokens: token_mean, sequence_mean (each reply weighs
    # the same) or dr_grpo (token sum / the batch's longest reply)
    vf_clip_coef: float | None = None  # value clip range around the old value (None = unclipped)
    vf_coef: float = 0.5  # weight of the value loss
    value_refit: float | None = 1.0  # after each update refit the value head by ridge regression on the batch's
    # returns, with this relative damping (ppo.ridge_refit); None = value-loss steps only
    turn_values: int = 0  # gae: the value head also learns a value for each turn's index in its episode (0 .. N - 1,
    # later turns sharing the last), added to its own, so it can price time spent that the prompt does not show
    # (algos/turn_values.py); 0 = off; an experiment, not a default
    ent_coef: float = 0.0  # weight of the entropy bonus on response tokens
    entropy_floor: float | None = 0.1  # scoring mode: while the sampled choices' mean entropy (as a fraction of the
    # most: entropy / ln(candidates)) is below this, an entropy bonus on the turns below it grows (ppo.EntropyFloor);
    # None = off
    entropy_floor_step: float = 0.002  # how much that bonus's weight rises (or falls, above the floor) per update
    barrier: float = 0.0  # scoring mode: weight of a log-barrier, the sum of log-probs over each turn's candidates
    # (weighed as its advantage), added to the objective: a candidate is never driven to probability 0 unsampled, one of
    # advantage A < 0 settles near barrier / |A| (ppo.log_barrier); 0 = off (an experiment: docs/learning-that-holds.md)
    barrier_floor: float = 0.0  # > 0: the barrier acts only on candidates under this probability (a hinge on log p),
    # so settled states keep their other candidates near it and open ones are left alone; 0 = on every candidate
    barrier_relative: bool = False  # True: that floor is a fraction of the reference (untrained) model's probability
    # of each candidate, so only what learning pushed down is held, not what the prior ruled out (one reference
    # forward pass a batch)
    max_grad_norm: float = 1.0  # global gradient-norm clip (with natural_gradient: of the adapter step itself)
    cap_cut_replies: bool = True  # a generated reply cut at max_new_tokens, before its end token, never gets positive
    # credit nor is imitated (it was read before it ended: else paying rambles teach the model never to end a reply);
    # False for replies meant to be cut, e.g. one-token answers with max_new_tokens=1
    whiten_advantages: bool = True  # center advantages on the batch's mean and divide them by `advantage_scale`
    advantage_scale: str = (
        "returns"  # whitening divides by: "batch" (this batch's advantage std), "returns" (the std of
    )
    # every return seen so far: a batch of equal returns stays near 0 instead of becoming unit noise), or "none"
    advantage_center: str = "batch"  # whitening centers each turn on: "batch" (the batch's mean) or "state" (the mean
    # of the batch's turns in its state, its prompt, where it has others: ppo.state_centered); an experiment
    repeated_input_power: float | None = None  # each turn's advantage x n**-power, n the batch's turns in its state
    # (its prompt; ppo.repeated_input_weights): 0 = every turn alike, 0.5 = each state equal noise, 1 = each state
    # equal weight; None = the action mode's `repeated_input_power` (scoring 0.5; generate 0, where it was not measured)
    inverse_choice_cap: float | None = None  # scoring mode, an experiment: a turn that did better than the batch
    # weighs 1 / (C p) within [1, this], p the policy's probability of its choice among C candidates
    # (ppo.inverse_choice_weights): a choice the policy had nearly given up rises as far per draw as it paid; None = off
    inverse_choice_evidence: float | None = None  # with inverse_choice_cap, an experiment: weigh a turn only where
    # its (prompt, choice) pair's draws across updates have paid, z = S / sqrt(1 + Q) >= this (decayed sums of their
    # advantages and squares; algos/choice_evidence.py): one lucky draw never passes 1; None = weigh on one draw
    max_kl: float | None = 0.02  # trust region: backtrack each step until the mean KL(old || new) per turn <= this
    # (scoring mode: per bit of choice, i.e. divided by log2 of the input's number of candidates)
    input_kl_factor: float | None = None  # trust region, an experiment: also bound each input's KL(old || new), at
    # this many times max_kl (the mean can sit inside its bound while one state moves far); None = the mean only
    max_kl_generate: bool = False  # also bound generated replies (a noisy k3 estimate; scoring mode is always bound)
    evidence_kl: float | None = None  # scoring mode, an experiment: each update's bound is max_kl x the share of the
    # batch's push its episodes agree on (llamagym.algos.evidence), and at least max_kl x this floor; None = off
    hold_batches: int = 0  # natural steps in scoring mode, an experiment: the inputs of the last N batches that are not
    # in this one join the step's solve with a target move of 0 (llamagym.algos.holding), so a step moves less where
    # the batch says nothing; one process only; 0 = off
    kl_coef: float = 0.0  # (initial) weight of the per-turn KL to the reference policy in the reward; 0 = none
    kl_estimator: str = "k1"  # per-token estimator of kl_ref: k1, k2 or k3
    adaptive_kl: bool = False  # adapt kl_coef toward kl_target (Ziegler et al. 2019)
    kl_target: float = 1.0  # target per-turn kl_ref for the adaptive controller (nats summed over a reply)
    kl_horizon: int = 10_000  # controller horizon in turns: how fast kl_coef moves
    use_target_kl: bool = False  # stop an update early when approx_kl exceeds 1.5 x target_kl
    target_kl: float = 0.05  # approx_kl (new vs old policy) limit for early stopping
    weight_decay: float = 0.0  # AdamW weight decay
    natural_gradient: bool | None = None  # PPO steps in function space over the minibatch's distinct inputs (see
    # llamagym.algos.natural_gradient); None = on when every trained weight is in a Linear layer (LoRA)
    natural_step: float = 1.0  # natural_gradient: output move per unit of an input's per-turn output gradient
    natural_damping: float = 0.1  # natural_gradient: relative damping (larger is closer to a plain gradient step)
    average_updates: int = 3  # greedy acting uses the adapter's average over about this many updates, at most the
    # latest quarter of those so far (Polyak; llamagym.algos.averaging); sampling and training keep the current
    # weights; 0 = the current weights
    anneal_updates: int = 0  # adapter step (learning_rate, natural_step) falls linearly to 0 over N updates, and the
    # trust region's max_kl with it, as the step squared (the region would otherwise size each step back up); 0 = off
    seed: int = 0  # seed of the minibatch shuffles and replay sampling
    max_skipped_steps: int = 10  # optimizer steps skipped in a row (non-finite loss/gradient) before the run stops

    def __post_init__(self) -> None:
        from .algos import estimators  # here, not at the top: the config alone stays importable without torch

        positive = (lambda v: _num(v) and v > 0, "a number > 0")
        unit = (lambda v: _num(v) and 0 <= v <= 1, "in the interval [0, 1]")
        non_negative = (lambda v: _num(v) and v >= 0, "a number >= 0")
        count = (lambda v: _int(v) and v >= 1, "an integer >= 1")
        count_or_none = (lambda v: v is None or (_int(v) and v >= 1), "None or an integer >= 1")
        flag = (lambda v: isinstance(v, bool), "True or False")
        _check_fields(
            self,
            {
                "learning_rate": positive,
                "value_learning_rate": (lambda v: v is None or (_num(v) and v > 0), "None or a number > 0"),
                "batch_size": count,
                "min_batch_turns": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0 = count episodes only)"),
                "mini_batch_size": count_or_none,
                "micro_batch_size": count_or_none,
                "ppo_epochs": count_or_none,
                "gamma": unit,
                "lam": unit,
                "policy_lam": (lambda v: v is None or unit[0](v), "None (= lam) or a number in the interval [0, 1]"),
                "pool_tail": flag,
                "advantage": (
                    lambda v: v in estimators.names(),
                    f"one of {', '.join(estimators.names())} (llamagym.algos.estimators)",
                ),
                "group_std_scaling": flag,
                "clip_coef": positive,
                "clip_coef_high": (lambda v: v is None or (_num(v) and v > 0), "None or a number > 0"),
                "loss_aggregation": (lambda v: v in LOSS_AGGREGATIONS, f"one of {', '.join(LOSS_AGGREGATIONS)}"),
                "vf_clip_coef": (lambda v: v is None or (_num(v) and v > 0), "None or a number > 0"),
                "vf_coef": non_negative,
                "value_refit": (lambda v: v is None or (_num(v) and v > 0), "None or a number > 0"),
                "turn_values": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0 = off)"),
                "ent_coef": non_negative,
                "entropy_floor": (lambda v: v is None or (_num(v) and 0 < v < 1), "None (off) or a number in (0, 1)"),
                "entropy_floor_step": positive,
                "inverse_choice_cap": (lambda v: v is None or (_num(v) and v >= 1), "None (off) or a number >= 1"),
                "inverse_choice_evidence": (lambda v: v is None or (_num(v) and v > 0), "None (off) or a number > 0"),
                "barrier": non_negative,
                "barrier_floor": (lambda v: _num(v) and 0 <= v < 1, "a number in [0, 1) (0 = every candidate)"),
                "barrier_relative": flag,
                "max_grad_norm": positive,
                "cap_cut_replies": flag,
                "whiten_advantages": flag,
                "advantage_scale": (lambda v: v in ADVANTAGE_SCALES, f"one of {', '.join(ADVANTAGE_SCALES)}"),
                "advantage_center": (lambda v: v in ADVANTAGE_CENTERS, f"one of {', '.join(ADVANTAGE_CENTERS)}"),
                "repeated_input_power": (lambda v: v is None or unit[0](v), "None or a number in the interval [0, 1]"),
                "max_kl": (lambda v: v is None or (_num(v) and v > 0), "None (no trust region) or a number > 0"),
                "input_kl_factor": (lambda v: v is None or (_num(v) and v >= 1), "None (off) or a number >= 1"),
                "max_kl_generate": flag,
                "evidence_kl": (lambda v: v is None or (_num(v) and 0 < v <= 1), "None (off) or a number in (0, 1]"),
                "hold_batches": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0 = off)"),
                "kl_coef": non_negative,
                "kl_estimator": (lambda v: v in KL_ESTIMATORS, f"one of {', '.join(KL_ESTIMATORS)}"),
                "adaptive_kl": flag,
                "kl_target": positive,
                "kl_horizon": count,
                "use_target_kl": flag,
                "target_kl": non_negative,
                "weight_decay": non_negative,
                "natural_gradient": (lambda v: v is None or isinstance(v, bool), "True, False or None (automatic)"),
                "natural_step": positive,
                "natural_damping": positive,
                "average_updates": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0 = no averaging)"),
                "anneal_updates": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0 = no annealing)"),
                "seed": (_int, "an integer"),
                "max_skipped_steps": count,
            },
        )
        if self.barrier_floor and not self.barrier:
            raise ValueError(
                f"`barrier_floor={self.barrier_floor}` says under which probability the log-barrier acts, and "
                "`barrier` is 0 (off). Set barrier (e.g. 0.02) to use it, or barrier_floor=0."
            )
        if self.barrier_relative and not self.barrier_floor:
            raise ValueError(
                "`barrier_relative=True` makes the barrier's floor a fraction of the reference model's probabilities, "
                "and `barrier_floor` is 0. Set barrier_floor (e.g. 0.25: a candidate is held once it falls under a "
                "quarter of where the untrained model put it), or barrier_relative=False."
            )
        if self.inverse_choice_evidence is not None and self.inverse_choice_cap is None:
            raise ValueError(
                f"`inverse_choice_evidence={self.inverse_choice_evidence}` says which turns the inverse-choice weights "
                "act on, and `inverse_choice_cap` is None (off). Set inverse_choice_cap (e.g. 10.0) to use it, or "
                "inverse_choice_evidence=None."
            )
        if self.pool_tail and (self.policy_lam is None or self.policy_lam == self.lam):
            raise ValueError(
                "`pool_tail=True` gives the policy back part of the `lam` advantage over its `policy_lam` one, and "
                f"`policy_lam` is {self.policy_lam} (= lam). Set policy_lam below lam (e.g. 0.5), or pool_tail=False."
            )
        if self.turn_values and (self.value_refit is None or self.advantage != "gae"):
            raise ValueError(
                f"`turn_values={self.turn_values}` adds a value per turn index to the value head's, fit by its ridge "
                f"refit, and the config has value_refit={self.value_refit}, advantage={self.advantage!r}. Set "
                "value_refit (e.g. 1.0) and advantage='gae', or turn_values=0."
            )
        if self.evidence_kl is not None and self.max_kl is None:
            raise ValueError(
                "`evidence_kl` scales the trust region's bound, and `max_kl` is None (no trust region). Set max_kl "
                "(e.g. 0.02), or evidence_kl=None."
            )
        if self.hold_batches and self.natural_gradient is False:
            raise ValueError(
                f"`hold_batches={self.hold_batches}` shapes the natural-gradient step, and `natural_gradient` is "
                "False. Set natural_gradient=None (on with LoRA), or hold_batches=0."
            )
        if self.input_kl_factor is not None and self.max_kl is None:
            raise ValueError(
                "`input_kl_factor` bounds each input's KL at a multiple of the trust region's bound, and `max_kl` is "
                "None (no trust region). Set max_kl (e.g. 0.02), or input_kl_factor=None."
            )


@dataclass
class ReplayConfig:
    """SFT warm-start: keep the best episodes and imitate them a little after every PPO update."""

    capacity: int = 64  # episodes kept; the oldest leave first (demonstrations are kept apart, never evicted)
    top_fraction: float = 0.25  # share of each batch's episodes, best returns first, that enter the buffer
    min_return: float | None = None  # episodes must also reach this return to enter (None = no floor)
    sft_steps: int = 2  # supervised minibatch steps after each PPO update
    sft_batch_size: int = 8  # assistant turns per supervised step
    sft_coef: float = 0.5  # scale of the supervised loss
    demo_fraction: float = 0.5  # share of each supervised minibatch drawn from demonstrations when there are any

    def __post_init__(self) -> None:
        count = (lambda v: _int(v) and v >= 1, "an integer >= 1")
        _check_fields(
            self,
            {
                "capacity": count,
                "top_fraction": (lambda v: _num(v) and 0 < v <= 1, "in the interval (0, 1]"),
                "min_return": (lambda v: v is None or _num(v), "None or a number"),
                "sft_steps": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
                "sft_batch_size": count,
                "sft_coef": (lambda v: _num(v) and v > 0, "a number > 0"),
                "demo_fraction": (lambda v: _num(v) and 0 <= v <= 1, "in the interval [0, 1]"),
            },
        )
