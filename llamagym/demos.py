"""Demonstrations for the SFT warm-start: chat transcripts (JSONL) turned into token-exact episodes.

JSONL format, one episode per line: `{"messages": [{"role": "user", "content": ...}, {"role": "assistant",
"content": ...}, ...]}`; a leading system message is optional (the agent's system prompt is used otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

from .chat import ChatFormatter, Message
from .rollout import Episode, Turn


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
