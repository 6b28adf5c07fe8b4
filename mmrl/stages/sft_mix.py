"""Behaviour-cloning regularisation of the RL update (DAPG, arXiv 1709.10087)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from mmrl.stages.base import AuxiliaryLoss, register_stage


@register_stage("sft_mix")
@dataclass
class SFTMix(AuxiliaryLoss):
    """DAPG's behaviour cloning term (arXiv 1709.10087): every optimizer step of the update adds
    `coef` x the policy's supervised loss on a fresh expert batch of `batch_size` examples of the
    task (the VLA recipes that mix SFT into RL). Logs the supervised loss itself, unscaled."""

    metric: ClassVar[str] = "sft_loss"
    coef: float = 0.1
    batch_size: int = 32
    rng: np.random.Generator | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.coef <= 0 or self.batch_size < 1:
            raise ValueError(f"sft_mix needs coef > 0 and batch_size >= 1, got {self.coef} and {self.batch_size}")

    def setup(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed + 3)

    def loss(self, policy, task) -> tuple[torch.Tensor, float]:
        loss = policy.sft_loss(task.sft_batch(self.batch_size, self.rng))
        return self.coef * loss, loss.item()

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
