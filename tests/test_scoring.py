"""Scoring mode: the policy is a softmax over the candidates' length-normalised log-likelihoods."""

import pytest
import torch

from llamagym.algos import ppo
from llamagym.algos.modes import MODES, ScoreMode
from llamagym.algos.rollout import Episode, Turn, collate, collate_scored
from llamagym.algos.trainer import PPOTrainer
from llamagym.config import PPOConfig
from llamagym.models.policy import Policy
from tests.envs import YesNoAgent, watch_old_outputs

PROMPTS = [[257, 50, 51, 256, 259], [257, 52, 256, 258, 53, 256, 259]]
CANDIDATES = [[[60, 61, 256], [70, 256]], [[80, 256], [81, 82, 83, 256], [84, 256]]]


def choose(actor, prompts, candidates, greedy=False):
    """The score mode's choice (an index) for each prompt."""
    return [c.choice for c in MODES["score"].choose(actor, prompts, candidates, greedy)]


def scores(actor):
    """The score mode's memory: each distinct input's log-probs over its candidates."""
    return {key: scored.logprobs for key, scored in actor.memory(MODES["score"]).items()}


def manual_scores(policy, prompt, candidates):
    batch = collate([Turn(prompt, c) for c in candidates], pad_token_id=256)
    logprobs = policy(*batch).logprobs
    return torch.stack([logprobs[i].sum() / len(c) for i, c in enumerate(candidates)])


def test_probabilities_over_candidates_of_different_lengths_sum_to_one_and_match_separate_rows(model, lora_config):
    policy = Policy(model, lora_config)
    out = policy.score(collate_scored(PROMPTS, CANDIDATES, pad_token_id=256))
    torch.testing.assert_close(out.logprobs.exp().sum(-1), torch.ones(2))
    assert out.logprobs[0, 2] == float("-inf")  # row 0 has two candidates only
    for i, (prompt, candidates) in enumerate(zip(PROMPTS, CANDIDATES, strict=True)):
        expected = torch.log_softmax(manual_scores(policy, prompt, candidates), -1)
        torch.testing.assert_close(out.logprobs[i, : len(candidates)], expected)


def test_value_in_scoring_mode_is_read_at_the_last_prompt_token(model, lora_config):
    policy = Policy(model, lora_config)
    with torch.no_grad():
        policy.value_head.linear.weight.normal_()
    scored = policy.score(collate_scored(PROMPTS, CANDIDATES, pad_token_id=256)).values
    plain = policy(*collate([Turn(p, [256]) for p in PROMPTS], pad_token_id=256)).values
    torch.testing.assert_close(scored, plain)


def test_greedy_choice_is_the_highest_likelihood_candidate(model, tokenizer, lora_config):
    from llamagym.agent.chat import ChatFormatter
    from llamagym.agent.choosing import Actor

    policy = Policy(model, lora_config)
    actor = Actor(policy, ChatFormatter(tokenizer), 256, {256}, {"max_new_tokens": 4, "temperature": 1.0})
    choices = choose(actor, PROMPTS, CANDIDATES, greedy=True)
    expected = [int(manual_scores(policy, p, c).argmax()) for p, c in zip(PROMPTS, CANDIDATES, strict=True)]
    assert choices == expected


def test_scored_turns_train_with_ratio_exactly_one_on_the_first_minibatch(model, lora_config, monkeypatch):
    seen = []
    original = ppo.policy_loss

    def spy(logprobs, old_logprobs, advantages, mask, clip_coef):
        seen.append((logprobs.detach().clone(), old_logprobs.clone()))
        return original(logprobs, old_logprobs, advantages, mask, clip_coef)

    monkeypatch.setattr(ppo, "policy_loss", spy)
    trainer = PPOTrainer(Policy(model, lora_config), PPOConfig(ppo_epochs=2, mini_batch_size=2), 256)
    episodes = [
        Episode([Turn(p, c[1], reward=float(i), candidates=c, choice=1)])
        for i, (p, c) in enumerate(zip(PROMPTS, CANDIDATES, strict=True))
    ]
    before = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    stats = trainer.step(episodes)
    assert torch.equal(seen[0][0], seen[0][1]) and seen[0][0].shape == (2, 1)
    assert stats["ppo/approx_kl"] >= 0 and stats["ppo/minibatches"] == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.trainable_parameters(), strict=True))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_reusing_the_shared_prefix_cache_equals_the_uncached_forward(model, lora_config, precision):
    from llamagym.models.prefill import shared_prefix

    prompts = [[257, 50, 51, 52, 256, 258, 60, 256, 259], [257, 50, 51, 52, 256, 258, 61, 62, 63, 256, 259]]
    candidates = [CANDIDATES[0], CANDIDATES[1]]
    policy = Policy(model, lora_config, precision=precision)
    batch = collate_scored(prompts, candidates, pad_token_id=256)
    prefix = shared_prefix(prompts)
    assert prefix == 6
    with torch.no_grad():
        plain, cached = policy.score(batch), policy.score(batch, prefix=prefix)
    finite = plain.logprobs.isfinite()
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if precision == "fp32" else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(cached.logprobs[finite], plain.logprobs[finite], **tolerance)
    torch.testing.assert_close(cached.values, plain.values, **tolerance)


def test_shared_prefix_leaves_every_prompt_its_last_token():
    from llamagym.models.prefill import shared_prefix

    assert shared_prefix([[1, 2, 3], [1, 2, 3]]) == 2
    assert shared_prefix([[1, 2, 3], [1, 9, 3]]) == 1
    assert shared_prefix([[5], [5, 6]]) == 0


def test_a_repeated_input_is_scored_once_per_policy_version(model, tokenizer, lora_config, monkeypatch):
    from llamagym.agent.chat import ChatFormatter
    from llamagym.agent.choosing import Actor

    policy = Policy(model, lora_config)
    actor = Actor(policy, ChatFormatter(tokenizer), 256, {256}, {"max_new_tokens": 4, "temperature": 1.0})
    scored_rows, score = [], policy.score
    monkeypatch.setattr(
        policy, "score", lambda batch, **k: scored_rows.append(len(batch.input_ids)) or score(batch, **k)
    )
    prompts, candidates = [PROMPTS[0], PROMPTS[1], PROMPTS[0]], [CANDIDATES[0], CANDIDATES[1], CANDIDATES[0]]
    torch.manual_seed(0)
    sampled = [choose(actor, prompts, candidates) for _ in range(200)]
    assert scored_rows == [2]  # two distinct inputs, scored once for all 200 steps
    expected = [manual_scores(policy, p, c).softmax(-1) for p, c in zip(PROMPTS, CANDIDATES, strict=True)]
    for slot, which in enumerate([0, 1, 0]):  # each env samples its own action from its state's distribution
        counts = torch.bincount(torch.tensor([step[slot] for step in sampled]), minlength=len(CANDIDATES[which]))
        torch.testing.assert_close(counts / 200, expected[which].detach(), atol=0.12, rtol=0)
    assert choose(actor, prompts, candidates, greedy=True) == [int(e.argmax()) for e in (*expected, expected[0])]
    policy.version += 1  # the weights changed (an optimizer step or a load): the distributions are scored again
    choose(actor, prompts, candidates)
    assert scored_rows == [2, 2]


def test_token_chunks_cut_in_order_within_the_budget():
    from llamagym.algos.modes.score import token_chunks

    assert token_chunks([3, 4, 2, 9, 1], size=lambda n: n, budget=7) == [[3, 4], [2], [9], [1]]
    assert token_chunks([], size=len, budget=5) == []
    # at least `least` items per chunk, whatever their size (the trainer's forwards without gradient)
    assert token_chunks([3, 4, 2, 9, 1], size=lambda n: n, budget=7, least=2) == [[3, 4], [2, 9], [1]]


def test_scoring_within_a_token_budget_gives_the_same_distributions(model, tokenizer, lora_config, monkeypatch):
    from llamagym.agent.chat import ChatFormatter
    from llamagym.agent.choosing import Actor

    policy = Policy(model, lora_config, precision="fp32")
    actor = Actor(policy, ChatFormatter(tokenizer), 256, {256}, {"max_new_tokens": 4, "temperature": 1.0})
    actor.reuse_prefix = False
    greedy = choose(actor, PROMPTS, CANDIDATES, greedy=True)
    whole = [scores(actor)[(tuple(p), tuple(map(tuple, c)))] for p, c in zip(PROMPTS, CANDIDATES, strict=True)]
    scored_rows, score = [], policy.score
    monkeypatch.setattr(
        policy, "score", lambda batch, **k: scored_rows.append(len(batch.input_ids)) or score(batch, **k)
    )
    policy.version += 1
    actor.score_tokens = 1  # one input per forward
    assert choose(actor, PROMPTS, CANDIDATES, greedy=True) == greedy and scored_rows == [1] * len(PROMPTS)
    for (p, c), expected in zip(zip(PROMPTS, CANDIDATES, strict=True), whole, strict=True):
        torch.testing.assert_close(scores(actor)[(tuple(p), tuple(map(tuple, c)))], expected, atol=1e-5, rtol=0)


def test_an_update_takes_the_old_outputs_acting_computed_and_runs_only_the_inputs_it_lacks(
    model, tokenizer, lora_config, monkeypatch
):
    config = PPOConfig(batch_size=2, min_batch_turns=0, seed=0)
    agent = YesNoAgent(model, tokenizer, "cpu", ppo_config=config, lora_config=lora_config, precision="fp32")
    compared, rows_run = watch_old_outputs(monkeypatch)
    for observations in ([0, 1], [0, 2]):
        for observation in observations:
            agent.act(observation)
            agent.assign_reward(float(observation))
        if observations[-1] == 2:  # the input of the last turn is forgotten (as an evicted or older one would be)
            turn = agent.episode.turns[-1]
            del agent.actor.memory(MODES["score"])[ScoreMode.key(turn.prompt_ids, turn.candidates)]
            rows_run.clear()
        stats = agent.terminate_episode()
    assert "ppo/policy_loss" in stats
    ((recalled, fresh, used),) = compared
    assert recalled.known.tolist() == [True, True, True, False] and rows_run[0] == 1  # only the forgotten input ran
    for old, new in zip(fresh, used, strict=True):  # log-probs, values, distributions, the value head's inputs
        torch.testing.assert_close(new, old, atol=1e-5, rtol=0)


def test_the_value_refit_makes_remembered_outputs_stale_even_without_a_policy_step(model, tokenizer, lora_config):
    trainer = PPOTrainer(Policy(model, lora_config), PPOConfig(max_kl=None), 256)
    version = trainer.policy.version
    trainer._refit_value(torch.randn(6, model.config.hidden_size), torch.randn(6))
    assert trainer.policy.version == version + 1


def _play_two_episodes(agent) -> dict:
    """Two 2-turn episodes of distinct observations, so a batch of 2 updates once; the update's stats."""
    for observations in ([0, 1], [2, 3]):
        for observation in observations:
            agent.act(observation)
            agent.assign_reward(float(observation))
        stats = agent.terminate_episode()
    return stats


@pytest.mark.parametrize("sft_warm_start", [False, True])
def test_an_update_leaves_acting_the_outputs_its_trust_region_measured_at_the_new_weights(
    model, tokenizer, lora_config, sft_warm_start
):
    config = PPOConfig(batch_size=2, min_batch_turns=0, seed=0)
    agent = YesNoAgent(
        model,
        tokenizer,
        "cpu",
        ppo_config=config,
        lora_config=lora_config,
        precision="fp32",
        sft_warm_start=sft_warm_start,
    )
    stats = _play_two_episodes(agent)
    assert stats["trust/scale"] > 0 and stats["trust/undone"] == 0  # a step was taken and kept
    memory = agent.actor.memory(MODES["score"])
    if sft_warm_start:  # the replay's supervised steps moved the weights after the measure: nothing is kept
        assert stats["sft/loss"] > 0 and memory == {}
        return
    assert len(memory) == 4  # every input of the batch, at the weights acting uses now
    for (prompt, candidates), kept in memory.items():
        batch = collate_scored([list(prompt)], [[list(c) for c in candidates]], pad_token_id=agent.pad_token_id)
        fresh = agent.policy.score(batch, candidate_logits=MODES["score"].candidate_logits)
        torch.testing.assert_close(kept.logprobs, fresh.logprobs[0, : len(candidates)], atol=1e-5, rtol=0)
        torch.testing.assert_close(kept.value, fresh.values[0], atol=1e-5, rtol=0)  # the refitted head's value
        torch.testing.assert_close(kept.features, fresh.features[0].float(), atol=1e-5, rtol=0)
    runs = []
    score = agent.policy.score
    agent.policy.score = lambda *args, **kwargs: runs.append(1) or score(*args, **kwargs)
    agent.act(0)  # an input of the last batch: acting takes what the update left
    assert runs == []
