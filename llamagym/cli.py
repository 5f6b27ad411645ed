"""The `llamagym` command: `doctor` checks this installation, `models` lists the model registry.

Run as `llamagym doctor` (console script) or `python -m llamagym doctor`. The only module that prints.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import platform
import re
import sys
import time

from llamagym.models.registry import DEFAULT_MODEL, MODELS

# (import name, distribution, minimum version from setup.py)
REQUIRED = (
    ("torch", "torch", "2.3"),
    ("transformers", "transformers", "4.51"),
    ("peft", "peft", "0.14"),
    ("gymnasium", "gymnasium", "1.0"),
    ("accelerate", "accelerate", "1.0"),
    ("gguf", "gguf", "0.10"),
)
# (import name, distribution, what it is for, the command that installs it)
OPTIONAL = (
    ("bitsandbytes", "bitsandbytes", "4/8-bit loading, Linux + CUDA only", "pip install -r requirements/linux.txt"),
    ("textworld", "textworld", "the TextWorld example", "python scripts/bootstrap.py --extras textworld"),
    ("wandb", "wandb", "--wandb logging", "python scripts/bootstrap.py --extras wandb"),
    ("matplotlib", "matplotlib", "plots of training curves", "python scripts/bootstrap.py (requirements/base.txt)"),
)
INSTALL_FIX = "python scripts/bootstrap.py (or: pip install -r requirements/base.txt && pip install --no-deps -e .)"


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default `sys.argv[1:]`), run the command and return its exit status."""
    parser = argparse.ArgumentParser(prog="llamagym", description="Fine-tune LLM agents with online RL in Gymnasium.")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_parser = commands.add_parser("doctor", help="check versions, devices and the embedded default model")
    doctor_parser.add_argument("--no-load", action="store_true", help="skip loading the default model (fast)")
    doctor_parser.add_argument("--device", default="cpu", help="device for the load check: auto, cpu, cuda, mps")
    commands.add_parser("models", help="list the registered models")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "models":
        return models()
    return doctor(load=not args.no_load, device=args.device)


def _line(status: str, what: str, detail: str) -> None:
    print(f"{status:<5} {what:<15} {detail}", flush=True)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------------------ doctor
def doctor(load: bool = True, device: str = "cpu") -> int:
    """Print one line per check; return 1 if a required piece is missing or broken, else 0.

    Args:
        load: also load the embedded default model and generate a short reply (about 3 s cached, 20 s cold).
        device: device for that load.
    """
    failed = False
    python_ok = sys.version_info >= (3, 11)
    failed |= not python_ok
    _line("ok" if python_ok else "FAIL", "Python", f"{platform.python_version()} (needs >= 3.11)")
    for module, dist, minimum in REQUIRED:
        failed |= not _check_required(module, dist, minimum)
    if failed:
        _line("FAIL", "summary", f"required packages are missing or broken; fix: {INSTALL_FIX}")
        return 1
    cuda = _check_devices()
    failed |= not _check_default_model(load, device)
    for module, dist, purpose, fix in OPTIONAL:
        _check_optional(module, dist, purpose, fix, cuda)
    _line("FAIL" if failed else "ok", "summary", "a required piece is broken" if failed else "ready")
    return int(failed)


def _check_required(module: str, dist: str, minimum: str) -> bool:
    version = _dist_version(dist)
    if version is None:
        _line("FAIL", module, f"not installed; fix: {INSTALL_FIX}")
        return False
    if _version_tuple(version) < _version_tuple(minimum):
        _line("FAIL", module, f"{version} is too old (needs >= {minimum}); fix: pip install -U '{dist}>={minimum}'")
        return False
    try:
        importlib.import_module(module)
    except Exception as err:  # a broken install can raise anything at import; report it rather than crash
        _line("FAIL", module, f"{version} is installed but does not import: {type(err).__name__}: {err}")
        return False
    _line("ok", module, version)
    return True


def _check_devices() -> bool:
    """Print the devices line and return whether CUDA is available."""
    import torch

    from .models.devices import cpu_precision_note, matmul_gflops

    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    cpu = f"cpu: torch uses {torch.get_num_threads()} of {os.cpu_count()} cores"
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    cpu += f" ({capability})" if capability else ""
    cpu += f", {cpu_precision_note()}, {matmul_gflops():.0f} GFLOP/s at its matrix products"
    gpu = f"cuda: {torch.cuda.get_device_name(0)}" if cuda else "cuda: not available"
    _line("ok", "devices", f"{cpu}; {gpu}; mps: {'available' if mps else 'not available'}")
    return cuda


def _check_default_model(load: bool, device: str) -> bool:
    from llamagym.models.loading import default_model_status

    status = default_model_status()
    if not status["installed"]:
        _line("FAIL", "default model", f"{status['name']} is not installed; fix: {status['fix']}")
        return False
    cache = f"; cached at {status['cached']}" if status["cached"] else "; not cached yet (first load converts it)"
    _line(
        "ok", "default model", f"{status['name']}: {status['package']} {status['version']} at {status['path']}{cache}"
    )
    if not load:
        _line("skip", "load+generate", "skipped (--no-load)")
        return True
    try:
        seconds, reply = _load_and_generate(device)
    except Exception as err:  # any failure here is the finding; print it instead of a traceback
        _line("FAIL", "load+generate", f"{type(err).__name__}: {err}")
        return False
    ok = bool(reply.strip())
    shown = reply.strip().replace("\n", " ")[:60]
    _line("ok" if ok else "FAIL", "load+generate", f"loaded in {seconds:.1f} s on {device}; replied {shown!r}")
    return ok


def _load_and_generate(device: str) -> tuple[float, str]:
    """Load the default model, answer one chat turn greedily; return (load seconds, reply)."""
    import torch

    from llamagym.models.loading import load_model_and_tokenizer

    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL, device=device)
    seconds = time.perf_counter() - start
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    inputs = inputs.to(model.device)
    with torch.no_grad():
        output = model.generate(
            **inputs, max_new_tokens=model.llamagym_spec.generation["max_new_tokens"], do_sample=False
        )
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return seconds, reply


def _check_optional(module: str, dist: str, purpose: str, fix: str, cuda: bool) -> None:
    version = _dist_version(dist)
    if module == "bitsandbytes" and not cuda:
        detail = f"{version} installed but unusable" if version else "not installed"
        _line("skip", module, f"{detail}: {purpose} (no CUDA here); on a GPU machine: {fix}")
    elif version is None:
        _line("miss", module, f"not installed (optional: {purpose}); fix: {fix}")
    else:
        _line("ok", module, f"{version} ({purpose})")


# ------------------------------------------------------------------------------------------------------ models
def models() -> int:
    """Print the registry as a table; the default model is marked with `*`."""
    header = ("name", "params", "source", "hub id", "LoRA r/alpha", "LoRA targets", "aliases")
    rows = [header]
    for spec in MODELS.values():
        name = f"{spec.name}{' *' if spec.name == DEFAULT_MODEL else ''}"
        lora = f"{spec.lora_r}/{spec.lora_alpha}"
        targets = ",".join(spec.lora_target_modules)
        rows.append((name, spec.params, spec.source, spec.hub_id or "-", lora, targets, ",".join(spec.aliases) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print(
        "\n* default. Hub ids (org/name, e.g. openai-community/gpt2; needs the hub), local directories saved with "
        "save_pretrained and .gguf files work too."
    )
    return 0
