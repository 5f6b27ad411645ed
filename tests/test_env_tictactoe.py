"""Tic-tac-toe against a random opponent: the env, the exact evaluator (by hand, golden values, simulation), the
expert, and the agent's hooks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from llamagym.agent.parsing import parse_action
from llamagym.envs import tictactoe as ttt
from llamagym.envs.suite import markov
from llamagym.envs.tictactoe import GAME, TicTacToeAgent, TicTacToeEnv, evaluate, expert

# Golden references, computed by `reference_outcomes` (expected returns; exact fractions where recognised).
GOLDEN = {
    True: {"random": -0.832317, "random_legal": 0.296825, "minimax": 0.994792, "optimal": 0.994792},  # 187/630, 191/192
    False: {"random": -0.922753, "random_legal": -0.296825, "minimax": 0.806349, "optimal": 0.924868},
}


def lowest_empty(observation) -> int:
    """The lowest-numbered free cell, as an action (a cell number 1..9)."""
    return ttt.empty_cells(tuple(observation))[0] + 1


def simulate(policy, episodes: int, agent_first: bool = True, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """Returns and outcomes of `episodes` env episodes played by `policy(observation, env) -> action`."""
    env = TicTacToeEnv(agent_first)
    env.reset(seed=seed)
    env.action_space.seed(seed + 1000)  # not `seed`: the same stream would mirror the opponent's draws
    returns, ends = [], []
    for _ in range(episodes):
        observation, _ = env.reset()
        terminated = False
        while not terminated:
            observation, reward, terminated, truncated, info = env.step(policy(observation, env))
            assert not truncated
        returns.append(reward)
        ends.append(info["outcome"])
    return np.array(returns), ends


def assert_within_4_stderr(samples: np.ndarray, exact: float) -> None:
    stderr = samples.std(ddof=1) / math.sqrt(len(samples))
    assert abs(samples.mean() - exact) <= 4 * stderr + 1e-12, (samples.mean(), exact, stderr)


# ---- the env ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("agent_first", [True, False])
def test_env_passes_gymnasium_check_env(agent_first):
    check_env(TicTacToeEnv(agent_first=agent_first), skip_render_check=True)


@pytest.mark.parametrize("agent_first", [1, "yes", None])
def test_agent_first_must_be_a_bool(agent_first):
    with pytest.raises(ValueError, match=r"`agent_first` should be a bool. Received"):
        TicTacToeEnv(agent_first=agent_first)


def test_opponent_opens_at_reset_when_agent_is_second():
    observation, _ = TicTacToeEnv(agent_first=False).reset(seed=3)
    assert observation.dtype == np.int64 and sorted(observation.tolist()) == [0] * 8 + [2]


def test_actions_are_the_cell_numbers_1_to_9_row_major():
    env = TicTacToeEnv()
    assert (env.action_space.start, env.action_space.n) == (1, 9)
    for action in range(1, 10):
        env.reset(seed=action)
        observation, _, _, _, _ = env.step(np.int64(action))
        assert observation[action - 1] == ttt.AGENT  # number n is board index n - 1
        assert np.count_nonzero(observation == ttt.AGENT) == 1


def test_occupied_cell_ends_the_episode_as_an_illegal_loss():
    env = TicTacToeEnv()
    env.reset(seed=0)
    observation, _, _, _, _ = env.step(5)
    taken = int(np.flatnonzero(observation == ttt.OPPONENT)[0]) + 1
    observation, reward, terminated, truncated, info = env.step(taken)
    assert (reward, terminated, truncated, info) == (-1.0, True, False, {"outcome": "illegal"})
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(1)


def test_actions_outside_the_board_raise_in_env_and_evaluator():
    env = TicTacToeEnv()
    env.reset(seed=0)
    for action in (0, 10, True, 5.0):
        with pytest.raises(ValueError, match=r"integer in 1..9. Received"):
            env.step(action)
    with pytest.raises(ValueError, match=r"integer in 1..9. Received 0"):
        evaluate(lambda paths: [0] * len(paths))


def test_outcomes_cover_win_draw_and_each_random_reply():
    """`outcomes` works on board indices 0..8 (cell number - 1)."""
    a, o = ttt.AGENT, ttt.OPPONENT
    assert ttt.outcomes((a, a, 0, o, o, 0, 0, 0, 0), 2) == [((a, a, a, o, o, 0, 0, 0, 0), "win")]
    full = (a, o, a, a, o, o, o, a, 0)
    assert ttt.outcomes(full, 8) == [((*full[:8], a), "draw")]  # the agent fills the board
    replies = ttt.outcomes((a, a, o, 0, o, 0, 0, 0, 0), 3)  # O wins on index 6 (2-4-6), 1 reply in 4
    assert [end for _, end in replies] == [None, "loss", None, None]


# ---- the evaluator ------------------------------------------------------------------------------------------------
def test_top_row_path_policy_matches_hand_computation():
    """Play cell 1, then 2, then 3 (the top row), chosen by the path length (not from the board).

    O's first reply is uniform over the 8 cells 2..9:
      - on 2 (1/8): our move 2 is illegal at turn 2;
      - on 3 (1/8): move 2 is fine, O cannot have 3 in a row, then move 3 is illegal at turn 3;
      - elsewhere (6/8): O's second reply is uniform over 6 cells; on 3 (1/6) move 3 is illegal, else we win.
    P(win) = 6/8 * 5/6 = 5/8, P(loss) = P(illegal) = 3/8, return 1/4, turns 1/8 * 2 + 7/8 * 3 = 23/8.
    """
    seen = []

    def decide(paths):
        seen.extend(paths)
        return [(1, 2, 3)[len(path) - 1] for path in paths]

    figures = evaluate(decide)
    assert figures["score"] == pytest.approx(1 / 4)
    assert (figures["win"], figures["draw"]) == (pytest.approx(5 / 8), 0.0)
    assert figures["loss"] == figures["illegal"] == pytest.approx(3 / 8)
    assert figures["mean_turns"] == pytest.approx(23 / 8)
    assert figures["normalised"] == pytest.approx(
        (1 / 4 - figures["random"]) / (figures["optimal"] - figures["random"])
    )
    assert all(path[0].tolist() == [0] * 9 for path in seen)  # every path starts from the empty board
    assert {len(path) for path in seen} == {1, 2, 3}


def test_always_center_when_opponent_opens_matches_hand_computation():
    """O opens on the centre with prob 1/9: illegal at turn 1; else the centre is ours and our 2nd move is illegal.
    Return -1 always; turns 1/9 * 1 + 8/9 * 2 = 17/9."""
    figures = evaluate(markov(lambda observation: 5), agent_first=False)
    assert figures["score"] == figures["expected_return"] == pytest.approx(-1.0)
    assert figures["illegal"] == pytest.approx(1.0)
    assert figures["mean_turns"] == pytest.approx(17 / 9)


@pytest.mark.parametrize("agent_first", [True, False])
def test_reference_values_are_golden(agent_first):
    refs = ttt.reference_outcomes(agent_first)
    for name, value in GOLDEN[agent_first].items():
        assert refs[name]["expected_return"] == pytest.approx(value, abs=1e-6)
        assert refs[name]["win"] + refs[name]["draw"] + refs[name]["loss"] == pytest.approx(1.0)
    figures = evaluate(markov(expert), agent_first=agent_first)
    assert (figures["random"], figures["optimal"]) == pytest.approx((GOLDEN[agent_first]["random"], figures["score"]))


def test_random_legal_matches_the_classic_figures():
    """Random X vs random O: X wins 737/1260 = 58.5%, draws 8/63 = 12.7%, loses 363/1260 = 28.8%."""
    refs = ttt.reference_outcomes()["random_legal"]
    assert (refs["win"], refs["draw"], refs["loss"]) == pytest.approx((737 / 1260, 8 / 63, 363 / 1260))


@pytest.mark.parametrize("agent_first", [True, False])
def test_uniform_random_over_actions_matches_simulation(agent_first):
    returns, _ = simulate(lambda observation, env: env.action_space.sample(), 4000, agent_first)
    assert_within_4_stderr(returns, GOLDEN[agent_first]["random"])


@pytest.mark.parametrize("agent_first", [True, False])
def test_expert_matches_simulation_and_golden_optimal(agent_first):
    returns, _ = simulate(lambda observation, env: expert(observation), 2000, agent_first, seed=1)
    assert_within_4_stderr(returns, GOLDEN[agent_first]["optimal"])


def test_lowest_empty_cell_policy_matches_simulation():
    figures = evaluate(markov(lowest_empty), agent_first=False)
    assert min(figures["win"], figures["draw"], figures["loss"]) > 0.01  # all three outcomes occur
    returns, ends = simulate(lambda observation, env: lowest_empty(observation), 4000, agent_first=False, seed=2)
    assert_within_4_stderr(returns, figures["score"])
    assert_within_4_stderr(np.array([end == "win" for end in ends], dtype=float), figures["win"])


def test_expert_normalised_score_is_one_and_worse_policies_score_less():
    for agent_first in (True, False):
        assert evaluate(markov(expert), agent_first=agent_first)["normalised"] == pytest.approx(1.0)
        for policy in (lowest_empty, ttt.minimax, lambda observation: 1):
            assert evaluate(markov(policy), agent_first=agent_first)["normalised"] <= 1.0 + 1e-9
    assert evaluate(markov(lambda observation: 1))["normalised"] < 0.0  # repeats cell 1: worse than random
    minimax = evaluate(markov(ttt.minimax), agent_first=False)
    assert minimax["score"] == pytest.approx(minimax["minimax"]) and minimax["normalised"] < 0.95


def test_expert_and_minimax_play_an_immediate_win_and_never_an_occupied_cell():
    a, o = ttt.AGENT, ttt.OPPONENT
    assert expert(np.array([a, a, 0, o, o, 0, 0, 0, 0])) == ttt.minimax(np.array([a, a, 0, o, o, 0, 0, 0, 0])) == 3
    for board in ttt.start_boards(agent_first=False):
        for policy in (expert, ttt.minimax):
            assert 1 <= policy(np.array(board)) <= 9
            assert board[policy(np.array(board)) - 1] == ttt.EMPTY


# ---- the agent ----------------------------------------------------------------------------------------------------
@pytest.fixture
def agent(model, tokenizer):
    return TicTacToeAgent(model, tokenizer, action_space=TicTacToeEnv().action_space, **GAME.agent_kwargs)


def test_agent_hooks_render_parse_and_list_free_cells(agent):
    a, o = ttt.AGENT, ttt.OPPONENT
    board = np.array([a, 0, o, 0, a, 0, 0, 0, 0])
    assert agent.format_observation(board) == "X|2|O\n4|X|6\n7|8|9"
    assert agent.action_candidates(board) == ["2", "4", "6", "7", "8", "9"]
    assert [agent.extract_action(text) for text in agent.action_candidates(board)] == [2, 4, 6, 7, 8, 9]
    for reply, action in [("5", 5), ("I play 9.", 9), ("cell 3, then 7", 3), ("10 or 2", 2)]:
        assert agent.extract_action(reply) == action
    for reply in ["", "no idea", "0", "10", "X"]:
        assert agent.extract_action(reply) is None
    # a redrawn board is an echo, not a move: its lines are skipped, a number outside them still counts
    for reply, action in [("1|2|3", None), ("X|2|O\n4|X|6", None), ("O|O|O", None), ("7\n1|2|3\n4|5|6", 7)]:
        assert agent.extract_action(reply) == action
    assert agent.extract_action("X | 2 | O\nI play 4.") == 4
    assert agent.context_turns == 0
    ids, _ = agent.formatter.prompt_ids(agent.get_system_prompt(), [{"role": "user", "content": "X|2|O"}])
    text = agent.tokenizer.decode(ids)
    assert "tic-tac-toe" in text and "X|2|O" in text


def test_json_and_plain_text_replies_name_the_same_cell():
    """The action is the number the board text shows: `{"action": 5}` (taken as the action itself) and "5" agree."""
    hooks = object.__new__(TicTacToeAgent)  # the hooks only: no model
    space = TicTacToeEnv().action_space
    fallback = GAME.agent_kwargs["fallback_action"]
    assert fallback == 5 and space.contains(fallback)  # the centre
    json_reply = parse_action('{"action": 5}', hooks.extract_action, 5, space)
    assert json_reply.valid and json_reply.action == parse_action("5", hooks.extract_action, 5, space).action == 5
    for number in range(1, 10):
        replies = [f'{{"action": {number}}}', f'{{"action": "{number}"}}', str(number), f"I play {number}."]
        assert {parse_action(reply, hooks.extract_action, fallback, space).action for reply in replies} == {number}
    for reply in ['{"action": 0}', '{"action": 10}', "0"]:  # outside the board: invalid, the fallback is played
        assert not parse_action(reply, hooks.extract_action, fallback, space).valid
    env = TicTacToeEnv()
    env.reset(seed=0)
    observation, _, _, _, _ = env.step(json_reply.action)
    assert hooks.format_observation(observation).splitlines()[1][2] == "X"  # the centre of the drawn board


@pytest.mark.parametrize("mode, generation", [("score", None), ("generate", {"max_new_tokens": 4})])
def test_agent_plays_an_episode(model, tokenizer, mode, generation):
    env = TicTacToeEnv()
    agent = TicTacToeAgent(
        model,
        tokenizer,
        action_space=env.action_space,
        action_mode=mode,
        generation_config=generation,
        **GAME.agent_kwargs,
    )
    observation, _ = env.reset(seed=0)
    terminated = False
    while not terminated:
        action = agent.act(observation)
        if mode == "score":
            assert observation[action - 1] == ttt.EMPTY  # every candidate is a free cell
        observation, reward, terminated, _, _ = env.step(action)
        agent.assign_reward(reward)
    stats = agent.terminate_episode()
    assert stats["env/return"] == reward and stats["env/length"] >= 1
