"""What a suite game provides, the registry of games, and exact play-out of a deterministic policy.

A suite game is a plain Gymnasium env plus three things that say what "learned" means:
- a ready `Agent` subclass (its hooks and action names),
- `evaluate(decide, **env_kwargs)`: the exact figures of a deterministic (greedy) policy, beside uniform random
  play and the best achievable, with a normalised score (0 = random, 1 = optimal),
- `expert(observation) -> action`: the optimal policy, so tests can check that it scores 1.

A policy is evaluated through a *decider*: `decide(paths) -> actions`, one env action per path, where a path is the
tuple of observations of one episode so far (the last one is the observation to act on). A deterministic policy's
replies are a function of the observations it has seen, so paths are all an evaluator needs to replay a policy that
reads its conversation; a decider whose `markov` attribute is true looks at the last observation only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

Path = tuple  # the observations of one episode so far, oldest first
Decide = Callable[[list[Path]], list[Any]]


@dataclass(frozen=True)
class Game:
    """One game of the learning suite.

    Attributes:
        name: short name used on the command line and in tables, e.g. "tictactoe".
        env_id: the Gymnasium id, e.g. "llamagym/TicTacToe-v0" (registered when `llamagym.envs` is imported).
        entry_point: the env class as "module:Class", for `gymnasium.register`.
        agent: the ready `Agent` subclass for this game at its default size (see `agent_for`).
        evaluate: `evaluate(decide, **env_kwargs) -> figures`; the figures hold at least `score` (the game's own
            measure), `random`, `optimal` and `normalised`.
        expert: `expert(observation) -> action`, an optimal policy (the evaluators' tests use it).
        agent_kwargs: what `Agent(...)` needs to know about the env besides the model, e.g. `fallback_action`.
        env_kwargs: the keyword arguments of the default size or difficulty (passed to `gym.make` and `evaluate`).
        measure: what `score` is, in words, for tables ("expected return", "success rate", ...).
    """

    name: str
    env_id: str
    entry_point: str
    agent: type
    evaluate: Callable[..., dict[str, Any]]
    expert: Callable[[Any], Any]
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    measure: str = "expected return"

    def agent_for(self, **env_kwargs) -> type:
        """The agent class for an env made with `env_kwargs` (over the defaults): `agent.for_env(**kwargs)` when the
        agent defines it (its hooks depend on the size, e.g. the rooms of a house), else `agent`."""
        for_env = getattr(self.agent, "for_env", None)
        return for_env(**{**self.env_kwargs, **env_kwargs}) if for_env is not None else self.agent


GAMES: dict[str, Game] = {}


def register_game(game: Game) -> Game:
    """Add `game` to `GAMES`; a name already taken raises."""
    if game.name in GAMES:
        raise ValueError(f"A suite game named {game.name!r} is already registered.")
    GAMES[game.name] = game
    return game


def get_game(name: str) -> Game:
    """The suite game called `name`; an unknown name lists the known ones."""
    if name not in GAMES:
        raise KeyError(f"No suite game named {name!r}. Known games: {', '.join(sorted(GAMES))}.")
    return GAMES[name]


def normalised(score: float, random: float, optimal: float) -> float:
    """(score - random) / (optimal - random): 0 for uniform random play, 1 for the best achievable.

    Raises:
        ValueError: `optimal` equals `random` (nothing to learn).
    """
    if optimal == random:
        raise ValueError(f"The optimal score equals the random one ({optimal}): the game has nothing to learn.")
    return (score - random) / (optimal - random)


def freeze(observation: Any) -> Hashable:
    """A hashable stand-in for an observation: arrays and lists become tuples, dicts sorted item tuples."""
    if hasattr(observation, "tolist"):  # numpy arrays and scalars, torch tensors
        observation = observation.tolist()
    if isinstance(observation, dict):
        return tuple((key, freeze(value)) for key, value in sorted(observation.items()))
    if isinstance(observation, (list, tuple)):
        return tuple(freeze(value) for value in observation)
    return observation


def markov(policy: Callable[[Any], Any]) -> Decide:
    """A decider from `policy(observation) -> action` (an expert, a table): it sees the last observation only."""

    def decide(paths: list[Path]) -> list[Any]:
        return [policy(path[-1]) for path in paths]

    decide.markov = True
    return decide


def ask_table(decide: Decide, states: Sequence, what: str) -> tuple[list[Any], float | None]:
    """A Markov decider's action in each of `states`, asked once for all (the paths `(state,)`), and the share of
    them whose reply named no valid action (None when the decider cannot tell): what an evaluator that plays a
    policy's table exactly needs. `what` names the evaluation in the error.

    Raises:
        ValueError: `decide` is not Markov (its `markov` attribute is not true).
        RuntimeError: `decide` returned the wrong number of actions.
    """
    if not getattr(decide, "markov", False):
        raise ValueError(
            f"{what} needs a policy of the current observation only (a decider whose `markov` attribute is true, e.g. "
            f"an agent with `context_turns = 0`): a policy that reads earlier turns is not a table over the "
            f"{len(states)} states."
        )
    paths = [(state,) for state in states]
    actions = list(decide(paths))
    if len(actions) != len(paths):
        raise RuntimeError(f"The policy returned {len(actions)} actions for {len(paths)} observations.")
    valid = getattr(decide, "valid", None)
    invalid = None if valid is None else sum(not ok for ok in valid(paths)) / len(paths)
    return actions, invalid


class Transition(NamedTuple):
    """One outcome of an action: its probability, the next state and observation, the reward, and the end."""

    prob: float
    state: Any
    observation: Any
    reward: float
    done: bool


class Leaf(NamedTuple):
    """One finished episode of a play-out, with its probability."""

    prob: float
    path: Path  # every observation the policy acted on
    actions: tuple  # the actions it took
    total: float  # undiscounted return
    state: Any  # the final state (games read their outcome from it)


class PlayOut(NamedTuple):
    leaves: list[Leaf]
    invalid_rate: float | None  # probability-weighted share of turns whose reply could not be parsed (None: unknown)


def play_out(
    starts: Iterable[tuple[float, Any, Any]],
    decide: Decide,
    step: Callable[[Any, Any], Sequence[Transition]],
    max_turns: int = 1000,
) -> PlayOut:
    """Every episode a deterministic policy can play, with its exact probability: expectation without sampling.

    The tree is walked one turn at a time, and all paths of a turn go to `decide` in one call (one batched
    forward pass for an LLM policy).

    Args:
        starts: (probability, state, first observation) of each start; probabilities sum to 1.
        decide: the policy (see the module docstring). If it has a `valid(paths) -> list[bool]` method, it is
            asked after each call, and the share of invalid replies is reported.
        step: `step(state, action)` -> the transitions of the game's dynamics (chance over the opponent, cards...).
        max_turns: a safety bound: an episode still running after this many turns raises.

    Returns:
        The leaves (finished episodes) and the invalid-reply rate.

    Raises:
        RuntimeError: an episode ran past `max_turns`, or `decide` returned the wrong number of actions.
    """
    frontier = [(p, state, (obs,), (), 0.0) for p, state, obs in starts if p > 0]
    leaves: list[Leaf] = []
    turns = invalid = 0.0
    valid = getattr(decide, "valid", None)
    for _ in range(max_turns):
        if not frontier:
            return PlayOut(leaves, invalid / turns if valid is not None and turns else None)
        paths = [node[2] for node in frontier]
        actions = list(decide(paths))
        if len(actions) != len(paths):
            raise RuntimeError(f"The policy returned {len(actions)} actions for {len(paths)} observations.")
        flags = valid(paths) if valid is not None else [True] * len(paths)
        following = []
        for (p, state, path, taken, total), action, ok in zip(frontier, actions, flags, strict=True):
            turns += p
            invalid += p * (not ok)
            for t in step(state, action):
                if t.prob <= 0:
                    continue
                prob, history, reward = p * t.prob, (*taken, action), total + t.reward
                if t.done:
                    leaves.append(Leaf(prob, path, history, reward, t.state))
                else:
                    following.append((prob, t.state, (*path, t.observation), history, reward))
        frontier = following
    raise RuntimeError(f"An episode was still running after {max_turns} turns; the game should end sooner.")


def summary(out: PlayOut, random: float, optimal: float, score: float | None = None) -> dict[str, Any]:
    """The figures every evaluator reports from a play-out: `score` (the expected return unless given), `random`,
    `optimal`, `normalised`, `expected_return` and `mean_turns` (both exact), and `invalid_rate` when known."""
    expected = sum(leaf.prob * leaf.total for leaf in out.leaves)
    score = expected if score is None else score
    figures = {
        "score": score,
        "random": random,
        "optimal": optimal,
        "normalised": normalised(score, random, optimal),
        "expected_return": expected,
        "mean_turns": sum(leaf.prob * len(leaf.actions) for leaf in out.leaves),
    }
    if out.invalid_rate is not None:
        figures["invalid_rate"] = out.invalid_rate
    return figures
