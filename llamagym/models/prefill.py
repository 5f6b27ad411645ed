"""Prompts prefilled once each: a KV cache that lets batched generation skip the prompt tokens it has seen.

`generate` over N prompts first runs every token of every prompt through the model (its prefill). Acting prompts
repeat: each starts with the same system prompt, and envs in the same state have the same prompt (every episode
starts in one). `prefill` runs the prompts' shared first tokens once, then each distinct prompt's own tokens once,
and spreads the cache over the N rows; `generate` then runs only the last token of each prompt before it samples.

Layout: row i is the shared prefix, then pads, then the rest of prompt i (left-padded among the rests). Positions
follow the attention mask (as `generate` computes them), so every token sits where it would in its prompt alone
and the outputs equal a plain left-padded `generate`'s up to float rounding.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..algos.rollout import left_pad


class Prefilled(NamedTuple):
    """What `generate` takes: the rows' ids and mask (N, L), and a cache of their first L - 1 columns (or None)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    cache: Any  # a transformers DynamicCache; None: nothing prefilled, `generate` runs the prompts itself


def shared_prefix(prompts: list[list[int]]) -> int:
    """Length of the token prefix all prompts share, leaving each at least its last token (where V is read, and
    where generation starts)."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for i in range(limit):
        if any(p[i] != first[i] for p in prompts):
            return i
    return max(limit, 0)


def _reusable(cache) -> bool:
    """A cache whose rows may be copied and whose every layer keeps all past positions (no sliding window, which
    would count the pads between prefix and rest as positions)."""
    from transformers import DynamicCache

    if type(cache) is not DynamicCache:
        return False
    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers 4.x: one list of tensors per layer, every position kept
        return True
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in layers)


@torch.no_grad()
def prefill(decoder, prompts: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu") -> Prefilled:
    """The rows of `prompts` for `generate`, with the prompts' tokens but the last run through `decoder` once per
    distinct prompt (the shared prefix once for all).

    Args:
        decoder: the causal LM's decoder (`model.get_decoder()`, the adapter in it), run under the caller's
            autocast.
        prompts: N token lists (chat template applied), each at least one token.

    Returns a plain left-padded batch with `cache` None when the prompts share no first token or the model's cache
    cannot be reused this way (a sliding-window or other non-dynamic cache).
    """
    distinct = list(dict.fromkeys(map(tuple, prompts)))
    where = {prompt: i for i, prompt in enumerate(distinct)}
    index = torch.tensor([where[tuple(p)] for p in prompts], device=device)
    prefix = shared_prefix([list(p) for p in distinct])
    if prefix == 0:
        return Prefilled(*left_pad(prompts, pad_token_id, device), None)
    head = torch.tensor([distinct[0][:prefix]], dtype=torch.long, device=device)
    cache = decoder(input_ids=head, use_cache=True).past_key_values
    if not _reusable(cache):
        return Prefilled(*left_pad(prompts, pad_token_id, device), None)
    rest_ids, rest_mask = left_pad([list(p[prefix:]) for p in distinct], pad_token_id, device)
    mask = torch.cat([rest_mask.new_ones(len(distinct), prefix), rest_mask], dim=1)
    if rest_ids.shape[1] > 1:  # the rests' tokens but the last, one row per distinct prompt
        cache.batch_repeat_interleave(len(distinct))
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, prefix:-1]
        cache = decoder(
            input_ids=rest_ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        ).past_key_values
        cache.batch_select_indices(index)
    else:
        cache.batch_repeat_interleave(len(prompts))
    input_ids = torch.cat([head.expand(len(prompts), -1), rest_ids[index]], dim=1)
    return Prefilled(input_ids, mask[index], cache)
