"""Turning a model reply into an env action: JSON first, then the user's `extract_action`, else a fallback.

An unparsable reply never crashes the loop and never hands `None` to `env.step`; the caller counts it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

_JSON_OBJECT = re.compile(r"\{[^{}]*\}")


class ParsedAction(NamedTuple):
    action: Any  # what goes to env.step (the fallback when invalid)
    valid: bool  # False when the reply could not be turned into an action
    error: str | None  # why it was invalid, for logs


def json_action(response: str) -> tuple[bool, Any]:
    """The value of the first `{"action": ...}` object in `response`, as (found, value)."""
    for match in _JSON_OBJECT.finditer(response):
        try:
            obj = json.loads(match.group(0))
        except ValueError:
            continue
        if isinstance(obj, dict) and "action" in obj:
            return True, obj["action"]
    return False, None


def _coerce(value: Any, action_space) -> Any:
    """Make a JSON value fit a Discrete space: "1" and 1.0 become 1; anything else is returned unchanged."""
    if action_space is not None and type(action_space).__name__ == "Discrete":
        if isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value.strip())
    return value


def _in_space(action: Any, action_space) -> bool:
    if action_space is None:
        return True
    try:
        return bool(action_space.contains(action))
    except (TypeError, ValueError):  # e.g. a string handed to a numeric space
        return False


def parse_action(
    response: str, extract_action: Callable[[str], Any], fallback_action: Any, action_space=None
) -> ParsedAction:
    """Parse `response` into an action.

    Order: a JSON object with an "action" key (its value, coerced to int for Discrete spaces; a string value is
    handed to `extract_action`), then `extract_action(response)`. The result must not be None and, when
    `action_space` is given, must be in it. Otherwise (or if `extract_action` raises) the fallback is returned.
    """
    candidates: list[Callable[[], Any]] = []
    found, value = json_action(response)
    if found:
        value = _coerce(value, action_space)
        if isinstance(value, str) and not _in_space(value, action_space):
            candidates.append(lambda: extract_action(value))
        else:
            candidates.append(lambda: value)
    candidates.append(lambda: extract_action(response))

    errors = []
    for candidate in candidates:
        try:
            action = candidate()
        except Exception as exc:  # a user hook may raise anything; the loop must go on
            errors.append(f"extract_action raised {type(exc).__name__}: {exc}")
            continue
        if action is None:
            errors.append("extract_action returned None")
        elif not _in_space(action, action_space):
            errors.append(f"action {_short(action)} is not in the action space {action_space}")
        else:
            return ParsedAction(action, True, None)
    return ParsedAction(fallback_action, False, "; ".join(errors))


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
