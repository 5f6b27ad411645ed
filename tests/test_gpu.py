"""The GPU path on one CUDA device: bf16 updates, CPU-equal generation, scoring and log-barrier, 4-bit QLoRA,
checkpointing, and two suite games trained through the user's loop in both action modes.

Every test here skips without CUDA (CI has none); run them on a GPU machine with `pytest tests/test_gpu.py`. The
4-bit test also needs bitsandbytes (`pip install -r requirements/linux.txt`). Models are the tiny random Llama,
so nothing is downloaded.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llamagym.algos.rollout import collate_scored
from llamagym.algos.trainer import PPOTrainer
from llamagym.config import PPOConfig
from llamagym.models.loading import load_model_and_tokenizer
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model
from tests.test_update_pinned import episodes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22]]
CANDIDATES = [[[40, 41], [42]], [[43], [44, 45, 46]], [[47], [48], [49]]]


def policy_on(device: str, tokenizer, lora_config, precision: str = "fp32", **options) -> Policy:
    torch.manual_seed(0)
    return Policy(build_tiny_model(tokenizer, seed=0).to(device), lora_config, precision=precision, **options)


def trained(policy: Policy, tokenizer, scored: bool, updates: int = 1, config: PPOConfig | None = None) -> dict:
    """The update's stats, after `updates` fixed-seed updates."""
    trainer = PPOTrainer(policy, config or PPOConfig(seed=0), tokenizer.pad_token_id)
    for seed in range(updates):
        stats = trainer.step(episodes(scored, seed=seed))
    return stats


@pytest.mark.parametrize("scored", [True, False], ids=["score-natural", "generate-adamw"])
def test_a_bf16_update_on_cuda_is_finite_and_moves_only_lora_and_the_value_head(tokenizer, lora_config, scored):
    policy = policy_on("cuda", tokenizer, lora_config, precision="bf16")
    assert policy.precision == "bf16" and policy.value_head.linear.weight.dtype == torch.float32
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    stats = trained(policy, tokenizer, scored)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in stats.items() if k.startswith("ppo/"))
    assert stats.get("ppo/skipped_steps", 0) == 0
    moved = {name for name, p in policy.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all("lora_" in name or name.startswith("value_head.") for name in moved)
    assert any("lora_" in name for name in moved)


def test_a_barrier_relative_to_the_reference_updates_on_cuda_as_on_the_cpu(tokenizer, lora_config):
    """The hinge's floor is a share of the reference's (adapter-off) probabilities, scored under `policy.reference()`
    beside the policy's own: both on the policy's device, and the update the CPU's."""
    config = PPOConfig(seed=0, barrier=0.5, barrier_floor=0.99, barrier_relative=True)
    stats = {}
    for device in ("cpu", "cuda"):
        stats[device] = trained(policy_on(device, tokenizer, lora_config), tokenizer, True, config=config)
    assert stats["cuda"]["ppo/barrier"] != 0  # the fixture's adapter starts away from the reference: the hinge acts
    for key in ("ppo/barrier", "ppo/surrogate", "ppo/value_loss"):
        assert stats["cuda"][key] == pytest.approx(stats["cpu"][key], rel=1e-3, abs=1e-6), key


def test_batched_scoring_on_cuda_matches_the_cpu(tokenizer, lora_config):
    out = {}
    for device in ("cpu", "cuda"):
        policy = policy_on(device, tokenizer, lora_config)
        with torch.no_grad():
            batch = collate_scored(PROMPTS, CANDIDATES, pad_token_id=tokenizer.pad_token_id, device=device)
            out[device] = policy.score(batch)
    torch.testing.assert_close(out["cuda"].logprobs.cpu(), out["cpu"].logprobs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["cuda"].values.cpu(), out["cpu"].values, rtol=1e-4, atol=1e-4)


def test_batched_greedy_generation_on_cuda_matches_the_cpu(tokenizer, lora_config):
    replies, scores = {}, {}
    for device in ("cpu", "cuda"):
        policy = policy_on(device, tokenizer, lora_config)
        ids = torch.tensor(PROMPTS, device=device)
        out = policy.generate(
            ids,
            torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=None,
        )
        replies[device] = out.sequences.cpu()
        scores[device] = torch.stack(out.scores, dim=1).cpu()
    assert replies["cuda"].shape == (len(PROMPTS), len(PROMPTS[0]) + 8)
    assert torch.equal(replies["cuda"], replies["cpu"])
    torch.testing.assert_close(scores["cuda"], scores["cpu"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("scored", [True, False], ids=["score-natural", "generate-adamw"])
def test_gradient_checkpointing_on_cuda_gives_the_same_update_with_less_memory(tokenizer, lora_config, scored):
    params, peaks = {}, {}
    for checkpointed in (False, True):
        policy = policy_on("cuda", tokenizer, lora_config, gradient_checkpointing=checkpointed)
        trained(policy, tokenizer, scored, updates=2)
        params[checkpointed] = [p.detach().clone() for p in policy.trainable_parameters()]
        policy = Policy(
            build_tiny_model(tokenizer, seed=0, hidden_size=256).cuda(),
            precision="fp32",
            gradient_checkpointing=checkpointed,
        )
        ids = torch.randint(3, 250, (8, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        response = torch.zeros_like(ids)
        response[:, 256:] = 1
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = policy(ids, torch.ones_like(ids), response, value_index=torch.full((8,), 255, device="cuda"))
        (out.logprobs.sum() + out.values.sum()).backward()
        torch.cuda.synchronize()
        peaks[checkpointed] = torch.cuda.max_memory_allocated() - start
        del policy, out
    for a, b in zip(params[True], params[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert peaks[True] < 0.8 * peaks[False], peaks


def test_a_4bit_tiny_model_loads_and_takes_an_update(tmp_path, tokenizer):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    build_tiny_model(tokenizer, seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = load_model_and_tokenizer(str(tmp_path), device="cuda", quantization="4bit")
    assert getattr(model, "is_loaded_in_4bit", False)
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized  # the attention and MLP projections are 4-bit
    packed = [m.weight.detach().clone() for m in quantized]
    policy = Policy(model, precision="auto", gradient_checkpointing=True)  # the registry's LoRA for a Llama
    assert policy.value_head.linear.weight.dtype == torch.float32
    assert policy.causal_lm().get_decoder().norm.weight.dtype == torch.float32  # prepared for k-bit training
    before = {name: p.detach().clone() for name, p in policy.named_parameters() if p.requires_grad}
    stats = trained(policy, tokenizer, scored=True)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in stats.items() if k.startswith("ppo/"))
    after = dict(policy.named_parameters())
    assert any(not torch.equal(after[name], p) for name, p in before.items() if "lora_" in name)
    assert all(torch.equal(m.weight, w) for m, w in zip(quantized, packed, strict=True))  # the base stays put


def test_suite_games_train_on_cuda_in_both_modes(tmp_path):
    """The user's loop on the GPU (`learning_suite.py --quick --device cuda`, two games of different shapes):
    acting, acting's memory handed to the update, the trust region and the evaluations, which unit tests on the CPU
    cannot show keep to one device."""
    root = Path(__file__).resolve().parents[1]
    games = ["guess_number", "tictactoe"]
    cmd = [sys.executable, "benchmarks/learning_suite.py", "--quick", "--device", "cuda", "--output", str(tmp_path)]
    cmd += ["--games", ",".join(games)]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r.get("error") for r in runs] == [None] * len(runs), [r.get("error") for r in runs]
    assert {(r["game"], r["mode"]) for r in runs} == {(g, m) for g in games for m in ("score", "generate")}
    seen = [(r["game"], r["mode"], r["updates"], r["device"]) for r in runs]
    assert all(r["updates"] > 0 and r["device"] == torch.cuda.get_device_name() for r in runs), seen
