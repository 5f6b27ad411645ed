"""Demonstrations for the SFT warm-start: chat transcripts (JSONL) turned into token-exact episodes.

JSONL format, one episode per line: `{"messages": [{"role": "user", "content": ...}, {"role": "assistant",
"content": ...}, ...]}`; a leading system message is optional (the agent's system prompt is used otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..algos.rollout import Episode, Turn
from .chat import ChatFormatter, Message
from .parsing import parse_action


def response_ids(formatter: ChatFormatter, messages: list[Message], prompt: list[int], eos_ids: set[int]) -> list[int]:
    """Token ids of the final assistant message of `messages`, as the model would produce them after `prompt`.

    Rendered through the chat template and sliced by token count after the prompt, then cut after the first
    end-of-turn token (templates add a newline after it that the model never generates). Falls back to plain
    tokenisation plus an end token when the template's prompt is not a prefix of the rendered conversation.
    """
    full = formatter.encode(messages, add_generation_prompt=False)
    if full[: len(prompt)] == prompt and len(full) > len(prompt):
        reply = full[len(prompt) :]
    else:
        reply = formatter.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        reply = list(reply) + [min(eos_ids)]
    for i, token in enumerate(reply):
        if token in eos_ids:
            return reply[: i + 1]
    return reply


def episode_from_messages(
    formatter: ChatFormatter, system_prompt: str, messages: list[Message], eos_ids: set[int]
) -> Episode:
    """An episode with one turn per assistant message of a user/assistant transcript."""
    if messages and messages[0]["role"] == "system":
        system_prompt, messages = messages[0]["content"], messages[1:]
    episode = Episode(is_demo=True)
    for k, message in enumerate(messages):
        if message.get("role") not in ("user", "assistant") or not isinstance(message.get("content"), str):
            raise ValueError(f"message {k} should have role 'user' or 'assistant' and a string content: {message!r}")
        if message["role"] != "assistant":
            continue
        prompt, _ = formatter.prompt_ids(system_prompt, messages[:k])
        rendered = formatter.messages(system_prompt, messages[: k + 1])
        episode.turns.append(Turn(prompt, response_ids(formatter, rendered, prompt, eos_ids)))
    if not episode.turns:
        raise ValueError("a demonstration needs at least one assistant message")
    return episode


def load_demonstrations(path: str | Path, formatter: ChatFormatter, system_prompt: str, eos_ids: set[int]):
    """Episodes from a JSONL file of transcripts; errors name the file and line."""
    episodes = []
    for number, messages in load_jsonl(path):
        try:
            episodes.append(episode_from_messages(formatter, system_prompt, messages, eos_ids))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    return episodes


def play_expert(agent, env, expert, episodes: int, seed: int | None = None) -> list[Episode]:
    """Episodes of a scripted `expert(observation) -> reply text` in `env`, tokenised as the agent's own turns.

    Raises:
        ValueError: a reply of the expert does not parse into a valid action of the agent.
    """
    played = []
    system_prompt = agent.get_system_prompt()
    for i in range(episodes):
        observation, _ = env.reset(seed=None if seed is None else seed + i)
        history: list[Message] = []
        episode, done = Episode(is_demo=True), False
        while not done:
            history.append({"role": "user", "content": str(agent.format_observation(observation))})
            prompt, _ = agent.formatter.prompt_ids(system_prompt, history)
            reply = expert(observation)
            history.append({"role": "assistant", "content": reply})
            parsed = parse_action(reply, agent.extract_action, agent.fallback_action, agent.action_space)
            if not parsed.valid:
                raise ValueError(f"the expert's reply {reply!r} is not a valid action: {parsed.error}")
            observation, reward, terminated, truncated, _ = env.step(parsed.action)
            rendered = agent.formatter.messages(system_prompt, history)
            episode.turns.append(Turn(prompt, response_ids(agent.formatter, rendered, prompt, agent.eos_ids), reward))
            done = terminated or truncated
        played.append(episode)
    return played


def load_jsonl(path: str | Path) -> list[tuple[int, list[Message]]]:
    """Read (line number, transcript) pairs from a JSONL file; errors name the file and line."""
    transcripts = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                messages = record["messages"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: expected a JSON object with a 'messages' list ({exc})") from None
            if not isinstance(messages, list):
                raise ValueError(f"{path}:{number}: 'messages' should be a list of {{role, content}} objects")
            transcripts.append((number, messages))
    return transcripts
