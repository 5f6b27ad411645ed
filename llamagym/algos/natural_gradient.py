"""Natural-gradient PPO steps: move each input's outputs where its own loss asks, not where the batch mean pulls.

Why: a small LM encodes the states of a simple game as nearly one vector (SmolLM2-135M's last hidden states of the
280 Blackjack prompts have a mean cosine similarity of 0.996). The model's neural tangent kernel over those inputs
is then close to rank one, so a plain (or Adam) gradient step moves every state's logits together by the batch's
mean advantage, and the policy collapses to the action that is best on average (always "stick") before the small,
state-specific part of the gradient can separate the states.

The fix is a Gauss-Newton step in function space over the minibatch's distinct inputs. With g_i the gradient of
input i's share of the policy loss and c_i the gradient of that loss with respect to i's outputs (its candidate
log-probs, or its reply's token log-probs), the step is

    delta = -step * N * G^T alpha,   (K + damping * mean(K_ii / t_i) * diag(t)) alpha = t,   K = G G^T, t_i = |c_i|^2

(N the minibatch's turn count; |delta| is capped at `max_grad_norm`). That is the smallest parameter change that
decreases each input's loss as a step of `step` along -c_i in its output space would, with every input's change
solved for jointly (K is small: one row per distinct input).
`RowGradients` collects the per-input gradients g_i in the same backward pass as the plain gradient, from hooks
on the adapter's `nn.Linear` modules (LoRA A and B): no extra forward or backward pass. The value head keeps its
AdamW step on features it no longer back-propagates into.
`NaturalGradient` wraps both as one optimizer: `zero_grad()`, the forward passes inside `recording()`, the backward
passes, then `clip_grad_norm()` and `step()`, called as the trainer calls them on its AdamW.

Memory: G has one row of the adapter's P weights per distinct input (491,520 floats for the registry's LoRA on 8
layers). `NaturalGradient.grad_dtype` may hold it in bfloat16, half the bytes; its products (the Gram matrix K, the
step G^T alpha) are then taken in float32 a block of columns at a time, so only G's entries are rounded.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .. import distributed


class RowGradients:
    """Per-row (per input in the batch dimension) gradients of every trainable parameter of `model`.

    All trainable parameters must belong to `nn.Linear` modules whose input has the batch as its first dimension
    (true of LoRA adapters and the value head); anything else raises `ValueError` at construction.

    Use: run the forward pass inside `with rows.recording():` and call `rows.watch(outputs...)` there on the
    per-row outputs the loss is computed from; after `loss.backward()` (inside the block or not), `rows.take()`
    returns `(G, t)`: G the (B, P) per-row gradients in `params` order, t (B,) the squared norms of the per-row
    output gradients.
    """

    def __init__(self, model: nn.Module, params: list[nn.Parameter]):
        self.params = params
        owners = {}
        for module in model.modules():
            if isinstance(module, nn.Linear):
                for name in ("weight", "bias"):
                    p = getattr(module, name)
                    if p is not None and p.requires_grad:
                        owners[id(p)] = module
        missing = [tuple(p.shape) for p in params if id(p) not in owners]
        if missing:
            raise ValueError(
                f"natural_gradient needs every trainable parameter to be in an nn.Linear layer (LoRA adapters, the "
                f"value head); parameters of shapes {missing[:3]} are not. Use LoRA without modules_to_save, or set "
                f"PPOConfig(natural_gradient=False)."
            )
        self.modules = list(dict.fromkeys(owners[id(p)] for p in params))
        self._grads: dict[int, torch.Tensor] = {}  # id(param) -> (B, *param.shape) accumulated per-row gradient
        self._out_sq: torch.Tensor | None = None
        self._active = False
        self.keep_outputs = False  # also keep the per-row output gradients themselves (data-parallel merging)
        self._out_raw: list[torch.Tensor] = []
        self.outputs: torch.Tensor | None = None  # with keep_outputs: (B, W) those of the rows last taken

    @contextmanager
    def recording(self):
        """Capture per-row gradients of the forward and backward passes run inside this block."""
        handles = [m.register_forward_hook(self._forward_hook) for m in self.modules]
        self._active = True
        try:
            yield self
        finally:
            self._active = False
            for handle in handles:
                handle.remove()

    def watch(self, *outputs: torch.Tensor) -> None:
        """Record |d loss / d output|^2 summed per row for these (B, ...) outputs (inside `recording()`)."""
        for out in outputs:
            if out.requires_grad:
                out.register_hook(self._output_hook)

    def clear(self) -> None:
        """Forget what was recorded (a skipped step)."""
        self._grads, self._out_sq, self._out_raw = {}, None, []

    @property
    def width(self) -> int:
        """P, the number of columns of G (all the watched parameters, flattened)."""
        return sum(p.numel() for p in self.params)

    def take(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(G, t) of the rows recorded since the last call, and forget them.

        With `out` (a float32 or bfloat16 (>= B, P) view, e.g. the free rows of a buffer holding a whole minibatch),
        G is written into its first B rows (rounded to its dtype) and returned, so no second copy of the per-row
        gradients is made.
        """
        if self._out_sq is None or not self._grads:
            raise RuntimeError("RowGradients.take() before a recorded forward and backward pass.")
        rows = self._out_sq.shape[0]
        out = torch.empty(rows, self.width, device=self._out_sq.device) if out is None else out[:rows]
        offset = 0
        for p in self.params:
            g = self._grads.get(id(p))
            out[:, offset : offset + p.numel()] = g.reshape(rows, -1) if g is not None else 0.0
            offset += p.numel()
        result = out, self._out_sq
        self.outputs = torch.cat(self._out_raw, dim=1) if self.keep_outputs else None
        self.clear()
        return result

    # ---- hooks -----------------------------------------------------------------------------------------------
    def _forward_hook(self, module: nn.Linear, inputs, output: torch.Tensor) -> None:
        if not (self._active and output.requires_grad):
            return
        x = inputs[0].detach()

        def backward_hook(grad_output: torch.Tensor) -> None:
            rows = x.shape[0]
            d, a = (
                grad_output.float().reshape(rows, -1, grad_output.shape[-1]),
                x.float().reshape(rows, -1, x.shape[-1]),
            )
            self._add(module.weight, torch.einsum("bto,bti->boi", d, a))
            if module.bias is not None:
                self._add(module.bias, d.sum(1))

        output.register_hook(backward_hook)

    def _add(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if param.requires_grad:
            key = id(param)
            self._grads[key] = self._grads[key] + grad if key in self._grads else grad

    def _output_hook(self, grad: torch.Tensor) -> None:
        sq = torch.nan_to_num(grad.float()).pow(2).reshape(grad.shape[0], -1).sum(1)
        if self.keep_outputs:
            self._out_raw.append(torch.nan_to_num(grad.float()).reshape(grad.shape[0], -1))
        self._out_sq = sq if self._out_sq is None else self._out_sq + sq


class NaturalGradient:
    """The natural-gradient step as an optimizer: the adapter moves by the solve over the per-input gradients
    recorded since `zero_grad()`, the value head by `value_optimizer` (AdamW) on its own gradient.

    Use, per step: `zero_grad()`; `expect(inputs, turns)`; for each micro-batch, the forward pass inside
    `with optimizer.recording() as watch:` (calling `watch(outputs)` on the per-input outputs the loss is computed
    from) and `loss.backward()`; then `clip_grad_norm()` and, when that is finite, `step()`.
    The per-input gradients are taken after each backward pass, into one (inputs, P) buffer: at the next
    `recording()` or at `clip_grad_norm()`.

    Args:
        rows: the per-input gradient recorder over the adapter's parameters (`RowGradients`).
        value_optimizer: the AdamW over the adapter (group 0) and the value head; only the value head's gradient is
            kept for its step, the adapter's plain gradient is dropped.
        lr: `natural_step`, the move of each input's outputs per unit of its (per-turn) output gradient; the step
            is scaled by the minibatch's turn count. Annealed through `param_groups[0]["lr"]`, as AdamW's is.
        damping: `natural_damping` (see `natural_coefficients`).
        max_norm: the cap on the step's norm, and the value head's gradient clip.

    `grad_dtype` (float32; settable between steps) is the dtype G is held in from the next `expect()` on: bfloat16
    halves its memory (see the module docstring). Data-parallel steps keep float32 (G is gathered across ranks).
    """

    def __init__(self, rows: RowGradients, value_optimizer, lr: float, damping: float, max_norm: float):
        self.rows, self.value_optimizer = rows, value_optimizer
        self.grad_dtype = torch.float32
        self.params = rows.params
        self.param_groups = [{"params": self.params, "lr": lr}]
        self.value_params = [p for group in value_optimizer.param_groups[1:] for p in group["params"]]
        self.damping, self.max_norm = damping, max_norm
        self._grads: torch.Tensor | None = None  # (inputs, P) the step's per-input gradients G
        self._filled = 0  # rows of `_grads` taken so far
        self._targets: list[torch.Tensor] = []  # their output-gradient targets t, per micro-batch
        self._turns = 0  # the minibatch's turn count (the step's scale)
        self._held = 0  # how many of the last rows are held inputs (`expect`)
        self._pending = False  # a recorded forward whose gradients are not taken yet
        self._direction: torch.Tensor | None = None  # the solved step, between clip_grad_norm() and step()
        self._keys: torch.Tensor | None = None  # data-parallel: each row's input id, the same on every rank
        self._outputs: list[torch.Tensor] = []  # data-parallel: the rows' output gradients c_i, per micro-batch

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the recorded per-input gradients and every accumulated gradient (also after a skipped step)."""
        self.value_optimizer.zero_grad(set_to_none=set_to_none)
        self.rows.clear()
        self._grads, self._filled, self._targets, self._pending, self._direction = None, 0, [], False, None
        self._outputs = []

    def expect(self, inputs: int, turns: int, keys: torch.Tensor | None = None, held: int = 0) -> None:
        """The next step's minibatch: `inputs` distinct inputs (the rows of G), `turns` turns (the step's scale),
        and `held` inputs to hold (`llamagym.algos.holding`), recorded after the minibatch's, whose rows ask the step
        to leave their outputs as they are (`natural_coefficients`). One process only.

        Data-parallel (`keys` given): `inputs` are this rank's, `turns` the minibatch's over every rank, and `keys`
        (inputs,) each row's input id, numbered alike on every rank in the order the rows are recorded. The step is
        then solved over every rank's rows, an input met on several ranks merged into one row (see `_gathered`).
        """
        if held and keys is not None:
            raise ValueError("Held inputs (PPOConfig.hold_batches) are not supported data-parallel: set it to 0.")
        self.rows.clear()
        dtype = self.grad_dtype if keys is None else torch.float32
        self._grads = torch.empty(inputs + held, self.rows.width, device=self.params[0].device, dtype=dtype)
        self._filled, self._targets, self._turns, self._held = 0, [], turns, held
        self._keys, self._outputs = keys, []
        self.rows.keep_outputs = keys is not None

    @contextmanager
    def recording(self):
        """Record the per-input gradients of the forward pass run inside (and of its backward); yields `watch`."""
        self._take()
        with self.rows.recording():
            yield self.rows.watch
        self._pending = True

    @torch.no_grad()
    def clip_grad_norm(self) -> torch.Tensor:
        """Solve for the step and clip the value head's gradient; returns the step's norm before its cap, or the
        value head's gradient norm when that is not finite (the step is then to be skipped)."""
        self._take()
        grads, targets = self._grads[: self._filled], torch.cat(self._targets)
        if self._keys is not None:
            grads, targets = self._gathered(grads)
        self._grads, self._targets, self._outputs = None, [], []
        scale = self.param_groups[0]["lr"] * self._turns
        self._direction, norm = natural_direction(grads, targets, self.damping, scale, self.max_norm, self._held)
        value_norm = torch.nn.utils.clip_grad_norm_(self.value_params, self.max_norm)
        return norm if torch.isfinite(value_norm) else value_norm

    @torch.no_grad()
    def step(self) -> None:
        """Move the adapter by the step `clip_grad_norm()` solved for, and the value head by its AdamW step."""
        for p in self.params:
            p.grad = None  # the plain gradient, accumulated as well, is not used
        subtract_flat(self.params, self._direction)
        self._direction = None
        self.value_optimizer.step()

    def _take(self) -> None:
        """Take the per-input gradients of the last recorded forward and backward pass into the buffer."""
        if self._pending:
            targets = self.rows.take(out=self._grads[self._filled :])[1]
            self._targets.append(targets)
            if self._keys is not None:
                self._outputs.append(self.rows.outputs)
            self._filled += len(targets)
            self._pending = False

    def _gathered(self, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(G, t) over every rank's rows, exactly as one process would record them for the union of the ranks'
        turns: each rank's per-input gradients and output gradients are gathered, the rows of an input met on
        several ranks are summed (both are sums over the input's turns), and t_i = |c_i|^2 is taken after merging.

        Every rank then holds the same (G, t) and solves for the same step. Cost: every rank holds all ranks' rows
        (inputs x P floats), as a single process over the whole batch would.
        """
        width = max(o.shape[1] for o in self._outputs)
        width = int(distributed.reduce_number(width, "max"))  # outputs are padded at their end: rows align
        outputs = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1])) for o in self._outputs])
        all_grads = distributed.all_gather_cat(grads)[0]
        all_outputs = distributed.all_gather_cat(outputs)[0]
        keys = distributed.all_gather_cat(self._keys.to(grads.device))[0]
        distinct, inverse = torch.unique(keys, return_inverse=True)
        merged = grads.new_zeros(len(distinct), grads.shape[1]).index_add_(0, inverse, all_grads)
        merged_outputs = outputs.new_zeros(len(distinct), width).index_add_(0, inverse, all_outputs)
        return merged, merged_outputs.pow(2).sum(1)


PRODUCT_COLUMNS = 65536  # columns of a bfloat16 G cast to float32 at a time (a block of 160 inputs: 42 MB)


def natural_coefficients(gram: torch.Tensor, targets: torch.Tensor, damping: float, held: int = 0) -> torch.Tensor:
    """alpha solving (K + damping * mean(K_ii / t_i) * diag(t)) alpha = t (see the module docstring).

    Rows whose target or own gain is zero (a clipped or zero-advantage input) get alpha = 0. Solved in float64.
    The last `held` rows are held inputs (`llamagym.algos.holding`): their right-hand side is 0 instead of t_j, so
    the step is solved to leave their outputs where they are as closely as it fits the others' moves (t_j, the
    squared norm of the held output's direction, weighs each as one moved input; the gain is the moved rows' mean).

    Args:
        gram: (N, N) K = G G^T of the per-input loss gradients.
        targets: (N,) t_i = |d loss_i / d outputs_i|^2.
        damping: relative damping (> 0); larger is closer to a plain gradient step, smaller trusts K more.
        held: how many of the last rows are held.

    Example (damping 0.1): two inputs a step moves nearly alike, K = [[1, 0.9], [0.9, 1]], t = (1, 1). The first
    alone: alpha = 0.909, which moves it by K alpha = 0.909 and the second by 0.818. The second held: alpha =
    (2.75, -2.25), moving the first by 0.725 and the second by 0.225.
    """
    k, t = gram.double(), targets.double()
    alpha = torch.zeros_like(t)
    live = (t > 0) & (k.diagonal() > 0)
    moved = torch.ones_like(live)
    if held:
        moved[-held:] = False
    if not (live & moved).any():
        return alpha.to(targets.dtype)
    k, t_live, rhs = k[live][:, live], t[live], torch.where(moved, t, 0.0)[live]
    gain = (k.diagonal() / t_live)[moved[live]].mean()
    alpha[live] = torch.linalg.solve(k + damping * gain * torch.diag(t_live), rhs)
    return alpha.to(targets.dtype)


def natural_direction(
    grads: torch.Tensor, targets: torch.Tensor, damping: float, scale: float, max_norm: float, held: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, norm): the flat parameter step to *subtract*, `scale * G^T alpha` capped at `max_norm`, and its
    norm before the cap (non-finite when the solve failed; the caller then skips the step). The last `held` rows
    of `grads` are held inputs (`natural_coefficients`).

    `grads` in bfloat16 gives a float32 step: its products are taken in float32, a block of columns at a time."""
    if grads.dtype != torch.bfloat16:
        alpha = natural_coefficients(grads @ grads.T, targets, damping, held)
        step = grads.T @ alpha.to(grads.dtype) * scale
    else:
        blocks = [grads[:, i : i + PRODUCT_COLUMNS] for i in range(0, grads.shape[1], PRODUCT_COLUMNS)]
        gram = grads.new_zeros(grads.shape[0], grads.shape[0], dtype=torch.float32)
        for block in blocks:
            block = block.float()
            gram += block @ block.T
        alpha = natural_coefficients(gram, targets.float(), damping, held)
        step = torch.cat([block.float().T @ alpha for block in blocks]) * scale
    norm = step.norm()
    if norm > max_norm:  # a trust region: the linearisation holds for small parameter moves only
        step = step * (max_norm / norm)
    return step, norm


@torch.no_grad()
def subtract_flat(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """params -= flat, with `flat` laid out as the concatenation of the flattened params (as in `RowGradients`)."""
    offset = 0
    for p in params:
        p.sub_(flat[offset : offset + p.numel()].view_as(p).to(p.dtype))
        offset += p.numel()
