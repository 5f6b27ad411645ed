"""Generate mode's draw (`InverseCdfDraw`: one uniform number per row) against `torch.multinomial`, side by side.

16 envs of guess-the-number play a few sampled steps in generate mode to collect the prompt batches acting meets;
then each batch is prefilled and decoded by `Policy.generate` with sampling done both ways, alternating: the library's
(a greedy call whose last logits processor draws) and transformers' own (`do_sample=True`, which calls
`torch.multinomial` on every step's probabilities). The two draw from the same distribution by other random streams,
so their replies, and their numbers of decoding steps, can differ: it prints the median seconds per decoding step of
each, and their ratio. Compare the ratios of one run.

Quick check (tiny model, seconds):  python benchmarks/sampling_draw.py --quick
Full benchmark (quiet machine):     python benchmarks/sampling_draw.py
"""

import argparse
import statistics
import time

import torch
from generate_prefill import acting_args, prompt_batches  # beside this file
from learning_suite import cpu_model

from llamagym import load_model_and_tokenizer
from llamagym.algos.modes.generate import InverseCdfDraw, sampling_config
from llamagym.envs import suite


def parse_args():
    return acting_args(
        argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    )


def seconds_per_step(actor, prompts, ours: bool) -> float:
    """One sampled call's seconds per decoding step, drawn by `InverseCdfDraw` (`ours`) or by transformers."""
    policy, settings = actor.policy, actor.generation
    rows = policy.prefill(prompts, actor.pad_token_id)
    config = sampling_config(
        settings["max_new_tokens"], settings["temperature"], ours, actor.pad_token_id, actor.eos_ids
    )
    processors = [InverseCdfDraw(settings["temperature"])] if ours else []
    start = time.perf_counter()
    out = policy.generate(
        rows.input_ids, rows.attention_mask, generation_config=config, past_key_values=rows.cache,
        logits_processor=processors,
    )  # fmt: skip
    return (time.perf_counter() - start) / (out.shape[1] - rows.input_ids.shape[1])


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}, {args.threads} threads; model {args.model}; {args.envs} envs")
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    actor, batches = prompt_batches(suite.get_game("guess_number"), model, tokenizer, args)
    print(f"policy in {actor.policy.precision}")
    seconds = {False: [], True: []}
    for prompts in batches:
        seconds_per_step(actor, prompts, True)  # warm-up
        for _ in range(args.repeats):
            for ours in (False, True):
                seconds[ours].append(seconds_per_step(actor, prompts, ours))
    a, b = statistics.median(seconds[False]), statistics.median(seconds[True])
    print("| sampling | s per decoding step, torch.multinomial | the draw | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| {args.envs} rows | {a * 1000:.1f} ms | {b * 1000:.1f} ms | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
