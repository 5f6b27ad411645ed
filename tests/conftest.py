"""Shared fixtures: a tiny random Llama and a byte-level tokenizer built locally. Nothing is downloaded."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402

from llamagym.models.registry import MODELS  # noqa: E402
from llamagym.models.tiny_random import build_tiny_model, build_tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)  # two test processes on two cores must not fight over threads


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def model(tokenizer):
    return build_tiny_model(tokenizer, seed=0)


@pytest.fixture
def lora_config():
    """A LoRA adapter that is not the identity at step 0 (so adapter != base can be checked)."""
    return LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias="none", lora_dropout=0.0, init_lora_weights=False
    )


@pytest.fixture
def restore_models():
    """Tests that register models put the registry back as it was."""
    saved = dict(MODELS)
    yield
    MODELS.clear()
    MODELS.update(saved)
