"""Tic-tac-toe against a uniformly random opponent, with an exact evaluator.

Rules: a 3x3 board; the agent plays X and, by default, moves first; the opponent O plays a uniformly random empty
cell (with `agent_first=False` it also makes a random first move at reset). Three in a row (row, column or diagonal)
wins; a full board without one is a draw. Playing an occupied cell is illegal: it ends the episode at once as a loss.

Observation: the board as a numpy int64 array of 9 cells, row-major (0 empty, 1 agent X, 2 opponent O);
`MultiDiscrete([3] * 9)`. It is the whole state: the game is Markov.
Actions: `Discrete(9, start=1)`, the cell number 1..9, row-major: the number the agent's board text shows on a free
cell, so the reply "5" and the JSON reply `{"action": 5}` both play the centre. (Inside, the board is indexed 0..8:
`outcomes`, `empty_cells` and the board tuples use index = number - 1; `env.step`, the evaluator, `expert` and
`minimax` speak cell numbers.)
Rewards: +1 win, 0 draw, -1 loss (an illegal move included), paid at the end; `info["outcome"]` is then "win",
"draw", "loss" or "illegal".

The evaluator walks every episode a deterministic policy can play, the opponent's moves being chance transitions
of probability 1/(number of empty cells), and reports its exact expected return (`score`), its win/draw/loss
probabilities (loss includes illegal moves, also given alone as `illegal`), and four references, all exact:
`random` (uniform over the 9 actions, occupied cells included), `random_legal` (uniform over the empty cells),
`minimax` (worst-case optimal play, ties to the lowest cell number) and `optimal` (expectimax against the random
opponent: the best achievable expected return). `normalised` is 0 for `random` and 1 for `optimal`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import gymnasium as gym
import numpy as np

from ..agent import Agent
from .suite import Decide, Game, Transition, freeze, play_out, summary

Board = tuple[int, ...]  # 9 cells, row-major, indexed 0..8 (cell number - 1): EMPTY, AGENT (X) or OPPONENT (O)
Outcome = tuple[float, float, float]  # (P(win), P(draw), P(loss))

EMPTY, AGENT, OPPONENT = 0, 1, 2  # the agent plays X, the opponent O
EMPTY_BOARD: Board = (EMPTY,) * 9
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
REWARDS = {"win": 1.0, "draw": 0.0, "loss": -1.0, "illegal": -1.0}
_ENDS: dict[str, Outcome] = {"win": (1.0, 0.0, 0.0), "draw": (0.0, 1.0, 0.0), "loss": (0.0, 0.0, 1.0)}
_ENDS["illegal"] = _ENDS["loss"]
_LINES_THROUGH = [[line for line in LINES if cell in line] for cell in range(9)]


# ---- the dynamics: one source of truth for the env and the evaluator ---------------------------------------------
def empty_cells(board: Board) -> list[int]:
    """Indices 0..8 of the empty cells, ascending (cell number - 1)."""
    return [cell for cell, mark in enumerate(board) if mark == EMPTY]


def completes_line(board: Board, cell: int) -> bool:
    """Whether the mark on `cell` is part of three in a row (only a line through the last move can be new)."""
    return any(board[a] == board[b] == board[c] for a, b, c in _LINES_THROUGH[cell])


def _place(board: Board, cell: int, mark: int) -> Board:
    return (*board[:cell], mark, *board[cell + 1 :])


def start_boards(agent_first: bool = True) -> list[Board]:
    """The equally likely boards the agent first acts on: empty, or one O anywhere when the opponent starts."""
    return [EMPTY_BOARD] if agent_first else [_place(EMPTY_BOARD, cell, OPPONENT) for cell in range(9)]


def outcomes(board: Board, action: int) -> list[tuple[Board, str | None]]:
    """The equally likely results of the agent playing the cell of index `action`, then the opponent's random reply.

    Args:
        board: the board the agent acts on.
        action: a cell index 0..8 (cell number - 1; any int-like, e.g. a numpy integer); an occupied cell is an
            illegal move. `cell_index` turns an env action (a cell number 1..9) into one.

    Returns:
        (board, outcome) pairs, each with probability 1/len: outcome is None while the game goes on, else
        "win", "draw", "loss" or "illegal" (the board is then left as the game ended).

    Raises:
        ValueError: `action` is not an integer in 0..8.
    """
    if isinstance(action, (bool, np.bool_)) or not isinstance(action, (int, np.integer)) or not 0 <= action < 9:
        raise ValueError(f"`action` should be a cell index, an integer in 0..8. Received {action!r}.")
    return list(_outcomes(tuple(board), int(action)))


@functools.lru_cache(maxsize=1 << 16)  # every (board, action) of the game fits: the evaluators share the work
def _outcomes(board: Board, action: int) -> tuple[tuple[Board, str | None], ...]:
    if board[action] != EMPTY:
        return ((board, "illegal"),)
    board = _place(board, action, AGENT)
    if completes_line(board, action):
        return ((board, "win"),)
    if EMPTY not in board:
        return ((board, "draw"),)
    results = []
    for cell in empty_cells(board):
        after = _place(board, cell, OPPONENT)
        outcome = "loss" if completes_line(after, cell) else None if EMPTY in after else "draw"
        results.append((after, outcome))
    return tuple(results)


def cell_index(action) -> int:
    """The board index 0..8 of the env action `action`, a cell number 1..9 (any int-like, e.g. a numpy integer).

    Raises:
        ValueError: `action` is not an integer in 1..9.
    """
    if isinstance(action, (bool, np.bool_)) or not isinstance(action, (int, np.integer)) or not 1 <= action <= 9:
        raise ValueError(f"`action` should be a cell number, an integer in 1..9. Received {action!r}.")
    return int(action) - 1


def cell_number(index: int) -> int:
    """The env action (cell number 1..9) of the board index `index` 0..8."""
    return index + 1


def observation(board: Board) -> np.ndarray:
    """The env's observation of `board`."""
    return np.array(board, dtype=np.int64)


def _check_agent_first(agent_first) -> bool:
    if not isinstance(agent_first, (bool, np.bool_)):
        raise ValueError(f"`agent_first` should be a bool. Received {agent_first!r}.")
    return bool(agent_first)


# ---- the env ------------------------------------------------------------------------------------------------------
class TicTacToeEnv(gym.Env):
    """Tic-tac-toe as X against a uniformly random O (see the module docstring).

    Args:
        agent_first: the agent moves first (True) or the opponent opens with a random move at reset (False).

    Raises:
        ValueError: `agent_first` is not a bool.
    """

    metadata = {"render_modes": []}

    def __init__(self, agent_first: bool = True):
        self.agent_first = _check_agent_first(agent_first)
        self.observation_space = gym.spaces.MultiDiscrete([3] * 9)
        self.action_space = gym.spaces.Discrete(9, start=1)  # the cell numbers 1..9
        self._board: Board | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        boards = start_boards(self.agent_first)
        self._board = boards[int(self.np_random.integers(len(boards)))]
        return observation(self._board), {}

    def step(self, action):
        if self._board is None:
            raise RuntimeError("step() was called before reset() or after the episode ended; call reset() first.")
        results = outcomes(self._board, cell_index(action))
        board, outcome = results[int(self.np_random.integers(len(results)))]
        self._board = None if outcome is not None else board
        info = {} if outcome is None else {"outcome": outcome}
        return observation(board), REWARDS.get(outcome, 0.0), outcome is not None, False, info


# ---- the exact evaluator --------------------------------------------------------------------------------------------
def _q(board: Board, action: int, value: Callable[[Board], Outcome]) -> Outcome:
    """Outcome probabilities of playing `action` on `board`, then following `value` on the boards that follow."""
    return _mean(
        [_ENDS[outcome] if outcome is not None else value(after) for after, outcome in _outcomes(board, action)]
    )


def _solve(choose: Callable[[Board, Callable[[int], Outcome]], Outcome]) -> Callable[[Board], Outcome]:
    """The (memoised) outcome of every board where `choose(board, q)` picks or mixes the actions' outcomes `q(a)`."""

    @functools.cache
    def value(board: Board) -> Outcome:
        return choose(board, lambda action: _q(board, action, value))

    return value


def _mean(outs: list[Outcome]) -> Outcome:
    return tuple(sum(column) / len(outs) for column in zip(*outs, strict=True))


def _best_cell(board: Board, score: Callable[[int], float]) -> int:
    """The empty cell of highest `score`, ties (within float error) to the lowest index."""
    cells = empty_cells(board)
    scores = [score(cell) for cell in cells]
    return next(cell for cell, s in zip(cells, scores, strict=True) if s >= max(scores) - 1e-12)


def _return(outcome: Outcome) -> float:
    return outcome[0] - outcome[2]  # P(win) - P(loss)


_OPTIMAL = _solve(lambda board, q: max((q(a) for a in empty_cells(board)), key=_return))  # expectimax


@functools.cache
def _minimax_value(board: Board) -> float:
    """The game-theoretic value of `board` (agent to move) when O plays its worst case for the agent."""
    return max(_minimax_q(board, cell) for cell in empty_cells(board))


def _minimax_q(board: Board, action: int) -> float:
    return min(REWARDS[o] if o is not None else _minimax_value(b) for b, o in _outcomes(board, action))


@functools.cache
def _minimax_cell(board: Board) -> int:
    return _best_cell(board, lambda cell: _minimax_q(board, cell))


def minimax(observation) -> int:
    """The minimax move, as a cell number 1..9: the best worst-case cell (as if O played perfectly), ties to the
    lowest number."""
    return cell_number(_minimax_cell(tuple(freeze(observation))))


@functools.lru_cache
def _references(agent_first: bool) -> dict[str, Outcome]:
    rules = {
        "random": _solve(lambda board, q: _mean([q(a) for a in range(9)])),
        "random_legal": _solve(lambda board, q: _mean([q(a) for a in empty_cells(board)])),
        "minimax": _solve(lambda board, q: q(_minimax_cell(board))),
        "optimal": _OPTIMAL,
    }
    return {name: _mean([value(b) for b in start_boards(agent_first)]) for name, value in rules.items()}


def reference_outcomes(agent_first: bool = True) -> dict[str, dict[str, float]]:
    """Exact figures of the reference players: "random" (uniform over the 9 actions), "random_legal" (uniform over
    the empty cells), "minimax" and "optimal", each as `{"expected_return", "win", "draw", "loss"}`."""
    return {
        name: {"expected_return": win - loss, "win": win, "draw": draw, "loss": loss}
        for name, (win, draw, loss) in _references(_check_agent_first(agent_first)).items()
    }


def evaluate(decide: Decide, agent_first: bool = True) -> dict:
    """Exact figures of a deterministic policy: every game it can play, weighted by the opponent's random moves.

    Args:
        decide: the policy as a decider (see `suite`) returning cell numbers 1..9 like the env's actions; it may
            return any cell, occupied ones lose as in the env.
        agent_first: as for the env.

    Returns:
        `suite.summary` (score = expected return, random, optimal, normalised, ...) plus `win`, `draw`, `loss`
        (illegal moves included), `illegal`, the references `random_legal` and `minimax` (expected returns) and
        `invalid_rate` when the decider reports it.

    Raises:
        ValueError: `agent_first` is not a bool, or the policy returned an action outside 1..9.
    """
    refs = reference_outcomes(agent_first)
    boards = start_boards(agent_first)
    starts = [(1.0 / len(boards), (b, None), observation(b)) for b in boards]

    def step(state, action) -> list[Transition]:
        results = outcomes(state[0], cell_index(action))
        return [
            Transition(1.0 / len(results), (b, o), observation(b), REWARDS.get(o, 0.0), o is not None)
            for b, o in results
        ]

    result = play_out(starts, decide, step)
    figures = summary(result, refs["random"]["expected_return"], refs["optimal"]["expected_return"])

    def share(*ends: str) -> float:
        return sum((leaf.prob for leaf in result.leaves if leaf.state[1] in ends), 0.0)

    figures.update(win=share("win"), draw=share("draw"), loss=share("loss", "illegal"), illegal=share("illegal"))
    figures["random_legal"] = refs["random_legal"]["expected_return"]
    figures["minimax"] = refs["minimax"]["expected_return"]
    return figures


# ---- the expert ---------------------------------------------------------------------------------------------------
@functools.cache
def _optimal_cell(board: Board) -> int:
    return _best_cell(board, lambda cell: _return(_q(board, cell, _OPTIMAL)))


def expert(observation) -> int:
    """The optimal move against the random opponent (expectimax), as a cell number 1..9, ties to the lowest number."""
    return cell_number(_optimal_cell(tuple(freeze(observation))))


# ---- the agent ----------------------------------------------------------------------------------------------------
_MARKS = {AGENT: "X", OPPONENT: "O"}
_CELL_NUMBER = re.compile(r"(?<!\d)[1-9](?!\d)")


class TicTacToeAgent(Agent):
    """Plays X from the board drawn as 3 rows, free cells numbered 1-9; replies with a free cell's number, which is
    the env's action itself (so "5" and `{"action": 5}` are the same move)."""

    context_turns = 0  # the board is the whole state

    def get_system_prompt(self) -> str:
        return "You are X in tic-tac-toe against O. Get three X in a row. Reply with the number of a free cell."

    def format_observation(self, observation) -> str:
        cells = [_MARKS.get(mark, str(cell_number(i))) for i, mark in enumerate(freeze(observation))]
        return "\n".join("|".join(cells[row : row + 3]) for row in (0, 3, 6))

    def extract_action(self, response: str) -> int | None:
        """The first standalone digit 1-9 in `response`, the cell number and so the action itself, or None. The
        reply alone cannot tell whether the cell is free: the env punishes an occupied one.

        Lines with a '|' draw the board and are skipped: a redrawn row ("1|2|3") is an echo of the observation, not
        a choice, and read as a move it would be rewarded whenever its first free cell wins, teaching the model to
        redraw boards, which late in a game hold no free cell to read."""
        text = "\n".join(line for line in response.splitlines() if "|" not in line)
        match = _CELL_NUMBER.search(text)
        return int(match.group()) if match else None

    def action_candidates(self, observation) -> list[str]:
        """The numbers of the empty cells: every scored move is legal."""
        return [str(cell_number(cell)) for cell in empty_cells(tuple(freeze(observation)))]


GAME = Game(
    name="tictactoe",
    env_id="llamagym/TicTacToe-v0",
    entry_point="llamagym.envs.tictactoe:TicTacToeEnv",
    agent=TicTacToeAgent,
    evaluate=evaluate,
    expert=expert,
    agent_kwargs={"fallback_action": 5},  # the centre
    env_kwargs={"agent_first": True},
    measure="expected return",
)
