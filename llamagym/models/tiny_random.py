"""A tiny random chat model and tokenizer built locally: no download, for tests and smoke runs.

The tokenizer is byte-level BPE with no merges (every UTF-8 byte is a token), so it round-trips any text,
plus three role tokens and an end-of-turn token, and a ChatML-like chat template.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SPECIAL = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of 260 tokens with a chat template; `<|end|>` is both EOS and PAD."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": "<|end|>", "pad_token": "<|end|>"})
    tokenizer.add_special_tokens({"additional_special_tokens": _SPECIAL[1:]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden_size: int = 32, initializer_range: float = 0.2
) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights sized to `tokenizer` (fp32, about 37k parameters).

    The init range is 10x transformers' default: with a frozen LM head of std 0.02, an adapter could move the
    logits by well under one nat and nothing would be learnable in tests.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    torch.random.set_rng_state(generator_state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def build_tiny(seed: int = 0) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Tokenizer and model together, as the `tiny-random` registry entry loads them."""
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(tokenizer, seed=seed), tokenizer
