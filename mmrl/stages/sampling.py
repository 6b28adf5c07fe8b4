"""Rollout stages of the collect: filters that keep the groups worth an update, and prompt replay."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from mmrl import algos
from mmrl.checkpoint import from_plain, to_plain
from mmrl.rollout import Rollout
from mmrl.stages.base import RolloutStage, group_contexts, register_stage


@register_stage("dynamic_sampling")
@dataclass
class DynamicSampling(RolloutStage):
    """DAPO's dynamic sampling (arXiv 2503.14476): keep only the groups whose total rewards differ
    (a group that scores alike on every sample has zero advantage and no gradient), re-sampling
    until the step has its groups."""

    is_filter: ClassVar[bool] = True

    def keep(self, rollout: Rollout) -> torch.Tensor:
        return algos.nonconstant_groups(rollout.rewards["total"], rollout.group_ids)


@register_stage("success_rate_filter")
@dataclass
class SuccessRateFilter(RolloutStage):
    """SimpleVLA-RL's / SRPO's filter (arXiv 2509.09674): keep the groups whose mean of `reward`
    (default: the first configured reward, a success flag) lies in [low, high]."""

    is_filter: ClassVar[bool] = True
    low: float = 0.0
    high: float = 1.0
    reward: str | None = None

    def __post_init__(self):
        if not 0 <= self.low <= self.high <= 1:
            raise ValueError(f"success_rate_filter needs 0 <= low <= high <= 1, got [{self.low}, {self.high}]")

    def keep(self, rollout: Rollout) -> torch.Tensor:
        name = self.reward or next(iter(rollout.rewards))  # rewards are filled in config order
        return algos.success_rate_filter(rollout.rewards[name], rollout.group_ids, self.low, self.high)


@register_stage("prompt_replay")
@dataclass
class PromptReplay(RolloutStage):
    """Prompt replay (after GRESO, arXiv 2506.02177): `share` of each draw's prompts comes again
    from the prompts whose last group had differing rewards (a FIFO of `capacity`), sampled afresh
    by the current policy.

    Late in training most groups score the same on every sample (the policy has settled those
    prompts) and carry no gradient; dynamic sampling throws them away after paying for their
    rollouts. A prompt whose group had differing rewards is one the policy has not settled, and it
    usually still is a few steps later. Replaying it keeps training on-policy; only the prompt
    distribution leans towards the unsettled ones (the idea behind GRESO, arXiv 2506.02177, and
    SPEED-RL, arXiv 2506.09016, run the other way round). A replayed prompt leaves the buffer and
    comes back only if its new group is informative again, so a learned prompt drops out by itself."""

    share: float = 0.5
    capacity: int = 512
    buffer: deque = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not 0 < self.share <= 1:
            raise ValueError(f"prompt_replay share must be in (0, 1], got {self.share}")
        if self.capacity < 1:
            raise ValueError(f"prompt replay capacity must be >= 1, got {self.capacity}")
        self.buffer = deque(maxlen=self.capacity)  # oldest dropped first when full

    def __len__(self) -> int:
        return len(self.buffer)

    def draw(self, n: int) -> list[Any]:
        """Up to `n` prompts, oldest first (fewer when the buffer holds fewer)."""
        return [self.buffer.popleft() for _ in range(min(n, len(self.buffer)))]

    def push(self, contexts: list[Any]) -> None:
        self.buffer.extend(contexts)

    def replayed(self, n: int) -> list[Any]:
        return self.draw(round(self.share * n)) if n else []

    def observe(self, rollout: Rollout, replayed: int, stats: dict[str, float]) -> None:
        unsettled = group_contexts(rollout, algos.nonconstant_groups(rollout.rewards["total"], rollout.group_ids))
        self.push(unsettled)
        stats["replay/pushed"] += len(unsettled)
        stats["replay/drawn"] += replayed
        stats["replay/size"] = len(self.buffer)

    def state_dict(self) -> dict[str, Any]:
        # Contexts hold numpy images and a domain's dataclasses: kept as tensors and plain values,
        # which a checkpoint loads without running code from the file.
        return {"buffer": [to_plain(c) for c in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.clear()
        self.buffer.extend(from_plain(c) for c in state["buffer"])
