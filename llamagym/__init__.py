"""llamagym: fine-tune LLM agents with online reinforcement learning in any Gymnasium environment.

The public names are imported lazily (PEP 562), so `llamagym models` and `import llamagym.models.registry` stay instant.
"""

from __future__ import annotations

import importlib
import logging

# bitsandbytes (the Linux `quantization` extra) warns at import that a CPU kernel package is missing. Its 4-bit
# path needs CUDA and is never used on a CPU, so the warning only confuses; errors still show.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__version__ = "0.3.0"

_EXPORTS = {
    "Agent": "agent",
    "PPOConfig": "config",
    "ReplayConfig": "config",
    "ModelLoadError": "models.loading",
    "load_model_and_tokenizer": "models.loading",
    "Policy": "models.policy",
    "PPOTrainer": "algos.trainer",
    "DEFAULT_MODEL": "models.registry",
    "MODELS": "models.registry",
    "ModelSpec": "models.registry",
    "UnknownModelError": "models.registry",
    "find_model_spec": "models.registry",
    "get_model_spec": "models.registry",
    "register_model": "models.registry",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'llamagym' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
