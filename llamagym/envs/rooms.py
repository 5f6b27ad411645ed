"""Rooms: walk through a small house of named rooms to a goal room, by naming the door to go through.

Rules. A house is a connected undirected graph over rooms 0..num_rooms-1; room i is called `ROOM_NAMES[i]`. The
layout is fixed by `(num_rooms, layout_seed)`: a random spanning tree (each room in a random order joins a random
earlier room with a free door), then `num_rooms // 4` extra edges between random non-adjacent rooms with free
doors, all from `numpy.random.default_rng(layout_seed)`; every room has at most 4 doors. Each episode draws
(start, target) uniformly among the ordered pairs of distinct rooms.

Observation: (current room, target room), two `Discrete(num_rooms)` ints. Action: `Discrete(num_rooms)`, the room
to walk to; a room that is not a neighbour of the current one leaves the agent where it is (the step still
counts). Reaching the target after t steps pays d(start, target) / t and terminates, so the return is the SPL
(success weighted by path length): 1 for a shortest path, less for detours, 0 on failure. After `max_steps` steps
(default 2 x the house's diameter) without success the episode is truncated with reward 0. The observation holds
all the player needs: whatever the steps used so far, a shortest path from the current room is best.

Evaluator: the exact SPL (= expected return), success rate and mean hops of a deterministic policy over all
ordered (start, target) pairs, each with equal probability; `random` is the exact SPL of uniformly random actions
(dynamic programming over (room, steps used)); `optimal` is the share of pairs within `max_steps` of each other
(1.0 by default).
"""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np

from ..agent import Agent
from . import suite

ROOM_NAMES = (
    "kitchen", "hall", "library", "pantry", "study", "cellar", "attic", "garden",
    "bedroom", "bathroom", "office", "garage", "lounge", "porch", "nursery", "laundry",
    "gallery", "chapel", "ballroom", "workshop", "closet", "foyer", "balcony", "parlor",
    "vault", "sauna", "den", "loft", "lobby", "studio", "terrace", "armory",
)  # fmt: skip
MAX_DOORS = 4


# ---- layouts and dynamics (shared by the env, the evaluator and the agent) -----------------------------------------
class Layout(NamedTuple):
    """A house: `doors[i]` are room i's neighbours (ascending), `distance[i][j]` the shortest path lengths."""

    doors: tuple[tuple[int, ...], ...]
    distance: tuple[tuple[int, ...], ...]

    @property
    def num_rooms(self) -> int:
        return len(self.doors)

    @property
    def diameter(self) -> int:
        return max(max(row) for row in self.distance)


class State(NamedTuple):
    room: int
    target: int
    start: int
    steps: int


@functools.lru_cache(maxsize=64, typed=True)
def make_layout(num_rooms: int = 8, layout_seed: int = 0) -> Layout:
    """The house of `num_rooms` rooms built from `layout_seed` (the same arguments always give the same house).

    Raises:
        ValueError: `num_rooms` is not an integer in [3, len(ROOM_NAMES)], or `layout_seed` not an integer >= 0.
    """
    if not _is_int(num_rooms) or not 3 <= num_rooms <= len(ROOM_NAMES):
        raise ValueError(f"`num_rooms` should be an integer in [3, {len(ROOM_NAMES)}]. Received {num_rooms!r}.")
    if not _is_int(layout_seed) or layout_seed < 0:
        raise ValueError(f"`layout_seed` should be an integer >= 0. Received {layout_seed!r}.")
    rng = np.random.default_rng(int(layout_seed))
    doors: list[set[int]] = [set() for _ in range(num_rooms)]
    order = [int(room) for room in rng.permutation(num_rooms)]
    for k in range(1, num_rooms):  # a tree of k rooms always has one with a free door (degrees sum to 2k - 2)
        free = [room for room in order[:k] if len(doors[room]) < MAX_DOORS]
        _join(doors, order[k], free[int(rng.integers(len(free)))])
    for _ in range(num_rooms // 4):
        pairs = [
            (a, b)
            for a in range(num_rooms)
            for b in range(a + 1, num_rooms)
            if b not in doors[a] and len(doors[a]) < MAX_DOORS and len(doors[b]) < MAX_DOORS
        ]
        if not pairs:
            break
        _join(doors, *pairs[int(rng.integers(len(pairs)))])
    neighbours = tuple(tuple(sorted(d)) for d in doors)
    return Layout(neighbours, tuple(_bfs(neighbours, room) for room in range(num_rooms)))


def _join(doors: list[set[int]], a: int, b: int) -> None:
    doors[a].add(b)
    doors[b].add(a)


def _bfs(doors: tuple[tuple[int, ...], ...], source: int) -> tuple[int, ...]:
    distance = [-1] * len(doors)
    distance[source] = 0
    queue = [source]
    for room in queue:  # the queue grows while it is read: breadth first
        for n in doors[room]:
            if distance[n] < 0:
                distance[n] = distance[room] + 1
                queue.append(n)
    return tuple(distance)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def settings(num_rooms: int = 8, layout_seed: int = 0, max_steps: int | None = None) -> tuple[Layout, int]:
    """The layout and the validated time limit (None = 2 x diameter) of the env's keyword arguments.

    Raises:
        ValueError: an argument is out of range (see `make_layout`), or `max_steps` is not an integer >= 1.
    """
    layout = make_layout(num_rooms, layout_seed)
    if max_steps is None:
        return layout, 2 * layout.diameter
    if not _is_int(max_steps) or max_steps < 1:
        raise ValueError(f"`max_steps` should be an integer >= 1 or None. Received {max_steps!r}.")
    return layout, int(max_steps)


def walk(layout: Layout, state: State, action: Any, max_steps: int) -> tuple[State, float, bool, bool]:
    """One step: (next state, reward, terminated, truncated). A non-neighbour `action` stays put.

    Raises:
        ValueError: `action` is not a room index in [0, num_rooms).
    """
    if not _is_int(action) or not 0 <= action < layout.num_rooms:
        raise ValueError(f"`action` should be a room index in [0, {layout.num_rooms}). Received {action!r}.")
    room = int(action) if action in layout.doors[state.room] else state.room
    state = State(room, state.target, state.start, state.steps + 1)
    if room == state.target:
        return state, layout.distance[state.start][state.target] / state.steps, True, False
    return state, 0.0, False, state.steps >= max_steps


def describe(layout: Layout, room: int, target: int) -> str:
    """The observation in words, e.g. "You are in the kitchen. Goal: library. Doors: hall, pantry."."""
    doors = ", ".join(ROOM_NAMES[n] for n in layout.doors[room])
    return f"You are in the {ROOM_NAMES[room]}. Goal: {ROOM_NAMES[target]}. Doors: {doors}."


# ---- the env -------------------------------------------------------------------------------------------------------
class RoomsEnv(gym.Env):
    """Walk from a random room to a random goal room of a fixed house (see the module docstring).

    Args:
        num_rooms: rooms in the house, 3..len(ROOM_NAMES).
        layout_seed: which house of that size.
        max_steps: the time limit; None is twice the house's diameter.
        render_mode: None or "ansi" (`render()` returns the observation in words).
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, num_rooms: int = 8, layout_seed: int = 0, max_steps: int | None = None, render_mode=None):
        self.layout, self.max_steps = settings(num_rooms, layout_seed, max_steps)
        if render_mode not in (None, "ansi"):
            raise ValueError(f"`render_mode` should be None or 'ansi'. Received {render_mode!r}.")
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Tuple((gym.spaces.Discrete(num_rooms), gym.spaces.Discrete(num_rooms)))
        self.action_space = gym.spaces.Discrete(num_rooms)
        self.state: State | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        n = self.layout.num_rooms
        start = int(self.np_random.integers(n))
        target = (start + 1 + int(self.np_random.integers(n - 1))) % n  # uniform over the other rooms
        self.state = State(start, target, start, 0)
        return (start, target), self._info(False)

    def step(self, action):
        if self.state is None:
            raise RuntimeError("Call reset() before step().")
        self.state, reward, terminated, truncated = walk(self.layout, self.state, action, self.max_steps)
        return (self.state.room, self.state.target), reward, terminated, truncated, self._info(terminated)

    def render(self) -> str | None:
        if self.render_mode == "ansi" and self.state is not None:
            return describe(self.layout, self.state.room, self.state.target)
        return None

    def _info(self, success: bool) -> dict[str, Any]:
        shortest = self.layout.distance[self.state.start][self.state.target]
        return {"shortest": shortest, "hops": self.state.steps, "success": success}


# ---- the exact evaluator -------------------------------------------------------------------------------------------
def evaluate(decide: suite.Decide, num_rooms: int = 8, layout_seed: int = 0, max_steps: int | None = None) -> dict:
    """Exact figures of a deterministic policy over every ordered (start, target) pair, equally likely.

    Args:
        decide: the policy as a decider (see `suite`); it sees paths of (room, target) observations.
        num_rooms, layout_seed, max_steps: the env's arguments.

    Returns:
        `suite.summary` (score = SPL = expected return) plus `success` (P(reach the target)), `mean_hops` (mean
        steps of the successful episodes; None when none succeeds), `mean_shortest` (mean d(start, target)) and
        `invalid_rate` when the decider reports it.
    """
    layout, limit = settings(num_rooms, layout_seed, max_steps)
    pairs = _pairs(layout.num_rooms)
    starts = [(1 / len(pairs), State(s, t, s, 0), (s, t)) for s, t in pairs]

    def step(state: State, action: Any) -> list[suite.Transition]:
        state, reward, terminated, truncated = walk(layout, state, action, limit)
        return [suite.Transition(1.0, state, (state.room, state.target), reward, terminated or truncated)]

    result = suite.play_out(starts, decide, step, max_turns=limit + 1)
    figures = suite.summary(
        result, random_spl(num_rooms, layout_seed, limit), optimal_spl(num_rooms, layout_seed, limit)
    )
    success = sum(leaf.prob for leaf in result.leaves if leaf.state.room == leaf.state.target)
    hops = sum(leaf.prob * leaf.state.steps for leaf in result.leaves if leaf.state.room == leaf.state.target)
    figures["success"] = success
    figures["mean_hops"] = hops / success if success > 0 else None  # None: no success (JSON has no NaN)
    figures["mean_shortest"] = sum(layout.distance[s][t] for s, t in pairs) / len(pairs)
    return figures


def _pairs(n: int) -> list[tuple[int, int]]:
    return [(s, t) for s in range(n) for t in range(n) if s != t]


@functools.lru_cache(maxsize=64, typed=True)
def random_spl(num_rooms: int = 8, layout_seed: int = 0, max_steps: int | None = None) -> float:
    """Exact SPL of uniformly random actions over `Discrete(num_rooms)`.

    W[k][room] = E[1 / T] from `room` with k steps used (T = the step that reaches the target, 1/T = 0 on
    failure), computed backwards from k = max_steps; the SPL averages d(start, target) * W[0][start] over pairs.
    """
    layout, limit = settings(num_rooms, layout_seed, max_steps)
    n = layout.num_rooms
    total = 0.0
    for target in range(n):
        later = [0.0] * n  # W[k + 1], all zero past the time limit
        for k in range(limit - 1, -1, -1):
            now = [0.0] * n
            for room in range(n):
                if room == target:
                    continue
                stay = (n - len(layout.doors[room])) * later[room]
                moves = sum(1 / (k + 1) if nxt == target else later[nxt] for nxt in layout.doors[room])
                now[room] = (stay + moves) / n
            later = now
        total += sum(layout.distance[s][target] * later[s] for s in range(n) if s != target)
    return total / (n * (n - 1))


def optimal_spl(num_rooms: int = 8, layout_seed: int = 0, max_steps: int | None = None) -> float:
    """The best SPL: a shortest path earns 1 wherever it fits within `max_steps` (every pair by default)."""
    layout, limit = settings(num_rooms, layout_seed, max_steps)
    pairs = _pairs(layout.num_rooms)
    return sum(layout.distance[s][t] <= limit for s, t in pairs) / len(pairs)


def expert(observation: Any, num_rooms: int = 8, layout_seed: int = 0) -> int:
    """The first move of a shortest path (BFS distances; ties go to the lowest room index); at the goal, stay."""
    layout = make_layout(num_rooms, layout_seed)
    room, target = _rooms(observation, num_rooms)
    if room == target:
        return room
    return next(n for n in layout.doors[room] if layout.distance[n][target] < layout.distance[room][target])


# ---- the agent -----------------------------------------------------------------------------------------------------
class RoomsAgent(Agent):
    """Names a door to walk through. Its hooks read the house from the class attributes `num_rooms` and
    `layout_seed` (the env's defaults); for another house use `RoomsAgent.for_env(num_rooms=..., layout_seed=...)`."""

    num_rooms = 8
    layout_seed = 0
    context_turns = 0  # (room, target) is the whole state

    @classmethod
    def for_env(cls, num_rooms: int = 8, layout_seed: int = 0, max_steps: int | None = None) -> type[RoomsAgent]:
        """The agent for the env made with these arguments (`Game.agent_for` calls it): this class for its own
        house, else a subclass for the house `make_layout(num_rooms, layout_seed)` (validated here)."""
        make_layout(num_rooms, layout_seed)
        if (num_rooms, layout_seed) == (cls.num_rooms, cls.layout_seed):
            return cls
        attributes = {"num_rooms": num_rooms, "layout_seed": layout_seed, "__doc__": cls.__doc__}
        return type(f"{cls.__name__}_{num_rooms}_{layout_seed}", (cls,), attributes)

    def get_system_prompt(self) -> str:
        return "Walk to the goal room. Each turn, reply with the name of one door's room to go there."

    def format_observation(self, observation) -> str:
        return describe(make_layout(self.num_rooms, self.layout_seed), *_rooms(observation, self.num_rooms))

    def action_candidates(self, observation) -> list[str]:
        doors = make_layout(self.num_rooms, self.layout_seed).doors[_rooms(observation, self.num_rooms)[0]]
        return [ROOM_NAMES[n] for n in doors]

    def extract_action(self, response: str) -> int | None:
        """The index of the first room of this house named in `response` (case-insensitive, whole word)."""
        match = _name_pattern(self.num_rooms).search(response)
        return ROOM_NAMES.index(match.group(1).lower()) if match else None


def _rooms(observation: Any, num_rooms: int) -> tuple[int, int]:
    room, target = (int(x) for x in observation)
    if not (0 <= room < num_rooms and 0 <= target < num_rooms):
        raise ValueError(
            f"The observation {observation!r} names a room outside a house of {num_rooms} rooms. For another house, "
            "use `expert(observation, num_rooms, layout_seed)` or the agent `RoomsAgent.for_env(num_rooms=...)`."
        )
    return room, target


@functools.lru_cache(maxsize=64, typed=True)
def _name_pattern(num_rooms: int) -> re.Pattern:
    return re.compile(r"\b(" + "|".join(ROOM_NAMES[:num_rooms]) + r")\b", re.IGNORECASE)


GAME = suite.Game(
    name="rooms",
    env_id="llamagym/Rooms-v0",
    entry_point="llamagym.envs.rooms:RoomsEnv",
    agent=RoomsAgent,
    evaluate=evaluate,
    expert=expert,
    agent_kwargs={"fallback_action": 0},
    env_kwargs={"num_rooms": 8, "layout_seed": 0},
    measure="SPL (success weighted by path length)",
)
