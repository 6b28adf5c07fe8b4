"""Advantage transforms: the estimator's advantages reweighted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from mmrl import algos
from mmrl.stages.base import AdvantageInputs, AdvantageTransform, register_stage


@register_stage("gfpo")
@dataclass
class GFPO(AdvantageTransform):
    """GFPO (arXiv 2508.09726): of each group keep the `keep` samples best by `metric` (shortest,
    or reward per length); the group statistics and the credit are theirs alone, the rest get 0."""

    keep: int = 1
    metric: Literal["shortest", "reward_per_length"] = "shortest"

    def __post_init__(self):
        if self.keep < 1:
            raise ValueError(f"gfpo keep must be >= 1, got {self.keep}")

    def transform(self, adv: torch.Tensor, x: AdvantageInputs) -> torch.Tensor:
        gids = x.rollout.group_ids
        kept = algos.gfpo_keep(x.rewards, gids, self.keep, self.metric, x.rollout.lengths)
        return algos.gfpo_advantages(x.rewards, gids, kept)


@register_stage("certainty_reweight")
@dataclass
class CertaintyReweight(AdvantageTransform):
    """VL-Calibration (arXiv 2604.09529): per-token weights of the negative advantages from the
    rollout's visual certainty (its log-probs with and without the image), w = clip(1 + alpha
    (1 - 2c), 0, 2); the advantages become [N, T]."""

    needs_policy_scores: ClassVar[bool] = True
    alpha: float = 0.5

    def __post_init__(self):
        if self.alpha <= 0:
            raise ValueError(f"certainty_reweight alpha must be > 0, got {self.alpha}")

    @property
    def needs_masked_images(self) -> bool:
        return True

    def weights(self, adv: torch.Tensor, x: AdvantageInputs) -> torch.Tensor:
        """The token weights [N, T] of the advantages [N]."""
        scores = x.policy_scores()
        certainty = algos.visual_certainty(scores["logp"], scores["logp_masked"], scores["entropy"], x.mask,
                                           group_ids=x.rollout.group_ids)
        return algos.certainty_token_weights(certainty, x.mask, advantages=adv, alpha=self.alpha)

    def transform(self, adv: torch.Tensor, x: AdvantageInputs) -> torch.Tensor:
        return adv[:, None] * self.weights(adv, x)
