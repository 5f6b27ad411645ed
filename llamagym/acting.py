"""Choosing replies for a batch of prompts: sampled generation, or scoring a list of candidate replies.

Both take many prompts (one per env slot) in a single batched call. Generation left-pads and samples; scoring
packs each prompt with its candidates into one sequence and samples from the softmax over their
length-normalised log-likelihoods (every action is valid by construction, one forward pass per step).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from .chat import ChatFormatter
from .demos import response_ids
from .policy import Policy
from .rollout import collate_scored, left_pad


class Actor:
    """Turns prompts into replies with the current policy.

    Args:
        policy: the policy to act with.
        formatter: renders candidate replies through the chat template.
        pad_token_id: padding id for batched prompts.
        eos_ids: tokens that end a reply.
        generation: sampling settings (`max_new_tokens`, `temperature`).
    """

    def __init__(
        self, policy: Policy, formatter: ChatFormatter, pad_token_id: int, eos_ids: set[int], generation: dict
    ):
        self.policy = policy
        self.formatter = formatter
        self.pad_token_id = pad_token_id
        self.eos_ids = eos_ids
        self.generation = generation
        self._candidate_cache: dict[str, list[int]] = {}

    def generate(self, prompts: list[list[int]], greedy: bool = False) -> list[list[int]]:
        """One reply per prompt, sampled (or greedy), cut after the first end-of-turn token."""
        input_ids, attention_mask = left_pad(prompts, self.pad_token_id, self.policy.device)
        config = GenerationConfig(
            max_new_tokens=self.generation["max_new_tokens"],
            do_sample=not greedy,
            temperature=None if greedy else self.generation["temperature"],
            top_k=None if greedy else 0,
            top_p=None if greedy else 1.0,
            pad_token_id=self.pad_token_id,
            eos_token_id=sorted(self.eos_ids),
        )
        output = self.policy.generate(input_ids, attention_mask, generation_config=config)
        replies = []
        for row in output[:, input_ids.shape[1] :].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in self.eos_ids), len(row))
            replies.append(row[:end])
        return replies

    def candidate_ids(self, text: str) -> list[int]:
        """Token ids of `text` as an assistant reply (chat-template exact, with its end-of-turn token); cached."""
        if text not in self._candidate_cache:
            history = [{"role": "user", "content": "."}]
            prompt = self.formatter.encode(self.formatter.messages("", history))
            rendered = self.formatter.messages("", [*history, {"role": "assistant", "content": text}])
            self._candidate_cache[text] = response_ids(self.formatter, rendered, prompt, self.eos_ids)
        return self._candidate_cache[text]

    @torch.no_grad()
    def choose(self, prompts: list[list[int]], candidates: list[list[list[int]]], greedy: bool = False) -> list[int]:
        """Index of the chosen candidate for each prompt: sampled from the policy, or its arg-max when greedy."""
        batch = collate_scored(prompts, candidates, pad_token_id=self.pad_token_id, device=self.policy.device)
        logprobs = self.policy.score(batch).logprobs
        if greedy:
            return logprobs.argmax(dim=-1).tolist()
        return torch.multinomial(logprobs.exp(), 1)[:, 0].tolist()
