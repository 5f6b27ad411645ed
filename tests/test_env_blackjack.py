"""Blackjack: the docs/design.md §8 references, known optimal cells, agreement with the real env, the suite evaluator,
the agent and the policy picture."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.toy_text.blackjack import BlackjackEnv
from gymnasium.utils.env_checker import check_env

from llamagym.envs import blackjack as bj
from llamagym.envs import suite
from llamagym.evaluation import sampled_return

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# docs/design.md §8: exact expected return and win rate per hand (each confirmed there by 200,000 simulated hands).
REFERENCES = {
    "uniform random": (-0.396, 0.28),
    "always stick": (-0.186, 0.38),
    "stick on >= 17": (-0.079, 0.41),
    "optimal": (-0.047, 0.43),
}


@pytest.fixture(scope="module")
def references():
    return bj.reference_returns()


@pytest.mark.parametrize("name", REFERENCES)
def test_reference_returns_match_design_table(references, name):
    expected_return, win_rate = REFERENCES[name]
    result = references[name]
    assert result["expected_return"] == pytest.approx(expected_return, abs=1e-3)
    assert result["win"] == pytest.approx(win_rate, abs=5e-3)
    assert result["win"] + result["draw"] + result["loss"] == pytest.approx(1.0, abs=1e-12)
    assert result["expected_return"] == pytest.approx(result["win"] - result["loss"], abs=1e-12)


def test_optimal_is_at_least_as_good_as_every_reference(references):
    for result in references.values():
        assert references["optimal"]["expected_return"] >= result["expected_return"] - 1e-12


def test_optimal_beats_every_single_state_deviation():
    """Flipping any one action of the optimal policy cannot raise the expected return (it is a fixed point)."""
    optimal = bj.optimal_policy()
    best = bj.exact_return(optimal)["expected_return"]
    for state in bj.STATES[::7]:
        flipped = dict(optimal)
        flipped[state] = 1 - flipped[state]
        assert bj.exact_return(flipped)["expected_return"] <= best + 1e-12


def test_there_are_280_decision_states():
    assert len(bj.STATES) == len(set(bj.STATES)) == 280  # (18 hard sums 4..21 + 10 soft sums 12..21) x 10 dealer
    assert {s for s, _, usable in bj.STATES if not usable} == set(range(4, 22))
    assert {s for s, _, usable in bj.STATES if usable} == set(range(12, 22))


@pytest.mark.parametrize(
    "state, action",
    [
        ((16, 10, 0), bj.HIT),
        ((12, 4, 0), bj.STICK),
        ((12, 2, 0), bj.HIT),
        ((13, 2, 0), bj.STICK),
        ((17, 1, 0), bj.STICK),
        ((11, 10, 0), bj.HIT),
        ((18, 9, 1), bj.HIT),
        ((18, 1, 1), bj.HIT),
        ((18, 8, 1), bj.STICK),
        ((17, 6, 1), bj.HIT),
        ((19, 10, 1), bj.STICK),
        ((21, 10, 1), bj.STICK),
    ],
)
def test_known_optimal_strategy_cells(state, action):
    assert bj.optimal_policy()[state] == action


def test_dealer_final_scores_are_a_distribution_over_bust_and_17_to_21():
    for card in bj.DEALER_CARDS:
        dist = bj.dealer_distribution(card)
        assert set(dist) <= {0, 17, 18, 19, 20, 21}
        assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)
    assert bj.dealer_distribution(6)[0] > bj.dealer_distribution(10)[0]  # a 6 up busts more often than a 10


def test_callable_mapping_and_stochastic_policies_agree():
    table = {state: bj.stick_on_17(*state) for state in bj.STATES}
    assert bj.exact_return(table) == bj.exact_return(bj.stick_on_17)
    assert bj.exact_return(lambda *state: 0.5) == pytest.approx(bj.exact_return(bj.uniform_random))


def test_always_hit_always_busts():
    assert bj.exact_return(lambda *state: bj.HIT) == pytest.approx(
        {"expected_return": -1, "win": 0, "draw": 0, "loss": 1}
    )


def test_invalid_policies_raise_with_the_state():
    with pytest.raises(KeyError, match=r"\(4, 1, 0\)"):
        bj.exact_return({})
    with pytest.raises(ValueError, match="Received 2.0"):
        bj.exact_return(lambda *state: 2)


def test_policy_table_layout():
    table = bj.policy_table(bj.optimal_policy())
    assert list(table["hard"]) == list(range(4, 22))
    assert list(table["soft"]) == list(range(12, 22))
    assert all(len(row) == 10 for rows in table.values() for row in rows.values())
    assert table["hard"][16][9] == 1.0  # hard 16 vs dealer 10 (column index 9): hit
    assert table["hard"][12][3] == 0.0  # hard 12 vs dealer 4: stick


def play_hand(env, hit_probs, rng, seed):
    obs, _ = env.reset(seed=seed)
    while True:
        obs, reward, terminated, truncated, _ = env.step(int(rng.random() < hit_probs[obs]))
        if terminated or truncated:
            return reward


@pytest.mark.parametrize("name", ["uniform random", "optimal"])
def test_exact_values_agree_with_the_real_env(references, name):
    """20,000 hands of gym.make("Blackjack-v1", natural=False, sab=False) land within 4 standard errors (~1 s)."""
    env = gym.make("Blackjack-v1", natural=False, sab=False)
    hit_probs = bj.hit_probabilities(bj.reference_policies()[name])
    rng = np.random.default_rng(0)
    stats = sampled_return(lambda seed: play_hand(env, hit_probs, rng, seed), episodes=20_000, seed=1)
    exact = references[name]
    assert abs(stats["mean"] - exact["expected_return"]) < 4 * stats["stderr"]
    for key in ("win", "draw", "loss"):
        p = exact[key]
        assert abs(stats[key] - p) < 4 * np.sqrt(p * (1 - p) / stats["n"])


def test_optimal_advantages_sign_is_the_optimal_action_and_values_are_known():
    gains = bj.optimal_advantages()
    best = bj.optimal_policy()
    assert all((gains[s] > 0) == bool(best[s]) for s in bj.STATES)
    # hard 21: a hit always busts (-1); sticking wins unless the dealer also makes 21 (a draw)
    p21 = bj.dealer_distribution(10)[21]
    assert gains[(21, 10, 0)] == pytest.approx(-1.0 - (1.0 - p21), abs=1e-12)


def coin(total: int, dealer: int, usable: int) -> float:
    """A stochastic policy with a different hit probability across states (no state at 0 or 1)."""
    return 0.05 + 0.9 * ((7 * total + 3 * dealer + 5 * usable) % 11) / 10


def test_visits_start_from_the_deal_and_follow_the_hits():
    stick, hit = bj.visits(bj.always_stick), bj.visits(lambda *state: 1.0)
    p_card, p_ten = 1 / 13, 4 / 13
    # ace + ten against a dealer's 5, in either order; and 2 + 2 against a dealer's ten
    assert stick[21, 5, 1] == pytest.approx(2 * p_card * p_ten * p_card)
    assert hit[4, 10, 0] == stick[4, 10, 0] == pytest.approx(p_card**3 * 4)
    # sticking decides once a hand: the states' probabilities sum to one; hitting until a bust, 1.93 times
    assert sum(stick.values()) == pytest.approx(1.0) and 1.9 < sum(hit.values()) < 2
    # hard 5 is dealt only as 2 + 3 or 3 + 2, and reached by hitting from nowhere else
    assert hit[5, 1, 0] == pytest.approx(2 * p_card**3)


def test_the_gap_to_optimal_is_each_states_visits_times_its_wrong_action_cost():
    # J* - J(pi) = sum over states of visits(pi) * P(pi's action is not optimal) * |Q*(hit) - Q*(stick)|
    best, gains, reach = bj.optimal_policy(), bj.optimal_advantages(), bj.visits(coin)
    probs = bj.hit_probabilities(coin)
    wrong = {s: 1 - probs[s] if best[s] else probs[s] for s in bj.STATES}
    gap = bj.exact_return(best)["expected_return"] - bj.exact_return(coin)["expected_return"]
    assert gap == pytest.approx(sum(reach[s] * wrong[s] * abs(gains[s]) for s in bj.STATES), rel=1e-9) and gap > 0.1


@pytest.mark.parametrize("state", [(16, 10, 0), (12, 4, 0), (17, 1, 1), (9, 6, 0)])
def test_hit_gains_are_what_hitting_once_more_is_worth_under_the_policy(state):
    # hitting for sure at `state` changes the return by visits * P(stick there) * gain: no state comes twice a hand
    gains, reach, probs = bj.hit_gains(coin), bj.visits(coin), bj.hit_probabilities(coin)
    hits_there = {**probs, state: 1.0}
    change = bj.exact_return(hits_there)["expected_return"] - bj.exact_return(coin)["expected_return"]
    assert change == pytest.approx(reach[state] * (1 - probs[state]) * gains[state], rel=1e-9, abs=1e-15)
    assert gains != bj.optimal_advantages()


# ---- the suite game ------------------------------------------------------------------------------------------------
def test_check_env_passes_on_the_game_env():
    check_env(BlackjackEnv(natural=False, sab=False), skip_render_check=True)


def test_game_describes_the_default_rules():
    game = bj.GAME
    assert (game.name, game.env_id, game.measure) == ("blackjack", "llamagym/Blackjack-v0", "expected return")
    assert game.env_kwargs == {"natural": False, "sab": False} and game.agent is bj.BlackjackAgent
    module, cls = game.entry_point.split(":")
    assert getattr(__import__(module, fromlist=[cls]), cls) is BlackjackEnv


def test_expert_scores_normalised_one_and_reports_random_and_optimal():
    result = bj.evaluate(suite.markov(bj.expert), **bj.GAME.env_kwargs)
    assert result["normalised"] == pytest.approx(1.0, abs=1e-12)
    assert result["random"] == pytest.approx(-0.395896, abs=1e-6)
    assert result["optimal"] == pytest.approx(-0.046556, abs=1e-6)
    assert result["score"] == result["expected_return"] == pytest.approx(result["win"] - result["loss"], abs=1e-12)
    assert "invalid_rate" not in result  # the decider cannot tell


def test_always_stick_scores_its_exact_return_in_one_batched_call():
    calls = []

    def decide(paths):
        calls.append(paths)
        return [bj.STICK for _ in paths]

    decide.markov = True
    result = bj.evaluate(decide)
    assert calls == [[(state,) for state in bj.STATES]]
    exact = bj.exact_return(bj.always_stick)
    assert result["score"] == exact["expected_return"]
    assert {k: result[k] for k in exact} == exact
    assert result["normalised"] == pytest.approx((-0.186368 + 0.395896) / (-0.046556 + 0.395896), abs=1e-5)


def test_invalid_rate_is_the_share_of_states_with_invalid_replies():
    decide = suite.markov(lambda observation: bj.stick_on_17(*observation))
    decide.valid = lambda paths: [path[-1][1] != 1 for path in paths]  # replies against an ace "unparseable"
    assert bj.evaluate(decide)["invalid_rate"] == pytest.approx(28 / 280)  # 28 of the 280 states show an ace


def test_a_non_markov_decider_raises_a_clear_error():
    with pytest.raises(ValueError, match="current observation only.*context_turns = 0"):
        bj.evaluate(lambda paths: [len(path) % 2 for path in paths])
    with pytest.raises(ValueError, match="natural=False, sab=False.*Received natural=True"):
        bj.evaluate(suite.markov(bj.expert), natural=True)


def test_expert_accepts_numpy_observations():
    env = BlackjackEnv(natural=False, sab=False)
    observation, _ = env.reset(seed=0)
    assert bj.expert(np.array(observation)) == bj.optimal_policy()[tuple(int(x) for x in observation)]


@pytest.mark.parametrize(
    "reply, action", [("hit", 1), ("I will stick.", 0), ("Stand", 0), ("1", 1), ("maybe", None), ("", None)]
)
def test_agent_extracts_actions_from_free_text(reply, action):
    assert bj.BlackjackAgent.extract_action(None, reply) == action


def test_agent_is_markov_and_its_greedy_table_evaluates(model, tokenizer):
    env = BlackjackEnv(natural=False, sab=False)
    agent = bj.BlackjackAgent(model, tokenizer, action_space=env.action_space, **bj.GAME.agent_kwargs)
    assert agent.context_turns == 0
    assert [agent.extract_action(name) for name in agent.action_names] == [bj.STICK, bj.HIT]
    assert agent.format_observation((13, 1, 1)) == "Total 13 (usable ace), dealer 1. Hit or stick?"

    tables = []

    def decide(paths):
        tables.append(dict(zip(bj.STATES, agent.predict([path[-1] for path in paths]), strict=True)))
        return list(tables[-1].values())

    decide.markov = True
    result = bj.evaluate(decide)
    assert len(tables) == 1 and set(tables[0].values()) <= {bj.STICK, bj.HIT}
    assert result["score"] == bj.exact_return(tables[0])["expected_return"] <= result["optimal"] + 1e-12


# ---- the policy picture --------------------------------------------------------------------------------------------
def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_blackjack_policy_png(tmp_path):
    pytest.importorskip("matplotlib")
    from llamagym.envs.blackjack_plot import plot_blackjack_policy

    agent = bj.policy_table(bj.stick_on_17)
    assert_png(plot_blackjack_policy(agent, bj.policy_table(bj.optimal_policy()), tmp_path / "policy.png"))


def test_blackjack_policy_accepts_json_keys_and_default_optimal(tmp_path):
    pytest.importorskip("matplotlib")
    from llamagym.envs.blackjack_plot import plot_blackjack_policy

    table = bj.policy_table(bj.uniform_random)
    as_json = {kind: {str(total): row for total, row in rows.items()} for kind, rows in table.items()}
    assert_png(plot_blackjack_policy(as_json, None, tmp_path / "policy.png"))
