"""The learning suite: small text games, each a plain Gymnasium env with a ready `Agent` and an exact evaluator.

    import gymnasium as gym
    import llamagym.envs  # registers the ids below with Gymnasium

    env = gym.make("llamagym/TicTacToe-v0")
    figures = llamagym.envs.evaluate("tictactoe", agent)  # exact, greedy; 0 = random play, 1 = optimal

| name | id | what is learned | score |
| --- | --- | --- | --- |
| tictactoe | llamagym/TicTacToe-v0 | beat a random opponent | expected return |
| guess_number | llamagym/GuessNumber-v0 | find a number from higher/lower hints | success rate |
| rooms | llamagym/Rooms-v0 | walk a house of named rooms to a target | success weighted by path length |
| blackjack | llamagym/Blackjack-v0 | Gymnasium's Blackjack-v1 (natural=False, sab=False) | expected return |
| arithmetic | llamagym/Arithmetic-v0 | one-turn word problems with a checkable answer | held-out accuracy |

`GAMES` maps each name to its `Game` (env id, agent class, evaluator, expert); `register_game` adds one.
"""

from __future__ import annotations

import gymnasium as gym

from . import arithmetic, blackjack, guess_number, rooms, tictactoe
from .policies import AgentPolicy, TextPolicy, evaluate, openai_chat
from .suite import GAMES, Game, get_game, markov, normalised, play_out, register_game

for _module in (tictactoe, guess_number, rooms, blackjack, arithmetic):
    _game = register_game(_module.GAME)
    if _game.env_id not in gym.registry:
        gym.register(id=_game.env_id, entry_point=_game.entry_point, kwargs=dict(_game.env_kwargs))

__all__ = [
    "GAMES",
    "AgentPolicy",
    "Game",
    "TextPolicy",
    "evaluate",
    "get_game",
    "markov",
    "normalised",
    "openai_chat",
    "play_out",
    "register_game",
]
