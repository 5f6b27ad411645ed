import os

import pytest
import torch
from peft import LoraConfig

from llamagym.algos.rollout import Turn, collate
from llamagym.models.policy import Policy


@pytest.fixture
def batch(tokenizer):
    turns = [Turn([257, 50, 51, 256, 259], [60, 61, 256]), Turn([257, 52, 256, 258, 70, 256, 259], [62, 256])]
    return collate(turns, tokenizer.pad_token_id)


def test_reference_logits_equal_base_model_and_differ_outside(model, lora_config, batch):
    policy = Policy(model, lora_config)
    base = policy.model.get_base_model()
    with policy.reference():
        ref = policy(*batch, reference=True).logprobs
        with torch.no_grad():
            base_logits = base(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lora = policy(*batch).logprobs
    manual = torch.log_softmax(base_logits.float(), -1)[:, :-1].gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.response_mask[:, 1:].bool()
    torch.testing.assert_close(ref[:, 1:][mask], manual[mask])
    assert not torch.allclose(lora, ref)


def test_reference_without_peft_adapter_is_the_untouched_base(tokenizer, batch):
    from llamagym.models.tiny_random import build_tiny_model

    untouched = build_tiny_model(tokenizer, seed=0)
    policy = Policy(build_tiny_model(tokenizer, seed=0), LoraConfig(r=4, target_modules=["q_proj"], bias="none"))
    with policy.reference(), torch.no_grad():
        ref = policy(*batch, reference=True).logprobs
        base = Policy(untouched, full_finetune=True)(*batch).logprobs
    torch.testing.assert_close(ref, base)


def test_only_lora_and_value_head_parameters_are_trainable(model, lora_config):
    policy = Policy(model, lora_config)
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n or n.startswith("value_head.") for n in names)
    assert any(n.startswith("value_head.") for n in names)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_value_head_is_fp32_with_one_value_per_row(model, lora_config, batch, precision):
    policy = Policy(model, lora_config, precision=precision)
    out = policy(*batch)
    assert policy.value_head.linear.weight.dtype == torch.float32
    assert out.values.shape == (2,) and out.values.dtype == torch.float32
    assert out.logprobs.shape == batch.input_ids.shape


def test_logprobs_are_zero_outside_the_response(model, lora_config, batch):
    out = Policy(model, lora_config)(*batch, with_entropy=True)
    outside = batch.response_mask == 0
    assert torch.all(out.logprobs[outside] == 0) and torch.all(out.entropy[outside] == 0)
    assert torch.all(out.logprobs[~outside] < 0)


@pytest.mark.parametrize("full_finetune", [False, True])
def test_logits_in_chunks_give_the_same_log_probs_entropy_scores_and_gradients(
    tokenizer, lora_config, batch, monkeypatch, full_finetune
):
    from llamagym.algos.rollout import collate_scored
    from llamagym.models import policy as policy_module
    from llamagym.models.tiny_random import build_tiny_model

    policy = Policy(build_tiny_model(tokenizer, seed=0), None if full_finetune else lora_config, full_finetune)
    policy.temperature = 0.7
    scored = collate_scored([[257, 50, 51, 259], [257, 52, 259]], [[[60, 61, 256], [70, 256]], [[80, 256]]], 256)
    runs = []
    for rows in (policy_module.LOGIT_ROWS, 2):  # 5 response positions and 7 candidate tokens: several chunks of 2
        monkeypatch.setattr(policy_module, "LOGIT_ROWS", rows)
        policy.zero_grad(set_to_none=True)
        out, score = policy(*batch, with_entropy=True), policy.score(scored)
        finite = score.logprobs.isfinite()
        (out.logprobs.sum() + out.entropy.sum() + score.logprobs[finite].sum()).backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        runs.append((out.logprobs.detach(), out.entropy.detach(), score.logprobs.detach(), grads))
    (*whole, whole_grads), (*chunked, chunked_grads) = runs
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert whole_grads.keys() == chunked_grads.keys() and any("lora_" in n or "embed" in n for n in whole_grads)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(
            grad, chunked_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_bf16_autocast_keeps_weights_fp32_and_log_probs_close_to_fp32(model, lora_config, batch):
    policy = Policy(model, lora_config, precision="bf16")
    low = policy(*batch).logprobs
    policy.precision = "fp32"
    full = policy(*batch).logprobs
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    assert low.dtype == torch.float32 and (low - full).abs().max() < 0.1


def test_unknown_precision_is_refused(model):
    with pytest.raises(ValueError, match="precision"):
        Policy(model, precision="fp8")


def test_bias_other_than_none_is_refused(model):
    with pytest.raises(ValueError, match="bias"):
        Policy(model, LoraConfig(r=4, target_modules=["q_proj"], bias="all"))


def test_full_finetune_keeps_a_frozen_reference_copy(model, batch):
    policy = Policy(model, full_finetune=True)
    assert policy.reference_model is not None
    assert not any(p.requires_grad for p in policy.reference_model.parameters())


def test_save_then_load_round_trips_adapter_and_value_head(tokenizer, lora_config, batch, tmp_path):
    from llamagym.models.tiny_random import build_tiny_model

    policy = Policy(build_tiny_model(tokenizer), lora_config)
    with torch.no_grad():
        policy.value_head.linear.weight.normal_()
    before = policy(*batch)
    policy.save(tmp_path)
    fresh = Policy(
        build_tiny_model(tokenizer),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias="none", lora_dropout=0.0),
    )
    assert not torch.allclose(fresh(*batch).logprobs, before.logprobs)
    fresh.load(tmp_path)
    after = fresh(*batch)
    torch.testing.assert_close(after.logprobs, before.logprobs)
    torch.testing.assert_close(after.values, before.values)


def test_lora_layers_adapts_only_the_top_layers(model):
    policy = Policy(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], bias="none"), lora_layers=1)
    adapted = {n.split(".layers.")[1].split(".")[0] for n, p in policy.named_parameters() if "lora_" in n}
    assert adapted == {"1"}  # the tiny model has layers 0 and 1
    with pytest.raises(ValueError, match="lora_layers"):
        Policy(model, LoraConfig(r=4, target_modules=["q_proj"], bias="none"), lora_layers=3)


def test_wrapping_a_model_in_lora_prints_no_deprecation_warning(model, recwarn):
    import warnings

    warnings.simplefilter("always")
    Policy(model)
    assert not [w for w in recwarn if "is_gradient_checkpointing" in str(w.message)]


def test_a_bf16_policy_on_a_cpu_caps_onednn_cache_unless_the_user_set_one(tokenizer, lora_config, monkeypatch):
    from llamagym.models import host_memory
    from llamagym.models.tiny_random import build_tiny_model

    environ = {k: v for k, v in os.environ.items() if k not in host_memory.ONEDNN_CACHE_VARIABLES}
    monkeypatch.setattr(os, "environ", environ)
    Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision="fp32")
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in environ  # fp32: its products kept no such cache (23rd session)
    Policy(build_tiny_model(tokenizer, seed=0), lora_config, precision="bf16")
    assert environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(host_memory.ONEDNN_CACHE_CAPACITY) == "16"
    environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "512"  # the user's setting wins, under either of its names
    assert host_memory.bound_onednn_cache() is False and environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
    del environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    environ["DNNL_PRIMITIVE_CACHE_CAPACITY"] = "64"
    assert host_memory.bound_onednn_cache() is False and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in environ
