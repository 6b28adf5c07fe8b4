"""Guidance where RL cannot learn (ReLIFT, arXiv 2506.07527)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from mmrl import algos
from mmrl.rollout import Rollout
from mmrl.stages.base import AuxiliaryLoss, RolloutStage, group_contexts, register_stage


@register_stage("guidance")
@dataclass
class Guidance(RolloutStage, AuxiliaryLoss):
    """ReLIFT's guidance (arXiv 2506.07527): a prompt whose group's best total reward is below
    `below` (every sample failed: zero advantage, nothing to learn from) adds `coef` x the policy's
    supervised loss on the task's expert target to the first optimizer step of the update, also
    when no group is left for RL."""

    first_step_only: ClassVar[bool] = True
    metric: ClassVar[str] = "guide_loss"
    below: float = 0.0
    coef: float = 1.0
    contexts: list[Any] = field(init=False, default_factory=list, repr=False, compare=False)

    def __post_init__(self):
        if self.coef <= 0:
            raise ValueError(f"guidance coef must be > 0, got {self.coef}")

    def begin(self) -> None:
        self.contexts = []

    def observe(self, rollout: Rollout, replayed: int, stats: dict[str, float]) -> None:
        failed = algos.failed_groups(rollout.rewards["total"], rollout.group_ids, self.below)
        self.contexts += group_contexts(rollout, failed)

    def summary(self) -> dict[str, float]:
        return {"guide/failed_groups": len(self.contexts)}

    def pending(self) -> int:
        return len(self.contexts)

    def loss(self, policy, task) -> tuple[torch.Tensor, float] | None:
        if not self.contexts:
            return None
        try:
            loss = self.coef * policy.sft_loss(self.contexts)
        except KeyError as exc:
            raise ValueError(f"algo.guide_below needs the task's expert target in every context; "
                             f"{type(task).__name__}'s contexts lack {exc}") from None
        return loss, loss.item()
