"""Reward shapers: the batch's total reward [N] shaped before the advantages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mmrl import algos
from mmrl.rollout import Rollout
from mmrl.stages.base import RewardShaper, register_stage


@register_stage("overlong_penalty")
@dataclass
class OverlongPenalty(RewardShaper):
    """DAPO's soft overlong punishment (arXiv 2503.14476): a reply longer than L_max - `cache_len`
    units loses up to 1 linearly, and 1 past L_max (the sampler's unit budget, or
    `algo.loss_params.max_response_len`)."""

    cache_len: int = 0

    def __post_init__(self):
        if self.cache_len < 1:
            raise ValueError(f"overlong_penalty cache_len must be >= 1, got {self.cache_len}")

    def shape(self, rewards: torch.Tensor, rollout: Rollout, unit_budget: int,
              generator: torch.Generator) -> torch.Tensor:
        return rewards + algos.overlong_penalty(rollout.lengths, unit_budget, self.cache_len)


@register_stage("redit")
@dataclass
class ReDit(RewardShaper):
    """ReDit (arXiv 2506.18631): zero-mean noise of `scale` on discrete rewards, so a group of
    near-equal rewards still ranks its samples (drawn from the sampling stream)."""

    scale: float = 0.05
    kind: Literal["gaussian", "uniform"] = "gaussian"

    def __post_init__(self):
        if self.scale <= 0:
            raise ValueError(f"redit scale must be > 0, got {self.scale}")

    def shape(self, rewards: torch.Tensor, rollout: Rollout, unit_budget: int,
              generator: torch.Generator) -> torch.Tensor:
        return algos.redit(rewards, self.scale, kind=self.kind, generator=generator)
