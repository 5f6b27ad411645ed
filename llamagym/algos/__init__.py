"""The learning side: from finished episodes to a policy update. Nothing here knows about prompts or envs.

- `rollout.py`          turns and episodes, their padded tensors (the seam between the agent and the trainer), and
                        `UpdateBatch`, one update's tensors in one bundle
- `modes/`              action modes, one file each (generate, score): choosing at act time, collating, evaluating,
                        the KL and the same-input key; `register_mode` adds one
- `ppo.py`              PPO math as pure tensor functions: log-probs, GAE, KL estimators, clipped losses
- `estimators.py`       advantage estimators by name (gae, grpo, rloo, rebn, gigpo) and their registry
- `trainer.py`          `PPOTrainer`: one update over a batch of episodes (advantages, epochs, value refit, SFT)
- `natural_gradient.py` natural-gradient steps over the batch's distinct inputs (`NaturalGradient`, an optimizer)
- `trust_region.py`     the KL trust region every step is checked against (TRPO's line search)
- `sft_replay.py`       the SFT warm-start replay buffer and its imitation loss
- `averaging.py`        the adapter's average over the last updates, which greedy acting uses (Polyak averaging)
"""
