"""The trainable policy: a peft LoRA model plus an fp32 value head kept outside peft.

`reference()` is the same weights with the adapter disabled (LoRA `bias="none"`), so no second copy of the
model is held. Only full fine-tuning (no LoRA) keeps a frozen reference copy. Log-probs are computed by running
the LM head on response positions only: full-vocabulary logits for every prompt token are most of the memory. A
backward pass keeps those logits alone, not float32 copies of them (`ppo.token_logprobs`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from peft import (
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    prepare_model_for_kbit_training,
    set_peft_model_state_dict,
)
from safetensors.torch import load_file, save_file
from torch import nn

from ..algos import ppo
from ..algos.rollout import ScoreBatch, left_pad
from . import checkpointing
from .devices import resolve_precision
from .frozen_cache import FrozenLayerCache, frozen_prefix_layers, probe
from .head_cast import casts_kept, keep_head_cast
from .host_memory import bound_onednn_cache
from .prefill import Prefilled, prefill
from .registry import GENERIC_SPEC, ModelSpec

VALUE_HEAD_FILE = "value_head.safetensors"
LOGIT_ROWS = 64  # positions whose float32 vocabulary-wide rows exist at once (`ppo.token_logprobs`)
POLICY_META_FILE = "policy.json"


def lora_config_from_spec(spec: ModelSpec | None) -> LoraConfig:
    """The registry's LoRA defaults for a model (a causal-LM adapter without biases; all linear layers if unknown)."""
    return LoraConfig(**(spec or GENERIC_SPEC).lora_kwargs())


def _top_layers(lora_config: LoraConfig, model, count: int) -> LoraConfig:
    """A copy of `lora_config` that adapts only the top `count` transformer layers."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    total = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int) or isinstance(count, bool) or total is None or not 1 <= count <= total:
        raise ValueError(f"`lora_layers` should be an integer in [1, {total}] (the model's layers). Got {count!r}.")
    return dataclasses.replace(lora_config, layers_to_transform=list(range(total - count, total)))


def is_quantized(model) -> bool:
    """Whether `model` was loaded in 4 or 8 bits (bitsandbytes), i.e. its base weights cannot train."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


class ValueHead(nn.Module):
    """V(s) from the last hidden state: an fp32 `Linear(hidden, 1)`, zero-initialised so values start at 0.

    With `detach_input` set, the value loss trains this head only, not the adapter below it (the natural-gradient
    trainer steps the adapter on the policy loss alone).
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.detach_input = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) hidden states of any dtype -> (...) fp32 values (also under autocast)."""
        if self.detach_input:
            hidden = hidden.detach()
        with torch.autocast(hidden.device.type, enabled=False):
            return self.linear(hidden.float()).squeeze(-1)


class PolicyOutput(NamedTuple):
    logprobs: torch.Tensor  # (B, L) fp32 log-prob of each token at response positions, 0 elsewhere
    values: torch.Tensor | None  # (B,) fp32 value at `value_index`, or None when not asked for
    entropy: torch.Tensor | None  # (B, L) fp32 entropy at response positions, or None when not asked for


def length_normalised(totals: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each candidate's mean token log-prob (N, C), from its summed token log-probs and its token count (N, C)."""
    return totals / lengths.clamp(min=1)


CandidateLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (totals, lengths) (N, C) -> logits (N, C)


class ScoreOutput(NamedTuple):
    logprobs: torch.Tensor  # (N, C) log-probability of each candidate reply, -inf where a row has fewer
    values: torch.Tensor  # (N,) fp32 value at the last prompt token
    features: torch.Tensor  # (N, H) the value head's input there: the last prompt token's hidden state


class Policy(nn.Module):
    """A causal LM with a LoRA adapter (or fully trainable) and a value head.

    Args:
        model: a transformers causal LM (as returned by `load_model_and_tokenizer`) or a `PeftModel`.
        lora_config: the adapter to add; None takes the registry defaults in `model.llamagym_spec` (LoRA on all
            linear layers when the model has no spec). Ignored for a `PeftModel`.
        full_finetune: train every weight instead of an adapter; a frozen reference copy is then kept.
        lora_layers: adapt only the top N transformer layers. The backward pass then stops at the lowest of them:
            about 2x faster training on a CPU for SmolLM2-135M with 8 of 30 layers. None adapts them all.
        precision: "bf16" runs every forward under bf16 autocast (weights and the value head stay fp32), "fp32"
            runs plain, "auto" picks bf16 where it is native (see `devices.resolve_precision`). Acting, old,
            reference and new log-probs all use this one setting, so the PPO ratio compares like with like.
        frozen_cache_mb: with `lora_layers`, keep up to this many MiB of the hidden states that leave the frozen
            layers below the adapter, one per distinct input (see `frozen.FrozenLayerCache`): repeated inputs then
            run the adapted layers only. 0 turns it off. Used only where a probe shows the split is exact.
        gradient_checkpointing: recompute the training layers' activations in the backward pass instead of
            keeping them (see `checkpointing`): less memory for one more forward of those layers; same gradients.
    """

    def __init__(
        self,
        model,
        lora_config: LoraConfig | None = None,
        full_finetune: bool = False,
        precision: str = "fp32",
        lora_layers: int | None = None,
        frozen_cache_mb: float = 512,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        if not isinstance(gradient_checkpointing, bool):
            raise ValueError(f"`gradient_checkpointing` should be True or False. Received {gradient_checkpointing!r}.")
        self.full_finetune = full_finetune
        self.reference_model = None
        if isinstance(model, PeftModel):
            self.model = model
        elif full_finetune:
            if is_quantized(model):
                raise ValueError(
                    "`full_finetune` cannot train a 4/8-bit quantized model (its weights are frozen integers). "
                    "Train a LoRA adapter on it instead (QLoRA): leave full_finetune=False."
                )
            self.model = model
            self.reference_model = copy.deepcopy(model).eval().requires_grad_(False)
        else:
            if lora_config is None:
                lora_config = lora_config_from_spec(getattr(model, "llamagym_spec", None))
            if lora_layers is not None:
                lora_config = _top_layers(lora_config, model, lora_layers)
            if lora_config.bias != "none":
                raise ValueError(
                    f"LoRA `bias` should be 'none' so that disabling the adapter gives the reference model exactly. "
                    f"Received {lora_config.bias!r}."
                )
            with warnings.catch_warnings():
                # peft reads `is_gradient_checkpointing`, which transformers 5 renamed: a FutureWarning on every run
                # that the user can do nothing about (the property still works)
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                if is_quantized(model):  # QLoRA: norms (and any other 16-bit weights) upcast to fp32, all frozen
                    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
                self.model = get_peft_model(model, lora_config)
        keep_head_cast(self.causal_lm())  # under bf16 autocast the frozen LM head is cast once, not at every call
        if gradient_checkpointing:
            checkpointing.enable(self.causal_lm())
        self.gradient_checkpointing = gradient_checkpointing
        config = self.causal_lm().config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.value_head = ValueHead(text_config.hidden_size).to(self.device)
        self.precision = resolve_precision(precision, self.device)
        if self.precision == "bf16" and self.device.type == "cpu":
            bound_onednn_cache()  # before the first bf16 product: oneDNN's cache would fill with every new length
        # Gemma-2-style logit soft-capping lives in the causal LM's forward, so the LM-head shortcut would skip it.
        self._full_forward = getattr(text_config, "final_logit_softcapping", None) is not None
        self.frozen_cache = self._frozen_cache(frozen_cache_mb, text_config.vocab_size)
        self.temperature = 1.0  # sampling temperature; log-probs are scored under the same one
        self.version = 0  # bumped whenever the weights change (optimizer step, load): outputs cached by it go stale
        self.sharded = False  # frozen weights sharded over the ranks (FSDP): every forward is then a collective
        self.keep_casts = True  # `generate` keeps the frozen layers' bf16 casts for the call (`head_cast.casts_kept`)
        self.eval()  # dropout stays off: old, reference and new log-probs come from one computation path

    # ---- structure -------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def causal_lm(self, reference: bool = False):
        """The underlying transformers model (with the LoRA layers injected, for peft)."""
        if reference and self.reference_model is not None:
            return self.reference_model
        return self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model

    @contextlib.contextmanager
    def reference(self):
        """Inside this context the LM is the reference policy (adapter disabled; or the frozen copy)."""
        if isinstance(self.model, PeftModel):
            with self.model.disable_adapter():
                yield
        else:
            yield

    def summed_gradients(self):
        """A context in which forwards with gradient may run the rows' shared first tokens once (the frozen-layer
        cache's `summed_gradients`): for losses whose gradient is only needed summed over the rows. A no-op without
        the cache, or with gradient checkpointing (its recomputation would extend the shared keys and values twice)."""
        if self.frozen_cache is None or self.gradient_checkpointing:
            return contextlib.nullcontext()
        return self.frozen_cache.summed_gradients()

    @contextlib.contextmanager
    def float32(self):
        """Inside this context every forward runs in plain float32, without the frozen-layer cache (filled under
        bf16): outputs that do not depend on the batch they are in or on the CPU thread count. bf16 rounding does,
        and it can flip the greedy choice between near-tied actions. A no-op when the policy runs in fp32."""
        if self.precision == "fp32":
            yield
            return
        saved = self.precision, self.frozen_cache
        self.precision, self.frozen_cache = "fp32", None
        try:
            yield
        finally:
            self.precision, self.frozen_cache = saved

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # ---- forward ---------------------------------------------------------------------------------------------
    def autocast(self):
        """The autocast context every forward of this policy runs in (a no-op at fp32)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def _frozen_cache(self, megabytes: float, vocab_size: int) -> FrozenLayerCache | None:
        """The frozen-layer cache when only top layers train and the split is exact for this model, else None."""
        if megabytes <= 0 or self.full_finetune or self._full_forward:
            return None
        decoder = self.causal_lm().get_decoder()
        start = frozen_prefix_layers(decoder)
        if start == 0:
            return None
        cache = FrozenLayerCache(decoder, start, int(megabytes * 2**20))
        return cache if probe(cache, vocab_size) else None

    def _hidden(self, input_ids, attention_mask, reference: bool, position_ids=None, prefix: int = 0):
        lm = self.causal_lm(reference)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        with self.autocast():
            if self.frozen_cache is not None:  # the reference (adapter off) has the same frozen layers: cached too
                return self.frozen_cache(input_ids, attention_mask, position_ids), None
            if self._full_forward:
                out = lm(**inputs, output_hidden_states=True)
                return out.hidden_states[-1], out.logits
            if prefix:
                return self._hidden_with_prefix(lm.get_decoder(), input_ids, attention_mask, position_ids, prefix), None
            return lm.get_decoder()(**inputs).last_hidden_state, None

    @staticmethod
    def _hidden_with_prefix(decoder, input_ids, attention_mask, position_ids, prefix: int) -> torch.Tensor:
        """Hidden states when every row starts with the same `prefix` tokens: the prefix runs once, its KV cache
        is repeated across the batch, and only the rest of each row is computed (a 4D mask is required)."""
        rows = input_ids.shape[0]
        shared = decoder(input_ids=input_ids[:1, :prefix], position_ids=position_ids[:1, :prefix], use_cache=True)
        cache = shared.past_key_values
        cache.batch_repeat_interleave(rows)
        rest = decoder(
            input_ids=input_ids[:, prefix:],
            attention_mask=attention_mask[:, :, prefix:, :],
            position_ids=position_ids[:, prefix:],
            past_key_values=cache,
        ).last_hidden_state
        return torch.cat([shared.last_hidden_state.expand(rows, -1, -1), rest], dim=1)

    def _token_logprobs(
        self, hidden, full_logits, rows, positions, targets, reference: bool, temperature=1.0, with_entropy=False
    ):
        """Log-probs of `targets` predicted at (rows, positions) at `temperature` (and the entropy there, or None),
        running the LM head on those positions only, once per position (a scored state's candidates all predict
        their first token at its last prompt token); a backward pass keeps only their logits (`ppo.token_logprobs`)."""
        where, shared = torch.unique(rows * hidden.shape[1] + positions, return_inverse=True)
        rows, positions = where // hidden.shape[1], where % hidden.shape[1]
        if full_logits is not None:
            logits = full_logits[rows, positions]
        else:
            with self.autocast():
                logits = self.causal_lm(reference).get_output_embeddings()(hidden[rows, positions])
        return ppo.token_logprobs(logits, targets, temperature, with_entropy, LOGIT_ROWS, rows=shared)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
        value_index: torch.Tensor | None = None,
        reference: bool = False,
        with_entropy: bool = False,
    ) -> PolicyOutput:
        """Log-probs of the response tokens (and values, entropy) for right-padded sequences.

        Args:
            input_ids, attention_mask: (B, L) prompt + response, right-padded.
            response_mask: (B, L) 1 on response tokens (never at position 0).
            value_index: (B,) position whose hidden state gives V (the last prompt token), or None.
            reference: score under the reference policy (call inside `reference()` for peft models).
            with_entropy: also return the per-token entropy.
        """
        hidden, full_logits = self._hidden(input_ids, attention_mask, reference)
        select = response_mask[:, 1:].bool()  # the token at p is predicted by the hidden state at p - 1
        rows, positions = select.nonzero(as_tuple=True)
        token_logprobs, token_entropy = self._token_logprobs(
            hidden, full_logits, rows, positions, input_ids[:, 1:][select], reference, self.temperature, with_entropy
        )
        logprobs = token_logprobs.new_zeros(select.shape)
        logprobs[select] = token_logprobs
        logprobs = F.pad(logprobs, (1, 0))
        entropy = None
        if with_entropy:
            entropy = token_logprobs.new_zeros(select.shape)
            entropy[select] = token_entropy
            entropy = F.pad(entropy, (1, 0))
        values = None
        if value_index is not None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            values = self.value_head(hidden[rows, value_index])
        return PolicyOutput(logprobs, values, entropy)

    def score(
        self,
        batch: ScoreBatch,
        reference: bool = False,
        prefix: int = 0,
        candidate_logits: CandidateLogits | None = None,
    ) -> ScoreOutput:
        """The policy over candidate replies: softmax of `candidate_logits(totals, lengths)`, by default their
        length-normalised log-likelihoods (TWOSOME; a scoring action mode passes its own, `algos/modes/score.py`).

        One forward pass per row scores the prompt and all its packed candidates (see `rollout.ScoreBatch`).
        `prefix` > 0 says the rows share their first `prefix` tokens (e.g. the system prompt): they are computed
        once and their KV cache reused. Acting uses it; training never does, so that old, reference and new
        log-probs come from one computation path.
        """
        hidden, full_logits = self._hidden(batch.input_ids, batch.attention_mask, reference, batch.position_ids, prefix)
        valid = batch.owner >= 0
        rows = torch.arange(batch.input_ids.shape[0], device=hidden.device)[:, None].expand_as(batch.owner)[valid]
        token_logprobs = self._token_logprobs(
            hidden, full_logits, rows, batch.source[valid], batch.target[valid], reference
        )[0]
        n, width = batch.input_ids.shape[0], int(batch.num_candidates.max())
        slot = rows * width + batch.owner[valid]
        totals = token_logprobs.new_zeros(n * width).index_add(0, slot, token_logprobs)
        counts = token_logprobs.new_zeros(n * width).index_add(0, slot, torch.ones_like(token_logprobs))
        scores = (candidate_logits or length_normalised)(totals.view(n, width), counts.view(n, width))
        exists = torch.arange(width, device=hidden.device)[None] < batch.num_candidates[:, None]
        logprobs = torch.log_softmax(scores.masked_fill(~exists, float("-inf")), dim=-1)
        features = hidden[torch.arange(n, device=hidden.device), batch.value_index]
        return ScoreOutput(logprobs, self.value_head(features), features)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **generation_kwargs) -> torch.Tensor:
        """Sample continuations of left-padded prompts with the current policy; returns (B, L + new).

        In bf16 the frozen layers' casts are made once for the call (`head_cast.casts_kept`), not at every step.
        Sharded (FSDP), every rank runs as many forwards as the rank with the longest replies (`synced_gpus`).
        """
        if self.sharded:
            generation_kwargs.setdefault("synced_gpus", True)
        # every decoding step would cast each frozen weight again; a sharded unit's weight is gathered per forward
        keep = self.keep_casts and self.precision == "bf16" and not self.sharded
        kept = casts_kept(self.model) if keep else contextlib.nullcontext()
        with self.autocast(), kept:
            return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **generation_kwargs)

    def prefill(self, prompts: list[list[int]], pad_token_id: int) -> Prefilled:
        """The rows of `prompts` for `generate` and a KV cache of their tokens, each distinct prompt run once and
        their shared first tokens once for all (`prefill.prefill`); no cache when sharded (each forward is a
        collective the other ranks would have to join)."""
        if self.sharded:
            return Prefilled(*left_pad(prompts, pad_token_id, self.device), None)
        with self.autocast():
            return prefill(self.causal_lm().get_decoder(), prompts, pad_token_id, self.device)

    # ---- persistence -----------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write the adapter (or the whole model when fully fine-tuned) and the value head into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if isinstance(self.model, PeftModel):
            save_file(get_peft_model_state_dict(self.model), str(directory / "adapter_model.safetensors"))
            self.model.peft_config["default"].save_pretrained(str(directory))
        else:
            state = {k: v.contiguous() for k, v in self.model.state_dict().items()}
            save_file(state, str(directory / "model.safetensors"))
        save_file(self.value_head.state_dict(), str(directory / VALUE_HEAD_FILE))
        meta = {"full_finetune": self.full_finetune, "base_model": self.causal_lm().config.name_or_path}
        (directory / POLICY_META_FILE).write_text(json.dumps(meta, indent=2))

    def load(self, directory: str | Path) -> None:
        """Load weights written by `save` into this policy (same base model and adapter shape)."""
        directory = Path(directory)
        device = self.device
        if isinstance(self.model, PeftModel):
            state = load_file(str(directory / "adapter_model.safetensors"), device=str(device))
            result = set_peft_model_state_dict(self.model, state)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"Adapter in {directory} does not fit this model: {result.unexpected_keys[:5]}")
        else:
            self.model.load_state_dict(load_file(str(directory / "model.safetensors"), device=str(device)))
        self.value_head.load_state_dict(load_file(str(directory / VALUE_HEAD_FILE), device=str(device)))
        self.version += 1
