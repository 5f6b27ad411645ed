import pytest
import torch

from llamagym.algos import ppo
from llamagym.algos.modes import MODES, ActionMode, mode_of
from llamagym.algos.rollout import Episode, Turn
from llamagym.algos.trainer import PPOTrainer, _loss_options, distinct_prompts, episode_groups
from llamagym.config import PPOConfig, ReplayConfig
from llamagym.models.policy import Policy
from llamagym.models.tiny_random import build_tiny_model


def make_episodes(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    episodes = []
    for e in range(n):
        turns = [
            Turn(
                torch.randint(0, 256, (4 + k,), generator=g).tolist(),
                torch.randint(0, 256, (2 + e,), generator=g).tolist(),
                float(e % 2),
            )
            for k in range(1 + e % 2)
        ]
        episodes.append(Episode(turns))
    return episodes


# plain clipped PPO with AdamW and an adaptive KL penalty: the machinery these tests pin (the defaults add natural
# steps and a trust region, tested in test_natural.py and test_trust_region.py)
PLAIN = {"natural_gradient": False, "max_kl": None, "kl_coef": 0.05, "adaptive_kl": True, "advantage_scale": "batch"}


def make_trainer(model, lora_config, tokenizer, precision="fp32", **overrides):
    config = PPOConfig(**{**PLAIN, "mini_batch_size": 2, "ppo_epochs": 2, "learning_rate": 1e-3, **overrides})
    return PPOTrainer(Policy(model, lora_config, precision=precision), config, tokenizer.pad_token_id)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_step_is_finite_moves_lora_and_value_head_and_leaves_base_bit_identical(
    model, lora_config, tokenizer, precision
):
    trainer = make_trainer(model, lora_config, tokenizer, precision)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    stats = trainer.step(make_episodes())
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    for name, param in trainer.policy.named_parameters():
        changed = not torch.equal(before[name], param)
        if "lora_" in name or name.startswith("value_head."):
            assert changed, f"{name} did not move"
        else:
            assert not changed, f"base parameter {name} moved"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_first_minibatch_ratio_is_exactly_one(model, lora_config, tokenizer, monkeypatch, precision):
    seen = []
    original = ppo.policy_loss

    def spy(logprobs, old_logprobs, advantages, mask, clip_coef, **options):
        seen.append((logprobs.detach().clone(), old_logprobs.clone(), mask.clone()))
        return original(logprobs, old_logprobs, advantages, mask, clip_coef, **options)

    monkeypatch.setattr(ppo, "policy_loss", spy)
    trainer = make_trainer(model, lora_config, tokenizer, precision, ppo_epochs=1, mini_batch_size=64)
    stats = trainer.step(make_episodes())
    logprobs, old_logprobs, mask = seen[0]
    assert torch.equal(logprobs[mask.bool()], old_logprobs[mask.bool()])
    assert stats["ppo/approx_kl"] == 0.0 and stats["ppo/clipfrac"] == 0.0


def test_tiny_target_kl_stops_after_one_minibatch_and_says_so(model, lora_config, tokenizer):
    trainer = make_trainer(model, lora_config, tokenizer, use_target_kl=True, target_kl=1e-9)
    stats = trainer.step(make_episodes())
    assert stats["ppo/early_stopped"] == 1.0 and stats["ppo/minibatches"] == 1.0


def test_without_target_kl_every_minibatch_runs(model, lora_config, tokenizer):
    trainer = make_trainer(model, lora_config, tokenizer, target_kl=1e-9)
    stats = trainer.step(make_episodes())
    assert stats["ppo/early_stopped"] == 0.0 and stats["ppo/minibatches"] == 6.0  # 6 turns / 2 x 2 epochs
    # every applied step marks the weights as changed (act-time caches go stale), and so does the value refit
    assert trainer.policy.version == 6 + 1


@pytest.mark.parametrize("truncated, expected", [(False, -1.0), (True, 0.0)])
def test_bootstrap_on_truncation_only(model, lora_config, tokenizer, truncated, expected):
    trainer = make_trainer(model, lora_config, tokenizer, gamma=1.0, lam=1.0)
    with torch.no_grad():
        trainer.policy.value_head.linear.bias.fill_(1.0)  # V(s) = 1 everywhere
    episode = Episode([Turn([1, 2, 3], [4, 5], reward=0.0)], truncated=truncated, bootstrap_prompt_ids=[1, 2, 6])
    advantages, returns, _ = trainer._advantages([episode], torch.zeros(1), torch.ones(1))
    assert advantages.tolist() == [expected]  # terminated: 0 - V = -1; truncated: 0 + V(next) - V = 0


def test_credit_reaches_earlier_turns_through_gae(model, lora_config, tokenizer):
    trainer = make_trainer(model, lora_config, tokenizer, gamma=1.0, lam=1.0)
    episode = Episode([Turn([1, 2], [3]), Turn([1, 2, 3, 4], [5], reward=1.0)])
    advantages, _, _ = trainer._advantages([episode], torch.tensor([0.0, 1.0]), torch.zeros(2))
    assert advantages.tolist() == [1.0, 1.0]  # the final reward is the first turn's too, not split


def test_policy_lam_decouples_the_advantages_from_the_value_targets(model, lora_config, tokenizer):
    # two turns, V = (0.5, 0.25), reward 1 at the end, gamma 1: deltas (-0.25, 0.75); the value head's targets are
    # GAE(lam) + V, the policy's advantages GAE(policy_lam)
    episode = Episode([Turn([1, 2], [3]), Turn([1, 2, 3, 4], [5], reward=1.0)])
    rewards, values = torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.25])
    trainer = make_trainer(model, lora_config, tokenizer, gamma=1.0, lam=1.0, policy_lam=0.0)
    advantages, returns, _ = trainer._advantages([episode], rewards, values)
    assert advantages.tolist() == [-0.25, 0.75]  # one-step TD errors (lambda 0)
    assert returns.tolist() == [1.0, 1.0]  # Monte-Carlo returns (lambda 1)
    trainer = make_trainer(model, lora_config, tokenizer, gamma=1.0, lam=0.5, policy_lam=None)
    advantages, returns, _ = trainer._advantages([episode], rewards, values)
    assert advantages.tolist() == [0.125, 0.75] and returns.tolist() == [0.625, 1.0]  # -0.25 + 0.5 x 0.75


def test_pool_tail_gives_a_repeated_reply_back_its_lam_advantage(model, lora_config, tokenizer):
    # the same two-turn episode twice (V = 0.5, 0.25; reward 1): each turn's (prompt, reply) group has a tail
    # (lambda 1 minus lambda 0: 0.5 + 0.25 at the first turn, 0 at the second) that is the same every time, so the
    # pooled advantages are the lambda-1 ones
    episode = Episode([Turn([1, 2], [3]), Turn([1, 2, 3, 4], [5], reward=1.0)])
    rewards, values = torch.tensor([0.0, 1.0] * 2), torch.tensor([0.5, 0.25] * 2)
    trainer = make_trainer(model, lora_config, tokenizer, gamma=1.0, lam=1.0, policy_lam=0.0, pool_tail=True)
    advantages, returns, stats = trainer._advantages([episode, episode], rewards, values)
    torch.testing.assert_close(advantages, torch.tensor([0.5, 0.75] * 2))
    assert returns.tolist() == [1.0] * 4
    assert stats["adv/tail_weight"] == 1.0


def test_turn_values_enter_the_old_values_and_a_truncated_episode_s_bootstrap(model, lora_config, tokenizer):
    # the head starts at 0, so before any refit V(s, t) is the turn value alone
    trainer = make_trainer(model, lora_config, tokenizer, turn_values=3, gamma=1.0, lam=1.0)
    trainer.turn_values.copy_(torch.tensor([0.0, 0.25, 0.5]))
    stats = trainer.step(make_episodes())  # two episodes of one turn, two of two
    assert stats["ppo/values_mean"] == pytest.approx((0 + 0 + 0.25 + 0 + 0 + 0.25) / 6)
    trainer = make_trainer(model, lora_config, tokenizer, turn_values=3, gamma=1.0, lam=1.0)  # its head at 0 again
    trainer.turn_values.copy_(torch.tensor([0.0, 0.25, 0.5]))
    truncated = Episode([Turn([1, 2], [3]), Turn([1, 2, 3, 4], [5], reward=1.0)], True, [1, 2, 3, 4, 5, 6])
    values = torch.tensor([0.0, 0.25])
    _, returns, _ = trainer._advantages([truncated], torch.tensor([0.0, 1.0]), values)
    assert returns.tolist() == [1.5, 1.5]  # rewards 0 + 1, then V(next state) = 0 + turn value [2] = 0.5


def test_turn_values_learn_what_the_prompt_does_not_show(model, lora_config, tokenizer):
    # every turn has the same prompt and reply, and its return is 0.5 at the first turn and 1 at the second
    # (gamma 0.5): no head of the prompt can tell them apart, the turn values can
    episodes = [Episode([Turn([1, 2], [3]), Turn([1, 2], [3], reward=1.0)]) for _ in range(4)]
    plain = make_trainer(model, lora_config, tokenizer, gamma=0.5, lam=1.0).step(episodes)
    trainer = make_trainer(model, lora_config, tokenizer, gamma=0.5, lam=1.0, turn_values=2)
    stats = trainer.step(episodes)
    assert abs(plain["ppo/value_refit_ev"]) < 1e-6 and stats["ppo/value_refit_ev"] > 0.1
    assert trainer.turn_values[1] > trainer.turn_values[0]
    assert stats["ppo/turn_value_range"] == pytest.approx(float(trainer.turn_values[1] - trainer.turn_values[0]))
    restored = make_trainer(model, lora_config, tokenizer, gamma=0.5, lam=1.0, turn_values=2)
    restored.load_state_dict(trainer.state_dict())
    assert torch.equal(restored.turn_values, trainer.turn_values)


def test_nan_reward_skips_the_step_and_keeps_weights(model, lora_config, tokenizer):
    trainer = make_trainer(model, lora_config, tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    episodes = make_episodes()
    episodes[0].turns[0].reward = float("nan")
    stats = trainer.step(episodes)
    assert stats["ppo/skipped_steps"] > 0
    assert all(torch.equal(before[n], p) for n, p in trainer.policy.named_parameters())


def test_the_first_skip_warns_once_with_the_batch_stats(model, lora_config, tokenizer, caplog):
    trainer = make_trainer(model, lora_config, tokenizer)
    episodes = make_episodes()
    episodes[0].turns[0].reward = float("nan")
    with caplog.at_level("WARNING", logger="llamagym.algos.trainer"):
        stats = trainer.step(episodes)
    warnings = [r.getMessage() for r in caplog.records if "skipped an optimizer step" in r.getMessage()]
    assert stats["ppo/skipped_steps"] == 6 and len(warnings) == 1  # 2 epochs x 3 minibatches, one warning
    assert "non-finite loss" in warnings[0] and "mean reward nan" in warnings[0] and "kl/ref" in warnings[0]


def test_repeated_skips_stop_the_run_but_an_applied_step_resets_the_count(model, lora_config, tokenizer):
    trainer = make_trainer(model, lora_config, tokenizer, ppo_epochs=1, max_skipped_steps=4)
    bad = make_episodes()
    bad[0].turns[0].reward = float("inf")
    trainer.step(bad)  # 3 minibatches, 3 skipped steps in a row: below the limit
    trainer.step(make_episodes())  # finite: steps are applied again
    assert trainer.consecutive_skips == 0 and trainer.skipped_steps == 3
    trainer.step(bad)
    with pytest.raises(RuntimeError, match=r"4 optimizer steps in a row were skipped.*learning rate"):
        trainer.step(bad)


def test_adaptive_kl_coefficient_moves_after_an_update(model, lora_config, tokenizer):
    trainer = make_trainer(model, lora_config, tokenizer, kl_estimator="k3", kl_target=1e-6, kl_horizon=10)
    start = trainer.kl_controller.value
    stats = trainer.step(make_episodes())
    assert stats["kl/ref"] > 0 and stats["kl/coef"] > start


def test_freed_memory_goes_back_to_the_system_after_every_update_on_a_cpu(model, lora_config, tokenizer, monkeypatch):
    from llamagym.models import host_memory

    calls = []
    monkeypatch.setattr(host_memory, "release_freed_memory", lambda: calls.append(1) or True)
    trainer = make_trainer(model, lora_config, tokenizer)
    for update in (1, 2):
        stats = trainer.step(make_episodes())
        assert len(calls) == 2 * update  # before the steps and after them; far below the bound within them
        assert stats["memory/trims"] == 0
    trim = host_memory._malloc_trim()
    monkeypatch.undo()
    assert host_memory.release_freed_memory() is (trim is not None)  # glibc (Linux) has it; elsewhere a no-op
    monkeypatch.setattr(host_memory, "_malloc_trim", lambda: None)
    assert host_memory.release_freed_memory() is False


def test_freed_memory_within_an_update_is_trimmed_past_the_bound(model, lora_config, tokenizer, monkeypatch):
    from llamagym.models import host_memory

    resident, trims = [1000 * 2**20], []
    monkeypatch.setattr(host_memory, "resident_bytes", lambda: resident[0])

    def trim():
        trims.append(resident[0])
        resident[0] = 1100 * 2**20  # what the trim gave back; the rest is live
        return True

    monkeypatch.setattr(host_memory, "release_freed_memory", trim)
    bound = host_memory.FreedMemoryBound(slack_mib=256)
    assert not bound.check() and bound.mark == 1000 * 2**20  # the first check marks where it starts
    resident[0] = 1256 * 2**20
    assert not bound.check() and trims == []  # at the bound: kept
    resident[0] = 1257 * 2**20
    assert bound.check() and trims == [1257 * 2**20] and bound.trims == 1 and bound.mark is None
    resident[0] = 1400 * 2**20  # the next step faults its working set in again: marked, not trimmed
    assert not bound.check() and bound.mark == 1400 * 2**20
    resident[0] = 1600 * 2**20
    assert not bound.check() and bound.trims == 1
    monkeypatch.setattr(host_memory, "release_freed_memory", lambda: False)  # no malloc_trim here: nothing counted
    resident[0] = 2000 * 2**20
    assert not bound.check() and bound.trims == 1
    monkeypatch.setattr(host_memory, "release_freed_memory", trim)
    with pytest.raises(ValueError, match="slack_mib"):
        host_memory.FreedMemoryBound(slack_mib=0)

    # the trainer checks after each optimizer step: an update whose steps leave freed memory past the bound trims
    trainer = make_trainer(model, lora_config, tokenizer, mini_batch_size=2)
    trainer.freed_memory = host_memory.FreedMemoryBound(slack_mib=1)
    grow = trainer.freed_memory.check

    def check():
        resident[0] += 2 * 2**20  # each step leaves 2 MiB behind
        return grow()

    monkeypatch.setattr(trainer.freed_memory, "check", check)
    trims.clear()
    stats = trainer.step(make_episodes())
    steps = stats["ppo/minibatches"]  # marked at the first, trimmed at the second, marked at the third, ...
    assert steps >= 4 and stats["memory/trims"] == steps // 2
    assert len(trims) == stats["memory/trims"] + 2  # and before the steps and after the update


def test_sft_replay_runs_after_the_update_and_reports_its_loss(model, lora_config, tokenizer):
    trainer = PPOTrainer(
        Policy(model, lora_config),
        PPOConfig(mini_batch_size=4),
        tokenizer.pad_token_id,
        ReplayConfig(sft_steps=2, sft_batch_size=3),
    )
    stats = trainer.step(make_episodes())
    assert stats["sft/buffer_size"] == 1 and stats["sft/loss"] > 0


def test_state_dict_round_trip_restores_counters_and_controller(model, lora_config, tokenizer):
    trainer = make_trainer(model, lora_config, tokenizer)
    trainer.step(make_episodes())
    state = trainer.state_dict()
    other = make_trainer(model, lora_config, tokenizer)
    other.load_state_dict(state)
    assert other.num_updates == 1 and other.kl_controller.value == trainer.kl_controller.value
    assert torch.equal(other.generator.get_state(), trainer.generator.get_state())


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "dr_grpo"])
def test_micro_batches_accumulate_to_the_same_update_as_one_minibatch(tokenizer, lora_config, aggregation):
    from llamagym.models.tiny_random import build_tiny_model

    results, options = [], {"loss_aggregation": aggregation}
    for micro in (None, 1):
        torch.manual_seed(0)
        trainer = PPOTrainer(
            Policy(build_tiny_model(tokenizer), lora_config),
            PPOConfig(mini_batch_size=6, micro_batch_size=micro, ppo_epochs=1, learning_rate=1e-2, **options),
            tokenizer.pad_token_id,
        )
        stats = trainer.step(make_episodes())
        results.append((stats, [p.detach().clone() for p in trainer.policy.trainable_parameters()]))
    (whole, whole_params), (micro, micro_params) = results
    for key in ("ppo/policy_loss", "ppo/value_loss", "ppo/approx_kl", "ppo/grad_norm"):
        assert whole[key] == pytest.approx(micro[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(whole_params, micro_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_value_head_has_its_own_learning_rate(model, lora_config, tokenizer):
    trainer = make_trainer(model, lora_config, tokenizer, learning_rate=1e-4, value_learning_rate=3e-3)
    groups = trainer.optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-4, 3e-3]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in trainer.policy.value_head.parameters()}


def test_annealing_scales_the_adapter_step_to_zero_and_keeps_the_value_head_rate(model, lora_config, tokenizer, caplog):
    trainer = make_trainer(model, lora_config, tokenizer, value_learning_rate=3e-3, anneal_updates=2)
    rates, scales = [], []
    for _ in range(2):
        scales.append(trainer.step(make_episodes())["ppo/step_scale"])
        rates.append([g["lr"] for g in trainer.optimizer.param_groups])
    assert scales == [1.0, 0.5] and rates == [[1e-3, 3e-3], [5e-4, 3e-3]]
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    with caplog.at_level("WARNING"):
        assert trainer.step(make_episodes())["ppo/step_scale"] == 0.0
        trainer.step(make_episodes())
    assert len([r for r in caplog.records if "anneal_updates=2 is reached" in r.getMessage()]) == 1
    for name, param in trainer.policy.named_parameters():
        assert torch.equal(before[name], param) != name.startswith("value_head."), name


def repeated_episodes(scored: bool):
    """7 one-turn episodes over 3 distinct inputs in no symmetric order, with different rewards (and choices)."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    episodes = []
    for i, which in enumerate([0, 0, 1, 2, 2, 2, 1]):
        prompt = prompts[which]
        if scored:
            candidates, choice = [[20, 21], [22]], (i // 2) % 2
            turn = Turn(prompt, candidates[choice], float(i), candidates=candidates, choice=choice)
        else:
            turn = Turn(prompt, [30, 31], float(i))
        episodes.append(Episode([turn]))
    return episodes


@pytest.mark.parametrize("scored", [False, True])
def test_repeated_inputs_are_computed_once_with_the_same_update(model, lora_config, tokenizer, monkeypatch, scored):
    def run(share: bool):
        if not share:  # every turn its own input: the action modes' `distinct_inputs` numbers them 0..N-1
            monkeypatch.setattr(ActionMode, "distinct_inputs", lambda self, turns: torch.arange(len(turns)))
        torch.manual_seed(0)  # the same LoRA and value-head initialisation in both runs
        # every turn alike: weighing repeated inputs down (scoring's default) reads the very ids this test hides
        trainer = make_trainer(
            build_tiny_model(tokenizer, seed=0), lora_config, tokenizer, mini_batch_size=7, repeated_input_power=0.0
        )
        rows = []
        forward = trainer.policy.score if scored else trainer.policy.forward
        counting = lambda batch, *a, **k: rows.append(batch.input_ids.shape[0]) or forward(batch, *a, **k)  # noqa: E731
        if scored:
            monkeypatch.setattr(trainer.policy, "score", counting)
        else:
            monkeypatch.setattr(
                trainer.policy, "forward", lambda *a, **k: rows.append(a[0].shape[0]) or forward(*a, **k)
            )
        stats = trainer.step(repeated_episodes(scored))
        monkeypatch.undo()
        return stats, sum(rows), dict(trainer.policy.named_parameters())

    shared_stats, shared_rows, shared = run(share=True)
    alone_stats, alone_rows, alone = run(share=False)
    assert shared_stats["ppo/distinct_turns"] == 3 and alone_stats["ppo/distinct_turns"] == 7
    assert shared_rows == 4 * 3 and alone_rows == 4 * 7  # old, reference, 2 epochs: 3 inputs each instead of 7 rows
    for name, param in shared.items():
        torch.testing.assert_close(param, alone[name], rtol=1e-5, atol=1e-6, msg=name)
    for key in ("ppo/policy_loss", "ppo/value_loss", "ppo/entropy"):
        assert shared_stats[key] == pytest.approx(alone_stats[key], rel=1e-4, abs=1e-6)


# ---- advantage estimators and loss options in the trainer ----------------------------------------------------------


def test_episode_groups_are_the_first_prompt_unless_a_group_is_given():
    a, b = Turn([1, 2], [3]), Turn([4, 5], [6])
    episodes = [Episode([a]), Episode([b]), Episode([a, b]), Episode([a], group="x"), Episode([b], group="x")]
    assert episode_groups(episodes).tolist() == [0, 1, 0, 2, 2]


def test_step_keys_are_prompts_whatever_the_reply():
    turns = [Turn([1, 2], [3]), Turn([1, 2], [4]), Turn([5], [3])]
    assert distinct_prompts(turns).tolist() == [0, 0, 1]
    assert MODES["generate"].distinct_inputs(turns).tolist() == [0, 1, 2]  # the model inputs differ by reply
    candidates = [[3], [4]]
    scored = [Turn([1, 2], [3], candidates=candidates, choice=0), Turn([1, 2], [4], candidates=candidates, choice=1)]
    scored.append(Turn([1, 2], [3], candidates=[[3]], choice=0))
    assert MODES["score"].distinct_inputs(scored).tolist() == [0, 0, 1]  # whichever was chosen: the candidates count


def test_the_turns_action_mode_collates_them_and_mixed_modes_are_refused():
    generated, scored = Turn([1, 2], [3]), Turn([1, 2], [3], candidates=[[3], [4, 5]], choice=0)
    assert mode_of([generated]) is MODES["generate"] and mode_of([scored]) is MODES["score"]
    assert MODES["generate"].action_mask(MODES["generate"].collate([generated], 0)).tolist() == [[0.0, 0.0, 1.0]]
    batch = MODES["score"].collate([scored], 0)
    assert MODES["score"].action_mask(batch).tolist() == [[1.0]]  # one choice per turn
    assert MODES["score"].empty_distributions(batch).shape == (1, 2)
    with pytest.raises(ValueError, match="mixes generated and scored turns"):
        mode_of([generated, scored])


def test_grpo_in_the_trainer_groups_episodes_by_first_prompt_and_is_not_whitened(model, lora_config, tokenizer):
    trainer = make_trainer(model, lora_config, tokenizer, advantage="grpo", group_std_scaling=False)
    same, other = [1, 2, 3], [7, 8]
    episodes = [Episode([Turn(same, [4], r)]) for r in (1.0, 0.0, 0.0, 1.0)] + [Episode([Turn(other, [4], 5.0)])]
    advantages, returns, stats = trainer._advantages(episodes, torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0]), torch.zeros(5))
    assert advantages.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0]  # the lone episode is a group of one
    assert stats == {"adv/groups": 2.0, "adv/zero_variance_groups": 1.0}
    result = trainer.step(episodes)
    assert result["adv/zero_variance_groups"] == 1.0 and result["adv/raw_std"] == pytest.approx(0.4472, abs=1e-4)
    assert "adv/equal_returns" not in result


def test_critic_free_estimators_skip_the_bootstrap_forward(model, lora_config, tokenizer, monkeypatch):
    trainer = make_trainer(model, lora_config, tokenizer, advantage="rloo")
    monkeypatch.setattr(trainer.policy, "forward", lambda *a, **k: pytest.fail("no forward pass expected"))
    episode = Episode([Turn([1, 2, 3], [4, 5], reward=1.0)], truncated=True, bootstrap_prompt_ids=[1, 2, 6])
    advantages, returns, _ = trainer._advantages([episode, episode], torch.tensor([1.0, 0.0]), torch.zeros(2))
    assert advantages.tolist() == [1.0, -1.0] and returns.tolist() == [1.0, 0.0]  # no bootstrap added


@pytest.mark.parametrize("center", ["batch", "state"])
def test_advantage_center_passes_the_turns_states_to_the_scaling(model, lora_config, tokenizer, monkeypatch, center):
    seen = []
    scale = ppo.scale_advantages
    monkeypatch.setattr(ppo, "scale_advantages", lambda *a: seen.append(a[3] if len(a) > 3 else None) or scale(*a))
    trainer = make_trainer(model, lora_config, tokenizer, advantage_center=center)
    same, other = [1, 2, 3], [7, 8]
    episodes = [Episode([Turn(same, [4], r)]) for r in (1.0, 0.0, 0.0)] + [Episode([Turn(other, [4], 5.0)])]
    stats = trainer.step(episodes)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    expected = None if center == "batch" else [0, 0, 0, 1]  # the prompts, numbered by first appearance
    assert [None if s is None else s.tolist() for s in seen] == [expected]


@pytest.mark.parametrize("advantage", ["gae", "grpo", "rloo", "rebn", "gigpo"])
def test_every_estimator_runs_a_finite_update_that_moves_the_adapter(model, lora_config, tokenizer, advantage):
    trainer = make_trainer(model, lora_config, tokenizer, advantage=advantage, clip_coef_high=0.28)
    before = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    episodes = make_episodes(6)
    for episode in episodes:
        episode.group = 0  # one group: rewards 0 and 1 alternate
    stats = trainer.step(episodes)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.trainable_parameters(), strict=True))
    assert (advantage == "gae") == ("adv/zero_variance_groups" not in stats)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({}, {}),
        ({"clip_coef_high": 0.28}, {"clip_coef_high": 0.28}),
        ({"loss_aggregation": "sequence_mean"}, {"aggregation": "sequence_mean", "max_length": 3}),
        ({"loss_aggregation": "dr_grpo"}, {"aggregation": "dr_grpo", "max_length": 3}),
    ],
)
def test_policy_loss_options_default_to_none_and_dr_grpo_uses_the_longest_reply(overrides, expected):
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    assert _loss_options(PPOConfig(**overrides), mask) == expected


@pytest.mark.parametrize(
    "field, value, accepted",
    [
        ("clip_coef_high", 0.0, "None or a number > 0"),
        ("loss_aggregation", "sum", "one of token_mean, sequence_mean, dr_grpo"),
        ("group_std_scaling", 1, "True or False"),
        ("advantage", "ppo", "one of gae, grpo, rloo, rebn, gigpo"),
        ("cap_cut_replies", 0, "True or False"),
        ("advantage_center", "prompt", "one of batch, state"),
    ],
)
def test_new_config_fields_are_validated_with_a_message_naming_them(field, value, accepted):
    with pytest.raises(ValueError, match=rf"`{field}` should be {accepted}.*Received {value!r}"):
        PPOConfig(**{field: value})


@pytest.mark.parametrize("kind", ["invalid", "cut", "valid", "cut, cap_cut_replies=False"])
def test_an_invalid_or_cut_reply_is_never_reinforced_by_what_it_won(model, lora_config, tokenizer, kind, caplog):
    # two one-turn episodes with the same prompt: the first reply won (+1), the valid reply lost (0). An invalid
    # reply's fallback won, and a reply cut at max_new_tokens was read before it ended: the advantage of either is
    # capped at 0, so its log-prob may not rise; a valid, finished winner's does, and so does a cut one when cut
    # replies are meant (cap_cut_replies=False)
    prompt, bad, good = [5, 6, 7, 8], [40, 41], [50, 51]

    def logprob(trainer, response):
        batch = mode_of([Turn(prompt, response)]).collate([Turn(prompt, response)], tokenizer.pad_token_id, "cpu")
        with torch.no_grad():
            return float(trainer.policy(batch.input_ids, batch.attention_mask, batch.response_mask).logprobs.sum())

    torch.manual_seed(0)
    capped = kind != "cut, cap_cut_replies=False"
    trainer = make_trainer(
        model, lora_config, tokenizer, kl_coef=0.0, adaptive_kl=False, mini_batch_size=2, cap_cut_replies=capped
    )
    before = logprob(trainer, bad)
    first = Turn(prompt, bad, 1.0, valid=kind != "invalid", finished=not kind.startswith("cut"))
    stats = trainer.step([Episode([first]), Episode([Turn(prompt, good, 0.0)])])
    assert (stats["adv/invalid_capped"], stats["adv/cut_capped"]) == {
        "invalid": (0.5, 0.0),
        "cut": (0.0, 0.5),
        "valid": (0.0, 0.0),
        "cut, cap_cut_replies=False": (0.0, 0.0),
    }[kind]
    assert (-1 if kind in ("invalid", "cut") else 1) * (logprob(trainer, bad) - before) > 0
    assert "cut at max_new_tokens" not in caplog.text  # half the batch cut: no warning


def test_a_batch_of_cut_replies_warns_once_naming_the_remedies(model, lora_config, tokenizer, caplog):
    trainer = make_trainer(model, lora_config, tokenizer, kl_coef=0.0, adaptive_kl=False, mini_batch_size=2)
    batch = [Episode([Turn([5, 6, 7, 8], [40 + i, 41], float(i % 2), finished=False)]) for i in range(4)]
    for _ in range(2):
        trainer.step(batch)
    warnings = [r.getMessage() for r in caplog.records if "cut at max_new_tokens" in r.getMessage()]
    assert len(warnings) == 1
    assert "100% of this batch's replies" in warnings[0]
    assert "Raise max_new_tokens" in warnings[0] and "PPOConfig(cap_cut_replies=False)" in warnings[0]
