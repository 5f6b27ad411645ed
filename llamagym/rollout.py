"""Turns and episodes, and their padded tensors: the seam between the agent (prompts) and the trainer (losses).

The agent records a `Turn` per action with the exact token ids the model saw and produced; the trainer never
sees a prompt string. `collate` right-pads turns into one batch whose response mask covers exactly the reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass
class Turn:
    """One action: the prompt the model saw, the reply it produced and the reward that followed."""

    prompt_ids: list[int]  # chat-template token ids ending with the assistant header
    response_ids: list[int]  # the sampled reply tokens (including the end-of-turn token when produced)
    reward: float = 0.0  # env reward summed over assign_reward calls (plus any format penalty)
    valid: bool = True  # False when the reply could not be parsed and the fallback action was used


@dataclass
class Episode:
    """A finished episode. `truncated` episodes bootstrap from V(next state), terminated ones never do."""

    turns: list[Turn] = field(default_factory=list)
    truncated: bool = False
    bootstrap_prompt_ids: list[int] | None = None  # the prompt of the state after the last turn (truncation only)
    is_demo: bool = False  # a demonstration (JSONL or scripted expert), not the policy's own play

    @property
    def env_return(self) -> float:
        return float(sum(turn.reward for turn in self.turns))


class TurnBatch(NamedTuple):
    input_ids: torch.Tensor  # (N, L) prompt + response, right-padded
    attention_mask: torch.Tensor  # (N, L) 1 on real tokens
    response_mask: torch.Tensor  # (N, L) float, 1 exactly on the response tokens
    value_index: torch.Tensor  # (N,) position of the last prompt token, where V(s) is read


def collate(turns: list[Turn], pad_token_id: int, device: torch.device | str = "cpu") -> TurnBatch:
    """Right-pad `turns` into tensors; the response mask is placed by token counts, never by string search.

    Raises:
        ValueError: a turn with an empty prompt or response (nothing to predict from or to train on).
    """
    if not turns:
        raise ValueError("collate() needs at least one turn.")
    for i, turn in enumerate(turns):
        if not turn.prompt_ids or not turn.response_ids:
            raise ValueError(f"turn {i} has an empty prompt or response; every turn needs both.")
    length = max(len(t.prompt_ids) + len(t.response_ids) for t in turns)
    input_ids = torch.full((len(turns), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(turns), length), dtype=torch.long)
    response_mask = torch.zeros((len(turns), length), dtype=torch.float32)
    value_index = torch.empty(len(turns), dtype=torch.long)
    for i, turn in enumerate(turns):
        p, r = len(turn.prompt_ids), len(turn.response_ids)
        input_ids[i, : p + r] = torch.tensor(turn.prompt_ids + turn.response_ids, dtype=torch.long)
        attention_mask[i, : p + r] = 1
        response_mask[i, p : p + r] = 1.0
        value_index[i] = p - 1
    return TurnBatch(*(t.to(device) for t in (input_ids, attention_mask, response_mask, value_index)))


def prompt_batch(prompts: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu") -> TurnBatch:
    """Right-padded prompts alone (no response), for reading V(s) at their last token."""
    length = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, : len(prompt)] = 1
    value_index = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)
    response_mask = torch.zeros_like(input_ids, dtype=torch.float32)
    return TurnBatch(*(t.to(device) for t in (input_ids, attention_mask, response_mask, value_index)))


def left_pad(prompts: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu"):
    """Left-padded (input_ids, attention_mask) for batched generation."""
    length = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, length - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def select(batch: TurnBatch, index: torch.Tensor) -> TurnBatch:
    """Rows `index` of a batch, trimmed to the longest remaining sequence (less padding, less compute)."""
    rows = TurnBatch(*(t[index] for t in batch))
    length = int(rows.attention_mask.sum(dim=1).max())
    return TurnBatch(
        rows.input_ids[:, :length], rows.attention_mask[:, :length], rows.response_mask[:, :length], rows.value_index
    )


def minibatch_indices(n: int, size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A shuffled partition of range(n) into chunks of at most `size` (every index exactly once)."""
    order = torch.randperm(n, generator=generator)
    return list(order.split(size))
