"""Any policy on the suite's games: a trained `Agent`, or any `reply(messages) -> text` callable (a script, or a
model behind an OpenAI-compatible endpoint), evaluated exactly with the same figures.

    from llamagym.envs import evaluate, openai_chat
    evaluate("tictactoe", agent)                                              # the agent you trained
    evaluate("tictactoe", openai_chat("http://localhost:8000/v1", "my-model"))  # an API model, same hooks

Evaluation is greedy: an agent replies with its arg-max (scoring mode) or greedy decoding (generate mode), in
float32 as `Agent.predict` does; a text policy should be deterministic too (the client asks for temperature 0).
Each distinct conversation is asked once.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from ..agent import Agent
from ..agent.parsing import parse_action
from .suite import Decide, Game, Path, freeze, get_game

Message = dict[str, str]
Reply = Callable[[list[Message]], str]


class _Replayed:
    """What both deciders share: each distinct path is answered once and remembered with its conversation, the
    action and whether the reply named one; a Markov policy (`context_turns` 0) keys paths by their last
    observation only."""

    def __init__(self, markov: bool):
        self.markov = markov
        self._done: dict[Any, tuple[list[Message], Any, bool]] = {}  # key -> (conversation with reply, action, valid)

    def _key(self, path: Path):
        return freeze(path[-1:] if self.markov else path)

    def _history(self, path: Path) -> list[Message]:
        """The conversation before the path's last observation (empty for a Markov policy or a first turn)."""
        return [] if self.markov or len(path) == 1 else self._done[self._key(path[:-1])][0]

    def valid(self, paths: list[Path]) -> list[bool]:
        """Whether each path's reply named a valid action (asked after `__call__`)."""
        return [self._done[self._key(path)][2] for path in paths]

    def replies(self) -> list[tuple[Any, str, Any, bool]]:
        """What the policy said, to read after an evaluation: for each distinct path asked so far, in the order
        asked, (its key: the last observation for a Markov policy, else the whole path; the reply; the action played;
        whether the reply named one, else the fallback was played)."""
        return [(key, said[-1]["content"], action, valid) for key, (said, action, valid) in self._done.items()]


class AgentPolicy(_Replayed):
    """The greedy policy of an `Agent` as a decider: its prompts and conversation, one batched call per turn.

    Args:
        agent: a (trained) agent. Its `context_turns` decides whether earlier turns are in the prompt; with 0 the
            policy is Markov and each distinct observation is asked once.
        chunk: observations per batched call (bounds memory).
    """

    def __init__(self, agent: Agent, chunk: int = 64):
        super().__init__(agent.formatter.context_turns == 0)
        self.agent, self.chunk = agent, chunk

    def __call__(self, paths: list[Path]) -> list[Any]:
        # Imported here: acting pulls in generation code that a text-only evaluation never needs.
        from ..agent.choosing import decide

        keys = [self._key(path) for path in paths]
        first = {}
        for key, path in zip(keys, paths, strict=True):
            first.setdefault(key, path)
        todo = [key for key in first if key not in self._done]
        with self.agent.policy.float32(), self.agent.trainer.greedy_weights():  # lent once for every chunk
            for start in range(0, len(todo), self.chunk):
                part = [first[key] for key in todo[start : start + self.chunk]]
                histories = [self._history(path) for path in part]
                wheres = [f"evaluation, turn {len(path)}" for path in part]
                decisions = decide(self.agent, [path[-1] for path in part], histories, wheres, greedy=True)
                for path, d in zip(part, decisions, strict=True):
                    said = [*d.history, {"role": "assistant", "content": d.reply}]
                    self._done[self._key(path)] = (said, d.parsed.action, d.parsed.valid)
        return [self._done[key][1] for key in keys]


class TextPolicy(_Replayed):
    """Any `reply(messages) -> text` as a decider, with an agent's hooks: its system prompt, observation text and
    action parsing (JSON first, then `extract_action`; an unparsable reply plays `fallback_action` and is counted).

    Args:
        reply: called with the chat messages (`[{"role": "system", ...}, {"role": "user", ...}, ...]`), returns
            the reply text.
        hooks: an `Agent`, or an `Agent` subclass used without a model (its hooks must not need one; the suite's
            agents don't). Its `context_turns` says how many earlier exchanges the messages keep.
        fallback_action: the action played for an unparsable reply.
        action_space: the env's action space; a parsed action outside it is invalid.
    """

    def __init__(self, reply: Reply, hooks: Agent | type[Agent], fallback_action: Any = 0, action_space=None):
        if isinstance(hooks, type):
            if not issubclass(hooks, Agent):
                raise TypeError(f"`hooks` should be an Agent or an Agent subclass. Received {hooks!r}.")
            hooks = object.__new__(hooks)  # the hooks only: no model is loaded
        super().__init__(hooks.context_turns == 0)
        self.reply, self.hooks = reply, hooks
        self.fallback_action, self.action_space = fallback_action, action_space
        self.context_turns = hooks.context_turns

    def __call__(self, paths: list[Path]) -> list[Any]:
        for path in paths:
            key = self._key(path)
            if key in self._done:
                continue
            earlier = self._history(path)
            if self.context_turns:
                earlier = earlier[-2 * self.context_turns :]
            user = {"role": "user", "content": str(self.hooks.format_observation(path[-1]))}
            system = {"role": "system", "content": self.hooks.get_system_prompt()}
            text = self.reply([system, *earlier, user])
            if not isinstance(text, str):
                raise TypeError(f"The reply function should return a string. Received {type(text).__name__}.")
            parsed = parse_action(text, self.hooks.extract_action, self.fallback_action, self.action_space)
            said = [*earlier, user, {"role": "assistant", "content": text}]
            self._done[key] = (said, parsed.action, parsed.valid)
        return [self._done[self._key(path)][1] for path in paths]


def openai_chat(
    base_url: str,
    model: str,
    api_key: str | None = None,
    temperature: float = 0.0,
    max_tokens: int = 64,
    timeout: float = 60.0,
) -> Reply:
    """A `reply(messages) -> text` backed by an OpenAI-compatible chat-completions endpoint (vLLM, llama.cpp's
    server, Ollama, a hosted API), with the standard library only.

    Args:
        base_url: the API root, e.g. "http://localhost:8000/v1" (POSTs go to `{base_url}/chat/completions`).
        model: the model name the server expects.
        api_key: sent as a bearer token; None reads `OPENAI_API_KEY` (and sends none when that is unset).
        temperature: 0 makes the evaluated policy (near) deterministic, as the exact evaluators assume.
        max_tokens: the reply's length limit.
        timeout: seconds per request.

    Returns:
        The reply function. It raises `ConnectionError` when the server cannot be reached and `RuntimeError` on an
        HTTP error or a response without a message, each naming the URL.
    """
    url = base_url.rstrip("/") + "/chat/completions"
    key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def reply(messages: list[Message]) -> str:
        body = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
        request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                data = json.loads(response.read().decode())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise RuntimeError(f"{url} answered HTTP {err.code}: {detail}") from None
        except urllib.error.URLError as err:
            raise ConnectionError(f"Could not reach {url} ({err.reason}). Is the server running?") from None
        except ValueError as err:
            raise RuntimeError(f"{url} did not answer with JSON ({err}).") from None
        try:
            return data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"{url} answered without choices[0].message.content: {str(data)[:300]}") from None

    return reply


def as_decider(game: Game, policy: Agent | Reply | Decide, hooks=None, **env_kwargs) -> Decide:
    """Turn what `evaluate` accepts into a decider (see `evaluate`)."""
    if isinstance(policy, Agent):
        return AgentPolicy(policy)
    if hasattr(policy, "markov"):  # already a decider, e.g. `suite.markov(expert)`
        return policy
    if not callable(policy):
        raise TypeError(f"`policy` should be an Agent, a reply(messages) function or a decider. Received {policy!r}.")
    import gymnasium as gym

    env = gym.make(game.env_id, **env_kwargs)
    fallback = game.agent_kwargs.get("fallback_action", 0)
    return TextPolicy(policy, hooks if hooks is not None else game.agent_for(**env_kwargs), fallback, env.action_space)


def evaluate(game: Game | str, policy: Agent | Reply | Decide, hooks=None, **env_kwargs) -> dict[str, Any]:
    """Exact figures of a greedy policy on a suite game, beside random play and the best achievable.

    Args:
        game: a suite game or its name ("tictactoe", "guess_number", "rooms", "blackjack", "arithmetic").
        policy: a trained `Agent` (greedy, its own hooks); a `reply(messages) -> text` function such as
            `openai_chat(...)` (read and parsed with `hooks`); or a decider (`suite.markov(expert)`).
        hooks: for a reply function, the `Agent` (or subclass) whose prompts and parsing to use; default the
            game's own agent.
        **env_kwargs: the game's size or difficulty (default: the game's defaults).

    Returns:
        The game's figures: `score`, `random`, `optimal`, `normalised` (0 = random, 1 = optimal), the game's own
        extras, and `invalid_rate` (share of turns whose reply named no valid action) for agents and reply
        functions.
    """
    game = get_game(game) if isinstance(game, str) else game
    kwargs = {**game.env_kwargs, **env_kwargs}
    return game.evaluate(as_decider(game, policy, hooks, **kwargs), **kwargs)
