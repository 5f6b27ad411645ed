"""PPO for LLM agents over whole episodes of chat turns.

What one action, one reward and one value are (docs/design.md §3):
1. One action = one assistant turn (a sampled reply).
2. The state value V(s) is read by the value head at the last prompt token of the turn.
3. The turn reward = env reward - kl_coef * (summed per-token KL of the reply to the reference policy).
4. GAE (gamma, lam) runs across the turns of an episode; bootstrap from V(next state) only on truncation (the
   policy's advantages at `policy_lam` instead, where set; the value head's targets stay at `lam`). Or
   another advantage estimator (`PPOConfig.advantage`, see `estimators.py`): critic-free ones compare an episode's
   return with its group's (episodes with the same first prompt, or the same `Episode.group`). The value head
   still learns their returns-to-go (its loss and refit run as ever), though they do not read it.
5. The turn's advantage is broadcast over its response tokens in a masked clipped PPO loss (a token mean, or
   `PPOConfig.loss_aggregation`; clip-higher with `clip_coef_high`). It is first weighed by n**-power when n of the
   batch's turns acted in its state, i.e. had its prompt (`PPOConfig.repeated_input_power`, by default the mode's:
   1/sqrt(n) scoring), and in scoring mode, where asked and it is positive, by 1/(C p) within [1, cap], p the
   probability of its choice among C candidates (`PPOConfig.inverse_choice_cap`, an experiment), there only where
   its (prompt, choice) pair has paid across updates if `PPOConfig.inverse_choice_evidence` is set (`choice_evidence`).

Two KLs, never mixed up: `kl_ref` (policy vs reference, in the reward, adaptive coefficient) and `approx_kl`
(new vs old policy within an update, for target-KL early stopping, checked before each optimizer step).
The backward pass and the optimizer step live in `_backward`/`_step` alone. A policy step is taken by
`policy_optimizer`: the AdamW `optimizer`, or the `natural` one
(`NaturalGradient`), called the same way (`zero_grad`, backward, clip, `step`).

Data parallel (several ranks, `llamagym.distributed`; docs/scaling.md): each rank steps on its own episodes, and
what an update reads from the whole batch is reduced so that every rank applies the update one process would on
the union of the ranks' episodes (in rank order): the estimator's inputs are gathered (advantages, groups, the
whitening and the running return scale are computed over every rank's turns, each rank keeping its own slice);
loss weights are shares of the global token and row counts and gradients are summed (AdamW), or every rank's
per-input rows gathered and merged (natural steps); the trust region's KL and surrogate, the KL controller's mean,
the value refit's features and the replay buffer's episodes are global. `batch_size` counts each rank's episodes;
`mini_batch_size` counts the turns of a step over all ranks. In one process every reduction is a no-op.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch

from .. import distributed
from ..config import PPOConfig, ReplayConfig
from ..models.host_memory import FreedMemoryBound
from ..models.policy import Policy
from . import estimators, evidence, ppo, turn_values
from .averaging import WeightAverage
from .choice_evidence import ChoiceEvidence
from .holding import HeldInputs, held_outputs
from .modes import ActionMode, Recalled, mode_of
from .modes.score import SCORE_TOKENS, token_chunks
from .natural_gradient import NaturalGradient, RowGradients
from .rollout import Episode, Turn, UpdateBatch, collate, minibatch_indices, numbered, prompt_batch
from .sft_replay import SFTReplayBuffer, sft_loss
from .trust_region import TrustRegion

logger = logging.getLogger(__name__)
PLAIN_MINI_BATCH = 8  # turns per AdamW step when `mini_batch_size` is None
PLAIN_EPOCHS = 2  # passes over the batch with AdamW (or minibatched natural) steps when `ppo_epochs` is None
CUT_WARNING = 0.9  # warn once when this share of a batch's replies was cut at max_new_tokens (and so not reinforced)


class PPOTrainer:
    """Owns the optimizer, the KL controller and the update loop; `step(episodes)` returns a stats dict.

    Args:
        policy: the LoRA policy with its value head.
        config: PPO hyperparameters.
        pad_token_id: id used to right-pad the training batch (masked out everywhere).
        replay_config: enables the SFT warm-start replay buffer when given.
        replay_modes: the action modes (`ActionMode.name`) whose updates are followed by the replay's supervised
            steps; None = every mode. Once the buffer holds demonstrations, every mode's updates are.
    """

    def __init__(
        self,
        policy: Policy,
        config: PPOConfig,
        pad_token_id: int,
        replay_config: ReplayConfig | None = None,
        replay_modes: tuple[str, ...] | None = None,
    ):
        self.policy = policy
        self.config = config
        self.pad_token_id = pad_token_id
        value_params = list(policy.value_head.parameters())
        lm_params = [p for p in policy.trainable_parameters() if all(p is not v for v in value_params)]
        value_lr = config.value_learning_rate or config.learning_rate
        self.optimizer = torch.optim.AdamW(
            [{"params": lm_params}, {"params": value_params, "lr": value_lr}],
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
        )
        if config.adaptive_kl:
            self.kl_controller = ppo.AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
        else:
            self.kl_controller = ppo.FixedKLController(config.kl_coef)
        self.replay = SFTReplayBuffer(replay_config) if replay_config is not None else None
        self.replay_modes = replay_modes
        self.estimator = estimators.get_estimator(config.advantage)  # `needs_value`: gae; whitened (see `step`)
        self._loss_options: dict = {}  # this update's options of `ppo.policy_loss` (see `_loss_options`)
        # natural-gradient steps (`NaturalGradient`): per-input gradients of the policy loss, solved for jointly,
        # move the adapter; the value head keeps its AdamW step on the value loss, which no longer reaches the adapter
        self.lm_params = lm_params
        rows = _row_gradients(policy, lm_params, config.natural_gradient)
        self.natural = None
        if rows is not None:
            self.natural = NaturalGradient(
                rows, self.optimizer, config.natural_step, config.natural_damping, config.max_grad_norm
            )
        policy.value_head.detach_input = self.natural is not None
        self.held = None  # the inputs of recent batches a natural step holds (`PPOConfig.hold_batches`)
        if config.hold_batches:
            if self.natural is None or distributed.is_distributed():
                raise ValueError(
                    f"PPOConfig(hold_batches={config.hold_batches}) needs natural-gradient steps (LoRA, every trained "
                    "weight in a Linear layer) in one process. Set hold_batches=0."
                )
            self.held = HeldInputs(config.hold_batches)
        self.choice_evidence = None  # each (prompt, choice) pair's draws across updates (`inverse_choice_evidence`)
        if config.inverse_choice_evidence is not None:
            if distributed.is_distributed():
                raise ValueError(
                    f"PPOConfig(inverse_choice_evidence={config.inverse_choice_evidence}) counts each (prompt, choice) "
                    "pair's draws in one process's table. Run it in one process, or set inverse_choice_evidence=None."
                )
            self.choice_evidence = ChoiceEvidence()
        self._held_data: UpdateBatch | None = None  # this update's held inputs, collated (scoring mode)
        self.policy_optimizer: torch.optim.AdamW | NaturalGradient = self.optimizer  # this update's (see `step`)
        self.trust_region = (
            TrustRegion(lm_params, config.max_kl, input_factor=config.input_kl_factor)
            if config.max_kl is not None
            else None
        )
        self.average = WeightAverage(lm_params, config.average_updates) if config.average_updates else None
        self._lent = False  # greedy_weights() has lent the average to the adapter
        self.return_moments = ppo.RunningMoments()  # every return so far: the scale of advantage_scale="returns"
        floor = config.entropy_floor
        self.entropy_floor = ppo.EntropyFloor(floor, config.entropy_floor_step) if floor is not None else None
        self.ent_coef = config.ent_coef  # this update's entropy bonus weight: ent_coef + the floor's (see `step`)
        self._barrier = config.barrier  # this update's log-barrier weight (0 on a batch of equal returns)
        self._turn_weights: torch.Tensor | None = None  # each turn's weight from its state's count (None: all 1)
        # a value per turn index added to the head's (`PPOConfig.turn_values`), and this update's turns' indices
        self.turn_values = torch.zeros(config.turn_values, device=policy.device) if config.turn_values else None
        self._turn_index: torch.Tensor | None = None
        self._entropy_weights: torch.Tensor | None = None  # that weight per turn of the batch (None: no bonus)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.num_updates = 0
        self.step_scale = 1.0  # this update's factor on the adapter's step size (see `anneal_updates`)
        self.skipped_steps = 0  # all skipped optimizer steps (reported as ppo/skipped_steps)
        self.consecutive_skips = 0  # skipped since the last applied step; the run stops at max_skipped_steps
        self._batch_summary = ""  # the current batch's reward/advantage/KL range, for the skip warning
        self._input_ids: torch.Tensor | None = None  # data-parallel: local distinct input -> id shared by all ranks
        self._measured: _Measured | None = None  # the last trust-region measure's outputs, kept for acting (`step`)
        # CPU: freed heap goes back to the system after each update, and within one when it grows past a bound
        self.freed_memory = FreedMemoryBound() if policy.device.type == "cpu" else None
        self._warned_cut = False  # the warning that nearly every reply was cut at max_new_tokens is given once
        self._warned_hold = False  # the warning that generate mode holds nothing is given once
        distributed.broadcast_(list(policy.trainable_parameters()))  # every rank starts from rank 0's weights

    # ---- one update ------------------------------------------------------------------------------------------
    def step(self, episodes: list[Episode], acted: Callable[[ActionMode], dict] | None = None) -> dict[str, float]:
        """Run one PPO update (then the SFT replay steps) on finished episodes.

        `acted(mode)` gives the acting memory of the turns' mode (the agent's `Actor.memory`): the old policy's
        outputs acting already computed with the current weights are taken from there (`ActionMode.recall`) and
        only the other inputs are run again; after the update, the outputs the trust region measured at the
        weights it kept are left there for the next batch's acting (`ActionMode.remember`). Not with the base
        sharded, where every forward is a collective."""
        cfg, start = self.config, time.perf_counter()
        episodes = [e for e in episodes if e.turns]
        if not episodes:
            raise ValueError("PPOTrainer.step() needs at least one episode with a turn.")
        self._anneal()
        trims = self.freed_memory.trims if self.freed_memory is not None else 0
        turns = [turn for episode in episodes for turn in episode.turns]
        mode = mode_of(turns)  # the action mode collates and evaluates the turns (`algos/modes/`)
        if self.policy.frozen_cache is not None:  # frozen-layer states unused for the mode's rounds go
            self.policy.frozen_cache.next_round(mode.cache_rounds)
        batch = mode.collate(turns, self.pad_token_id, self.policy.device)
        # Natural steps are automatic in every mode (LoRA), the trust region only where the KL is exact (scoring mode,
        # over the candidates): in generate mode the bound is a k3 estimate summed over sampled reply tokens, and in the
        # suite's generate runs it undid every step (docs/learning-that-holds.md), so it runs there only when asked.
        natural = self.natural is not None
        self.policy_optimizer = self.natural if natural else self.optimizer
        if natural:  # generate mode's update holds its replies' activations too: G in bf16 where the policy is
            low = not mode.exact_kl and self.policy.precision == "bf16"
            self.natural.grad_dtype = torch.bfloat16 if low else torch.float32
        region = self.trust_region if mode.exact_kl or cfg.max_kl_generate else None
        data = UpdateBatch(mode, batch, mode.distinct_inputs(turns), mode.action_mask(batch))
        mask = data.mask
        self._held_data = self._held(mode, turns) if natural else None
        # Shuffles for every epoch are drawn up front: the old log-probs are computed on epoch 0's minibatches,
        # so the first minibatch repeats that exact forward and its ratio is exactly 1 (1 up to rounding for the
        # inputs whose old outputs acting computed, `recall`).
        # Minibatches: a natural step solves over every distinct input at once, so it takes the whole batch; an AdamW
        # step is one small move, so plain steps take several per epoch (8 turns each, as generate mode once learned).
        size = cfg.mini_batch_size or (len(turns) if natural else PLAIN_MINI_BATCH)
        self._loss_options = _loss_options(cfg, mask)
        plans = self._plans(len(turns), size, whole=natural and cfg.mini_batch_size is None)
        if distributed.is_distributed():
            self._input_ids = _shared_input_ids(mode, turns)

        # 1. old log-probs and values (and, scoring, the old distributions over candidates), reference log-probs
        #    (no grad, dropout off)
        recalled = None
        keep = acted is not None and not self.policy.sharded  # acting's outputs taken, the measured ones handed back
        self._measured = None
        if keep:
            recalled = mode.recall(acted(mode), turns, batch)
        old_logprobs, old_values, old_dists, features = self._score(data, plans[0], reference=False, recalled=recalled)
        self._turn_index = None
        if self.turn_values is not None:  # V(s, t): the head's value of the prompt plus its turn index's
            lengths = torch.tensor([len(e.turns) for e in episodes], device=old_values.device)
            self._turn_index = turn_values.turn_indices(lengths, len(self.turn_values))
            old_values = old_values + self.turn_values[self._turn_index]
        ref_dists = None  # the reference's candidate distributions: only a relative barrier floor needs them
        relative = bool(cfg.barrier and cfg.barrier_relative and old_dists is not None)
        if self.kl_controller.value == 0 and not cfg.adaptive_kl and not relative:
            ref_logprobs = old_logprobs  # the KL term is off: skip the reference forward pass
        else:
            with self.policy.reference():
                ref_logprobs, _, ref_dists, _ = self._score(data, plans[0], reference=True)

        if self.freed_memory is not None:  # what acting and scoring freed goes back before the steps mark theirs
            self.freed_memory.release()

        # 2. per-turn rewards: env reward minus the KL penalty to the reference
        kl_ref = (ppo.kl_penalty(old_logprobs, ref_logprobs, cfg.kl_estimator) * mask).sum(dim=-1)
        env_rewards = torch.tensor([t.reward for t in turns], dtype=torch.float32, device=mask.device)
        rewards = env_rewards - self.kl_controller.value * kl_ref

        # 3. advantages: GAE across the turns of each episode (bootstrap on truncation only), or the configured
        #    estimator; critic-free ones center (and scale) their own advantages, so only value-based ones are whitened
        #    (data-parallel: over every rank's turns, in rank order; this rank keeps its own slice, `mine`)
        scored, mine = self._advantage_batch(episodes, rewards, old_values)
        advantages, returns, estimator_stats = self._estimate(scored)
        all_values = scored.values
        self.return_moments.update(returns)
        spread = {"adv/raw_std": _std(advantages), "adv/return_std": _std(returns), **estimator_stats}
        equal = _equal_returns(scored, cfg.gamma)
        if self.estimator.needs_value and cfg.whiten_advantages and len(advantages) >= 2:
            if equal:
                # every action led to the same return: nothing says one was better, and what A = R - V holds is
                # the value head's error, which whitening would blow up into full-size steps (a solved policy
                # then collapses). No policy step; the value head still learns.
                advantages = torch.zeros_like(advantages)
                spread["adv/equal_returns"] = 1.0
            else:
                states = scored.step_key if cfg.advantage_center == "state" else None
                advantages = ppo.scale_advantages(advantages, cfg.advantage_scale, self.return_moments.std, states)
        # an invalid reply named no action: the fallback chose what followed, so the reply never gets positive credit
        # for it (else a fallback that happens to pay teaches the model to reply in a form that cannot be read); nor
        # does a reply cut at max_new_tokens, read before it ended (else a paying one teaches the model to ramble on)
        local = advantages[mine]
        invalid = torch.tensor([not t.valid for t in turns], device=local.device)
        unfinished = torch.tensor([not t.finished for t in turns], device=local.device)
        cut = unfinished & ~invalid & cfg.cap_cut_replies
        cut_share = float(unfinished.float().mean())
        if cfg.cap_cut_replies and cut_share >= CUT_WARNING and not self._warned_cut:
            self._warned_cut = True
            logger.warning(
                f"{cut_share:.0%} of this batch's replies were cut at max_new_tokens before their end token; they "
                f"are never reinforced nor imitated (PPOConfig.cap_cut_replies). Raise max_new_tokens "
                f"(Agent(generation_config=...)), or set PPOConfig(cap_cut_replies=False) if your replies are meant "
                f"to be cut (e.g. one-token answers)."
            )
        spread["adv/invalid_capped"] = float((invalid & (local > 0)).sum()) / len(turns)
        spread["adv/cut_capped"] = float((cut & (local > 0)).sum()) / len(turns)
        local = torch.where(invalid | cut, local.clamp(max=0.0), local)
        drawn = local  # each turn's advantage before any weight: what the choice evidence counts
        power = mode.repeated_input_power if cfg.repeated_input_power is None else cfg.repeated_input_power
        if power:  # scaled after the estimator: the weights shrink what a turn moves, not its return. Counted by
            # state (the prompt; over every rank's turns, data-parallel), not by model input: a generated reply is
            # part of its input, and counting replies would weigh an action down for being chosen often
            self._turn_weights = state_weights(scored.step_key, power, mine, local.device)
            local = local * self._turn_weights
        else:
            self._turn_weights = None
        if cfg.inverse_choice_cap is not None and old_dists is not None:  # scored: one log-prob per turn, its choice's
            counts = batch.num_candidates.to(local.device)
            choice = ppo.inverse_choice_weights(old_logprobs[:, 0].to(local), counts, local, cfg.inverse_choice_cap)
            if self.choice_evidence is not None:  # only pairs whose draws have paid across updates are weighed
                pairs = [(hash(tuple(t.prompt_ids)), t.choice) for t in turns]
                scores = self.choice_evidence.update(pairs, drawn)
                choice = torch.where(scores >= cfg.inverse_choice_evidence, choice, torch.ones_like(choice))
                spread["adv/choice_weighed"] = float((choice > 1).float().mean())
            spread["adv/choice_weight_max"] = float(choice.max())
            local = local * choice
        self._batch_summary = (
            f"batch of {len(turns)} turns: mean reward {float(env_rewards.mean()):.4g}, advantages in "
            f"[{float(advantages.min()):.4g}, {float(advantages.max()):.4g}], kl/ref {float(kl_ref.mean()):.4g}"
        )
        data = data._replace(
            old_logprobs=old_logprobs,
            old_values=old_values,
            old_dists=old_dists,
            ref_dists=ref_dists if relative else None,
            advantages=local,
            returns=returns[mine],
        )
        spread.update(self._entropy_bonus(data, equal))
        # scoring mode: how much of the step the batch's episodes agree on. Data-parallel it takes two collectives,
        # so there it is measured only when it sizes the bound (`evidence_kl`); in one process it is always logged.
        asked = cfg.evidence_kl is not None
        if data.old_dists is not None and (asked or not distributed.is_distributed()):
            spread["adv/evidence"] = self._evidence(data, scored, mine)
            if region is not None and asked:
                # step_scale is 1 without annealing; with it the bound falls as the step squared (see `_anneal`)
                region.max_kl = cfg.max_kl * self.step_scale**2 * max(spread["adv/evidence"], cfg.evidence_kl)
        if region is not None and (asked or cfg.anneal_updates):
            spread["trust/bound"] = region.max_kl
        if self.held is not None:
            spread["hold/inputs"] = float(len(self._held_data.groups)) if self._held_data is not None else 0.0

        # 4. epochs x minibatches (each accumulated over micro-batches), target-KL check before each step
        stats: dict[str, list[float]] = defaultdict(list)
        early_stopped, done = False, 0
        for plan in plans:
            for index in plan:
                mb = self._minibatch_loss(data, index)
                if mb is None:  # a non-finite loss: nothing was applied, the step is skipped
                    continue
                if cfg.use_target_kl and ppo.kl_exceeded(mb["ppo/approx_kl"], cfg.target_kl):
                    self.policy_optimizer.zero_grad(set_to_none=True)
                    early_stopped = True
                    break
                if region is not None:
                    region.remember()
                if self._step(stats) and region is not None:
                    before = mb["ppo/surrogate"] + mb["ppo/entropy_bonus"] + mb["ppo/barrier"]
                    measure = functools.partial(self._measure, data, index, before, keep)
                    for key, value in region.enforce(measure, self._moved).items():
                        stats[f"trust/{key}"].append(value)
                done += 1
                for key, value in mb.items():
                    stats[key].append(value)
            if early_stopped:
                break
        measured, self._measured = self._measured, None  # the last measure's outputs, if at the weights as they are
        if measured is not None and measured.version != self.policy.version:
            measured = None

        # 5. refit the value head to this batch's returns (its AdamW steps alone barely move it in a few steps)
        if features is not None:
            turn_rows = distributed.all_gather_cat(self._turn_index)[0] if self._turn_index is not None else None
            refit_ev = self._refit_value(distributed.all_gather_cat(features)[0], returns, turn_rows)
            if math.isfinite(refit_ev):  # undefined when every return is equal
                spread["ppo/value_refit_ev"] = refit_ev
            if turn_rows is not None:  # how far apart the turn values of this batch's turn indices are
                seen = self.turn_values[torch.unique(turn_rows)]
                spread["ppo/turn_value_range"] = float(seen.max() - seen.min())
        refitted = self.policy.version

        # 6. adapt the KL coefficient toward its target
        if distributed.is_distributed():
            mean_kl_ref = distributed.reduce_number(float(kl_ref.sum())) / len(returns)
        else:
            mean_kl_ref = float(kl_ref.mean())
        self.kl_controller.update(mean_kl_ref, len(returns))

        # 7. SFT warm-start: imitate the best episodes (and demonstrations); data-parallel, every rank adds every
        #    rank's episodes and takes the same steps
        replaying = self.replay is not None and (
            self.replay_modes is None or mode.name in self.replay_modes or bool(self.replay.demos)
        )
        sft_stats = self._sft(episodes) if replaying else {}

        # 8. the trust region's last measure scored the batch's inputs with the weights acting uses next: acting takes
        #    those outputs (values from the refitted head) instead of scoring the inputs again. Only when nothing but
        #    the value head changed since (no replay step, no undone step).
        if measured is not None and self.policy.version == refitted:
            with torch.no_grad():
                values = self.policy.value_head(measured.features)
            rows = measured.rows.tolist()
            mode.remember(acted(mode), [turns[i] for i in rows], measured.dists, values, measured.features)

        if self.held is not None:
            self.held.add(mode, turns)
        self.num_updates += 1
        if self.freed_memory is not None:  # the update's activations are freed: give their pages back
            self.freed_memory.release()
        if self.average is not None:
            self.average.update()
        result = {key: sum(values) / len(values) for key, values in stats.items() if values}
        if self.freed_memory is not None:  # trims within the update (the bound on freed memory)
            result["memory/trims"] = float(self.freed_memory.trims - trims)
        if "trust/scale" in stats:
            result["trust/undone"] = float(sum(scale == 0 for scale in stats["trust/scale"]))
        result.update(
            {
                "ppo/early_stopped": float(early_stopped),
                "ppo/epochs_completed": done / len(plans[0]),
                "ppo/minibatches": float(done),
                "ppo/skipped_steps": float(self.skipped_steps),
                "ppo/advantages_mean": float(advantages.mean()),
                "ppo/returns_mean": float(returns.mean()),
                "ppo/values_mean": float(all_values.mean()),
                "ppo/num_turns": float(len(returns)),
                "ppo/distinct_turns": float(int(data.groups.max()) + 1),
                "ppo/num_updates": float(self.num_updates),
                "ppo/step_scale": self.step_scale,
                "kl/ref": mean_kl_ref,
                "kl/coef": float(self.kl_controller.value),
                "env/batch_return": _batch_return(episodes),
                "adv/returns_running_std": self.return_moments.std,
                **spread,
                "time/update_s": time.perf_counter() - start,
                **sft_stats,
            }
        )
        explained = float(ppo.explained_variance(all_values, returns, torch.ones_like(returns)))
        if math.isfinite(explained):  # undefined when every return is equal: left out, so metrics stay strict JSON
            result["ppo/explained_variance"] = explained
        return result

    @contextmanager
    def greedy_weights(self):
        """Inside this block the adapter holds the weights greedy acting uses: their average over the last
        `average_updates` updates (`averaging.WeightAverage`), or the current ones (averaging off, or no update yet).
        Cached outputs of either go stale on the way in and out. A nested block keeps the weights the outer one
        lent: an evaluation holds them across all its calls, and its cached scores stay valid between them."""
        if self._lent or self.average is None or self.average.mean is None:
            yield
            return
        self._lent = True
        try:
            with self.average.swapped():
                self._moved()
                yield
        finally:
            self._lent = False
            self._moved()

    @contextmanager
    def latest_weights(self):
        """Inside this block greedy acting uses the latest weights, not their average (to compare the two)."""
        with self.greedy_average(None):
            yield

    @contextmanager
    def greedy_average(self, average: WeightAverage | None):
        """Inside this block greedy acting uses `average` (a `WeightAverage` of this adapter's parameters, kept up
        to date by the caller; None = the latest weights) instead of the trainer's own: to compare averages on one
        training run. Training is unaffected."""
        own, self.average = self.average, average
        try:
            yield
        finally:
            self.average = own

    # ---- pieces ----------------------------------------------------------------------------------------------
    def _anneal(self) -> None:
        """Set this update's adapter step size (`anneal_updates`); the value head keeps its learning rate."""
        cfg = self.config
        self.step_scale = ppo.linear_anneal(self.num_updates, cfg.anneal_updates)
        self.optimizer.param_groups[0]["lr"] = cfg.learning_rate * self.step_scale
        if self.natural is not None:
            self.natural.param_groups[0]["lr"] = cfg.natural_step * self.step_scale
        if self.trust_region is not None and cfg.anneal_updates:  # the bound falls with the step (KL ~ step^2):
            # the region sizes each step to its bound (`next_start`), so a smaller rate alone would be sized back up
            self.trust_region.max_kl = cfg.max_kl * self.step_scale**2
        if self.step_scale == 0 and self.num_updates == cfg.anneal_updates:
            logger.warning(
                "update %d: anneal_updates=%d is reached, so the adapter's step size is 0 and further updates leave "
                "the policy unchanged (the value head still learns). Raise PPOConfig.anneal_updates to train longer.",
                self.num_updates + 1,
                cfg.anneal_updates,
            )

    def _plans(self, n: int, size: int, whole: bool) -> list[list[torch.Tensor]]:
        """Each epoch's minibatches: a shuffled partition of the batch's `n` turns into chunks of `size` (the whole
        batch when `whole`).

        Epochs: `ppo_epochs`, or when None one for whole-batch natural steps (a second step, from the clipped loss
        after the first, took back what the inputs past the clip range had gained: docs/learning-that-holds.md) and
        `PLAIN_EPOCHS` for the others.

        Data-parallel, every rank must take the same number of steps: the minibatch has `size` turns over all
        ranks, so each rank splits its own turns into ceil(all turns / size) near-equal chunks (no more than the
        fewest turns a rank has; one when `whole`).
        """
        epochs = self.config.ppo_epochs or (1 if whole else PLAIN_EPOCHS)
        if not distributed.is_distributed():
            return [minibatch_indices(n, size, self.generator) for _ in range(epochs)]
        total, fewest = distributed.reduce_number(n), distributed.reduce_number(n, "min")
        chunks = 1 if whole else max(1, min(math.ceil(total / size), int(fewest)))
        return [list(torch.randperm(n, generator=self.generator).tensor_split(chunks)) for _ in range(epochs)]

    def _evaluate(self, data: UpdateBatch, part, with_entropy: bool = False, watch=None, reference: bool = False):
        """The `modes.Evaluation` (log-probs, mask, values, entropy, distributions) of the actions of rows `part`
        by the batch's action mode: generated turns give one log-prob per response token, scored turns one per turn,
        log pi(chosen candidate), and the (P, C) log-probs of every candidate (None when generating).

        Rows with the same model input (`groups`) are computed once and shared: the result is the same, the cost
        is that of the distinct inputs only. `watch` (a `RowGradients.watch`) is given the per-input outputs.
        """
        distinct, inverse = torch.unique(data.groups[part], return_inverse=True)
        first = torch.full((len(distinct),), len(part)).scatter_reduce(0, inverse, torch.arange(len(part)), "amin")
        return data.mode.evaluate(self.policy, data.batch, part, first, inverse, with_entropy, watch, reference)

    def _micro(
        self, groups: torch.Tensor, index: torch.Tensor, head_rows: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """A minibatch's rows in micro-batches of at most `micro_batch_size` distinct inputs (which bounds the
        forward/backward memory); rows sharing an input stay in one micro-batch.

        `head_rows` ((N,) each row's `ActionMode.head_rows`) is for a forward without gradient, which keeps no
        activations: its micro-batches take more inputs while their rows of vocabulary-wide logits stay within
        `SCORE_TOKENS`, as acting's forwards do (the trust region's measures on Blackjack, 88 inputs: one
        forward instead of 11, which took 2.0 s instead of 3.3 s on a 2-core fp32 CPU).

        With the base sharded (FSDP) each forward is a collective, so every rank makes as many micro-batches: as
        many as the rank that needs the most, but no more than the fewest distinct inputs a rank has.
        """
        distinct, inverse = torch.unique(groups[index], return_inverse=True)
        size = self.config.micro_batch_size or len(distinct)
        if not self.policy.sharded:
            if head_rows is not None and size < len(distinct):
                rows = torch.zeros(len(distinct), dtype=torch.long).scatter_(
                    0, inverse.cpu(), head_rows[index].long().cpu()
                )
                chunks = token_chunks(rows.tolist(), int, SCORE_TOKENS, least=size)
                bounds = [0, *itertools.accumulate(map(len, chunks))]
                return [index[(inverse >= lo) & (inverse < hi)] for lo, hi in itertools.pairwise(bounds)]
            return [index[(inverse >= lo) & (inverse < lo + size)] for lo in range(0, len(distinct), size)]
        most = distributed.reduce_number(math.ceil(len(distinct) / size), "max")
        count = int(min(most, distributed.reduce_number(len(distinct), "min")))
        return [index[torch.isin(inverse, chunk)] for chunk in torch.arange(len(distinct)).tensor_split(count)]

    @torch.no_grad()
    def _score(self, data: UpdateBatch, plan: list[torch.Tensor], reference: bool, recalled: Recalled | None = None):
        """Log-probs (N, T), values (N,), scoring the candidate distributions (N, C) (else None), and the value
        head's inputs (N, H) when `value_refit` asks for them (else None) of the whole batch, computed micro-batch
        by micro-batch as the first epoch will (so the first minibatch's ratio is exactly 1).

        Rows `recalled.known` are taken from what acting computed with the same weights instead (in another batch
        shape: their first ratio is 1 up to rounding, exactly in fp32 but for the last bits)."""
        groups = data.groups
        logprobs = torch.zeros_like(data.mask)
        values = torch.zeros(data.batch.input_ids.shape[0], device=logprobs.device)
        dists, features = data.mode.empty_distributions(data.batch), None
        keep = not reference and self.config.value_refit is not None
        if recalled is not None:
            logprobs, values = recalled.logprobs.clone(), recalled.values.clone()
            dists = None if recalled.dists is None else recalled.dists.clone()
            features = recalled.features.clone() if keep and recalled.features is not None else None
            plan = [index[~recalled.known[index].to(index.device)] for index in plan]  # plans are on the CPU
        for part in (part for index in plan if len(index) for part in self._micro(groups, index)):
            with self._head_inputs(keep) as seen:
                mb_logprobs, _, mb_values, _, mb_dists = self._evaluate(data, part, reference=reference)
            logprobs[part, : mb_logprobs.shape[1]] = mb_logprobs
            values[part] = mb_values
            if keep:
                features = self._spread(features, seen, groups, part, len(values))
            if mb_dists is not None:  # a micro-batch may have fewer candidates than the batch's most
                dists[part, : mb_dists.shape[1]] = mb_dists
        return logprobs, values, dists, features

    @contextmanager
    def _head_inputs(self, active: bool):
        """Inside the block, a list collecting the value head's input of each forward (nothing unless `active`)."""
        seen: list[torch.Tensor] = []
        head = self.policy.value_head
        hook = head.register_forward_pre_hook(lambda _, args: seen.append(args[0])) if active else None
        try:
            yield seen
        finally:
            if hook is not None:
                hook.remove()

    @staticmethod
    def _spread(features: torch.Tensor | None, seen: list[torch.Tensor], groups, part, rows: int) -> torch.Tensor:
        """`features` (rows, H; zeros when None) with rows `part` filled from the value head's last input, which
        had one row per distinct input of the part (`groups`): spread back over the part's turns."""
        head_input = seen.pop().float()
        if features is None:
            features = torch.zeros(rows, head_input.shape[-1], device=head_input.device)
        features[part] = head_input[torch.unique(groups[part], return_inverse=True)[1]]
        return features

    @torch.no_grad()
    def _refit_value(self, features: torch.Tensor, returns: torch.Tensor, turns: torch.Tensor | None = None) -> float:
        """Refit the value head by ridge regression toward this batch's returns (`ppo.ridge_refit`), with the turn
        values where kept (`turns`: each row's turn index; `turn_values.refit`); returns the refit head's explained
        variance on the batch."""
        linear, damping = self.policy.value_head.linear, self.config.value_refit
        if turns is None:
            weight, bias = ppo.ridge_refit(features, returns, linear.weight, linear.bias, damping)
            by_turn = None
        else:
            weight, bias, by_turn = turn_values.refit(
                features, turns, returns, linear.weight, linear.bias, self.turn_values, damping
            )
        if not all(torch.isfinite(x).all() for x in (weight, bias, by_turn) if x is not None):
            logger.warning("value_refit gave non-finite weights; the value head keeps its value-loss steps only")
            return float("nan")
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
        self._moved()  # values acting remembered are stale, even if no policy step was taken
        fitted = (features @ weight.T).squeeze(-1) + bias
        if by_turn is not None:
            self.turn_values.copy_(by_turn)
            fitted = fitted + by_turn[turns]
        return float(ppo.explained_variance(fitted, returns, torch.ones_like(returns)))

    def _minibatch_loss(self, data: UpdateBatch, index: torch.Tensor) -> dict | None:
        """Forward and backward one minibatch in micro-batches (gradients accumulate); returns its stats.

        Token means are weighted by each micro-batch's share of the minibatch's tokens (turn means by rows), so
        the accumulated gradient equals that of the whole minibatch at once.
        """
        cfg, mask, groups = self.config, data.mask, data.groups
        # data-parallel: shares of the minibatch's tokens and rows over every rank, so the summed gradient is its own
        total_tokens, total_rows = distributed.all_reduce(mask[index].sum()), int(distributed.reduce_number(len(index)))
        sums: dict[str, float] = defaultdict(float)
        natural = self.policy_optimizer if isinstance(self.policy_optimizer, NaturalGradient) else None
        micro = self._micro(groups, index)
        if natural is not None:  # its per-input gradients are recorded by hooks set in the forward pass
            keys = None
            if self._input_ids is not None:  # the rows' shared ids, in the order the micro-batches record them
                keys = torch.cat([self._input_ids[torch.unique(groups[part])] for part in micro])
            held = len(self._held_data.groups) if self._held_data is not None else 0
            natural.expect(inputs=len(torch.unique(groups[index])), turns=total_rows, keys=keys, held=held)
        finite = True
        for part in micro:
            # a natural step records each input's own gradient; a plain one needs their sum: shared tokens run once
            with natural.recording() if natural is not None else self.policy.summed_gradients() as watch:
                logprobs, part_mask, values, entropy, dists = self._evaluate(data, part, True, watch=watch)
            old = data.old_logprobs[part, : logprobs.shape[1]]
            token_share, row_share = part_mask.sum() / total_tokens, len(part) / total_rows
            part_advantages = data.advantages[part].unsqueeze(-1).expand_as(old)
            surrogate = _surrogate(logprobs.detach(), old, part_advantages, part_mask)
            pg_loss, clipfrac = ppo.policy_loss(
                logprobs, old, part_advantages, part_mask, cfg.clip_coef, **self._loss_options
            )
            if self._turn_index is not None:
                values = values + self.turn_values[self._turn_index[part]]
            v_loss, v_clipfrac = ppo.value_loss(
                values, data.old_values[part], data.returns[part], torch.ones_like(values), cfg.vf_clip_coef
            )
            bonus = self._entropy_bonus_term(entropy, part, part_mask)
            barrier = self._barrier_term(data, dists, part, part_mask)
            entropy = ppo.masked_mean(entropy, part_mask)
            approx_kl = ppo.approx_kl(logprobs, old, part_mask)
            # a per-reply aggregation is a mean over rows: its micro-batch weighs by its share of the rows
            pg_share = token_share if cfg.loss_aggregation == "token_mean" else row_share
            pg_term = pg_loss if cfg.loss_aggregation == "token_mean" else pg_loss * (row_share / token_share)
            loss = (pg_term - bonus - barrier) * token_share + cfg.vf_coef * v_loss * row_share
            if not self._backward(loss):
                finite = False
                break
            for key, value, share in (
                ("ppo/policy_loss", pg_loss, pg_share),
                ("ppo/value_loss", v_loss, row_share),
                ("ppo/entropy", entropy, token_share),
                ("ppo/entropy_bonus", bonus, token_share),
                ("ppo/barrier", barrier, token_share),
                ("ppo/approx_kl", approx_kl, token_share),
                ("ppo/clipfrac", clipfrac, token_share),
                ("ppo/surrogate", surrogate, token_share),
                ("ppo/value_clipfrac", v_clipfrac, row_share),
                ("ppo/loss", loss, 1.0),
            ):
                sums[key] += float(value.detach() * share)
        if finite and natural is not None and self._held_data is not None:
            finite = self._hold(natural)
        if distributed.is_distributed():  # every rank skips the step together, and reports the minibatch's stats
            if not distributed.all_true(finite):
                if finite:
                    self.policy_optimizer.zero_grad(set_to_none=True)
                    self._skip("a non-finite loss on another rank")
                return None
            return distributed.reduce_dict(dict(sums))
        return dict(sums) if finite else None

    def _held(self, mode: ActionMode, turns: list[Turn]) -> UpdateBatch | None:
        """This update's held inputs (`PPOConfig.hold_batches`), collated: one row each; None when there are none
        (the first batch, generate mode)."""
        if self.held is None:
            return None
        if not mode.exact_kl:
            if not self._warned_hold:
                self._warned_hold = True
                logger.warning(
                    "PPOConfig.hold_batches holds scored inputs only (it needs every candidate's log-prob); this "
                    f"{mode.name}-mode update holds nothing. Set hold_batches=0 to silence this."
                )
            return None
        others = self.held.others(mode, turns)
        if not others:
            return None
        batch = mode.collate(others, self.pad_token_id, self.policy.device)
        return UpdateBatch(mode, batch, torch.arange(len(others)), mode.action_mask(batch))

    def _hold(self, natural: NaturalGradient) -> bool:
        """Record the held inputs' rows for the natural step (after the minibatch's): the gradient of each one's
        `holding.held_outputs`, whose target move the solve sets to 0. False when a forward was not finite."""
        held = self._held_data
        for part in self._micro(held.groups, torch.arange(len(held.groups))):
            with natural.recording() as watch:
                outputs = held_outputs(self._evaluate(held, part, watch=watch).dists).sum()
            if not self._backward(outputs):
                return False
        return True

    @torch.no_grad()
    def _measure(self, data: UpdateBatch, index: torch.Tensor, objective_before: float, keep: bool = False):
        """How far the policy now is from the batch's old one on rows `index`: the mean and largest KL(old || new)
        per turn (the action mode's `kl`: exact over the candidates when scoring, the k3 estimate summed over the
        reply when generating),
        and whether the step's objective, the unclipped surrogate mean(ratio x advantage) plus this update's entropy
        bonus (`_entropy_bonus_term`), did not fall below `objective_before`.

        "Below" allows 0.1% of the mean |advantage|: under bf16 a tiny step moves log-probs by rounding as much as
        by the step, and a stricter test rejected such steps at random, halving the step size each time.

        With `keep`, a mode with distributions over candidates keeps the outputs measured (`_measured`) for acting.
        """
        kls, objective_after, tokens = [], 0.0, distributed.all_reduce(data.mask[index].sum())
        keep = keep and data.old_dists is not None  # a mode with distributions can take them for acting
        dists = data.mode.empty_distributions(data.batch) if keep else None
        features: torch.Tensor | None = None
        for part in self._micro(data.groups, index, data.mode.head_rows(data.batch)):
            with self._head_inputs(keep) as seen:
                now = self._evaluate(data, part, with_entropy=self._entropy_weights is not None)
            if keep:
                dists[part, : now.dists.shape[1]] = now.dists
                features = self._spread(features, seen, data.groups, part, len(dists))
            logprobs, part_mask = now.logprobs, now.mask
            old = data.old_logprobs[part, : logprobs.shape[1]]
            kls.append(data.mode.kl(data, part, now))
            part_advantages = data.advantages[part].unsqueeze(-1).expand_as(old)
            objective = _surrogate(logprobs, old, part_advantages, part_mask)
            if self._entropy_weights is not None:
                objective = objective + self._entropy_bonus_term(now.entropy, part, part_mask)
            if self._barrier:
                objective = objective + self._barrier_term(data, now.dists, part, part_mask)
            objective_after += float(objective * part_mask.sum() / tokens)
        kl = torch.cat(kls)
        if keep:
            self._measured = _Measured(self.policy.version, index, dists[index], features[index])
        if distributed.is_distributed():  # over every rank's turns, so that all ranks keep or undo the same step
            total = distributed.reduce_dict(
                {
                    "kl": float(kl.sum()),
                    "turns": len(kl),
                    "objective": objective_after,
                    "adv": float(data.advantages[index].abs().sum()),
                }
            )
            kl_max = distributed.reduce_number(float(kl.max()), "max")
            tolerance = 1e-3 * total["adv"] / total["turns"] + 1e-7
            return total["kl"] / total["turns"], kl_max, total["objective"] >= objective_before - tolerance
        tolerance = 1e-3 * float(data.advantages[index].abs().mean()) + 1e-7
        return float(kl.mean()), float(kl.max()), objective_after >= objective_before - tolerance

    def _entropy_bonus(self, data: UpdateBatch, equal: bool) -> dict[str, float]:
        """Set this update's entropy bonus (and its log-barrier's weight, `PPOConfig.barrier`, which needs scored
        turns): the configured `ent_coef` on every turn plus the entropy floor's weight,
        adapted to the batch's mean entropy fraction (`ppo.EntropyFloor`; over every rank's turns, data-parallel), on
        the turns whose own entropy fraction is below the floor. A batch of equal returns gets none: nothing says any
        action was better, and it takes no policy step. Returns the stats to log."""
        fraction = data.mode.entropy_fraction(data) if self.entropy_floor is not None else None
        stats: dict[str, float] = {}
        floor = 0.0
        if fraction is not None:
            total = {"sum": float(fraction.sum()), "turns": len(fraction)}
            if distributed.is_distributed():
                total = distributed.reduce_dict(total)
            stats["ppo/entropy_fraction"] = total["sum"] / total["turns"]
            floor = self.entropy_floor.update(stats["ppo/entropy_fraction"])
            stats["ppo/entropy_floor_coef"] = floor
        self.ent_coef = 0.0 if equal else self.config.ent_coef + floor
        if data.old_dists is None and (error := needs_scoring(self.config)):
            raise error
        self._barrier = 0.0 if equal else self.config.barrier
        weights = None
        if self.ent_coef:
            weights = torch.full_like(data.advantages, self.config.ent_coef)
            if floor:
                below = self.entropy_floor.weights(fraction.to(weights))
                weights = weights + below
                stats["ppo/entropy_floor_turns"] = float((below > 0).float().mean())
        self._entropy_weights = weights
        return stats

    def _entropy_bonus_term(self, entropy: torch.Tensor, part: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Rows `part`'s entropy bonus, each token's entropy times its turn's weight (`_entropy_bonus`), averaged over
        the `mask`ed tokens as the loss averages them (0 when this update has no bonus)."""
        if self._entropy_weights is None:
            return entropy.new_zeros(())
        return ppo.masked_mean(entropy * self._entropy_weights[part].unsqueeze(-1), mask)

    def _barrier_term(
        self, data: UpdateBatch, dists: torch.Tensor | None, part: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Rows `part`'s log-barrier (`ppo.log_barrier`) times this update's weight, each turn weighed as its
        advantage is (`repeated_input_power`), so that the barrier and the evidence of a frequent state shrink
        together, its floor relative to the reference's distributions where `barrier_relative` asks (0 when this
        update has none)."""
        if not self._barrier:
            return mask.new_zeros(())
        weights = None if self._turn_weights is None else self._turn_weights[part]
        reference = None if data.ref_dists is None else data.ref_dists[part, : dists.shape[1]]
        return self._barrier * ppo.log_barrier(dists, mask, weights, self.config.barrier_floor, reference)

    def _moved(self) -> None:
        """The weights changed outside an optimizer step (the trust region, the value refit): outputs cached under
        the old version are stale."""
        self.policy.version += 1

    @torch.no_grad()
    def _advantages(self, episodes: list[Episode], rewards: torch.Tensor, values: torch.Tensor) -> estimators.Estimate:
        """The configured estimator's (advantages, returns, stats) over the batch's turns (`PPOConfig.advantage`):
        over every rank's turns, data-parallel (see `_advantage_batch`)."""
        return self._estimate(self._advantage_batch(episodes, rewards, values)[0])

    def _estimate(self, batch: estimators.AdvantageBatch) -> estimators.Estimate:
        """The configured estimator on `batch`. With `PPOConfig.policy_lam` set (and a value-based estimator), the
        advantages are its estimate at that lambda and the returns (the value head's targets) its estimate at `lam`;
        with `pool_tail` as well, the advantages get back part of the `lam` estimate's (`estimators.pooled_tail`)."""
        cfg = self.config
        estimate = self.estimator(batch, cfg.gamma, cfg.lam, cfg.group_std_scaling)
        if cfg.policy_lam is None or cfg.policy_lam == cfg.lam or not self.estimator.needs_value:
            return estimate
        for_policy = self.estimator(batch, cfg.gamma, cfg.policy_lam, cfg.group_std_scaling)
        advantages, stats = for_policy.advantages, {**estimate.stats, **for_policy.stats}
        if cfg.pool_tail:
            advantages, pooled = estimators.pooled_tail(advantages, estimate.advantages, batch.action_key)
            stats.update(pooled)
        return estimators.Estimate(advantages, estimate.returns, stats)

    @torch.no_grad()
    def _advantage_batch(self, episodes: list[Episode], rewards: torch.Tensor, values: torch.Tensor):
        """(the estimator's `AdvantageBatch`, mine): the batch's turns, and the slice of them that is this rank's.

        Value-based estimators (gae) get the bootstrap values of truncated episodes: V of their next prompt, or of
        their last state when they have none. Every estimator gets each episode's group (`episode_groups`) and each
        turn's step key, an id of its prompt (`distinct_prompts`); under `pool_tail`, an id of its (prompt, reply).

        Data-parallel, the estimator runs on every rank's turns at once (gathered in rank order, groups and step
        keys numbered over all of them), so a group split across ranks is one group, as in one process.
        """
        device = rewards.device
        counts = torch.tensor([len(e.turns) for e in episodes])
        bootstrap = None
        if self.estimator.needs_value:
            bootstrap = torch.zeros(len(episodes), device=device)
            truncated = [i for i, e in enumerate(episodes) if e.truncated and e.bootstrap_prompt_ids]
            if truncated:
                prompts = prompt_batch(
                    [episodes[i].bootstrap_prompt_ids for i in truncated], self.pad_token_id, self.policy.device
                )
                bootstrap[truncated] = self.policy(*prompts).values.to(bootstrap.dtype)
                if self.turn_values is not None:  # the next state's turn index is the episode's length
                    later = torch.tensor([len(episodes[i].turns) for i in truncated], device=device)
                    bootstrap[truncated] += self.turn_values[later.clamp(max=len(self.turn_values) - 1)]
            last = (counts.cumsum(0) - 1).tolist()
            for i, episode in enumerate(episodes):
                if episode.truncated and not episode.bootstrap_prompt_ids:  # no next state: bootstrap from V(s_T-1)
                    bootstrap[i] = values[last[i]]
        terminal = torch.tensor([not e.truncated for e in episodes], device=device)
        group_keys = [_group_key(e) for e in episodes]
        step_keys = [tuple(turn.prompt_ids) for episode in episodes for turn in episode.turns]
        pooled, action_keys = self.config.pool_tail, []  # (prompt, reply) keys only where pool_tail reads them
        if pooled:
            replies = (tuple(turn.response_ids) for episode in episodes for turn in episode.turns)
            action_keys = list(zip(step_keys, replies, strict=True))
        mine = slice(0, len(rewards))
        if distributed.is_distributed():
            parts = distributed.all_gather_objects((group_keys, step_keys, action_keys))
            group_keys, step_keys, action_keys = ([key for part in parts for key in part[i]] for i in range(3))
            rewards, sizes = distributed.all_gather_cat(rewards)
            values, counts, terminal = (distributed.all_gather_cat(x)[0] for x in (values, counts, terminal))
            if bootstrap is not None:
                bootstrap = distributed.all_gather_cat(bootstrap)[0]
            start = sum(sizes[: distributed.rank()])
            mine = slice(start, start + sizes[distributed.rank()])
        batch = estimators.AdvantageBatch(
            rewards=rewards,
            episode=torch.repeat_interleave(torch.arange(len(counts)), counts.cpu()).to(device),
            terminal=terminal,
            group=numbered(group_keys).to(device),
            values=values,
            bootstrap=bootstrap,
            step_key=numbered(step_keys).to(device),
            action_key=numbered(action_keys).to(device) if pooled else None,
        )
        return batch, mine

    @torch.no_grad()
    def _evidence(self, data: UpdateBatch, scored: estimators.AdvantageBatch, mine: slice) -> float:
        """`evidence.evidence_fraction` of this batch's scored turns (data-parallel: over every rank's turns, the
        same number on every rank)."""
        push = evidence.turn_pushes(data.advantages, data.batch.choice.to(data.advantages.device), data.old_dists)
        if distributed.is_distributed():  # candidate counts differ across ranks: pad the pushes to the widest
            width = int(distributed.reduce_number(push.shape[1], "max"))
            push = distributed.all_gather_cat(torch.nn.functional.pad(push, (0, width - push.shape[1])))[0]
            mine = slice(0, len(push))
        state, episode = scored.step_key[mine].to(push.device), scored.episode[mine].to(push.device)
        return evidence.evidence_fraction(push, state, episode, len(scored.terminal))

    def _backward(self, loss: torch.Tensor) -> bool:
        """Accumulate the gradient of `loss`; a non-finite loss clears the accumulated gradients instead."""
        if not torch.isfinite(loss):
            self.policy_optimizer.zero_grad(set_to_none=True)
            return self._skip(f"non-finite loss {float(loss.detach())}")
        loss.backward()
        return True

    def _step(self, stats: dict[str, list[float]], plain: bool = False) -> bool:
        """Clip and apply the accumulated gradient with this update's `policy_optimizer`; a non-finite gradient (or
        natural step) skips the step, weights unchanged.

        `plain` takes an AdamW step even under natural_gradient: the supervised replay steps record no per-input
        gradients to solve with.
        """
        optimizer = self.optimizer if plain else self.policy_optimizer
        if not plain:  # data-parallel: sum the ranks' gradients (natural steps gather their per-input rows instead)
            natural = optimizer is not self.optimizer
            params = optimizer.value_params if natural else list(self.policy.trainable_parameters())
            distributed.all_reduce_grads(params)
        if optimizer is self.optimizer:
            norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), self.config.max_grad_norm)
        else:
            norm = optimizer.clip_grad_norm()  # solves for the natural step: the norm is the step's
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            return self._skip(f"non-finite {type(optimizer).__name__} step: gradient norm {float(norm)}")
        optimizer.step()
        self.policy.version += 1
        optimizer.zero_grad(set_to_none=True)
        self.consecutive_skips = 0
        stats["ppo/grad_norm"].append(float(norm))
        if self.freed_memory is not None:  # the step's activations are freed; trims only past the bound
            self.freed_memory.check()
        return True

    def _skip(self, why: str) -> bool:
        """Count a skipped step; the first one warns with the batch's stats, too many in a row stop the run.

        Raises:
            RuntimeError: `max_skipped_steps` steps in a row were skipped: training has diverged or the data is bad.
        """
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.skipped_steps == 1:
            logger.warning("skipped an optimizer step: %s; %s (counted in ppo/skipped_steps)", why, self._batch_summary)
        if self.consecutive_skips >= self.config.max_skipped_steps:
            raise RuntimeError(
                f"{self.consecutive_skips} optimizer steps in a row were skipped (last: {why}; {self._batch_summary}). "
                "Stopping instead of training on garbage. Check the reward scale (huge or non-finite rewards), lower "
                "the learning rate, or use precision='fp32'. `PPOConfig.max_skipped_steps` sets this limit."
            )
        return False

    def _sft(self, episodes: list[Episode]) -> dict[str, float]:
        """Add this batch's best episodes to the replay buffer and take the supervised steps."""
        generator = self.generator
        if distributed.is_distributed():  # every rank holds every rank's episodes and draws the same turns
            episodes = [e for part in distributed.all_gather_objects(episodes) for e in part]
            generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.num_updates)
        added = self.replay.add_batch(episodes)
        cfg, losses = self.replay.config, []
        sft_stats: dict[str, list[float]] = defaultdict(list)
        for _ in range(cfg.sft_steps):
            turns = self.replay.sample_turns(cfg.sft_batch_size, generator, self.config.cap_cut_replies)
            if not turns:
                break
            batch = collate(turns, self.pad_token_id, self.policy.device)
            with self.policy.summed_gradients():  # a supervised step needs the rows' summed gradient only
                out = self.policy(batch.input_ids, batch.attention_mask, batch.response_mask)
            loss = sft_loss(out.logprobs, batch.response_mask)
            if self._backward(cfg.sft_coef * loss) and self._step(sft_stats, plain=True):
                losses.append(float(loss.detach()))
        stats = {"sft/buffer_size": float(len(self.replay)), "sft/added": float(added)}
        if losses:
            stats["sft/loss"] = sum(losses) / len(losses)
        return stats

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "generator": self.generator.get_state(),
            "num_updates": self.num_updates,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "replay": self.replay.state_dict() if self.replay is not None else None,
            "return_moments": self.return_moments.state_dict(),
            "trust_start": self.trust_region.start if self.trust_region is not None else None,
            "entropy_floor": self.entropy_floor.state_dict() if self.entropy_floor is not None else None,
            "average": self.average.state_dict() if self.average is not None else None,
            "held": self.held.state_dict() if self.held is not None else None,
            "turn_values": self.turn_values.clone() if self.turn_values is not None else None,
            "choice_evidence": self.choice_evidence.state_dict() if self.choice_evidence is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.generator.set_state(state["generator"])
        self.num_updates = state["num_updates"]
        self.skipped_steps = state.get("skipped_steps", state.get("skipped_updates", 0))  # the old name
        self.consecutive_skips = state.get("consecutive_skips", 0)  # absent in checkpoints written before it existed
        if self.replay is not None and state.get("replay") is not None:
            self.replay.load_state_dict(state["replay"])
        if "return_moments" in state:  # absent in checkpoints written before advantage_scale existed
            self.return_moments.load_state_dict(state["return_moments"])
        if self.trust_region is not None and state.get("trust_start") is not None:
            self.trust_region.start = state["trust_start"]
        if self.entropy_floor is not None and state.get("entropy_floor") is not None:  # absent before it existed
            self.entropy_floor.load_state_dict(state["entropy_floor"])
        if self.average is not None and state.get("average") is not None:  # absent before averaging existed
            self.average.load_state_dict(state["average"])
        if self.held is not None and state.get("held") is not None:  # absent before hold_batches existed
            self.held.load_state_dict(state["held"])
        if self.turn_values is not None and state.get("turn_values") is not None:  # absent before turn_values existed
            self.turn_values.copy_(state["turn_values"])
        if self.choice_evidence is not None and state.get("choice_evidence") is not None:  # absent before it existed
            self.choice_evidence.load_state_dict(state["choice_evidence"])


class _Measured(NamedTuple):
    """A trust-region measure's outputs on a minibatch, kept for acting (`ActionMode.remember`)."""

    version: int  # `Policy.version` of the weights measured
    rows: torch.Tensor  # (M,) the turns measured
    dists: torch.Tensor  # (M, C) their distributions over the candidates
    features: torch.Tensor  # (M, H) the value head's inputs (the values follow from the head as it is when used)


def needs_scoring(config: PPOConfig) -> ValueError | None:
    """The error for a setting that acts on candidates (`barrier`, `inverse_choice_cap`) with generated turns, or
    None (said by the agent when it is created in generate mode, and by the trainer when a batch of generated turns
    reaches it under "auto")."""
    use = "action_mode='score', or 'auto' with action_candidates"
    if config.barrier:
        return ValueError(
            f"PPOConfig(barrier={config.barrier}) is a log-barrier over candidates: it needs scoring mode ({use}). "
            "Set barrier=0 for generate mode."
        )
    if config.inverse_choice_cap is not None:
        return ValueError(
            f"PPOConfig(inverse_choice_cap={config.inverse_choice_cap}) weighs each turn by the probability of the "
            f"candidate it chose: it needs scoring mode ({use}). Set inverse_choice_cap=None for generate mode."
        )
    return None


def state_weights(step_key: torch.Tensor, power: float, mine: slice, device: torch.device) -> torch.Tensor:
    """This rank's turns' `ppo.repeated_input_weights` (n**-power, n the turns with the same prompt in `step_key`,
    every rank's turns), on `device`: the advantages' (on a GPU, not where the keys were counted)."""
    return ppo.repeated_input_weights(step_key, power)[mine].to(device)


def distinct_prompts(turns: list[Turn]) -> torch.Tensor:
    """(N,) id of each turn's prompt (the state it acted in), numbered by first appearance: gigpo's step key.

    Unlike the action mode's `distinct_inputs` the reply is left out: turns that answered the same prompt differently
    share an id.
    """
    return numbered([tuple(turn.prompt_ids) for turn in turns])


def episode_groups(episodes: list[Episode]) -> torch.Tensor:
    """(E,) group id of each episode, numbered by first appearance: its `group` when set, else its first prompt
    (episodes that start from the same observation form one group, as GRPO's samples of one question do)."""
    return numbered([_group_key(e) for e in episodes])


def _group_key(episode: Episode) -> tuple:
    """What makes episodes one group: their `group` when set, else their first prompt."""
    return ("group", episode.group) if episode.group is not None else ("prompt", tuple(episode.turns[0].prompt_ids))


def _shared_input_ids(mode, turns: list[Turn]) -> torch.Tensor:
    """Data-parallel: (this rank's distinct inputs,) the id of each of its inputs (numbered as `distinct_inputs`
    numbers them) among every rank's, numbered by first appearance in rank order: an input met on two ranks gets
    one id on both (natural steps merge its rows)."""
    local = list(dict.fromkeys(mode.input_key(turn) for turn in turns))  # numbered as `distinct_inputs` numbers them
    everyone = distributed.all_gather_objects(local)
    shared = numbered([key for keys in everyone for key in keys])
    start = sum(len(keys) for keys in everyone[: distributed.rank()])
    return shared[start : start + len(local)]


def _equal_returns(batch: estimators.AdvantageBatch, gamma: float) -> bool:
    """Whether every turn of the batch led to the same discounted reward-to-go, so no action did better than another.

    The rewards' own returns, not the estimator's targets: with lam < 1 those mix in the value head's estimates, so a
    solved game's batch of equal returns looks varied by the value head's error alone. A truncated episode's return
    is unknown (it would bootstrap), so a batch with one is never called equal; nor is one with a non-finite reward
    (its steps are skipped as such).
    """
    if not bool(batch.terminal.all()):
        return False
    returns = estimators.returns_to_go(batch.rewards, batch.episode, gamma)
    if not bool(torch.isfinite(returns).all()):
        return False
    return float(returns.max() - returns.min()) <= 1e-6 * (1.0 + float(returns.abs().max()))


def _batch_return(episodes: list[Episode]) -> float:
    """The mean env return of the batch's episodes (over every rank's, data-parallel)."""
    if not distributed.is_distributed():
        return sum(e.env_return for e in episodes) / len(episodes)
    total = distributed.reduce_dict({"return": sum(e.env_return for e in episodes), "count": len(episodes)})
    return total["return"] / total["count"]


def _loss_options(config: PPOConfig, mask: torch.Tensor) -> dict:
    """`ppo.policy_loss`'s keyword options that differ from its defaults (clip-higher, the loss aggregation)."""
    options: dict = {}
    if config.clip_coef_high is not None:
        options["clip_coef_high"] = config.clip_coef_high
    if config.loss_aggregation != "token_mean":
        options["aggregation"] = config.loss_aggregation
        # Dr.GRPO's constant: the batch's longest reply (over every rank's)
        options["max_length"] = int(distributed.reduce_number(int(mask.sum(-1).max()), "max"))
    return options


def _row_gradients(policy: Policy, lm_params: list, natural_gradient: bool | None) -> RowGradients | None:
    """The per-input gradient collector of natural-gradient steps, or None for plain steps. With None (automatic)
    it is used when it can be: every trained weight in a Linear layer (LoRA), not full fine-tuning."""
    if natural_gradient is False:
        return None
    try:
        return RowGradients(policy, lm_params)
    except ValueError:
        if natural_gradient:
            raise
        logger.info("natural_gradient=None: plain gradient steps, since some trained weights are not in Linear layers")
        return None


def _surrogate(logprobs, old_logprobs, advantages, mask) -> torch.Tensor:
    """The unclipped PPO surrogate, masked mean of ratio x advantage (TRPO's objective)."""
    ratio = torch.exp(torch.where(mask.bool(), logprobs - old_logprobs, 0.0))
    return ppo.masked_mean(ratio * advantages, mask)


def _std(x: torch.Tensor) -> float:
    """Population std of a tensor's entries (0 for fewer than 2)."""
    return float(x.std(unbiased=False)) if x.numel() > 1 else 0.0
