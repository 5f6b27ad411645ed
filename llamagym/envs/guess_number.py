"""Guess the number: find a secret integer from "too low" / "too high" hints, with an exact evaluator.

Rules: a secret integer is drawn uniformly from 1..n (default n=16). The player has at most k guesses (default 5,
enough for binary search: ceil(log2(n + 1))). Each guess is answered "too low", "too high" or "correct". A correct
guess pays 1 and ends the episode; a wrong one pays 0; after k wrong guesses the episode ends with 0 (terminated:
running out of guesses is a rule of the game, not a time limit).

Observation: (n, low, high, guesses_left), plain ints, where [low, high] is the interval still consistent with the
hints (it starts at (n, 1, n, k)). It is Markov: given the hints, the secret is uniform on [low, high]. `n` is part
of it so the agent can list every guess. The action is the guess itself: Discrete(n, start=1), so a reply "9" and a
reply {"action": 9} name the same guess. A guess outside [low, high] is legal but wastes a turn: its hint is still
given and the interval only shrinks as far as the hint implies.

The evaluator plays a deterministic policy against each of the n secrets (probability 1/n each; given the secret
the game is deterministic) and reports its success rate (`score`) and mean number of guesses (`mean_turns`), beside
uniform random guessing (1 - (1 - 1/n)^k: each uniform guess is right with probability 1/n, whatever the hints) and
the best achievable, min(n, 2^k - 1) / n, which binary search on the interval reaches (`expert`). With k = 1 the
two are equal (one blind guess) and the evaluator raises: there is nothing to learn.
"""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

import gymnasium as gym
from gymnasium import spaces

from ..agent import Agent
from .suite import Decide, Game, Transition, markov, play_out, summary

TOO_LOW, TOO_HIGH, CORRECT = "too low", "too high", "correct"


# ---- the dynamics, shared by the env and the evaluator -------------------------------------------------------------
class State(NamedTuple):
    """The whole game: the secret, the interval consistent with the hints so far, and the guesses left."""

    secret: int
    low: int
    high: int
    left: int


def check_size(n: Any, k: Any) -> tuple[int, int]:
    """Validate the game's size: `n` (the secret is in 1..n) and `k` (guesses allowed).

    Raises:
        ValueError: `n` is not an integer >= 2 or `k` not an integer >= 1.
    """
    for name, value, least in (("n", n, 2), ("k", k, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"`{name}` should be an integer >= {least}. Received {value!r}.")
    return n, k


def check_action(action: Any, n: int) -> int:
    """The guess (1..n) that action `action` is: the action is the guess itself.

    Raises:
        ValueError: `action` is not in Discrete(n, start=1).
    """
    if not spaces.Discrete(n, start=1).contains(action):
        raise ValueError(f"`action` should be an integer in [1, {n}]. Received {action!r}.")
    return int(action)


def play(state: State, guess: int) -> tuple[State, str, float, bool]:
    """One guess: the next state, the hint, the reward (1 when correct) and whether the game is over.

    Args:
        state: the game before the guess (`state.left` >= 1).
        guess: any integer in 1..n, inside [low, high] or not.
    """
    left = state.left - 1
    if guess == state.secret:
        return State(state.secret, guess, guess, left), CORRECT, 1.0, True
    if guess < state.secret:
        state, hint = State(state.secret, max(state.low, guess + 1), state.high, left), TOO_LOW
    else:
        state, hint = State(state.secret, state.low, min(state.high, guess - 1), left), TOO_HIGH
    return state, hint, 0.0, left == 0


def observe(n: int, state: State) -> tuple[int, int, int, int]:
    """The player's view of `state`: (n, low, high, guesses_left)."""
    return n, state.low, state.high, state.left


class GuessNumberEnv(gym.Env):
    """Guess a secret integer in 1..n within k guesses (see the module docstring for the rules).

    Args:
        n: the secret is uniform in 1..n (an integer >= 2).
        k: guesses allowed (an integer >= 1).

    `reset(options={"secret": s})` fixes the secret (for tests and demos). `info` holds the last `guess` and its
    `hint`, and the `secret` once the episode is over.
    """

    metadata = {"render_modes": []}

    def __init__(self, n: int = 16, k: int = 5):
        self.n, self.k = check_size(n, k)
        self.action_space = spaces.Discrete(n, start=1)  # the action is the guess
        self.observation_space = spaces.Tuple(
            (
                spaces.Discrete(1, start=n),
                spaces.Discrete(n, start=1),
                spaces.Discrete(n, start=1),
                spaces.Discrete(k + 1),
            )
        )  # (n: constant, low, high, guesses_left)
        self.state: State | None = None
        self.over = False

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        secret = (options or {}).get("secret")
        if secret is None:
            secret = int(self.np_random.integers(1, self.n + 1))
        elif not isinstance(secret, int) or not 1 <= secret <= self.n:
            raise ValueError(f"`options['secret']` should be an integer in [1, {self.n}]. Received {secret!r}.")
        self.state, self.over = State(secret, 1, self.n, self.k), False
        return observe(self.n, self.state), {}

    def step(self, action):
        if self.state is None or self.over:
            raise RuntimeError("No episode is running: call reset() before step().")
        guess = check_action(action, self.n)
        self.state, hint, reward, self.over = play(self.state, guess)
        info = {"guess": guess, "hint": hint, **({"secret": self.state.secret} if self.over else {})}
        return observe(self.n, self.state), reward, self.over, False, info


# ---- the exact evaluator -------------------------------------------------------------------------------------------
def _start(n: int, k: int) -> list[tuple[float, State, tuple[int, int, int, int]]]:
    return [(1.0 / n, State(s, 1, n, k), observe(n, State(s, 1, n, k))) for s in range(1, n + 1)]


@functools.lru_cache(maxsize=16)
def outcomes(low: int, high: int, left: int, guess: int) -> list[tuple[float, float, State | None]]:
    """(probability, reward, next state or None once the game is over) of guessing `guess` with `left` guesses on the
    interval [low, high], the secret uniform on it. The secrets below, at and above the guess each lead to one
    outcome, so one of each group is played (`play`); the next state's `secret` is that one, not the secret's law.

    Examples: [1, 3], 2 left, guess 2: 1/3 each of (1..1, 1 left), found (reward 1), (3..3, 1 left); guess 5: one
    outcome, (1..3, 1 left), the hint saying what was known.
    """
    size, result = high - low + 1, []
    for first, last in ((low, min(high, guess - 1)), (max(low, guess), min(high, guess)), (max(low, guess + 1), high)):
        if first <= last:
            nxt, _, reward, done = play(State(first, low, high, left), guess)
            result.append(((last - first + 1) / size, reward, None if done else nxt))
    return result


def references(n: int = 16, k: int = 5) -> dict[str, float]:
    """Exact success rates of uniform random guessing (`random`) and of the best policy (`optimal`), and binary
    search's mean number of guesses (`binary_search_turns`, from a play-out of `expert`).

    `random` and `optimal` come from dynamic programming over observations: given the hints the secret is uniform on
    [low, high], and the game is the same on every interval of one size, so it is solved on [1, size], in
    O(n^2 k) calls of `play`.
    """
    check_size(n, k)

    @functools.cache
    def values(size: int, left: int) -> tuple[float, float]:  # (uniform random, best) success from [1, size]
        if left == 0:
            return 0.0, 0.0
        total_random, best = 0.0, 0.0
        for guess in range(1, min(size + 1, n) + 1):
            count = 1 if guess <= size else n - size  # guess size + 1 stands for the n - size outside the interval
            q_random = q_best = 0.0
            for weight, reward, nxt in outcomes(1, size, left, guess):
                v_random, v_best = (0.0, 0.0) if nxt is None else values(nxt.high - nxt.low + 1, nxt.left)
                q_random, q_best = q_random + weight * (reward + v_random), q_best + weight * (reward + v_best)
            total_random, best = total_random + count * q_random, max(best, q_best)
        return total_random / n, best

    random, optimal = values(n, k)
    leaves = play_out(_start(n, k), markov(expert), _stepper(n)).leaves
    turns = sum(leaf.prob * len(leaf.actions) for leaf in leaves)
    return {"random": random, "optimal": optimal, "binary_search_turns": turns}


def _stepper(n: int):
    def step(state: State, action: Any) -> list[Transition]:
        nxt, _, reward, done = play(state, check_action(action, n))
        return [Transition(1.0, nxt, observe(n, nxt), reward, done)]

    return step


def evaluate(decide: Decide, n: int = 16, k: int = 5) -> dict[str, Any]:
    """The exact figures of a deterministic policy, played against each of the n secrets (one batched call per turn).

    Args:
        decide: a decider (see `llamagym.envs.suite`); it may read whole paths (earlier observations).
        n, k: the game's size, as for the env.

    Returns:
        `score` (success rate, = `expected_return`), `random` (1 - (1 - 1/n)^k), `optimal` (min(n, 2^k - 1) / n),
        `normalised`, `mean_turns` (mean guesses), `binary_search_turns` (the expert's mean guesses), and
        `invalid_rate` when the decider can tell.

    Raises:
        ValueError: a bad size; k = 1 (one blind guess: random play is optimal, there is nothing to learn); or
            `decide` returned an action outside Discrete(n, start=1), i.e. not a guess in 1..n (as `env.step` would).
    """
    check_size(n, k)
    result = play_out(_start(n, k), decide, _stepper(n))
    refs = references(n, k)
    figures = summary(result, refs["random"], refs["optimal"])
    figures["binary_search_turns"] = refs["binary_search_turns"]
    return figures


def expert(observation) -> int:
    """Binary search: guess the midpoint (low + high) // 2 of the interval (optimal for every n and k)."""
    _, low, high, _ = observation
    return (int(low) + int(high)) // 2


# ---- the agent -----------------------------------------------------------------------------------------------------
_INTEGER = re.compile(r"(?<!\d)-?\d+")


class GuessNumberAgent(Agent):
    """The interval and guesses left in words; a number in reply (scoring mode: the candidates "1".."n")."""

    context_turns = 0  # the observation is the whole state: a Markov policy

    def get_system_prompt(self) -> str:
        return "Guess the secret number. Each turn, reply with one number inside the range."

    def format_observation(self, observation) -> str:
        n, low, high, left = (int(x) for x in observation)
        guesses = "guess" if left == 1 else "guesses"
        return f"Secret number between 1 and {n} (range so far: {low} to {high}). {left} {guesses} left. Your guess?"

    def action_candidates(self, observation) -> list[str]:
        """Every guess 1..n (all actions: uniform play over them is uniform over the action space)."""
        return [str(guess) for guess in range(1, int(observation[0]) + 1)]

    def extract_action(self, response: str):
        """The last integer in the reply: the guess, which is the action; None without one (or for a guess below 1)."""
        numbers = _INTEGER.findall(response)
        if not numbers or len(numbers[-1]) > 9:
            return None
        guess = int(numbers[-1])
        return guess if guess >= 1 else None  # the action space rejects guesses above n


GAME = Game(
    name="guess_number",
    env_id="llamagym/GuessNumber-v0",
    entry_point="llamagym.envs.guess_number:GuessNumberEnv",
    agent=GuessNumberAgent,
    evaluate=evaluate,
    expert=expert,
    agent_kwargs={"fallback_action": 1},  # guess 1 when a reply names no number
    env_kwargs={"n": 16, "k": 5},
    measure="success rate",
)
