"""Train a suite game with TRL's `GRPOTrainer` through llamagym's adapter, on the embedded model, on a CPU.

The game's ready agent supplies the prompts and the parsing (`EpisodeRollout`); TRL owns the loop: each step plays
`--batch-size` episodes in groups of `--num-generations` from one env seed and makes one GRPO update of a LoRA
adapter. The greedy policy is evaluated exactly (`llamagym.envs.evaluate`) before and after.

    pip install -e .[trl]      # or: python scripts/bootstrap.py --extras trl
    python examples/trl_grpo.py                          # guess_number, 10 steps (minutes on a laptop CPU)
    python examples/trl_grpo.py --max-steps 50 --game tictactoe
    python examples/trl_grpo.py --max-seconds 600        # stop after 10 minutes of training instead
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL; we know


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--game", default="guess_number", choices=["guess_number", "tictactoe", "rooms"])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name, hub id or local path")
    parser.add_argument("--max-steps", type=int, default=10, help="GRPO updates")
    parser.add_argument("--max-seconds", type=float, default=None, help="also stop after this much training time")
    parser.add_argument("--batch-size", type=int, default=8, help="episodes per update")
    parser.add_argument("--num-generations", type=int, default=4, help="episodes per env seed (a GRPO group)")
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="AdamW step size (llamagym's default)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens per reply")
    parser.add_argument("--seeds", type=int, default=256, help="env seeds in the dataset (one row each)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/trl_grpo")
    return parser.parse_args(argv)


def lora_for(model):
    """The registry's LoRA settings for this model (rank, targets, top layers), as a peft `LoraConfig`."""
    from peft import LoraConfig

    spec = model.llamagym_spec
    layers = model.config.num_hidden_layers
    top = list(range(layers - spec.lora_layers, layers)) if spec.lora_layers else None
    targets = "all-linear" if spec.lora_target_modules == ("all-linear",) else list(spec.lora_target_modules)
    return LoraConfig(
        r=spec.lora_r, lora_alpha=spec.lora_alpha, target_modules=targets, lora_dropout=0.0, layers_to_transform=top
    )


def stop_after(seconds: float):
    """A transformers callback that stops training once `seconds` of training time have passed."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if time.perf_counter() - self.start >= seconds:
                control.should_training_stop = True

    return StopAfter()


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    from trl import GRPOConfig, GRPOTrainer

    import llamagym.envs as suite
    from llamagym import load_model_and_tokenizer
    from llamagym.integrations.trl import EpisodeRollout, episode_dataset, episode_return_reward

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    game = suite.get_game(args.game)
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    rollout = EpisodeRollout(
        game.agent_for(),  # the game's hooks; no llamagym Agent (and no model of its own) is built
        game.env_id,
        fallback_action=game.agent_kwargs.get("fallback_action", 0),
        max_new_tokens=args.max_new_tokens,
        env_kwargs=game.env_kwargs,
    )

    start = time.perf_counter()
    before = suite.evaluate(game, rollout.greedy_decider(model, tokenizer))
    print(f"before: normalised {before['normalised']:.3f}, {game.measure} {before['score']:.3f}, "
          f"invalid {before.get('invalid_rate', 0):.2f} ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip

    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=512,  # the whole episode: replies and the env's messages
        learning_rate=args.learning_rate,
        temperature=model.llamagym_spec.generation.get("temperature", 1.0),  # as llamagym's agent samples
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # a 135M model fits; checkpointing only slows a CPU down
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=episode_return_reward,
        args=config,
        train_dataset=episode_dataset(args.seeds, start=args.seed * 1_000_003),
        processing_class=tokenizer,
        rollout_func=rollout,
        peft_config=lora_for(model),
        callbacks=[stop_after(args.max_seconds)] if args.max_seconds else None,
    )
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start

    start = time.perf_counter()
    after = suite.evaluate(game, rollout.greedy_decider(trainer.model, tokenizer))
    print(f"after {trainer.state.global_step} steps ({train_s:.0f} s of training): normalised "
          f"{after['normalised']:.3f}, {game.measure} {after['score']:.3f}, invalid "
          f"{after.get('invalid_rate', 0):.2f} ({time.perf_counter() - start:.0f} s)")  # fmt: skip
    return {"before": before, "after": after, "steps": trainer.state.global_step, "train_s": train_s}


if __name__ == "__main__":
    main()
