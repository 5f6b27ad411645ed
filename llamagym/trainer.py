"""PPO for LLM agents over whole episodes of chat turns.

What one action, one reward and one value are (DESIGN.md §3):
1. One action = one assistant turn (a sampled reply).
2. The state value V(s) is read by the value head at the last prompt token of the turn.
3. The turn reward = env reward - kl_coef * (summed per-token KL of the reply to the reference policy).
4. GAE (gamma, lam) runs across the turns of an episode; bootstrap from V(next state) only on truncation.
5. The turn's advantage is broadcast over its response tokens in a masked, token-level clipped PPO loss.

Two KLs, never mixed up: `kl_ref` (policy vs reference, in the reward, adaptive coefficient) and `approx_kl`
(new vs old policy within an update, for target-KL early stopping, checked before each optimizer step).
The backward pass and the optimizer step live in `_optimize` alone, so data-parallel training stays a small step.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch

from . import ppo
from .config import PPOConfig, ReplayConfig
from .policy import Policy
from .replay import SFTReplayBuffer, sft_loss
from .rollout import Episode, ScoreBatch, TurnBatch, collate, collate_turns, minibatch_indices, prompt_batch, select

logger = logging.getLogger(__name__)


class PPOTrainer:
    """Owns the optimizer, the KL controller and the update loop; `step(episodes)` returns a stats dict.

    Args:
        policy: the LoRA policy with its value head.
        config: PPO hyperparameters.
        pad_token_id: id used to right-pad the training batch (masked out everywhere).
        replay_config: enables the SFT warm-start replay buffer when given.
    """

    def __init__(self, policy: Policy, config: PPOConfig, pad_token_id: int, replay_config: ReplayConfig | None = None):
        self.policy = policy
        self.config = config
        self.pad_token_id = pad_token_id
        self.optimizer = torch.optim.AdamW(
            policy.trainable_parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
        )
        if config.adaptive_kl:
            self.kl_controller = ppo.AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
        else:
            self.kl_controller = ppo.FixedKLController(config.kl_coef)
        self.replay = SFTReplayBuffer(replay_config) if replay_config is not None else None
        self.generator = torch.Generator().manual_seed(config.seed)
        self.num_updates = 0
        self.skipped_updates = 0

    # ---- one update ------------------------------------------------------------------------------------------
    def step(self, episodes: list[Episode]) -> dict[str, float]:
        """Run one PPO update (then the SFT replay steps) on finished episodes."""
        cfg, start = self.config, time.perf_counter()
        episodes = [e for e in episodes if e.turns]
        if not episodes:
            raise ValueError("PPOTrainer.step() needs at least one episode with a turn.")
        turns = [turn for episode in episodes for turn in episode.turns]
        batch = collate_turns(turns, self.pad_token_id, self.policy.device)
        mask = _action_mask(batch)
        # Shuffles for every epoch are drawn up front: the old log-probs are computed on epoch 0's minibatches,
        # so the first minibatch repeats that exact forward and its ratio is exactly 1.
        plans = [minibatch_indices(len(turns), cfg.mini_batch_size, self.generator) for _ in range(cfg.ppo_epochs)]

        # 1. old log-probs and values, reference log-probs (no grad, dropout off)
        old_logprobs, old_values = self._score(batch, plans[0], reference=False)
        with self.policy.reference():
            ref_logprobs, _ = self._score(batch, plans[0], reference=True)

        # 2. per-turn rewards: env reward minus the KL penalty to the reference
        kl_ref = (ppo.kl_penalty(old_logprobs, ref_logprobs, cfg.kl_estimator) * mask).sum(dim=-1)
        env_rewards = torch.tensor([t.reward for t in turns], dtype=torch.float32, device=mask.device)
        rewards = env_rewards - self.kl_controller.value * kl_ref

        # 3. GAE across the turns of each episode (bootstrap on truncation only)
        advantages, returns = self._advantages(episodes, rewards, old_values)
        if cfg.whiten_advantages and len(turns) >= 2:
            advantages = ppo.masked_whiten(advantages, torch.ones_like(advantages))

        # 4. epochs x minibatches, with target-KL early stopping before each optimizer step
        stats: dict[str, list[float]] = defaultdict(list)
        early_stopped, done = False, 0
        for plan in plans:
            for index in plan:
                mb_logprobs, mb_mask, mb_values, mb_entropy = self._evaluate(select(batch, index), with_entropy=True)
                mb_old_logprobs = old_logprobs[index, : mb_logprobs.shape[1]]
                mb_approx_kl = ppo.approx_kl(mb_logprobs, mb_old_logprobs, mb_mask)
                if cfg.use_target_kl and ppo.kl_exceeded(float(mb_approx_kl.detach()), cfg.target_kl):
                    early_stopped = True
                    break
                mb_advantages = advantages[index].unsqueeze(-1).expand_as(mb_old_logprobs)
                pg_loss, clipfrac = ppo.policy_loss(mb_logprobs, mb_old_logprobs, mb_advantages, mb_mask, cfg.clip_coef)
                v_loss, v_clipfrac = ppo.value_loss(
                    mb_values, old_values[index], returns[index], torch.ones_like(mb_values), cfg.vf_clip_coef
                )
                entropy = ppo.masked_mean(mb_entropy, mb_mask)
                loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * entropy
                self._optimize(loss, stats)
                done += 1
                for key, value in (
                    ("ppo/policy_loss", pg_loss),
                    ("ppo/value_loss", v_loss),
                    ("ppo/entropy", entropy),
                    ("ppo/approx_kl", mb_approx_kl),
                    ("ppo/clipfrac", clipfrac),
                    ("ppo/value_clipfrac", v_clipfrac),
                    ("ppo/loss", loss),
                ):
                    stats[key].append(float(value.detach()))
            if early_stopped:
                break

        # 5. adapt the KL coefficient toward its target
        mean_kl_ref = float(kl_ref.mean())
        self.kl_controller.update(mean_kl_ref, len(turns))

        # 6. SFT warm-start: imitate the best episodes (and demonstrations)
        sft_stats = self._sft(episodes) if self.replay is not None else {}

        self.num_updates += 1
        result = {key: sum(values) / len(values) for key, values in stats.items() if values}
        result.update(
            {
                "ppo/early_stopped": float(early_stopped),
                "ppo/epochs_completed": done / len(plans[0]),
                "ppo/minibatches": float(done),
                "ppo/skipped_updates": float(self.skipped_updates),
                "ppo/explained_variance": float(ppo.explained_variance(old_values, returns, torch.ones_like(returns))),
                "ppo/advantages_mean": float(advantages.mean()),
                "ppo/returns_mean": float(returns.mean()),
                "ppo/values_mean": float(old_values.mean()),
                "ppo/num_turns": float(len(turns)),
                "ppo/num_updates": float(self.num_updates),
                "kl/ref": mean_kl_ref,
                "kl/coef": float(self.kl_controller.value),
                "env/batch_return": sum(e.env_return for e in episodes) / len(episodes),
                "time/update_s": time.perf_counter() - start,
                **sft_stats,
            }
        )
        return result

    # ---- pieces ----------------------------------------------------------------------------------------------
    def _evaluate(self, batch: TurnBatch | ScoreBatch, reference: bool = False, with_entropy: bool = False):
        """(log-probs, mask, values, entropy) of the actions taken, shaped (B, T) with T = 1 in scoring mode.

        Generated turns give one log-prob per response token; scored turns one per turn: log pi(chosen candidate).
        """
        if isinstance(batch, ScoreBatch):
            out = self.policy.score(batch, reference=reference)
            chosen = out.logprobs.gather(1, batch.choice[:, None])
            probs = out.logprobs.exp()
            entropy = -(probs * out.logprobs.masked_fill(probs == 0, 0.0)).sum(-1, keepdim=True)
            return chosen, torch.ones_like(chosen), out.values, entropy
        out = self.policy(*batch, reference=reference, with_entropy=with_entropy)
        return out.logprobs, batch.response_mask, out.values, out.entropy

    @torch.no_grad()
    def _score(self, batch: TurnBatch | ScoreBatch, plan: list[torch.Tensor], reference: bool):
        """Log-probs (N, T) and values (N,) of the whole batch, computed minibatch by minibatch as in `plan`."""
        logprobs = torch.zeros_like(_action_mask(batch))
        values = torch.zeros(batch.input_ids.shape[0], device=logprobs.device)
        for index in plan:
            mb_logprobs, _, mb_values, _ = self._evaluate(select(batch, index), reference=reference)
            logprobs[index, : mb_logprobs.shape[1]] = mb_logprobs
            values[index] = mb_values
        return logprobs, values

    @torch.no_grad()
    def _advantages(self, episodes: list[Episode], rewards: torch.Tensor, values: torch.Tensor):
        """GAE per episode over its turns; truncated episodes bootstrap from V of their next prompt."""
        bootstrap = {}
        truncated = [i for i, e in enumerate(episodes) if e.truncated and e.bootstrap_prompt_ids]
        if truncated:
            prompts = prompt_batch(
                [episodes[i].bootstrap_prompt_ids for i in truncated], self.pad_token_id, self.policy.device
            )
            boot_values = self.policy(*prompts).values
            bootstrap = dict(zip(truncated, boot_values, strict=True))
        advantages, returns, offset = torch.zeros_like(rewards), torch.zeros_like(rewards), 0
        for i, episode in enumerate(episodes):
            n = len(episode.turns)
            dones = torch.zeros(n, device=rewards.device)
            if episode.truncated and i not in bootstrap:  # truncated without a next state: bootstrap from V(s_T-1)
                bootstrap[i] = values[offset + n - 1]
            if not episode.truncated:
                dones[-1] = 1.0
            last_value = bootstrap.get(i, torch.zeros((), device=rewards.device))
            adv, ret = ppo.gae(
                rewards[offset : offset + n],
                values[offset : offset + n],
                dones,
                last_value,
                self.config.gamma,
                self.config.lam,
            )
            advantages[offset : offset + n], returns[offset : offset + n] = adv, ret
            offset += n
        return advantages, returns

    def _optimize(self, loss: torch.Tensor, stats: dict[str, list[float]]) -> bool:
        """Backward, clip, step. A non-finite loss or gradient skips the step and leaves the weights as they were."""
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            return self._skip(f"non-finite loss {float(loss)}")
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), self.config.max_grad_norm)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return self._skip(f"non-finite gradient norm {float(grad_norm)}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats["ppo/grad_norm"].append(float(grad_norm))
        return True

    def _skip(self, why: str) -> bool:
        self.skipped_updates += 1
        if self.skipped_updates == 1:
            logger.warning("skipped an optimizer step: %s (counted in ppo/skipped_updates)", why)
        return False

    def _sft(self, episodes: list[Episode]) -> dict[str, float]:
        """Add this batch's best episodes to the replay buffer and take the supervised steps."""
        added = self.replay.add_batch(episodes)
        cfg, losses = self.replay.config, []
        sft_stats: dict[str, list[float]] = defaultdict(list)
        for _ in range(cfg.sft_steps):
            turns = self.replay.sample_turns(cfg.sft_batch_size, self.generator)
            if not turns:
                break
            batch = collate(turns, self.pad_token_id, self.policy.device)
            out = self.policy(batch.input_ids, batch.attention_mask, batch.response_mask)
            loss = sft_loss(out.logprobs, batch.response_mask)
            if self._optimize(cfg.sft_coef * loss, sft_stats):
                losses.append(float(loss))
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
            "skipped_updates": self.skipped_updates,
            "replay": self.replay.state_dict() if self.replay is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.generator.set_state(state["generator"])
        self.num_updates = state["num_updates"]
        self.skipped_updates = state["skipped_updates"]
        if self.replay is not None and state.get("replay") is not None:
            self.replay.load_state_dict(state["replay"])


def _action_mask(batch: TurnBatch | ScoreBatch) -> torch.Tensor:
    """(N, T) float mask of the action log-probs: the response tokens, or one slot per scored turn."""
    if isinstance(batch, ScoreBatch):
        return torch.ones((batch.input_ids.shape[0], 1), device=batch.input_ids.device)
    return batch.response_mask
