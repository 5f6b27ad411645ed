"""The frozen-layer cache: with LoRA on the top layers, repeated inputs skip the layers below, exactly."""

import contextlib

import pytest
import torch

from llamagym.algos.rollout import Episode, Turn, collate, collate_scored
from llamagym.models.frozen_cache import shared_prefix
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model

PROMPTS = [[257, 50, 51, 256, 259], [257, 52, 256, 258, 53, 256, 259], [257, 50, 51, 256, 259]]
CANDIDATES = [[[60, 61, 256], [70, 256]], [[80, 256], [81, 82, 83, 256], [84, 256]], [[60, 61, 256], [70, 256]]]


def twin_policies(tokenizer, lora_config, precision="fp32"):
    """The same top-layer adapter twice: with the cache, and without it."""
    policies = []
    for megabytes in (512, 0):
        torch.manual_seed(0)
        model = build_tiny_model(tokenizer, seed=0)  # 2 layers
        policies.append(Policy(model, lora_config, precision=precision, lora_layers=1, frozen_cache_mb=megabytes))
    return policies


def test_the_cache_is_on_only_when_lower_layers_are_frozen(tokenizer, lora_config):
    cached, plain = twin_policies(tokenizer, lora_config)
    assert cached.frozen_cache is not None and cached.frozen_cache.start == 1 and plain.frozen_cache is None
    assert Policy(build_tiny_model(tokenizer, seed=0), lora_config).frozen_cache is None  # every layer adapted


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_scores_values_and_gradients_match_the_plain_forward_and_repeats_hit_the_cache(
    tokenizer, lora_config, precision
):
    cached, plain = twin_policies(tokenizer, lora_config, precision)
    batch = collate_scored(PROMPTS, CANDIDATES, pad_token_id=256)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if precision == "fp32" else {"atol": 2e-2, "rtol": 2e-2}
    outs = []
    for policy in (cached, plain):
        out = policy.score(batch)
        finite = out.logprobs.isfinite()
        (out.logprobs[finite].sum() + out.values.sum()).backward()
        outs.append(out)
    assert cached.frozen_cache.misses == 2 and cached.frozen_cache.hits == 0  # rows 0 and 2: one input, run once
    torch.testing.assert_close(outs[0].logprobs, outs[1].logprobs, **tolerance)
    torch.testing.assert_close(outs[0].values, outs[1].values, **tolerance)
    for (name, a), (_, b) in zip(cached.named_parameters(), plain.named_parameters(), strict=True):
        if a.requires_grad:
            assert a.grad is not None and a.grad.abs().sum() > 0, name
            torch.testing.assert_close(a.grad, b.grad, **tolerance, msg=name)
    again = cached.score(batch)
    assert cached.frozen_cache.hits == 2 and cached.frozen_cache.misses == 2
    torch.testing.assert_close(again.logprobs, outs[0].logprobs.detach(), atol=0, rtol=0)


def test_generated_turns_match_and_the_reference_shares_the_cache(tokenizer, lora_config):
    cached, plain = twin_policies(tokenizer, lora_config)
    batch = collate([Turn([257, 50, 51, 259], [60, 61, 256]), Turn([257, 52, 259], [70, 256])], pad_token_id=256)
    for reference in (False, True):
        with contextlib.ExitStack() as stack:
            if reference:  # adapter off: the frozen layers are the same, so the cached states serve the reference
                stack.enter_context(cached.reference())
                stack.enter_context(plain.reference())
            a, b = cached(*batch, reference=reference), plain(*batch, reference=reference)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    assert cached.frozen_cache.misses == 2 and cached.frozen_cache.hits == 2


def test_memory_stays_within_the_budget(tokenizer, lora_config):
    cached, _ = twin_policies(tokenizer, lora_config)
    cache = cached.frozen_cache
    cache.max_bytes = 1  # room for one entry at a time (the newest is always kept)
    cached.score(collate_scored(PROMPTS[:2], CANDIDATES[:2], pad_token_id=256))
    assert len(cache.entries) == 1 and cache.size == next(iter(cache.entries.values())).numel() * 4


def test_each_entry_holds_its_own_memory_so_the_budget_counts_what_is_held(tokenizer, lora_config):
    cached, _ = twin_policies(tokenizer, lora_config)
    cached.score(collate_scored(PROMPTS[:2], CANDIDATES[:2], pad_token_id=256))  # rows of different lengths
    for state in cached.frozen_cache.entries.values():  # not views of the padded batch, which would stay alive
        assert state.untyped_storage().nbytes() == state.numel() * state.element_size()
    assert cached.frozen_cache.size == sum(s.untyped_storage().nbytes() for s in cached.frozen_cache.entries.values())


def test_the_agent_turns_the_cache_on_with_lora_layers_and_off_with_zero_megabytes(model, tokenizer, lora_config):
    from tests.test_agent import make_agent

    assert make_agent(model, tokenizer, lora_config, lora_layers=1).policy.frozen_cache is not None
    plain = build_tiny_model(tokenizer, seed=0)
    assert make_agent(plain, tokenizer, lora_config, lora_layers=1, frozen_cache_mb=0).policy.frozen_cache is None


def test_float32_context_is_the_plain_fp32_forward_and_restores_precision_and_cache(tokenizer, lora_config):
    cached, _ = twin_policies(tokenizer, lora_config, "bf16")
    _, plain32 = twin_policies(tokenizer, lora_config, "fp32")
    cache, batch = cached.frozen_cache, collate_scored(PROMPTS, CANDIDATES, pad_token_id=256)
    with torch.no_grad():
        low = cached.score(batch).logprobs
        with cached.float32():
            assert cached.precision == "fp32" and cached.frozen_cache is None
            exact = cached.score(batch).logprobs
        expected = plain32.score(batch).logprobs
    assert cached.precision == "bf16" and cached.frozen_cache is cache and cache.misses == 2  # the bf16 pass only
    torch.testing.assert_close(exact, expected, atol=0, rtol=0)  # the same computation, bit for bit
    assert not torch.equal(low, exact)  # bf16 rounding is what the context removes


def test_a_state_no_forward_used_in_the_last_round_is_dropped_when_the_next_begins(tokenizer, lora_config):
    cached, _ = twin_policies(tokenizer, lora_config)
    cache = cached.frozen_cache
    first, second = (collate([Turn(prompt, [60, 256])], pad_token_id=256) for prompt in PROMPTS[:2])
    with torch.no_grad():
        cached(*first)  # round 0: the first input
        cache.next_round()
        cached(*second)  # round 1: the second input only
        cache.next_round()  # the first was not used in round 1: dropped; the second was: kept
        assert len(cache.entries) == 1 and cache.size == next(iter(cache.entries.values())).numel() * 4
        cached(*second)
    assert cache.hits == 1 and cache.misses == 2
    cache.next_round()
    cache.next_round()
    assert not cache.entries and not cache.used and cache.size == 0


def test_a_state_is_kept_through_as_many_rounds_unused_as_asked(tokenizer, lora_config):
    cached, _ = twin_policies(tokenizer, lora_config)
    cache = cached.frozen_cache
    first, second = (collate([Turn(prompt, [60, 256])], pad_token_id=256) for prompt in PROMPTS[:2])
    with torch.no_grad():
        cached(*first)  # round 0
        cache.next_round(keep=3)
        cached(*second)  # round 1
        cache.next_round(keep=3)
        cache.next_round(keep=3)  # the first is unused in rounds 1 and 2, kept for a third
        assert len(cache.entries) == 2
        cached(*first)  # round 3: a hit
        assert cache.hits == 1 and cache.misses == 2
        cache.next_round(keep=3)
        cache.next_round(keep=3)  # the second, last used in round 1, is unused in rounds 2-4: dropped
    assert len(cache.entries) == 1 and cache.used[next(iter(cache.entries))] == 3


def test_each_update_starts_a_round_of_its_action_mode(tokenizer, lora_config, monkeypatch):
    from llamagym.algos.modes import MODES
    from tests.test_agent import make_agent

    agent = make_agent(build_tiny_model(tokenizer, seed=0), tokenizer, lora_config, lora_layers=1)
    kept = []
    monkeypatch.setattr(agent.policy.frozen_cache, "next_round", lambda keep=1: kept.append(keep))
    turn = Turn(PROMPTS[0], CANDIDATES[0][0], reward=1.0, candidates=CANDIDATES[0], choice=0, mode="score")
    agent.trainer.step([Episode([turn])])
    assert kept == [MODES["score"].cache_rounds] and MODES["score"].cache_rounds > MODES["generate"].cache_rounds


def test_each_update_starts_a_round_so_generated_inputs_do_not_pile_up(tokenizer, lora_config):
    from tests.envs import CountingEnv
    from tests.test_agent import make_agent, play

    agent = make_agent(build_tiny_model(tokenizer, seed=0), tokenizer, lora_config, lora_layers=1)
    cache = agent.policy.frozen_cache
    for update in range(1, 5):
        play(agent, CountingEnv(length=2), episodes=2)  # one update on freshly sampled replies
        assert cache.round == update and min(cache.used.values()) >= update - 1  # this update's inputs, the last's
    assert len(cache.entries) < cache.misses  # the earlier updates' inputs are gone


def test_shared_prefix_counts_the_first_tokens_every_row_sees_alike():
    ids = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [1, 2, 3, 4, 0]])
    mask2d = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert shared_prefix(ids, mask2d, None, [5, 5, 4]) == 3
    assert shared_prefix(ids[:1], mask2d[:1], None, [5]) == 0  # one row: nothing to share
    assert shared_prefix(ids[[0, 2]], mask2d[[0, 2]], None, [5, 4]) == 3  # each row keeps a token of its own
    assert shared_prefix(ids, mask2d, torch.tensor([[0, 1, 2, 3, 4]] * 2 + [[0, 1, 5, 6, 7]]), [5, 5, 4]) == 2
    packed = collate_scored([[1, 2, 3], [1, 2, 3]], [[[7], [8]], [[9]]], pad_token_id=0)  # equal prompts
    assert shared_prefix(packed.input_ids, packed.attention_mask, packed.position_ids, [5, 4]) == 3
    assert not packed.attention_mask[0, 0, 4, 3]  # candidate 2 does not see candidate 1, so neither is shared
    loose = packed.attention_mask.clone()
    loose[1, 0, 1, 3] = True  # row 1's second token looks ahead: only its first is shared
    assert shared_prefix(packed.input_ids, loose, packed.position_ids, [5, 4]) == 1


def adapted_tokens(policy) -> list[int]:
    """Tokens run through the adapted (top) layer by each forward, recorded by a hook."""
    seen = []
    layer = policy.causal_lm().get_decoder().layers[policy.frozen_cache.start]
    layer.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0] * args[0].shape[1]))
    return seen


def test_without_gradient_rows_run_their_shared_first_tokens_once_with_the_same_outputs(tokenizer, lora_config):
    cached, plain = twin_policies(tokenizer, lora_config)
    prompts = [[257, 50, 51, 52, 53, 256, 259, 40 + i] for i in range(4)]  # 7 shared tokens, then their own
    batch = collate_scored(prompts, [[[60, 61, 256], [70, 256]]] * 4, pad_token_id=256)
    seen = adapted_tokens(cached)
    with torch.no_grad():
        out, ref = cached.score(batch), plain.score(batch)
    assert cached.frozen_cache.share_prefix
    assert seen == [7, 4 * (batch.input_ids.shape[1] - 7)]  # the prefix once, then each row's rest
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.values, ref.values, atol=1e-5, rtol=1e-5)
    turns = [Turn(p, [60 + i, 256]) for i, p in enumerate(prompts)]  # a 2D mask: generated replies, right-padded
    turns[0] = Turn(prompts[0] + [30, 31], [60, 61, 62, 256])
    rows = collate(turns, pad_token_id=256)
    with torch.no_grad():
        mine = cached(rows.input_ids, rows.attention_mask, rows.response_mask, value_index=rows.value_index)
        theirs = plain(rows.input_ids, rows.attention_mask, rows.response_mask, value_index=rows.value_index)
    assert seen[-1] == 4 * (rows.input_ids.shape[1] - 7)
    torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_with_gradient_every_row_runs_whole_so_each_input_has_its_own_gradient(tokenizer, lora_config):
    cached, _ = twin_policies(tokenizer, lora_config)
    prompts = [[257, 50, 51, 52, 53, 256, 259, 40 + i] for i in range(4)]
    batch = collate_scored(prompts, [[[60, 61, 256], [70, 256]]] * 4, pad_token_id=256)
    seen = adapted_tokens(cached)
    cached.score(batch).values.sum().backward()
    assert seen == [4 * batch.input_ids.shape[1]]


def test_the_frozen_layers_run_new_rows_shared_first_tokens_once_with_gradient_or_not(tokenizer, lora_config):
    cached, plain = twin_policies(tokenizer, lora_config)
    prompts = [[257, 50, 51, 52, 53, 256, 259, 40 + i] for i in range(4)]  # 7 shared tokens, then their own
    rows = collate([Turn(p, [60 + i, 61, 256]) for i, p in enumerate(prompts)], pad_token_id=256)
    seen = []
    frozen = cached.causal_lm().get_decoder().layers[0]
    frozen.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0] * args[0].shape[1]))
    mine = cached(rows.input_ids, rows.attention_mask, rows.response_mask, value_index=rows.value_index)
    assert seen == [7, 4 * (rows.input_ids.shape[1] - 7)]  # the prefix once, then each row's rest
    with torch.no_grad():
        theirs = plain(rows.input_ids, rows.attention_mask, rows.response_mask, value_index=rows.value_index)
    torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
    mine.logprobs.sum().backward()  # the adapted layers above still give every row its own gradient
    adapter = [p for name, p in cached.model.named_parameters() if "lora_" in name]
    assert adapter and all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter)


def test_summed_gradients_run_shared_first_tokens_once_with_the_gradient_of_whole_rows(tokenizer, lora_config):
    cached, plain = twin_policies(tokenizer, lora_config)
    prompts = [[257, 50, 51, 52, 53, 256, 259, 40 + i] for i in range(4)]  # 7 shared tokens, then their own
    rows = collate([Turn(p, [60 + i, 61, 256]) for i, p in enumerate(prompts)], pad_token_id=256)
    seen = adapted_tokens(cached)
    weights = torch.linspace(-1, 1, rows.input_ids.shape[1])  # a loss that weighs every position differently
    grads = []
    for policy, scope in ((cached, cached.summed_gradients()), (plain, plain.summed_gradients())):
        with scope:
            out = policy(rows.input_ids, rows.attention_mask, rows.response_mask, value_index=rows.value_index)
        ((out.logprobs * weights).sum() + out.values.sum()).backward()
        grads.append([p.grad for name, p in policy.model.named_parameters() if "lora_" in name])
    assert seen == [7, 4 * (rows.input_ids.shape[1] - 7)]  # the prefix once, then each row's rest, with gradient
    for mine, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
    with cached.summed_gradients():  # the block ends: with gradient, rows run whole again
        assert cached.frozen_cache.summed
    assert not cached.frozen_cache.summed


@pytest.mark.parametrize("scored", [False, True], ids=["generate-adamw", "score-natural"])
def test_an_update_moves_the_adapter_alike_with_the_cache_and_its_shared_first_tokens(tokenizer, lora_config, scored):
    from llamagym.algos.rollout import Episode
    from llamagym.algos.trainer import PPOTrainer
    from llamagym.config import PPOConfig

    g = torch.Generator().manual_seed(0)
    system = [257, 50, 51, 52, 53, 256, 258]  # every prompt starts with it, as with a chat template's system prompt
    prompts = [system + torch.randint(3, 250, (2 + p,), generator=g).tolist() + [256, 259] for p in range(4)]
    candidates = [[40, 41, 256], [42, 256]]
    episodes = []
    for e in range(10):
        p, choice = e % 4, e % 2
        reply = candidates[choice] if scored else torch.randint(3, 250, (2 + e % 3,), generator=g).tolist()
        extra = {"candidates": candidates, "choice": choice} if scored else {}
        episodes.append(Episode([Turn(prompts[p], reply, float(p % 2) - 0.3 * choice, **extra)]))
    moved = []
    for policy in twin_policies(tokenizer, lora_config):
        before = [p.detach().clone() for p in policy.trainable_parameters()]
        trainer = PPOTrainer(policy, PPOConfig(seed=0), tokenizer.pad_token_id)
        for _ in range(2):
            trainer.step(episodes)
        moved.append(
            torch.cat([(p.detach() - b).flatten() for p, b in zip(policy.trainable_parameters(), before, strict=True)])
        )
    assert moved[0].norm() > 0
    torch.testing.assert_close(moved[0], moved[1], atol=1e-6, rtol=1e-4)
