"""Reuse the output of the frozen lower layers across forward passes.

With LoRA on the top layers only (`Policy(lora_layers=N)`), nothing below the lowest adapted layer ever changes:
the hidden state entering that layer is a function of the input alone. `FrozenLayerCache` computes it once per
distinct input and keeps it, so later passes (acting, old, reference and new log-probs, every epoch) run the
adapted layers only. A game with few distinct observations (Blackjack has 280) then trains at the cost of the
top layers.

The split runs the decoder twice with its layer list cut (`layers[:start]`, then `layers[start:]` fed the cached
states as `inputs_embeds`), so the model's own mask and rotary code is used unchanged. `probe` checks the split
against a plain forward once per model; an architecture where it does not match simply runs without the cache.

Rows that begin with the same tokens (the system prompt, in every game) run them once: their keys and values are
repeated over the rows, and each row runs only its own tokens (`shared_prefix`, 40-55% of a suite game's tokens).
The frozen layers do so for the new rows of every forward; the adapted layers without gradient (acting, the
trust region's measures, old and reference outputs) and in plain steps (`summed_gradients`), whose gradient is a sum
over the rows. The natural-gradient step needs each input's own gradient, which a prefix run once would mix: there
every row runs the adapted layers whole.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch
from torch import nn


class FrozenLayerCache:
    """Hidden states entering decoder layer `start`, per distinct input row, bounded by `max_bytes` (LRU).

    The trainer starts a new round with every update (`next_round`), and a state that no forward used in the last
    `keep` rounds is dropped then (the action mode's `cache_rounds`): generate mode's inputs (a prompt and a sampled
    reply) rarely come back in a later update, and without it the cache filled its whole budget with them in a long
    run, so they are kept one round. Scored observations come back, though not in every batch (under random play
    about 40% of a guess-the-number batch's inputs were in the batch before, 71% in one of the last four), and
    are kept for several.

    Args:
        decoder: the transformers decoder (`.layers`, `.norm`), e.g. `LlamaModel`.
        start: index of the lowest layer with trainable weights; layers below it must be frozen.
        max_bytes: memory budget of the kept states; the least recently used are dropped past it.
    """

    def __init__(self, decoder: nn.Module, start: int, max_bytes: int):
        self.decoder, self.start, self.max_bytes = decoder, start, max_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self.used: dict[bytes, int] = {}  # the round each state was last used in
        self.round = 0
        self.size = 0  # bytes held
        self.hits = self.misses = 0
        self.share_prefix = True  # rows' shared first tokens run once (`probe` checks it is exact)
        self.summed = False  # ... in the adapted layers with gradient too (`summed_gradients`)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids=None) -> torch.Tensor:
        """Last hidden states (B, L, H) of right-padded rows, as the full decoder would give them at real tokens.

        `attention_mask` is (B, L) (1 on real tokens) or a 4D (B, 1, L, L) boolean mask in which every real token
        sees the first one and padding sees itself only (`rollout.collate_scored`).
        """
        lengths = _lengths(attention_mask)
        keys = [_key(input_ids, attention_mask, position_ids, i, n) for i, n in enumerate(lengths)]
        states = {key: self.entries[key] for key in keys if key in self.entries}
        missing = list({key: i for i, key in enumerate(keys) if key not in states}.values())  # one row per input
        self.hits += len(set(states))
        self.misses += len(missing)
        for key in states:
            self.entries.move_to_end(key)
            self.used[key] = self.round
        if missing:
            rows = torch.tensor(missing, device=input_ids.device)
            mask, positions = attention_mask[rows], None if position_ids is None else position_ids[rows]
            shared = 0  # the frozen layers never train: shared first tokens run them once, with gradient or not
            if self.share_prefix:
                shared = shared_prefix(input_ids[rows], mask, positions, [lengths[i] for i in missing])
            bottom = self._run(slice(0, self.start), mask, positions, shared, input_ids=input_ids[rows])
            for k, i in enumerate(missing):  # a copy: a view would keep the whole padded batch alive, unaccounted
                states[keys[i]] = bottom[k, : lengths[i]].detach().clone()
                self._put(keys[i], states[keys[i]])
        first = states[keys[0]]
        hidden = first.new_zeros((len(keys), input_ids.shape[1], first.shape[-1]))
        for i, key in enumerate(keys):
            hidden[i, : lengths[i]] = states[key]
        shared = 0
        if self.share_prefix and (self.summed or not torch.is_grad_enabled()):
            shared = shared_prefix(input_ids, attention_mask, position_ids, lengths)
        return self._run(slice(self.start, None), attention_mask, position_ids, shared, inputs_embeds=hidden)

    @contextmanager
    def summed_gradients(self):
        """Inside this block the adapted layers run the rows' shared first tokens once with gradient too: for a loss
        whose gradient is needed summed over the rows (plain steps), not row by row (natural steps)."""
        saved, self.summed = self.summed, True
        try:
            yield
        finally:
            self.summed = saved

    def _run(self, layers: slice, attention_mask, position_ids, prefix: int = 0, **inputs) -> torch.Tensor:
        """The decoder with only `layers` over `inputs` (`input_ids` or `inputs_embeds`): the states entering the final
        norm (the bottom part, from layer 0) or the last hidden states. With `prefix` > 0 every row starts with the
        same `prefix` tokens: they run once, their keys and values are repeated over the rows, and only the rest of
        each row is computed."""
        captured = []
        hook = None
        if layers.start == 0:  # the bottom part: keep what enters the final norm, i.e. leaves layer start - 1
            hook = self.decoder.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        try:
            with self._layers(layers):
                if prefix:
                    outputs = self._shared(attention_mask, position_ids, prefix, **inputs)
                else:
                    outputs = [
                        self.decoder(
                            **inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                        ).last_hidden_state
                    ]
        finally:
            if hook is not None:
                hook.remove()
        if hook is not None:
            outputs = captured
        if len(outputs) == 1:
            return outputs[0]
        head, rest = outputs
        return torch.cat([head.expand(rest.shape[0], -1, -1), rest], dim=1)

    def _shared(self, attention_mask, position_ids, prefix: int, **inputs) -> list[torch.Tensor]:
        """The prefix's outputs (one row) and the rest's (every row), the prefix run once and its cache repeated."""
        ((name, x),) = inputs.items()
        rows, length = x.shape[:2]
        device = x.device
        if position_ids is None:
            position_ids = torch.arange(length, device=device).expand(rows, length)
        if attention_mask.dim() == 2:  # the rest's queries see the prefix, themselves causally, and no padding
            causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()[prefix:]
            attention_mask = (causal[None] & attention_mask.bool()[:, None, :])[:, None]
        head = self.decoder(
            **{name: x[:1, :prefix]},
            position_ids=position_ids[:1, :prefix],
            use_cache=True,
            cache_position=torch.arange(prefix, device=device),
        )
        cache = head.past_key_values
        cache.batch_repeat_interleave(rows)
        rest = self.decoder(
            **{name: x[:, prefix:]},
            attention_mask=attention_mask[:, :, -(length - prefix) :, :],
            position_ids=position_ids[:, prefix:],
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(prefix, length, device=device),
        )
        return [head.last_hidden_state, rest.last_hidden_state]

    @contextmanager
    def _layers(self, layers: slice):
        """Inside this block the decoder runs only `layers` of its layer list (restored after, on error too)."""
        full = self.decoder.layers
        self.decoder.layers = nn.ModuleList(list(full)[layers])
        try:
            yield
        finally:
            self.decoder.layers = full

    def _put(self, key: bytes, state: torch.Tensor) -> None:
        self.entries[key], self.used[key] = state, self.round
        self.size += state.numel() * state.element_size()
        while self.size > self.max_bytes and len(self.entries) > 1:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        key, dropped = self.entries.popitem(last=False)
        del self.used[key]
        self.size -= dropped.numel() * dropped.element_size()

    def next_round(self, keep: int = 1) -> None:
        """Start a new round (the trainer does, with each update): the states no forward used in the last `keep`
        rounds (this one included) are dropped."""
        while self.entries and self.used[next(iter(self.entries))] <= self.round - keep:
            self._drop_oldest()
        self.round += 1

    def clear(self) -> None:
        self.entries.clear()
        self.used.clear()
        self.size = 0


def shared_prefix(input_ids, attention_mask, position_ids, lengths: list[int]) -> int:
    """How many first tokens every row shares, as the adapted layers see them (ids, positions 0.., a causal mask that
    looks at nothing past them), leaving each row at least one token of its own; 0 for a single row."""
    rows = input_ids.shape[0]
    limit = min(lengths) - 1
    if rows < 2 or limit < 1:
        return 0
    same = (input_ids[:, :limit] == input_ids[:1, :limit]).all(0)
    if position_ids is not None:
        positions = torch.arange(limit, device=input_ids.device)
        same &= (position_ids[:, :limit] == positions).all(0)
    if attention_mask.dim() == 4:
        causal = torch.ones(limit, limit, dtype=torch.bool, device=input_ids.device).tril()
        block = attention_mask[:, 0, :limit, :].bool()
        same &= (block[:, :, :limit] == causal).all(2).all(0) & ~block[:, :, limit:].any(2).any(0)
    return int(same.int().cumprod(0).sum())


def _lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per right-padded row: the 2D mask's ones, or the positions that see the first token (4D)."""
    if attention_mask.dim() == 2:
        return attention_mask.sum(dim=1).tolist()
    return attention_mask[:, 0, :, 0].sum(dim=1).tolist()


def _key(input_ids, attention_mask, position_ids, i: int, n: int) -> bytes:
    """Everything the frozen layers see of row i's first n tokens: ids, positions and (4D) mask."""
    parts = [input_ids[i, :n].cpu().numpy().tobytes()]
    if position_ids is not None:
        parts.append(position_ids[i, :n].cpu().numpy().tobytes())
    if attention_mask.dim() == 4:
        parts.append(attention_mask[i, 0, :n, :n].cpu().numpy().tobytes())
    return b"|".join(parts)


def frozen_prefix_layers(decoder: nn.Module) -> int:
    """How many of the decoder's lowest layers hold no trainable weight (0 when the embeddings train too)."""
    if any(p.requires_grad for p in decoder.get_input_embeddings().parameters()):
        return 0
    for index, layer in enumerate(decoder.layers):
        if any(p.requires_grad for p in layer.parameters()):
            return index
    return 0  # nothing trains in the decoder: no split needed


@torch.no_grad()
def probe(cache: FrozenLayerCache, vocab_size: int) -> bool:
    """Whether the split forward equals a plain forward on this architecture (two short right-padded rows); and
    sets `cache.share_prefix` to whether running their shared first tokens once does too."""
    decoder = cache.decoder
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        return False
    ids = torch.arange(3, 10, device=next(decoder.parameters()).device)[None].repeat(2, 1) % vocab_size
    ids[1, 4] = (ids[1, 4] + 1) % vocab_size  # the rows share their first 4 tokens
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    real = mask.bool()

    def matches(share: bool) -> bool:
        cache.share_prefix = share
        try:
            split = cache(ids, mask)
        except Exception:  # an architecture whose decoder cannot run a cut layer list (or a cache over one)
            return False
        finally:
            cache.clear()
            cache.hits = cache.misses = 0
        return bool(torch.allclose(plain[real].float(), split[real].float(), atol=1e-4, rtol=1e-4))

    try:
        plain = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    except Exception:  # a decoder this probe cannot run plainly: no cache
        return False
    if not matches(share=False):
        return False
    cache.share_prefix = matches(share=True)
    return True
