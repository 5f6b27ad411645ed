"""The model side: which models are known, how they load, and the trainable policy built on them.

- `registry.py`         known models as data (`ModelSpec`: LoRA, generation, dtype and chat-template defaults)
- `loading.py`          `load_model_and_tokenizer`: the only place that calls `from_pretrained`
- `devices.py`          device and dtype resolution ("auto" = cuda, then mps, then cpu)
- `policy.py`           `Policy`: a peft LoRA model plus an fp32 value head
- `frozen_cache.py`     reuse of the frozen lower layers' output across forward passes
- `host_memory.py`      freed CPU memory handed back to the system after each update; oneDNN's cache capped
- `tiny_random.py`      a tiny random chat model and tokenizer built locally (tests, smoke runs)

Importing this package is instant (no torch): `llamagym models` lists the registry without loading anything.
"""
