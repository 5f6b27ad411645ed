"""The Rooms game: env, layouts, exact evaluator (hand values, golden values, simulation), expert and agent hooks."""

import math

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from llamagym.agent.parsing import parse_action
from llamagym.envs import suite
from llamagym.envs.rooms import (
    GAME,
    MAX_DOORS,
    ROOM_NAMES,
    RoomsAgent,
    RoomsEnv,
    evaluate,
    expert,
    make_layout,
    random_spl,
)

# The default house (8 rooms, seed 0): kitchen-cellar-garden-attic-hall on one side, pantry at the hub.
DEFAULT_DOORS = ((5,), (6,), (3, 4), (2, 4, 5, 6), (2, 3), (0, 3, 7), (1, 3, 7), (5, 6))
RANDOM_DEFAULT = 0.110513  # exact SPL of uniform random actions, num_rooms=8, layout_seed=0, max_steps=8
# The 3-room house (seed 0) is the path kitchen(0) - library(2) - hall(1); diameter 2, so max_steps = 4.
SMALL = {"num_rooms": 3, "layout_seed": 0}


def simulate(policy, episodes, seed=0, **env_kwargs):
    """Mean and standard error of the return of `policy(observation, rng)` over env episodes."""
    env, rng = RoomsEnv(**env_kwargs), np.random.default_rng(seed)
    returns = []
    for episode in range(episodes):
        observation, _ = env.reset(seed=seed * 100_000 + episode)
        total, done = 0.0, False
        while not done:
            observation, reward, terminated, truncated, _ = env.step(policy(observation, rng))
            total, done = total + reward, terminated or truncated
        returns.append(total)
    return float(np.mean(returns)), float(np.std(returns) / math.sqrt(episodes))


def uniform(observation, rng):
    return int(rng.integers(8))


def target_or_highest_door(observation, rng=None):
    """Walk to the target when it is a door, else through the highest-numbered door (it can loop)."""
    doors = make_layout().doors[observation[0]]
    return observation[1] if observation[1] in doors else doors[-1]


# ---- layouts and env -----------------------------------------------------------------------------------------------
def test_room_names_are_distinct_single_lowercase_words():
    assert len(ROOM_NAMES) >= 24 and len(set(ROOM_NAMES)) == len(ROOM_NAMES)
    assert all(name.isalpha() and name.islower() for name in ROOM_NAMES)


def test_default_layout_is_fixed():
    assert make_layout(8, 0).doors == DEFAULT_DOORS
    assert make_layout(8, 0).diameter == 4
    assert make_layout(3, 0).doors == ((2,), (2,), (0, 1))


@pytest.mark.parametrize("num_rooms", [3, 5, 8, 13, 24, len(ROOM_NAMES)])
@pytest.mark.parametrize("layout_seed", [0, 1, 7])
def test_layouts_are_connected_undirected_with_at_most_four_doors(num_rooms, layout_seed):
    layout = make_layout(num_rooms, layout_seed)
    assert all(len(doors) <= MAX_DOORS and room not in doors for room, doors in enumerate(layout.doors))
    assert all(room in layout.doors[n] for room, doors in enumerate(layout.doors) for n in doors)
    assert all(d >= 0 for row in layout.distance for d in row)  # every room reachable
    edges = sum(map(len, layout.doors)) // 2
    assert num_rooms - 1 <= edges <= num_rooms - 1 + num_rooms // 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_rooms": 2}, "`num_rooms` should be an integer in [3, 32]. Received 2."),
        ({"num_rooms": 33}, "Received 33"),
        ({"num_rooms": 8.0}, "Received 8.0"),
        ({"layout_seed": -1}, "`layout_seed` should be an integer >= 0. Received -1."),
        ({"max_steps": 0}, "`max_steps` should be an integer >= 1 or None. Received 0."),
    ],
)
def test_bad_sizes_raise_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RoomsEnv(**kwargs)


@pytest.mark.parametrize("kwargs", [SMALL, {}, {"num_rooms": 24, "layout_seed": 5}])
def test_env_passes_check_env(kwargs):
    check_env(RoomsEnv(**kwargs), skip_render_check=True)


def test_step_rules_stay_put_reward_spl_and_truncation():
    env = RoomsEnv(**SMALL, render_mode="ansi")
    env.reset(seed=0)
    env.state = env.state._replace(room=0, target=1, start=0)  # kitchen -> hall: kitchen, library, hall
    assert env.render() == "You are in the kitchen. Goal: hall. Doors: library."
    assert env.step(1)[:4] == ((0, 1), 0.0, False, False)  # hall is not a door of the kitchen: stay put
    assert env.step(2)[:4] == ((2, 1), 0.0, False, False)
    observation, reward, terminated, truncated, info = env.step(1)
    assert (observation, terminated, truncated) == ((1, 1), True, False)
    assert reward == pytest.approx(2 / 3) and info == {"shortest": 2, "hops": 3, "success": True}
    env.reset(seed=0)
    results = [env.step(env.state.room) for _ in range(4)]  # stay put until the limit of 4 steps
    assert [r[2:4] for r in results] == [(False, False)] * 3 + [(False, True)] and results[-1][1] == 0.0
    with pytest.raises(ValueError, match="Received 3"):
        env.step(3)


# ---- the evaluator -------------------------------------------------------------------------------------------------
def test_random_play_matches_hand_computation_on_three_rooms():
    # Path E1 - M - E2, uniform actions over 3 rooms, 4 steps. From an end, M is reached w.p. 1/3 a step; from M
    # each end w.p. 1/3, stay w.p. 1/3. W(room, k) = E[1/T] with k steps used.
    # End -> M: 1/3 (1 + (2/3)/2 + (4/9)/3 + (8/27)/4) = 14/27.
    # M -> end E1: W_M(3) = 1/12, W_E2(3) = 0; W_M(2) = 1/9 + 1/36 = 5/36, W_E2(2) = 1/36;
    #   W_M(1) = 1/6 + 1/108 + 5/108 = 2/9, W_E2(1) = 5/108 + 2/108 = 7/108; W_M(0) = 1/3 + 7/324 + 2/27 = 139/324.
    # E2 -> E1 (d = 2): 2 W_E2(0) = 2 (1/3 2/9 + 2/3 7/108) = 2 (19/162) = 19/81.
    # Mean over the 6 pairs (two of each kind): (14/27 + 139/324 + 19/81) / 3 = 383/972.
    assert random_spl(**SMALL) == pytest.approx(383 / 972, rel=1e-12)


def test_evaluator_matches_hand_computation_on_three_rooms():
    # Always walk to the library (the middle room, 2): kitchen->library and hall->library take 1 step (SPL 1);
    # from the library nothing moves, and end->end reaches the library then stays: 4 of 6 pairs fail after 4 steps.
    figures = evaluate(suite.markov(lambda observation: 2), **SMALL)
    assert figures["score"] == pytest.approx(1 / 3) and figures["success"] == pytest.approx(1 / 3)
    assert figures["mean_hops"] == pytest.approx(1.0) and figures["mean_turns"] == pytest.approx((2 + 4 * 4) / 6)
    assert figures["random"] == pytest.approx(383 / 972) and figures["optimal"] == 1.0
    assert figures["normalised"] == pytest.approx((1 / 3 - 383 / 972) / (1 - 383 / 972))
    assert figures["mean_shortest"] == pytest.approx((4 * 1 + 2 * 2) / 6)


def test_golden_values_of_the_default_house_match_simulation():
    figures = evaluate(suite.markov(expert), **GAME.env_kwargs)
    assert figures["random"] == pytest.approx(RANDOM_DEFAULT, abs=1e-6)
    assert figures["optimal"] == 1.0
    mean, stderr = simulate(uniform, 6000)
    assert abs(mean - RANDOM_DEFAULT) < 4 * stderr
    mean, _ = simulate(lambda observation, rng: expert(observation), 500)
    assert mean == pytest.approx(1.0)  # every expert episode earns exactly 1


def test_evaluator_matches_simulation_of_a_looping_policy():
    figures = evaluate(suite.markov(target_or_highest_door))
    assert 0.1 < figures["success"] < 0.9  # it loops on some pairs: a non-trivial check
    mean, stderr = simulate(target_or_highest_door, 3000, seed=1)
    assert abs(mean - figures["score"]) < 4 * stderr


@pytest.mark.parametrize("kwargs", [SMALL, {}, {"num_rooms": 24, "layout_seed": 3}, {"max_steps": 3}])
def test_expert_is_optimal_and_a_bad_policy_is_not(kwargs):
    room_kwargs = {k: v for k, v in kwargs.items() if k != "max_steps"}
    figures = evaluate(suite.markov(lambda observation: expert(observation, **room_kwargs)), **kwargs)
    assert figures["normalised"] == pytest.approx(1.0)
    if "max_steps" not in kwargs:  # every pair is reached along a shortest path
        assert figures["mean_hops"] == pytest.approx(figures["mean_shortest"])
    assert evaluate(suite.markov(lambda observation: 0), **kwargs)["normalised"] < 0.5


def test_short_time_limit_lowers_the_optimum():
    # Default house, 3 steps: only kitchen <-> hall (kitchen, cellar, pantry or garden, attic, hall) is 4 apart.
    far = [(s, t) for s, row in enumerate(make_layout().distance) for t, d in enumerate(row) if d > 3]
    assert far == [(0, 1), (1, 0)]
    assert evaluate(suite.markov(expert), max_steps=3)["optimal"] == pytest.approx(1 - 2 / 56)


def test_path_dependent_decider_is_evaluated_exactly():
    # Stay put on the first turn (walk to one's own room), then follow the expert: each pair earns d / (d + 1).
    # Three rooms: 4 pairs at d = 1 earn 1/2, 2 pairs at d = 2 earn 2/3: (2 + 4/3) / 6 = 5/9.
    calls = []

    def decide(paths):
        calls.append(len(paths))
        return [path[-1][0] if len(path) == 1 else expert(path[-1], num_rooms=3) for path in paths]

    figures = evaluate(decide, **SMALL)
    assert figures["score"] == pytest.approx(5 / 9) and figures["success"] == pytest.approx(1.0)
    assert figures["mean_hops"] == pytest.approx((4 * 2 + 2 * 3) / 6)
    assert calls == [6, 6, 2]  # one batched call per turn


# ---- the agent -----------------------------------------------------------------------------------------------------
def hooks(agent_class=RoomsAgent):
    """An agent whose hooks run without `__init__`: they need no instance state."""
    return agent_class.__new__(agent_class)


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("hall", 1),
        ("I go to the Library.", 2),
        ("GARDEN!", 7),
        ("kitchen, then hall", 0),
        ('{"action": "cellar"}', 5),
        ("the hallway", None),
        ("bedroom", None),  # a room of bigger houses only
        ("left", None),
        ("", None),
    ],
)
def test_extract_action_finds_the_first_room_named(reply, action):
    assert hooks().extract_action(reply) == action


def test_parse_action_reads_json_and_rejects_garbage():
    agent, space = hooks(), RoomsEnv().action_space
    assert parse_action('{"action": "study"}', agent.extract_action, 0, space).action == 4
    assert parse_action('{"action": 6}', agent.extract_action, 0, space).action == 6
    assert not parse_action("go north", agent.extract_action, 0, space).valid


@pytest.mark.parametrize(("num_rooms", "layout_seed"), [(8, 0), (3, 0), (24, 2)])
def test_every_candidate_maps_back_to_its_door(num_rooms, layout_seed):
    agent_class = RoomsAgent if num_rooms == 8 else RoomsAgent.for_env(num_rooms=num_rooms, layout_seed=layout_seed)
    agent, layout = hooks(agent_class), make_layout(num_rooms, layout_seed)
    for room, doors in enumerate(layout.doors):
        candidates = agent.action_candidates((room, (room + 1) % num_rooms))
        assert [agent.extract_action(text) for text in candidates] == list(doors)


def test_for_env_makes_an_agent_for_another_house():
    agent = hooks(RoomsAgent.for_env(num_rooms=24, layout_seed=2))
    assert agent.extract_action("the bedroom") == 8 and agent.context_turns == 0
    assert agent.format_observation((8, 0)).startswith("You are in the bedroom. Goal: kitchen. Doors: ")
    with pytest.raises(ValueError, match="Received 40"):
        RoomsAgent.for_env(num_rooms=40)
    with pytest.raises(ValueError, match="outside a house of 8 rooms"):
        hooks().format_observation((8, 0))


def test_prompt_and_observation_render():
    agent = hooks()
    assert "goal room" in agent.get_system_prompt()
    assert agent.format_observation((np.int64(3), 0)) == (
        "You are in the pantry. Goal: kitchen. Doors: library, study, cellar, attic."
    )
    assert agent.context_turns == 0 and GAME.agent_kwargs["fallback_action"] in DEFAULT_DOORS[0] + (0,)


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_agent_plays_an_episode(model, tokenizer, mode):
    env = RoomsEnv(**GAME.env_kwargs, max_steps=3)
    agent = GAME.agent(
        model,
        tokenizer,
        action_space=env.action_space,
        action_mode=mode,
        generation_config={"max_new_tokens": 4},
        **GAME.agent_kwargs,
    )
    observation, _ = env.reset(seed=0)
    done = False
    while not done:
        action = agent.act(observation)
        if mode == "score":
            assert action in make_layout().doors[observation[0]]
        observation, reward, terminated, truncated, _ = env.step(action)
        agent.assign_reward(reward)
        done = terminated or truncated
    stats = agent.terminate_episode(truncated=truncated, final_observation=observation)
    assert stats["env/length"] >= 1


def test_a_policy_that_never_arrives_has_no_mean_hops_and_its_figures_are_strict_json():
    import json

    figures = evaluate(suite.markov(lambda observation: observation[0]), **GAME.env_kwargs)  # always stays put
    assert figures["success"] == 0.0 and figures["mean_hops"] is None
    json.dumps(figures, allow_nan=False)
