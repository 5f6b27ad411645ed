"""One learning-suite run through TRL's `GRPOTrainer` (`learning_suite.py --trainer trl`; `pip install -e .[trl]`).

The same game, model, seed, training budget and evaluation schedule as a llamagym run, and a result in the suite's
format (`mode` "generate-trl": the adapter plays in generate mode). TRL's side: `--num-envs` episodes per update in
groups of `--group-size` (4 when 1) episodes from one env seed, a LoRA adapter with the registry's settings (as
llamagym's agent gets), llamagym's learning rate (or `--ppo learning_rate=...`), the model's sampling temperature.
Evaluation is exact and greedy on the token sequences the adapter trains (`EpisodeRollout.greedy_decider`); its time
is not counted in the budget.
"""

from __future__ import annotations

import os
import time


def train_trl(game_name: str, seed: int, args, run_record) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import llamagym.envs as suite
    from llamagym import PPOConfig, load_model_and_tokenizer
    from llamagym.integrations.trl import EpisodeRollout, episode_dataset, episode_return_reward

    torch.set_num_threads(args.threads)
    torch.manual_seed(seed)
    game = suite.get_game(game_name)
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    spec = model.llamagym_spec
    rollout = EpisodeRollout(
        game.agent_for(),
        game.env_id,
        fallback_action=game.agent_kwargs.get("fallback_action", 0),
        max_new_tokens=spec.generation.get("max_new_tokens", 32),
        env_kwargs=game.env_kwargs,
    )
    layers = model.config.num_hidden_layers
    lora = LoraConfig(
        r=spec.lora_r,
        lora_alpha=spec.lora_alpha,
        target_modules="all-linear" if spec.lora_target_modules == ("all-linear",) else list(spec.lora_target_modules),
        lora_dropout=0.0,
        layers_to_transform=list(range(layers - spec.lora_layers, layers)) if spec.lora_layers else None,
    )
    group = args.group_size if args.group_size > 1 else 4
    batch = max(group, args.num_envs // group * group)
    curve, clock, invalid_train, log = [], {"train": 0.0, "eval": 0.0, "updates": 0, "episodes": 0}, [], []

    def record(model):
        start = time.perf_counter()
        figures = suite.evaluate(game, rollout.greedy_decider(model, tokenizer))
        clock["eval"] += time.perf_counter() - start
        point = {k: clock[k] for k in ("train", "updates", "episodes")}
        point.update(normalised=figures["normalised"], score=figures["score"], invalid=figures.get("invalid_rate"))
        curve.append(point)
        return figures

    class Budget(TrainerCallback):  # training time only: evaluations pause the clock
        def on_step_begin(self, a, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **kwargs):
            clock["train"] += time.perf_counter() - self.start
            clock["updates"] += 1
            clock["episodes"] += batch
            episodes = rollout.last_episodes
            invalid_train.append(sum(e.invalid_replies for e in episodes) / max(1, sum(e.turns for e in episodes)))
            log.append({"train": clock["train"], "agent/batch_invalid_action_rate": invalid_train[-1]})
            if clock["train"] >= args.budget and clock["updates"] >= args.min_updates:
                control.should_training_stop = True
            elif clock["train"] - (curve[-1]["train"] if curve else 0.0) >= args.eval_every:
                record(model)

    record(model)
    config = GRPOConfig(
        output_dir=os.path.join(args.output, f"trl-{game_name}-seed{seed}"),
        max_steps=10**9,  # the budget stops it
        per_device_train_batch_size=batch,
        num_generations=group,
        max_completion_length=1024,
        learning_rate=args.overrides["ppo"].get("learning_rate", PPOConfig().learning_rate),
        temperature=spec.generation.get("temperature", 1.0),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=episode_return_reward,
        args=config,
        train_dataset=episode_dataset(100_000, start=seed * 1_000_003),
        processing_class=tokenizer,
        rollout_func=rollout,
        peft_config=lora,
        callbacks=[Budget()],
    )
    trainer.train()
    final = record(trainer.model)
    s_per_update = clock["train"] / clock["updates"] if clock["updates"] else None
    return run_record(game, "generate-trl", seed, curve, final, clock, invalid_train, s_per_update, log)
