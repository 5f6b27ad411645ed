"""The QLoRA path as far as a CPU goes: a k-bit model is prepared for LoRA training, and what cannot work says so.

Real 4-bit loading needs CUDA and bitsandbytes (tests/test_gpu.py does it there). Here the tiny model is loaded in
bf16 and marked `is_loaded_in_4bit`, which is what `Policy` reads: its 16-bit weights must come out fp32 (peft's
`prepare_model_for_kbit_training`, the QLoRA recipe), the value head fp32, and only the adapter and the head train.
"""

import pytest
import torch

from llamagym.algos.trainer import PPOTrainer
from llamagym.config import PPOConfig
from llamagym.models.loading import load_model_and_tokenizer
from llamagym.models.policy import Policy, is_quantized
from llamagym.models.tiny_random import build_tiny_model
from tests.test_update_pinned import episodes


def marked_4bit(tokenizer):
    model = build_tiny_model(tokenizer, seed=0).to(torch.bfloat16)
    model.is_loaded_in_4bit = True
    return model


def test_a_4bit_model_gets_fp32_norms_and_trains_only_the_adapter_and_value_head(tokenizer, lora_config):
    model = marked_4bit(tokenizer)
    assert is_quantized(model) and not is_quantized(build_tiny_model(tokenizer))
    policy = Policy(model, lora_config, precision="fp32", gradient_checkpointing=True)
    decoder = policy.causal_lm().get_decoder()
    assert (
        decoder.norm.weight.dtype == torch.float32 and decoder.layers[0].input_layernorm.weight.dtype == torch.float32
    )
    assert policy.value_head.linear.weight.dtype == torch.float32
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or name.startswith("value_head.") for name in trainable)
    assert any(name.startswith("value_head.") for name in trainable)
    frozen = {name: p.detach().clone() for name, p in policy.named_parameters() if not p.requires_grad}
    stats = PPOTrainer(policy, PPOConfig(seed=0), tokenizer.pad_token_id).step(episodes(True, seed=0))
    assert all(torch.isfinite(torch.tensor(v)) for k, v in stats.items() if k.startswith("ppo/"))
    assert all(torch.equal(p, frozen[name]) for name, p in policy.named_parameters() if not p.requires_grad)


def test_a_quantized_model_cannot_be_fully_finetuned(tokenizer):
    with pytest.raises(ValueError, match="cannot train a 4/8-bit quantized model.*full_finetune=False"):
        Policy(marked_4bit(tokenizer), full_finetune=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is about machines without CUDA")
def test_4bit_loading_on_a_cpu_says_what_it_needs(tmp_path):
    with pytest.raises(ValueError, match=r"needs a CUDA GPU and bitsandbytes.*requirements/linux.txt"):
        load_model_and_tokenizer("tiny-random", "cpu", quantization="4bit")
