"""Loss terms: per-unit quantities the update adds to the policy loss.

A term is a per-unit quantity [n, T] (from the policy's scores of the micro-batch) that the trainer
aggregates with the policy loss's own mask, `agg` mode and step normaliser, multiplies by the
term's coefficient and adds to the loss; the aggregated value is logged as `train/<name>`. A term
whose score is absent from a micro-batch (no masked-image pass, no reference) adds nothing.
Today's keys map to the built-in terms in mmrl.stages (`LEGACY_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mmrl import algos
from mmrl.stages.base import Stage, register_stage


@dataclass(frozen=True)
class TermInputs:
    """What a term reads for one micro-batch: the policy's per-unit scores [n, T] ("logp",
    "entropy", and where the update asked for them "kl_ref", "logp_masked", "entropy_masked"),
    the loss mask, the reference's log-probs (None without one) and the scores differentiated."""

    scores: dict[str, torch.Tensor]
    mask: torch.Tensor
    ref_logp: torch.Tensor | None
    trained: tuple[str, ...]


class LossTerm(Stage):
    """A loss term: `score` names the per-unit score whose gradient the term needs (the update
    scores it with graph when `coef` is not 0)."""

    @property
    def coef(self) -> float:
        raise NotImplementedError

    @property
    def score(self) -> str:
        raise NotImplementedError

    def per_unit(self, x: TermInputs) -> torch.Tensor | None:
        raise NotImplementedError


@register_stage("kl_ref")
@dataclass(frozen=True)
class KLToReference(LossTerm):
    """beta x KL(pi || pi_ref) per unit, by the estimator `kind` on log-probs (GRPO, arXiv
    2402.03300), or with kind "gaussian" the policy's own KL of its denoising steps' Gaussians
    (Flow-GRPO, arXiv 2505.05470), scored by the policy as "kl_ref"."""

    beta: float = 0.0
    kind: str = "k3"

    @property
    def coef(self) -> float:
        return self.beta

    @property
    def score(self) -> str:
        return "kl_ref" if self.kind == algos.GAUSSIAN_KL else "logp"

    def per_unit(self, x: TermInputs) -> torch.Tensor | None:
        kl = x.scores.get("kl_ref")
        if kl is None and x.ref_logp is not None:
            kl = algos.kl_penalty(x.scores["logp"], x.ref_logp, self.kind, mask=x.mask)
        return kl


class _EntropyOf(LossTerm):
    """`weight` x the entropy per unit of one of the policy's passes (the score `pass_score`)."""

    pass_score: ClassVar[str]
    weight: float

    @property
    def coef(self) -> float:
        return self.weight

    @property
    def score(self) -> str:
        return self.pass_score

    def per_unit(self, x: TermInputs) -> torch.Tensor | None:
        entropy = x.scores.get(self.pass_score)
        if entropy is None:
            return None
        return entropy if self.pass_score in x.trained else entropy.detach()  # logged even at weight 0


@register_stage("entropy")
@dataclass(frozen=True)
class Entropy(_EntropyOf):
    """`weight` x the policy's entropy per unit: weight < 0 is an entropy bonus (PPO's, arXiv
    1707.06347, `-algo.entropy_coef`), weight > 0 PAPO's entropy loss on the image's pass (arXiv
    2507.06448, `algo.papo_entropy[0]`). Logged even at weight 0."""

    pass_score: ClassVar[str] = "entropy"
    weight: float = 0.0


@register_stage("entropy_masked")
@dataclass(frozen=True)
class MaskedEntropy(_EntropyOf):
    """PAPO's double entropy loss on the masked-image pass (arXiv 2507.06448): `weight` x its entropy."""

    pass_score: ClassVar[str] = "entropy_masked"
    weight: float = 0.0

    @property
    def needs_masked_images(self) -> bool:
        return self.weight > 0


@register_stage("perception_kl")
@dataclass(frozen=True)
class PerceptionKL(LossTerm):
    """PAPO's implicit perception loss (arXiv 2507.06448): maximise gamma x the k3 KL between the
    policy with the image and with it masked, clipped per unit at `kl_max` (0: no clip)."""

    gamma: float = 0.0
    kl_max: float = 0.0

    @property
    def coef(self) -> float:
        return -self.gamma

    @property
    def score(self) -> str:
        return "logp_masked"

    @property
    def needs_masked_images(self) -> bool:
        return self.gamma > 0

    def per_unit(self, x: TermInputs) -> torch.Tensor | None:
        if "logp_masked" not in x.scores:
            return None
        return algos.perception_kl(x.scores["logp"], x.scores["logp_masked"], x.mask, self.kl_max)
