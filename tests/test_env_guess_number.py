"""Guess the number: the env's rules, the exact evaluator (by hand, against simulation), the expert and the agent."""

import math
import re

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from llamagym.agent.parsing import parse_action
from llamagym.envs import guess_number as gn
from llamagym.envs.suite import markov


def third(observation):
    """A fixed, non-trivial policy: guess a third of the way into the interval."""
    _, low, high, _ = observation
    return low + (high - low) // 3


def simulate(policy, n, k, episodes, seed=0, rng=None):
    """Success indicators and guess counts of `episodes` env episodes (`policy(obs) -> action`, or random play)."""
    env = gn.GuessNumberEnv(n=n, k=k)
    wins, turns = [], []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        steps, done = 0, False
        while not done:
            action = int(rng.integers(1, n + 1)) if policy is None else policy(obs)
            obs, reward, done, truncated, _ = env.step(action)
            steps += 1
            assert not truncated
        wins.append(reward)
        turns.append(steps)
    return np.array(wins), np.array(turns)


def within_4_stderr(samples, exact):
    stderr = max(samples.std(ddof=1), 1e-12) / math.sqrt(len(samples))
    return abs(samples.mean() - exact) < 4 * stderr


# ---- the env --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(16, 5), (2, 1), (10, 2)])
def test_env_passes_gymnasiums_checker(n, k):
    check_env(gn.GuessNumberEnv(n=n, k=k), skip_render_check=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 1}, "`n` should be an integer >= 2. Received 1."),
        ({"k": 0}, "`k` should be an integer >= 1. Received 0."),
        ({"n": 2.5}, "Received 2.5"),
        ({"k": True}, "Received True"),
    ],
)
def test_bad_sizes_raise_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gn.GuessNumberEnv(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        gn.evaluate(markov(gn.expert), **kwargs)


def test_hints_shrink_the_interval_and_a_correct_guess_ends_with_reward_1():
    env = gn.GuessNumberEnv(n=16, k=5)
    obs, _ = env.reset(options={"secret": 11})
    assert obs == (16, 1, 16, 5) and all(type(x) is int for x in obs)
    assert env.action_space == gym.spaces.Discrete(16, start=1)  # the action is the guess
    obs, reward, terminated, truncated, info = env.step(8)
    assert (obs, reward, terminated, info) == ((16, 9, 16, 4), 0.0, False, {"guess": 8, "hint": "too low"})
    obs, reward, terminated, _, info = env.step(12)
    assert (obs, reward, terminated, info["hint"]) == ((16, 9, 11, 3), 0.0, False, "too high")
    obs, _, _, _, info = env.step(16)  # outside [9, 11]: legal, wasted, interval unchanged
    assert (obs, info["hint"]) == ((16, 9, 11, 2), "too high")
    obs, reward, terminated, truncated, info = env.step(11)
    assert (obs, reward, terminated, truncated) == ((16, 11, 11, 1), 1.0, True, False)
    assert info == {"guess": 11, "hint": "correct", "secret": 11}
    with pytest.raises(RuntimeError, match="reset"):
        env.step(1)


def test_a_secret_given_in_options_is_validated():
    env = gn.GuessNumberEnv(n=4, k=2)
    with pytest.raises(ValueError, match=re.escape("`options['secret']` should be an integer in [1, 4]. Received 5.")):
        env.reset(options={"secret": 5})


def test_running_out_of_guesses_terminates_with_reward_0():
    env = gn.GuessNumberEnv(n=4, k=2)
    env.reset(options={"secret": 4})
    assert env.step(1)[1:4] == (0.0, False, False)
    obs, reward, terminated, truncated, info = env.step(2)
    assert (obs, reward, terminated, truncated, info["secret"]) == ((4, 3, 4, 0), 0.0, True, False, 4)


def test_out_of_range_actions_raise_in_the_env_and_in_the_evaluator():
    env = gn.GuessNumberEnv(n=4, k=2)
    env.reset(seed=0)
    for bad in (0, 5, -1, 1.5, "1"):
        with pytest.raises(ValueError, match=r"`action` should be an integer in \[1, 4\]"):
            env.step(bad)
    for bad in (0, 5):
        with pytest.raises(ValueError, match=rf"Received {bad}\."):
            gn.evaluate(markov(lambda obs, bad=bad: bad), n=4, k=2)


def test_seeded_resets_draw_every_secret_uniformly():
    env = gn.GuessNumberEnv(n=4, k=2)
    secrets = []
    for seed in range(4000):
        env.reset(seed=seed)
        secrets.append(env.state.secret)
    counts = np.bincount(secrets, minlength=5)[1:]
    assert counts.sum() == 4000 and all(abs(c - 1000) < 4 * math.sqrt(1000 * 0.75) for c in counts)


# ---- the evaluator: by hand ------------------------------------------------------------------------------------------
def test_evaluator_matches_hand_computed_values_for_n4_k2():
    # random = 1 - (3/4)^2 = 7/16 (each uniform guess is right w.p. 1/4 whatever the hints);
    # optimal = min(4, 2^2 - 1) / 4 = 3/4 (two guesses tell apart at most 3 secrets).
    # Binary search: guess (1+4)//2 = 2. Secret 2: 1 guess, won. Secret 1: then [1, 1], guess 1: 2 guesses, won.
    # Secrets 3, 4: then [3, 4], guess 3: secret 3 won, secret 4 lost; 2 guesses each.
    # score = 3/4, mean guesses = (1 + 2 + 2 + 2) / 4 = 7/4.
    figures = gn.evaluate(markov(gn.expert), n=4, k=2)
    assert figures == pytest.approx(
        {
            "score": 0.75,
            "random": 7 / 16,
            "optimal": 0.75,
            "normalised": 1.0,
            "expected_return": 0.75,
            "mean_turns": 1.75,
            "binary_search_turns": 1.75,
        }
    )
    # Always guessing 4: secret 4 won in 1 guess; the other three lose after 2 wasted-or-wrong guesses.
    # score = 1/4, mean guesses = (1 + 3 * 2) / 4 = 7/4, normalised = (1/4 - 7/16) / (3/4 - 7/16) = -3/5.
    figures = gn.evaluate(markov(lambda obs: 4), n=4, k=2)
    assert (figures["score"], figures["mean_turns"], figures["normalised"]) == pytest.approx((0.25, 1.75, -0.6))


def test_path_dependent_decider_is_replayed_exactly_with_one_call_per_turn():
    # n=8, k=3. Turn 1 guesses 4; later turns guess the `high` of the observation BEFORE the last one.
    # Secret 4: won at turn 1. Turn 2 guesses 8 (the start's high): secret 8 won; secrets 1..3 and 5..7 hear
    # "too high". Turn 3 guesses the high after turn 1: 3 for secrets 1..3 (secret 3 won), 8 for 5..7 (lost).
    # score = 3/8; guesses: 1 (secret 4) + 2 (secret 8) + 3 * 6 = 21, mean 21/8.
    calls = []

    def decide(paths):
        calls.append(len(paths))
        return [4 if len(path) == 1 else path[-2][2] for path in paths]

    figures = gn.evaluate(decide, n=8, k=3)
    assert (figures["score"], figures["mean_turns"]) == pytest.approx((3 / 8, 21 / 8))
    assert calls == [8, 7, 6]  # one batched call per turn: all secrets, then those still playing


def test_invalid_rate_is_the_probability_weighted_share_of_turns():
    # n=4, k=2 binary search: turn 1 for all secrets (weight 1), turn 2 for secrets 1, 3, 4 (weight 3/4).
    # Calling every first-turn reply invalid gives 1 / (7/4) = 4/7.
    decide = markov(gn.expert)
    decide.valid = lambda paths: [len(path) > 1 for path in paths]
    assert gn.evaluate(decide, n=4, k=2)["invalid_rate"] == pytest.approx(4 / 7)
    assert "invalid_rate" not in gn.evaluate(markov(gn.expert), n=4, k=2)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 16, 31])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_dynamic_programming_gives_the_closed_forms(n, k):
    refs = gn.references(n, k)
    assert refs["random"] == pytest.approx(1 - (1 - 1 / n) ** k, abs=1e-12)
    assert refs["optimal"] == pytest.approx(min(n, 2**k - 1) / n, abs=1e-12)


def test_one_guess_has_nothing_to_learn():
    with pytest.raises(ValueError, match="nothing to learn"):
        gn.evaluate(markov(gn.expert), n=16, k=1)


# ---- the evaluator: golden values and simulation --------------------------------------------------------------------
def test_golden_values_for_the_default_size():
    refs = gn.references()
    assert refs["random"] == pytest.approx(0.275804, abs=1e-6)  # 1 - (15/16)^5
    assert refs["optimal"] == 1.0
    # binary search on 1..16 finds 8 at depth 1, 4 and 12 at 2, four at 3, eight at 4 and 16 at 5: 54 / 16
    assert refs["binary_search_turns"] == pytest.approx(3.375)


def test_golden_values_agree_with_simulated_episodes():
    wins, _ = simulate(None, 16, 5, episodes=20_000, rng=np.random.default_rng(0))
    assert within_4_stderr(wins, gn.references()["random"])
    wins, turns = simulate(gn.expert, 16, 5, episodes=2_000)
    assert wins.all() and within_4_stderr(turns, gn.references()["binary_search_turns"])


def test_a_fixed_policy_agrees_with_simulated_episodes():
    figures = gn.evaluate(markov(third), n=16, k=3)
    assert 0.1 < figures["score"] < 0.9
    wins, turns = simulate(third, 16, 3, episodes=5_000)
    assert within_4_stderr(wins, figures["score"])
    assert within_4_stderr(turns, figures["mean_turns"])


@pytest.mark.parametrize("n, k", [(16, 5), (16, 3), (7, 2), (32, 4), (5, 9)])
def test_expert_is_optimal_and_a_bad_policy_is_not(n, k):
    assert gn.evaluate(markov(gn.expert), n=n, k=k)["normalised"] == pytest.approx(1.0)
    assert gn.evaluate(markov(lambda obs: 1), n=n, k=k)["normalised"] < 0.99


# ---- the agent ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hooks():
    return object.__new__(gn.GuessNumberAgent)  # the hooks need no model


@pytest.mark.parametrize(
    "reply, action",
    [
        ("8", 8),
        ("My guess is 12.", 12),
        ("3, no: 5", 5),
        ("between 1-16", 16),
        ("16\n", 16),
        ("17", 17),
        ("no idea", None),
        ("", None),
        ("0", None),
        ("-3", None),
        ("9" * 40, None),
    ],
)
def test_extract_action_reads_the_last_number(hooks, reply, action):
    assert hooks.extract_action(reply) == action


def test_replies_outside_the_range_are_invalid_for_the_agent(hooks):
    space = gn.GuessNumberEnv(n=16).action_space
    assert not parse_action("17", hooks.extract_action, 1, space).valid
    assert not parse_action('{"action": 0}', hooks.extract_action, 1, space).valid
    assert parse_action("I say 16", hooks.extract_action, 1, space) == (16, True, None)


def test_a_json_reply_and_a_plain_number_name_the_same_guess(hooks):
    space = gn.GuessNumberEnv(n=16).action_space
    as_json = parse_action('{"action": 9}', hooks.extract_action, 1, space)
    as_text = parse_action("9", hooks.extract_action, 1, space)
    assert as_json.valid and as_text.valid
    assert as_json.action == as_text.action == 9


def test_candidates_are_every_action_once(hooks):
    space = gn.GuessNumberEnv(n=16).action_space
    candidates = hooks.action_candidates((16, 9, 12, 3))
    actions = [parse_action(text, hooks.extract_action, None, space).action for text in candidates]
    assert actions == list(range(1, 17))


def test_prompt_and_observation_render(hooks):
    assert "number" in hooks.get_system_prompt()
    text = hooks.format_observation((16, 9, 12, 3))
    assert text == "Secret number between 1 and 16 (range so far: 9 to 12). 3 guesses left. Your guess?"
    assert "1 guess left" in hooks.format_observation((16, 5, 5, 1))
    assert gn.GuessNumberAgent.context_turns == 0


@pytest.mark.parametrize("mode, extra", [("score", {}), ("generate", {"generation_config": {"max_new_tokens": 4}})])
def test_agent_plays_an_episode(model, tokenizer, mode, extra):
    env = gn.GuessNumberEnv(n=4, k=2)
    agent = gn.GuessNumberAgent(
        model, tokenizer, action_space=env.action_space, action_mode=mode, **gn.GAME.agent_kwargs, **extra
    )
    obs, _ = env.reset(seed=0)
    done, total = False, 0.0
    while not done:
        action = agent.act(obs)
        assert env.action_space.contains(action)
        obs, reward, done, truncated, _ = env.step(action)
        agent.assign_reward(reward)
        total += reward
        done = done or truncated
    stats = agent.terminate_episode()
    assert stats["env/return"] == total and 1 <= stats["env/length"] <= 2


def test_outcomes_of_a_guess_group_the_secrets_below_at_and_above_it():
    found = gn.outcomes(1, 3, 2, 2)
    assert [(p, reward) for p, reward, _ in found] == [(1 / 3, 0.0), (1 / 3, 1.0), (1 / 3, 0.0)]
    assert [(s.low, s.high, s.left) for _, _, s in (found[0], found[2])] == [(1, 1, 1), (3, 3, 1)]
    assert found[1][2] is None  # found: the game is over
    (only,) = gn.outcomes(4, 9, 3, 12)  # outside the interval: one outcome, nothing learned but a guess spent
    assert only[:2] == (1.0, 0.0) and (only[2].low, only[2].high, only[2].left) == (4, 9, 2)
