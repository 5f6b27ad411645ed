"""Arithmetic word problems: the env, its exact test-set evaluator against hand arithmetic and simulation, the
expert, and the agent's hooks."""

import re

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.registration import load_env_creator
from gymnasium.utils.env_checker import check_env

from llamagym.agent.parsing import parse_action
from llamagym.envs import AgentPolicy, TextPolicy
from llamagym.envs import arithmetic as ar
from llamagym.envs.suite import markov

SMALL = {"difficulty": 1, "max_answer": 6, "test_size": 3}
# The small test set, each answer checked by hand.
SMALL_PROBLEMS = [
    ("Ana has 3 cookies. Sam has twice as many. How many cookies does Sam have?", 6),  # 2 x 3
    ("Zoe has 3 cards. Leo has twice as many. How many cards does Leo have?", 6),  # 2 x 3
    ("Leo has 6 cookies and gives 2 away. How many cookies does he have left?", 4),  # 6 - 2
]


def numbers(text):
    return [int(n) for n in re.findall(r"\d+", text)]


def simulate(env, policy, episodes, seed=0):
    """Rewards of `episodes` episodes of `env`, acting with `policy(observation, rng)`."""
    rng = np.random.default_rng(seed)
    rewards = []
    for episode in range(episodes):
        observation, _ = env.reset(seed=seed + episode)
        _, reward, terminated, truncated, _ = env.step(policy(observation, rng))
        assert terminated and not truncated
        rewards.append(reward)
    return np.array(rewards)


def assert_within_4_stderr(rewards, exact):
    stderr = np.sqrt(exact * (1 - exact) / len(rewards))
    assert abs(rewards.mean() - exact) < 4 * stderr


# ---- the env --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs", [{}, {"difficulty": 2, "split": "test"}, {**SMALL, "split": "test"}, {"difficulty": 2, "max_answer": 50}]
)
def test_check_env_passes(kwargs):
    check_env(ar.ArithmeticEnv(**kwargs), skip_render_check=True)


@pytest.mark.parametrize("difficulty", [1, 2])
def test_every_generated_problem_fits_the_space_and_the_solver_reads_back_its_answer(difficulty):
    env = ar.ArithmeticEnv(difficulty=difficulty)
    rng = np.random.default_rng(0)
    steps = set()
    for _ in range(2000):
        text, answer = ar.draw_problem(rng, difficulty)
        template, _ = ar.parse_problem(text)
        steps.add(template.steps)
        assert env.observation_space.contains(text)
        assert env.action_space.contains(answer)
        assert ar.solve(text) == ar.expert(text) == answer
    assert steps == set(range(1, difficulty + 1))  # difficulty 2 mixes one- and two-step problems


def test_every_template_is_reachable_at_the_smallest_max_answer():
    for template in ar.TEMPLATES:
        assert ar._numbers(template, ar.MAX_ANSWERS[0]), template.text
    assert ar._numbers(ar.TEMPLATES[6], 6) == (((2, 2),),)  # together: a + (a + b) = 6 only for a = b = 2


def test_the_test_set_is_fixed_distinct_and_copied_on_each_call():
    problems = ar.test_problems()
    assert len(problems) == 100 and len({text for text, _ in problems}) == 100
    assert problems[0] == ("Ana has 7 cookies. Sam has twice as many. How many cookies does Sam have?", 14)
    problems.clear()
    assert ar.test_problems() == ar.test_problems(1, 20, 100) and len(ar.test_problems()) == 100
    assert ar.test_problems(**SMALL) == SMALL_PROBLEMS


def test_training_problems_are_redrawn_when_they_equal_a_test_problem():
    # max_answer=6 leaves few distinct problems, so a plain draw often hits one of 1000 test problems
    held_out = {text for text, _ in ar.test_problems(1, 6, 1000)}
    rng = np.random.default_rng(0)
    assert np.mean([ar.draw_problem(rng, 1, 6)[0] in held_out for _ in range(300)]) > 0.2
    env = ar.ArithmeticEnv(max_answer=6, test_size=1000)
    assert not any(env.reset(seed=seed)[0] in held_out for seed in range(300))


@pytest.mark.parametrize("split", ["train", "test"])
def test_reset_is_deterministic_per_seed(split):
    env = ar.ArithmeticEnv(difficulty=2, split=split)
    first = [env.reset(seed=seed)[0] for seed in range(20)]
    assert first == [env.reset(seed=seed)[0] for seed in range(20)]
    assert len(set(first)) > 10


def test_test_split_resets_to_test_problems_and_options_pick_one():
    env = ar.ArithmeticEnv(split="test")
    texts = {text for text, _ in ar.test_problems()}
    assert all(env.reset(seed=seed)[0] in texts for seed in range(50))
    assert env.reset(options={"index": 3})[0] == ar.test_problems()[3][0]


def test_step_pays_one_for_the_right_answer_and_terminates():
    env = ar.ArithmeticEnv(**SMALL, split="test")
    text, _ = env.reset(options={"index": 2})
    assert env.step(4) == (text, 1.0, True, False, {"answer": 4, "correct": True})  # 6 - 2 = 4
    assert env.step(np.int64(5)) == (text, 0.0, True, False, {"answer": 4, "correct": False})
    with pytest.raises(ValueError, match=r"\[0, 6\]. Received 7"):
        env.step(7)
    with pytest.raises(RuntimeError, match="reset"):
        ar.ArithmeticEnv().step(0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"difficulty": 3}, "`difficulty` should be 1 or 2. Received 3."),
        ({"max_answer": 5}, r"`max_answer` should be an integer in \[6, 50\]. Received 5."),
        ({"max_answer": 51}, r"`max_answer` should be an integer in \[6, 50\]. Received 51."),
        ({"test_size": 0}, r"`test_size` should be an integer in \[1, 1000\]. Received 0."),
        ({"split": "dev"}, "`split` should be one of train, test. Received 'dev'."),
    ],
)
def test_bad_arguments_are_named_in_the_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ar.ArithmeticEnv(**kwargs)
    with pytest.raises(ValueError, match=message):
        ar.evaluate(markov(ar.expert), **kwargs)


# ---- the exact evaluator --------------------------------------------------------------------------------------------
def test_evaluator_matches_hand_arithmetic_on_the_small_set():
    # answers 6, 6, 4 (SMALL_PROBLEMS); 7 actions, so random = 1/7; majority = always 6 = 2/3
    always_4 = ar.evaluate(markov(lambda text: 4), **SMALL)
    assert always_4["score"] == pytest.approx(1 / 3)  # right on problem 3 only
    assert always_4["random"] == pytest.approx(1 / 7)
    assert always_4["optimal"] == 1.0
    assert always_4["normalised"] == pytest.approx(2 / 9)  # (1/3 - 1/7) / (1 - 1/7) = (4/21) / (18/21)
    assert always_4["majority"] == pytest.approx(2 / 3)
    assert always_4["mean_turns"] == pytest.approx(1.0)
    always_6 = ar.evaluate(markov(lambda text: 6), **SMALL)
    assert always_6["score"] == pytest.approx(2 / 3)
    assert always_6["normalised"] == pytest.approx(11 / 18)  # (14/21 - 3/21) / (18/21)
    first_number = ar.evaluate(markov(lambda text: numbers(text)[0]), **SMALL)
    assert first_number["score"] == 0.0  # answers 3, 3, 6 against 6, 6, 4
    assert first_number["normalised"] == pytest.approx(-1 / 6)  # (0 - 1/7) / (6/7)


@pytest.mark.parametrize("difficulty, majority", [(1, 0.12), (2, 0.09)])
def test_golden_figures_of_the_default_size(difficulty, majority):
    result = ar.evaluate(markov(ar.expert), difficulty=difficulty)
    assert result["random"] == pytest.approx(0.047619, abs=1e-6)  # 1/21
    assert result["optimal"] == 1.0
    assert result["score"] == result["normalised"] == pytest.approx(1.0)
    assert result["majority"] == pytest.approx(majority)


def test_random_and_optimal_agree_with_the_simulated_env():
    env = ar.ArithmeticEnv(split="test")
    rewards = simulate(env, lambda observation, rng: int(rng.integers(21)), episodes=20_000)
    assert_within_4_stderr(rewards, 1 / 21)
    for split in ("test", "train"):
        env = ar.ArithmeticEnv(difficulty=2, split=split)
        assert simulate(env, lambda observation, rng: ar.expert(observation), episodes=500).mean() == 1.0


def test_a_fixed_policy_scores_as_in_the_simulated_env():
    def capped_sum(text):  # right on "buys b more" and on a few others
        return min(sum(numbers(text)), 20)

    result = ar.evaluate(markov(capped_sum), difficulty=2)
    assert 0.1 < result["score"] < 0.5
    right = [capped_sum(text) == answer for text, answer in ar.test_problems(2)]
    assert result["score"] == pytest.approx(np.mean(right))
    one_step = [capped_sum(t) == a for t, a in ar.test_problems(2) if ar.parse_problem(t)[0].steps == 1]
    assert result["accuracy_one_step"] == pytest.approx(np.mean(one_step))
    env = ar.ArithmeticEnv(difficulty=2, split="test")
    assert_within_4_stderr(simulate(env, lambda observation, rng: capped_sum(observation), 20_000), result["score"])


def test_the_expert_is_optimal_and_a_bad_policy_is_not():
    assert ar.evaluate(markov(ar.expert), **ar.GAME.env_kwargs)["normalised"] == pytest.approx(1.0)
    assert ar.evaluate(markov(lambda text: 0), **ar.GAME.env_kwargs)["normalised"] < 0.5


def test_a_path_dependent_decider_is_asked_once_for_every_problem():
    calls = []

    def by_length(paths):  # not Markov: acts on the length of the path (always 1 here: one turn per episode)
        calls.append(paths)
        return [4 * len(path) for path in paths]

    result = ar.evaluate(by_length)
    assert len(calls) == 1 and calls[0] == [(text,) for text, _ in ar.test_problems()]
    assert result["score"] == pytest.approx(np.mean([answer == 4 for _, answer in ar.test_problems()]))


def test_invalid_replies_are_reported_and_out_of_space_actions_raise():
    decide = markov(ar.expert)
    decide.valid = lambda paths: [i % 4 != 0 for i in range(len(paths))]
    assert ar.evaluate(decide)["invalid_rate"] == pytest.approx(0.25)
    assert "invalid_rate" not in ar.evaluate(markov(ar.expert))
    with pytest.raises(ValueError, match="Received 21"):
        ar.evaluate(markov(lambda text: 21))


def test_the_game_record_is_consistent():
    game = ar.GAME
    assert (game.name, game.env_id) == ("arithmetic", "llamagym/Arithmetic-v0")
    env = load_env_creator(game.entry_point)(**game.env_kwargs)
    assert isinstance(env, ar.ArithmeticEnv)
    assert env.action_space.contains(game.agent_kwargs["fallback_action"])
    assert len(game.agent.action_names) == env.action_space.n


# ---- the agent ------------------------------------------------------------------------------------------------------
HOOKS = ar.ArithmeticAgent.__new__(ar.ArithmeticAgent)  # the hooks need no model


@pytest.mark.parametrize(
    "reply, action",
    [
        ("7", 7),
        ("She has 3 + 4 = 7 apples, so the answer is 7.", 7),
        ("The answer is 12!", 12),
        ("7.0", 7),
        ("0", 0),
        ("no idea", None),
        ("", None),
        ("-3", None),
        ("2.5", None),
    ],
)
def test_extract_action_reads_the_last_number(reply, action):
    assert HOOKS.extract_action(reply) == action


def test_answers_above_max_answer_are_rejected_by_the_action_space():
    space = gym.spaces.Discrete(21)
    assert HOOKS.extract_action("25") == 25
    assert not parse_action("The answer is 25.", HOOKS.extract_action, 0, space).valid
    assert parse_action("The answer is 20.", HOOKS.extract_action, 0, space) == (20, True, None)


def test_every_scoring_candidate_maps_back_to_its_action():
    space = gym.spaces.Discrete(21)
    for i, name in enumerate(ar.ArithmeticAgent.action_names):
        assert HOOKS.extract_action(name) == i and space.contains(i)
    assert HOOKS.action_candidates("any problem") == [str(i) for i in range(21)]
    sized = ar.ArithmeticAgent.__new__(ar.ArithmeticAgent)
    sized.action_space = gym.spaces.Discrete(7)  # another max_answer: as many candidates as answers
    assert sized.action_candidates("any problem") == [str(i) for i in range(7)]


@pytest.mark.parametrize("action_mode", ["score", "generate"])
def test_agent_plays_one_episode(model, tokenizer, action_mode):
    env = ar.ArithmeticEnv()
    agent = ar.ArithmeticAgent(
        model,
        tokenizer,
        action_space=env.action_space,
        action_mode=action_mode,
        generation_config={"max_new_tokens": 4},
        **ar.GAME.agent_kwargs,
    )
    observation, _ = env.reset(seed=0)
    message = {"role": "user", "content": agent.format_observation(observation)}
    prompt = tokenizer.decode(agent.formatter.prompt_ids(agent.get_system_prompt(), [message])[0])
    assert agent.get_system_prompt() in prompt and observation in prompt
    action = agent.act(observation)
    assert env.action_space.contains(action)
    _, reward, terminated, _, _ = env.step(action)
    agent.assign_reward(reward)
    assert terminated
    stats = agent.terminate_episode()
    assert stats["env/return"] == reward


def test_a_scripted_reply_through_the_agent_hooks_scores_one():
    def reply(messages):  # a chain-of-thought-style reply ending in the number
        return f"Let me think. The answer is {ar.solve(messages[-1]['content'])}."

    decide = TextPolicy(reply, ar.ArithmeticAgent, fallback_action=0, action_space=gym.spaces.Discrete(21))
    result = ar.evaluate(decide, difficulty=2)
    assert result["normalised"] == pytest.approx(1.0) and result["invalid_rate"] == 0.0


def test_a_greedy_agent_is_evaluated_exactly(model, tokenizer):
    agent = ar.ArithmeticAgent(model, tokenizer, action_space=gym.spaces.Discrete(7), **ar.GAME.agent_kwargs)
    result = ar.evaluate(AgentPolicy(agent), **SMALL)
    assert result["score"] * 3 == pytest.approx(round(result["score"] * 3))  # each of 3 problems is right or not
    assert result["invalid_rate"] * 3 == pytest.approx(round(result["invalid_rate"] * 3))
