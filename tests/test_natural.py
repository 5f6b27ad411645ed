"""Natural-gradient steps: per-input gradients from hooks, the function-space solve, and the trainer's step."""

import pytest
import torch

from llamagym.algos.natural_gradient import (
    PRODUCT_COLUMNS,
    NaturalGradient,
    RowGradients,
    natural_coefficients,
    natural_direction,
    subtract_flat,
)
from llamagym.algos.rollout import Episode, Turn, collate, collate_scored
from llamagym.algos.trainer import PPOTrainer
from llamagym.config import PPOConfig
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model

PROMPTS = [[257, 50, 51, 256, 259], [257, 52, 256, 258, 53, 256, 259], [257, 54, 256, 259]]
CANDIDATES = [[[60, 61, 256], [70, 256]], [[80, 256], [81, 82, 83, 256], [84, 256]], [[60, 256], [61, 256]]]


def flat_grad(loss, params):
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params, strict=True)]
    return torch.cat([g.flatten() for g in grads])


def row_loss(out, weights):
    """A loss that mixes candidate log-probs and values, row by row (finite entries only)."""
    logprobs = out.logprobs.masked_fill(~torch.isfinite(out.logprobs), 0.0)
    return (logprobs * weights[:, : logprobs.shape[1]]).sum(-1) + (out.values - 0.5) ** 2


@pytest.mark.parametrize("mode, into_buffer", [("score", False), ("generate", False), ("score", True)])
def test_hooked_per_row_gradients_equal_one_backward_per_row(model, lora_config, mode, into_buffer):
    policy = Policy(model, lora_config, precision="fp32")  # an identity of the maths: bf16 rounding would blur it
    with torch.no_grad():
        policy.value_head.linear.weight.normal_()
    params = policy.trainable_parameters()
    rows = RowGradients(policy, params)
    weights = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))

    def forward():
        if mode == "score":
            return policy.score(collate_scored(PROMPTS, CANDIDATES, pad_token_id=256))
        turns = [Turn(p, c[0]) for p, c in zip(PROMPTS, CANDIDATES, strict=True)]
        return policy(*collate(turns, pad_token_id=256))

    expected = torch.stack([flat_grad(loss, params) for loss in row_loss(forward(), weights)])  # not recorded
    with rows.recording():
        out = forward()
        rows.watch(out.logprobs, out.values)
    row_loss(out, weights).sum().backward()
    buffer = torch.full((5, rows.width), 7.0)
    grads, targets = rows.take(out=buffer[1:4]) if into_buffer else rows.take()
    torch.testing.assert_close(grads, expected, rtol=1e-4, atol=1e-6)
    if into_buffer:  # written in place, the rest of the buffer untouched
        assert grads.data_ptr() == buffer[1].data_ptr() and (buffer[[0, 4]] == 7).all()
    # the plain gradient is still accumulated as usual, and equals the sum of the rows
    plain = torch.cat([p.grad.flatten() for p in params])
    # summed in another order than autograd's: float32 rounding of gradients of order 1 reaches a few 1e-6
    torch.testing.assert_close(grads.sum(0), plain, rtol=1e-4, atol=2e-5)
    # targets: |d loss_i / d outputs_i|^2 (the -inf candidates of row 0 have zero gradient)
    finite = torch.isfinite(out.logprobs)
    expected_t = (weights[:, : out.logprobs.shape[1]] * finite).pow(2).sum(-1) + (2 * (out.values - 0.5)).pow(2)
    torch.testing.assert_close(targets, expected_t.detach(), rtol=1e-5, atol=1e-6)


def test_natural_gradient_optimizer_steps_by_the_solve_over_micro_batches_and_zero_grad_forgets():
    torch.manual_seed(0)
    body, head = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    adamw = torch.optim.AdamW([{"params": list(body.parameters())}, {"params": list(head.parameters())}], lr=0.1)
    params = list(body.parameters())
    optimizer = NaturalGradient(RowGradients(body, params), adamw, lr=0.5, damping=0.1, max_norm=10.0)
    x = torch.randn(4, 3)

    def losses(rows, watch=None):
        out = body(rows)
        if watch is not None:
            watch(out)
        return (out * torch.tensor([1.0, -2.0])).sum(-1) + head(out.detach()).squeeze(-1) ** 2

    expected = torch.stack([flat_grad(loss, params) for loss in losses(x)])  # one per input, not recorded
    before = [p.detach().clone() for p in (*params, *head.parameters())]
    optimizer.zero_grad()
    optimizer.expect(inputs=4, turns=4)
    for part in (x[:3], x[3:]):  # two micro-batches fill one buffer
        with optimizer.recording() as watch:
            loss = losses(part, watch).sum()
        loss.backward()
    norm = optimizer.clip_grad_norm()
    step, expected_norm = natural_direction(expected, torch.full((4,), 5.0), 0.1, 0.5 * 4, 10.0)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=1e-6)
    optimizer.step()
    moved = torch.cat([(b - p.detach()).flatten() for b, p in zip(before[:2], params, strict=True)])
    torch.testing.assert_close(moved, step, rtol=1e-5, atol=1e-6)  # the adapter moved by the solve alone
    # the value head by its AdamW step
    assert all(not torch.equal(b, p) for b, p in zip(before[2:], head.parameters(), strict=True))
    optimizer.zero_grad()
    assert all(p.grad is None for p in (*params, *head.parameters()))
    with optimizer.recording() as watch:
        losses(x, watch).sum().backward()
    optimizer.zero_grad()  # a skipped step: what was recorded is forgotten
    with pytest.raises(RuntimeError, match="before a recorded forward"):
        optimizer.rows.take()


def test_natural_coefficients_golden_values_and_dead_rows():
    gram = torch.tensor([[4.0, 2.0, 0.0], [2.0, 3.0, 0.0], [0.0, 0.0, 0.0]])
    targets = torch.tensor([1.0, 2.0, 5.0])  # row 2 has no gradient: alpha 0
    alpha = natural_coefficients(gram, targets, damping=0.5)
    # gain = mean(4/1, 3/2) = 2.75; (K + 0.5 * 2.75 * diag(1, 2)) alpha = (1, 2)
    system = torch.tensor([[5.375, 2.0], [2.0, 5.75]], dtype=torch.float64)
    expected = torch.linalg.solve(system, torch.tensor([1.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(alpha, torch.tensor([*expected.tolist(), 0.0]))
    assert torch.equal(natural_coefficients(torch.zeros(2, 2), torch.zeros(2), 0.1), torch.zeros(2))


def test_near_collinear_inputs_each_move_their_own_way():
    """Two inputs whose gradients are nearly parallel: a plain step moves both the same way, the natural step
    moves each as its own loss asks (the failure it exists to fix)."""
    g = torch.tensor([[1.0, 0.0, 0.05], [1.0, 0.05, 0.0]])  # per-input gradients of (loss_i = c_i * f_i)
    c = torch.tensor([1.0, -0.5])  # input 0 wants f down, input 1 wants f up
    plain_change = g @ (-(g.T @ torch.ones(2)))
    assert (plain_change < 0).all()  # the plain step pushes both inputs' losses the same way
    jac = g / c[:, None]  # d f_i / d theta
    alpha = natural_coefficients(g @ g.T, c**2, damping=1e-6)
    step = -(g.T @ alpha)
    torch.testing.assert_close(jac @ step, -c, rtol=1e-3, atol=1e-4)  # f_i moves by -c_i: both ways at once


def test_trainer_natural_step_moves_lora_and_value_head_only_and_decreases_the_loss(model, lora_config, tokenizer):
    rewards = [1.0, -1.0, -1.0]
    episodes = [
        Episode([Turn(p, cands[0], reward, candidates=cands, choice=0)])
        for p, cands, reward in zip(PROMPTS, CANDIDATES, rewards, strict=True)
    ]
    config = PPOConfig(
        natural_gradient=True, mini_batch_size=64, micro_batch_size=2, ppo_epochs=1, kl_coef=0.0, adaptive_kl=False
    )
    policy = Policy(model, lora_config, precision="fp32")  # bf16 rounding can flip a tiny move
    trainer = PPOTrainer(policy, config, tokenizer.pad_token_id)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    batch = collate_scored(PROMPTS, CANDIDATES, pad_token_id=256)
    old = policy.score(batch).logprobs[:, 0].detach()
    stats = trainer.step(episodes)
    assert stats["ppo/minibatches"] == 1 and torch.isfinite(torch.tensor(stats["ppo/grad_norm"]))
    for name, param in policy.named_parameters():
        changed = not torch.equal(before[name], param)
        assert changed == ("lora_" in name or name.startswith("value_head.")), name
    new = policy.score(batch).logprobs[:, 0].detach()
    advantages = torch.tensor(rewards)
    # the policy loss fell: the chosen actions moved the way their advantages say, on the whole (how each input
    # moves depends on the random LoRA init, which peft draws in an order that varies with Python's hash seed)
    assert float(((new - old) * advantages).sum()) > 0


def test_annealed_natural_step_leaves_the_adapter_once_the_schedule_ends(model, lora_config, tokenizer):
    config = PPOConfig(
        natural_gradient=True, mini_batch_size=64, ppo_epochs=1, kl_coef=0.0, adaptive_kl=False, anneal_updates=1
    )
    policy = Policy(model, lora_config)
    trainer = PPOTrainer(policy, config, tokenizer.pad_token_id)
    episodes = [
        Episode([Turn(p, c[0], r, candidates=c, choice=0)])
        for p, c, r in zip(PROMPTS, CANDIDATES, [1.0, -1.0, -1.0], strict=True)
    ]
    moved = []
    for _ in range(2):
        before = [p.detach().clone() for p in trainer.lm_params]
        trainer.step(episodes)
        moved.append(any(not torch.equal(b, p) for b, p in zip(before, trainer.lm_params, strict=True)))
    assert moved == [True, False]


def test_natural_gradient_refuses_parameters_outside_linear_layers_with_a_message(model, tokenizer):
    policy = Policy(model, full_finetune=True)  # embeddings and norms are trainable too
    with pytest.raises(ValueError, match=r"nn\.Linear layer[\s\S]*natural_gradient=False"):
        PPOTrainer(policy, PPOConfig(natural_gradient=True), tokenizer.pad_token_id)


def test_natural_trainer_skips_a_non_finite_step_and_leaves_the_weights(model, lora_config, tokenizer):
    config = PPOConfig(natural_gradient=True, mini_batch_size=64, ppo_epochs=1, kl_coef=0.0, adaptive_kl=False)
    policy = Policy(model, lora_config)
    trainer = PPOTrainer(policy, config, tokenizer.pad_token_id)
    rewards = [1.0, 0.0, float("nan")]
    episodes = [
        Episode([Turn(p, c[0], r, candidates=c, choice=0)])
        for p, c, r in zip(PROMPTS, CANDIDATES, rewards, strict=True)
    ]
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    stats = trainer.step(episodes)
    assert stats["ppo/skipped_steps"] >= 1
    assert all(torch.equal(before[n], p) for n, p in policy.named_parameters())


def test_natural_direction_is_capped_and_subtract_flat_lays_out_params_in_order():
    grads = torch.tensor([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]])
    step, norm = natural_direction(grads, torch.tensor([9.0, 16.0]), damping=1e-9, scale=1.0, max_norm=1.0)
    # K = diag(9, 16), alpha = 1 each: G^T alpha = (3, 4, 0), norm 5, capped to 1
    torch.testing.assert_close(norm, torch.tensor(5.0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(step, torch.tensor([0.6, 0.8, 0.0]), rtol=1e-6, atol=1e-6)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1, 1))]
    subtract_flat(params, torch.tensor([1.0, 2.0, 3.0]))
    assert params[0].tolist() == [-1.0, -2.0] and params[1].tolist() == [[-3.0]]


def test_automatic_natural_gradient_is_on_for_lora_and_off_for_full_fine_tuning(model, lora_config, tokenizer):
    lora = PPOTrainer(Policy(model, lora_config), PPOConfig(natural_gradient=None), tokenizer.pad_token_id)
    fresh = build_tiny_model(tokenizer, seed=0)  # get_peft_model wrapped the first one in place
    full = PPOTrainer(Policy(fresh, full_finetune=True), PPOConfig(natural_gradient=None), tokenizer.pad_token_id)
    assert lora.natural is not None and full.natural is None
    assert lora.policy.value_head.detach_input and not full.policy.value_head.detach_input


def test_sft_replay_steps_work_beside_natural_gradient_steps(model, lora_config, tokenizer):
    from llamagym.config import ReplayConfig

    config = PPOConfig(natural_gradient=True, mini_batch_size=None, ppo_epochs=1)
    trainer = PPOTrainer(Policy(model, lora_config), config, tokenizer.pad_token_id, ReplayConfig(sft_steps=1))
    episodes = [
        Episode([Turn(p, c[0], float(i == 0), candidates=c, choice=0)])
        for i, (p, c) in enumerate(zip(PROMPTS, CANDIDATES, strict=True))
    ]
    stats = trainer.step(episodes)
    assert stats["sft/loss"] > 0 and stats["ppo/minibatches"] == 1


def test_natural_direction_of_bfloat16_grads_is_the_float32_step_of_their_rounded_values():
    torch.manual_seed(0)
    grads = torch.randn(5, 2 * PRODUCT_COLUMNS + 7).to(torch.bfloat16)  # three blocks, the last a short one
    targets = torch.rand(5) + 0.5
    step, norm = natural_direction(grads, targets, damping=0.1, scale=0.01, max_norm=1e9)
    expected, expected_norm = natural_direction(grads.double(), targets.double(), 0.1, 0.01, 1e9)
    assert step.dtype == torch.float32 and step.shape == (grads.shape[1],)
    torch.testing.assert_close(step, expected.float(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(norm, expected_norm.float(), rtol=1e-5, atol=1e-7)


def test_natural_gradient_holds_its_per_input_gradients_in_grad_dtype():
    torch.manual_seed(0)
    body, head = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    adamw = torch.optim.AdamW([{"params": list(body.parameters())}, {"params": list(head.parameters())}], lr=0.1)
    x = torch.randn(4, 3)
    moves = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = list(body.parameters())
        before = [p.detach().clone() for p in params]
        optimizer = NaturalGradient(RowGradients(body, params), adamw, lr=0.5, damping=0.1, max_norm=10.0)
        optimizer.grad_dtype = dtype
        optimizer.zero_grad()
        optimizer.expect(inputs=4, turns=4)
        assert optimizer._grads.dtype == dtype
        with optimizer.recording() as watch:
            out = body(x)
            watch(out)
            (out * torch.tensor([1.0, -2.0])).sum().backward()
        assert torch.isfinite(optimizer.clip_grad_norm())
        optimizer.step()
        moves[dtype] = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, params, strict=True)])
        with torch.no_grad():
            for b, p in zip(before, params, strict=True):
                p.copy_(b)
    # bfloat16 rounds G's entries only (8 bits of mantissa): the step is float32's to within about 1%
    torch.testing.assert_close(moves[torch.bfloat16], moves[torch.float32], rtol=2e-2, atol=2e-3)
