"""Env slots: each env's running episode (turns, conversation, number) and their form inside a checkpoint.

A checkpoint carries every slot's running episode and the finished episodes not yet trained on, so a resumed run
continues them exactly and nothing collected is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..algos.rollout import Episode
from .chat import Message


@dataclass
class Slot:
    """One env's running episode: its turns, its conversation and its number (for error messages)."""

    episode: Episode
    history: list[Message]
    number: int
    last_reply: str = ""

    def where(self, offset: int = 0) -> str:
        return f"episode {self.number}, turn {len(self.episode.turns) + offset}"


def episodes_state(slots: list[Slot], batch: list[Episode]) -> dict:
    """The running episodes of `slots` and the untrained `batch`, as picklable plain containers."""
    return {"slots": [dict(vars(slot)) for slot in slots], "batch": list(batch)}


def load_episodes_state(state: dict) -> tuple[list[Slot], list[Episode]]:
    """Inverse of `episodes_state`: (slots, batch)."""
    return [Slot(**slot) for slot in state["slots"]], list(state["batch"])
