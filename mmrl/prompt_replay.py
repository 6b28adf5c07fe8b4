"""Prompt replay: prompts whose last group carried a learning signal are drawn again.

Late in training most groups score the same on every sample (the policy has settled those
prompts) and carry no gradient; dynamic sampling throws them away after paying for their
rollouts. A prompt whose group had differing rewards is one the policy has not settled, and it
usually still is a few steps later. Replaying it keeps training on-policy, since its group is
sampled afresh by the current policy; only the prompt distribution leans towards the unsettled
ones (the idea behind GRESO, arXiv 2506.02177, and SPEED-RL, arXiv 2506.09016, run the other way
round: keep the informative prompts instead of predicting the uninformative ones).

A replayed prompt leaves the buffer; it comes back only if its new group is informative again,
so a prompt the policy has learned drops out by itself.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class PromptReplay:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"prompt replay capacity must be >= 1, got {capacity}")
        self.buffer: deque[Any] = deque(maxlen=capacity)  # oldest dropped first when full

    def __len__(self) -> int:
        return len(self.buffer)

    def draw(self, n: int) -> list[Any]:
        """Up to `n` prompts, oldest first (fewer when the buffer holds fewer)."""
        return [self.buffer.popleft() for _ in range(min(n, len(self.buffer)))]

    def push(self, contexts: list[Any]) -> None:
        self.buffer.extend(contexts)

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": list(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.clear()
        self.buffer.extend(state["buffer"])
