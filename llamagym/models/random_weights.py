"""Registry architectures with random weights, built offline from a hard-coded config: for timing, never learning.

Benchmarks of 1-2B models must run where the hub is not reachable. `random_model(name)` builds the registry
model's architecture (the shapes of its published config.json) with random weights, and pairs it with the tiny
byte-level tokenizer (whose ids all fall inside every vocabulary here). Speed and memory per token are those of the
real model; prompts are longer in bytes than in the real tokenizer's tokens, which the benchmark reports.
"""

from __future__ import annotations

import torch

from .registry import get_model_spec
from .tiny_random import build_tiny_tokenizer

# The published config.json shapes (hub ids in the registry), copied so that nothing is downloaded.
ARCHITECTURES: dict[str, dict] = {
    "tinyllama-1.1b-chat": dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen2-1.5b-instruct": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
}


def random_model(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """(model, tokenizer): registry model `name`'s architecture with random weights on `device`, in eval mode.

    `model.llamagym_spec` is the registry's spec, so LoRA targets, generation and checkpointing defaults apply.

    Raises:
        ValueError: no hard-coded architecture for `name` (the message lists those there are).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = get_model_spec(name)
    if spec.name not in ARCHITECTURES:
        raise ValueError(f"No offline architecture for {name!r}; random_model knows {', '.join(ARCHITECTURES)}.")
    tokenizer = build_tiny_tokenizer()
    fields = dict(ARCHITECTURES[spec.name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.pad_token_id = config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = None
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    torch.random.set_rng_state(state)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.llamagym_spec = spec
    return model.eval(), tokenizer
