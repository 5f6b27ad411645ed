"""Games the defaults were not tuned on: Gymnasium's own FrozenLake and CliffWalking, as a user would bring them.

Each agent is what a user writes from the README's quickstart for a game whose observation is the whole state (three
hooks, `action_names`, `context_turns = 0`; the two share the hooks that read a cell and a move, `GridAgent`); nothing
else is set. The runs go through `learning_suite.py` (the same loop, budget, exact evaluations and outputs; every flag
of it works here), with four games registered beside the suite's:

| name | env | what is learned | score: exact, greedy, from the start | random | optimal |
| --- | --- | --- | --- | --- | --- |
| `frozenlake` | `FrozenLake-v1` 4x4, no slipping, 100 moves | the goal, 6 moves past 4 holes | P(goal) | 0.0139 | 1 |
| `slippery` | the same, slippery, 100 moves | moves safe wherever the ice slides | P(goal) | 0.0139 | 0.7402 |
| `cliff` | `CliffWalking-v1` 4x12, 50 moves | the goal past a cliff (-100); -1 a move | return | -579.16 | -13 |
| `cliff200` | the same, 200 moves | the same, with room for random play to find the goal | return | -2079.12 | -13 |

The greedy policy plays one episode; random play is exact (the distribution of states carried move by move). A move into
a wall stays put, so a policy can loop for ever; FrozenLake pays 1 at the goal whatever the path, so only the discount
(`PPOConfig.gamma` < 1; 0.99 by default) makes a loop worse than a walk.

On the slippery lake a move goes the way chosen one time in three and otherwise to either side of it, so an episode is a
distribution, not a path: the greedy policy is asked once for every cell play can reach (the agent is Markov) and its
table is played exactly, carrying the distribution over cells move by move, as random play is. Its optimal is the best
policy found, not proven best: value iteration's for the chance of ever reaching the goal, played for 100 moves (0.7402,
about 45 moves a game), which no change of one cell's move improves (the test checks it). Random play is the plain
lake's: a slip sends a uniformly random move in a uniformly random direction too.

    python benchmarks/held_out_games.py --games frozenlake,slippery,cliff,cliff200 --modes score --seeds 0 --budget 600
"""

from __future__ import annotations

import sys

import gymnasium as gym
import learning_suite  # beside this file
import numpy as np

from llamagym import Agent
from llamagym.envs import suite

FROZEN_LAKE_MOVES = ["left", "down", "right", "up"]  # FrozenLake's action order
CLIFF_MOVES = ["up", "right", "down", "left"]  # CliffWalking's


def one_word(response: str, words: list[str]) -> int | None:
    """The action of the one move `response` names; None when it names none or several."""
    named = [i for i, word in enumerate(words) if word in response.lower()]
    return named[0] if len(named) == 1 else None


class GridAgent(Agent):
    """A walker on a grid whose observation is its cell's index; a game's agent gives its moves, width and prompt."""

    columns: int
    context_turns = 0

    def format_observation(self, observation) -> str:
        return f"You are at row {int(observation) // self.columns}, column {int(observation) % self.columns}."

    def extract_action(self, response: str):
        return one_word(response, self.action_names)


class FrozenLakeAgent(GridAgent):
    action_names, columns = FROZEN_LAKE_MOVES, 4

    def get_system_prompt(self) -> str:
        return (
            "You walk on a frozen lake, a grid of 4 rows and 4 columns; row 0 is the top row and column 0 the left "
            "column. Four cells are holes: row 1 column 1, row 1 column 3, row 2 column 3 and row 3 column 0. "
            "Falling into a hole ends the game. Reach the goal at row 3, column 3. "
            "Reply with one word: left, down, right or up."
        )


class SlipperyLakeAgent(FrozenLakeAgent):
    ice = (
        " The ice is slippery: a move goes the way you chose one time in three, and otherwise to one of the two "
        "directions at right angles to it."
    )

    def get_system_prompt(self) -> str:
        return super().get_system_prompt().replace(" Falling", f"{self.ice} Falling")


class CliffAgent(GridAgent):
    action_names, columns = CLIFF_MOVES, 12

    def get_system_prompt(self) -> str:
        return (
            "You walk on a grid of 4 rows and 12 columns; row 0 is the top row and column 0 the left column. You "
            "start at row 3, column 0 and the goal is at row 3, column 11. The cells of row 3 between them are a "
            "cliff: stepping onto one costs 100 points and sends you back to the start. Every move costs 1 point. "
            "Reply with one word: up, right, down or left."
        )


def carry(table: dict, start: int, limit: int, policy: dict[int, int] | None = None) -> tuple[float, float]:
    """Exact expected return and mean number of moves of `limit` moves from `start`, the distribution over states
    carried move by move through the env's transition `table` (`env.unwrapped.P`: state -> action -> [(prob, next
    state, reward, terminated)]); `policy` (state -> action) plays, or uniform random play when None."""
    mass, total, moves = {start: 1.0}, 0.0, 0.0
    for _ in range(limit):
        following: dict[int, float] = {}
        for state, p in mass.items():
            moves += p
            actions = list(table[state]) if policy is None else [policy[state]]
            for action in actions:
                for prob, nxt, reward, terminated in table[state][action]:
                    share = p * prob / len(actions)
                    total += share * reward
                    if not terminated:
                        following[int(nxt)] = following.get(int(nxt), 0.0) + share
        mass = following
    return total, moves


def random_return(table: dict, start: int, limit: int) -> float:
    """Exact expected return of uniform random play for `limit` moves from `start` (`carry`)."""
    return carry(table, start, limit)[0]


def reachable(table: dict, start: int) -> list[int]:
    """The states play can be in before its end, from `start` (in the order found)."""
    found, todo = [start], [start]
    while todo:
        state = todo.pop()
        for outcomes in table[state].values():
            for prob, nxt, _, terminated in outcomes:
                if prob > 0 and not terminated and int(nxt) not in found:
                    found.append(int(nxt))
                    todo.append(int(nxt))
    return found


def best_policy(table: dict, states: list[int], sweeps: int = 2000) -> dict[int, int]:
    """Value iteration's policy for the most total reward ever collected (undiscounted: for a lake, the chance of
    ever reaching the goal); ties go to the lowest action."""
    value = dict.fromkeys(states, 0.0)

    def worth(state: int, action: int) -> float:
        return sum(p * (r + (0.0 if end else value[int(n)])) for p, n, r, end in table[state][action])

    for _ in range(sweeps):
        value = {state: max(worth(state, a) for a in table[state]) for state in states}
    return {state: max(table[state], key=lambda a: (round(worth(state, a), 9), -a)) for state in states}


def chance_evaluator(env_id: str, limit: int, **env_kwargs):
    """(`evaluate(decide)`, expert table) of a toy-text env with chance in its moves, for a Markov policy: it is asked
    once for every state play can reach (`reachable`), and its table plays exactly (`carry`). The optimal is
    `best_policy`'s return over `limit` moves."""
    env = gym.make(env_id, **env_kwargs).unwrapped
    table, start = env.P, int(np.argmax(env.initial_state_distrib))
    states = reachable(table, start)
    random, expert = random_return(table, start, limit), best_policy(table, states)
    optimal = carry(table, start, limit, expert)[0]

    def evaluate(decide, **_) -> dict:
        actions, invalid = suite.ask_table(decide, states, "This exact evaluation")
        score, moves = carry(table, start, limit, dict(zip(states, map(int, actions), strict=True)))
        figures = {"score": score, "random": random, "optimal": optimal, "expected_return": score, "mean_turns": moves}
        figures["normalised"] = suite.normalised(score, random, optimal)
        if invalid is not None:
            figures["invalid_rate"] = invalid
        return figures

    return evaluate, expert


def evaluator(env_id: str, limit: int, optimal: float, **env_kwargs):
    """`evaluate(decide)` of a deterministic toy-text env: the greedy policy's one episode from the start."""
    env = gym.make(env_id, **env_kwargs).unwrapped
    table, start = env.P, int(np.argmax(env.initial_state_distrib))
    random = random_return(table, start, limit)

    def evaluate(decide, **_) -> dict:
        def step(state, action):
            here, moves = state
            ((_, nxt, reward, terminated),) = table[here][action]
            done = bool(terminated) or moves + 1 >= limit
            return [suite.Transition(1.0, (int(nxt), moves + 1), int(nxt), float(reward), done)]

        return suite.summary(suite.play_out([(1.0, (start, 0), start)], decide, step, limit + 1), random, optimal)

    return evaluate


def frozen_lake_expert(observation) -> int:
    """A shortest path from the start: down, down, right, down, right, right."""
    return {0: 1, 4: 1, 8: 2, 9: 1, 13: 2, 14: 2}.get(int(observation), 0)


def cliff_expert(observation) -> int:
    """Up from the start, right along the cliff's edge, down into the goal."""
    row, column = divmod(int(observation), 12)
    return 0 if row == 3 else 1 if column < 11 else 2


def cliff_game(name: str, env_id: str) -> suite.Game:
    """CliffWalking with the move limit `LIMITS[name]` (for the registered env and its evaluator)."""
    evaluate = evaluator("CliffWalking-v1", LIMITS[name], -13.0)
    entry_point = "gymnasium.envs.toy_text:CliffWalkingEnv"
    return suite.Game(
        name, env_id, entry_point, CliffAgent, evaluate, cliff_expert, agent_kwargs={"fallback_action": 0}
    )


# moves per episode: the registered time limit and the evaluators'. CliffWalking twice: in 50 moves random play finds
# the goal once in about 800 episodes (1 in 100 keeping off the cliff), in 200 once in 43 (1 in 3.5)
LIMITS = {"frozenlake": 100, "slippery": 100, "cliff": 50, "cliff200": 200}
SLIPPERY, SLIPPERY_EXPERT = chance_evaluator("FrozenLake-v1", LIMITS["slippery"], is_slippery=True)
GAMES = [
    suite.Game(
        "frozenlake",
        "heldout/FrozenLake-v0",
        "gymnasium.envs.toy_text:FrozenLakeEnv",
        FrozenLakeAgent,
        evaluator("FrozenLake-v1", LIMITS["frozenlake"], 1.0, is_slippery=False),
        frozen_lake_expert,
        agent_kwargs={"fallback_action": 0},
        env_kwargs={"is_slippery": False},
        measure="success rate",
    ),
    suite.Game(
        "slippery",
        "heldout/FrozenLakeSlippery-v0",
        "gymnasium.envs.toy_text:FrozenLakeEnv",
        SlipperyLakeAgent,
        SLIPPERY,
        lambda observation: SLIPPERY_EXPERT[int(observation)],
        agent_kwargs={"fallback_action": 0},
        env_kwargs={"is_slippery": True},
        measure="success rate",
    ),
    cliff_game("cliff", "heldout/CliffWalking-v0"),
    cliff_game("cliff200", "heldout/CliffWalking200-v0"),
]


def register() -> None:
    """Add the held-out games to the suite's registry and to Gymnasium's (once)."""
    for game in GAMES:
        if game.name not in suite.GAMES:
            suite.register_game(game)
        if game.env_id not in gym.registry:
            kwargs = dict(game.env_kwargs)
            gym.register(game.env_id, game.entry_point, max_episode_steps=LIMITS[game.name], kwargs=kwargs)


if __name__ == "__main__":
    register()
    argv = sys.argv[1:]
    if not any(arg == "--games" or arg.startswith("--games=") for arg in argv):
        argv = ["--games", ",".join(game.name for game in GAMES), *argv]
    sys.exit(learning_suite.main(argv))
