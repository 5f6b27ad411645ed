"""Conversations rendered with the tokenizer's own chat template, within a token budget.

A prompt is always `apply_chat_template(..., add_generation_prompt=True)` token ids; we never split strings on
template markers. Templates without a system role get the system prompt folded into the first user message.
When a conversation outgrows the budget, the oldest user/assistant exchanges are dropped (system prompt kept).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

Message = dict[str, str]


def supports_system_role(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a system message (Gemma-style templates raise instead)."""
    marker = "llamagym-system-probe"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": marker}, {"role": "user", "content": "hi"}], tokenize=False
        )
    except Exception:  # jinja2 raises TemplateError (or a subclass of Exception) for "system role not supported"
        return False
    return marker in text


class ChatFormatter:
    """Builds prompt token ids for a system prompt plus a history of user/assistant messages.

    Args:
        tokenizer: a tokenizer with a chat template (the loader guarantees one).
        max_prompt_tokens: the budget for one prompt, in tokens.
        system_role: whether the template takes a system message; None = detect it.
        context_turns: past exchanges (user + assistant message pairs) a prompt keeps; None = all that fit.
    """

    def __init__(
        self,
        tokenizer,
        max_prompt_tokens: int = 1024,
        system_role: bool | None = None,
        context_turns: int | None = None,
    ):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "The tokenizer has no chat template. Load it with llamagym.load_model_and_tokenizer (which adds a "
                "fallback template) or set `tokenizer.chat_template` yourself."
            )
        if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
            raise ValueError(f"`max_prompt_tokens` should be an integer >= 1. Received {max_prompt_tokens!r}.")
        if context_turns is not None and (not isinstance(context_turns, int) or context_turns < 0):
            raise ValueError(f"`context_turns` should be None or an integer >= 0. Received {context_turns!r}.")
        self.context_turns = context_turns
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.system_role = supports_system_role(tokenizer) if system_role is None else system_role

    def messages(self, system_prompt: str, history: list[Message]) -> list[Message]:
        """The message list the template sees: system first, or folded into the first user message."""
        if not system_prompt:
            return list(history)
        if self.system_role:
            return [{"role": "system", "content": system_prompt}, *history]
        if history and history[0]["role"] == "user":
            first = {"role": "user", "content": f"{system_prompt}\n\n{history[0]['content']}"}
            return [first, *history[1:]]
        return [{"role": "user", "content": system_prompt}, *history]

    def encode(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` through the chat template."""
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

    def prompt_ids(self, system_prompt: str, history: list[Message]) -> tuple[list[int], int]:
        """Prompt ids for the next assistant turn, and how many old messages were dropped to fit the budget.

        `history` must end with the user message to answer. Oldest exchanges go first; the system prompt and the
        last user message always stay.

        Raises:
            ValueError: the system prompt plus the last user message alone exceed `max_prompt_tokens`.
        """
        if not history or history[-1]["role"] != "user":
            raise ValueError("The conversation must end with a user message before the assistant can reply.")
        start = 0 if self.context_turns is None else max(0, len(history) - 1 - 2 * self.context_turns)
        while True:
            ids = self.encode(self.messages(system_prompt, history[start:]))
            if len(ids) <= self.max_prompt_tokens:
                if start:
                    logger.debug("dropped %d old messages to fit %d tokens", start, self.max_prompt_tokens)
                return ids, start
            if start >= len(history) - 1:
                raise ValueError(
                    f"The system prompt plus the latest observation take {len(ids)} tokens, more than "
                    f"`max_prompt_tokens`={self.max_prompt_tokens}. Raise max_prompt_tokens or shorten the system "
                    "prompt / format_observation output."
                )
            # drop the oldest exchange (a user message and the assistant reply that follows it)
            start += 2 if start + 1 < len(history) - 1 and history[start + 1]["role"] == "assistant" else 1
