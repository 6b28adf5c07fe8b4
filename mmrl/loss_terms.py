"""Loss terms: what the update adds to the policy loss, each a small registered stage.

A term is a per-unit quantity [n, T] (from the policy's scores of the micro-batch) that the trainer
aggregates with the policy loss's own mask, `agg` mode and step normaliser, multiplies by the
term's coefficient and adds to the loss; the aggregated value is logged as `train/<name>`. A term
whose score is absent from a micro-batch (no masked-image pass, no reference) adds nothing.

Today's config keys are terms (`from_algo`, in the order the loss adds them):

| config keys                          | term             | paper                         |
| ------------------------------------ | ---------------- | ----------------------------- |
| algo.beta, algo.kl_kind              | `kl_ref`         | GRPO 2402.03300; Flow-GRPO 2505.05470 (gaussian) |
| algo.entropy_coef, algo.papo_entropy[0] | `entropy`     | PPO 1707.06347; PAPO 2507.06448 |
| algo.papo_gamma, algo.papo_kl_max    | `perception_kl`  | PAPO 2507.06448               |
| algo.papo_entropy[1]                 | `entropy_masked` | PAPO 2507.06448               |

A new term is one file: a frozen dataclass (its fields are its config, checked at load) with
`register_loss_term`, then `algo.loss_terms: [{name: ..., <fields>}]` in a config (see
docs/architecture.md, "Add a loss term").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mmrl import algos


@dataclass(frozen=True)
class TermInputs:
    """What a term reads for one micro-batch: the policy's per-unit scores [n, T] ("logp",
    "entropy", and where the update asked for them "kl_ref", "logp_masked", "entropy_masked"),
    the loss mask, the reference's log-probs (None without one) and the scores differentiated."""

    scores: dict[str, torch.Tensor]
    mask: torch.Tensor
    ref_logp: torch.Tensor | None
    trained: tuple[str, ...]


class LossTerm:
    """Base of the registered terms: `score` names the per-unit score whose gradient the term needs
    (the trainer scores it with graph when `coef` is not 0)."""

    name: ClassVar[str]

    @property
    def coef(self) -> float:
        raise NotImplementedError

    @property
    def score(self) -> str:
        raise NotImplementedError

    def per_unit(self, x: TermInputs) -> torch.Tensor | None:
        raise NotImplementedError


LOSS_TERMS: dict[str, type[LossTerm]] = {}


def register_loss_term(name: str):
    def wrap(cls: type[LossTerm]) -> type[LossTerm]:
        if name in LOSS_TERMS:
            raise ValueError(f"loss term {name!r} is registered twice")
        cls.name = name
        LOSS_TERMS[name] = cls
        return cls
    return wrap


@register_loss_term("kl_ref")
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


@register_loss_term("entropy")
@dataclass(frozen=True)
class Entropy(LossTerm):
    """`weight` x the policy's entropy per unit: weight < 0 is an entropy bonus (PPO's, arXiv
    1707.06347, `-algo.entropy_coef`), weight > 0 PAPO's entropy loss on the image's pass (arXiv
    2507.06448, `algo.papo_entropy[0]`). Logged even at weight 0."""

    weight: float = 0.0

    @property
    def coef(self) -> float:
        return self.weight

    @property
    def score(self) -> str:
        return "entropy"

    def per_unit(self, x: TermInputs) -> torch.Tensor | None:
        entropy = x.scores["entropy"]
        return entropy if "entropy" in x.trained else entropy.detach()


@register_loss_term("perception_kl")
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

    def per_unit(self, x: TermInputs) -> torch.Tensor | None:
        if "logp_masked" not in x.scores:
            return None
        return algos.perception_kl(x.scores["logp"], x.scores["logp_masked"], x.mask, self.kl_max)


@register_loss_term("entropy_masked")
@dataclass(frozen=True)
class MaskedEntropy(LossTerm):
    """PAPO's double entropy loss on the masked-image pass (arXiv 2507.06448): `weight` x its entropy."""

    weight: float = 0.0

    @property
    def coef(self) -> float:
        return self.weight

    @property
    def score(self) -> str:
        return "entropy_masked"

    def per_unit(self, x: TermInputs) -> torch.Tensor | None:
        return x.scores.get("entropy_masked")


def from_algo(algo) -> list[LossTerm]:
    """The loss terms of an `AlgoConfig`: today's keys (the table above), then `algo.loss_terms`,
    in the order the loss adds them (a float sum depends on its order). A built-in term at 0 stays:
    its value is logged."""
    terms = [KLToReference(beta=algo.beta, kind=algo.kl_kind),
             Entropy(weight=algo.papo_entropy[0] - algo.entropy_coef),
             PerceptionKL(gamma=algo.papo_gamma, kl_max=algo.papo_kl_max),
             MaskedEntropy(weight=algo.papo_entropy[1])]
    terms += [build_loss_term(spec, f"algo.loss_terms.{i}") for i, spec in enumerate(algo.loss_terms)]
    names = [t.name for t in terms]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"algo.loss_terms: {twice} already in the loss (set by its own keys, see "
                         f"mmrl.loss_terms); accepted: terms not built in, each once")
    return terms


def build_loss_term(spec: dict[str, Any], key: str = "algo.loss_terms") -> LossTerm:
    """A term from {"name": <registered>, **its fields}; a ValueError of one line naming the bad
    name or field and what is accepted."""
    if not isinstance(spec, dict):
        raise ValueError(f"{key}: {spec!r} is not a mapping; accepted: {{name: <loss term>, <its fields>}}")
    spec = dict(spec)
    name = spec.pop("name", None)
    if name not in LOSS_TERMS:
        raise ValueError(f"{key}.name: unknown loss term {name!r}; registered: {', '.join(sorted(LOSS_TERMS))}")
    cls = LOSS_TERMS[name]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    unknown = sorted(set(spec) - set(defaults))
    if unknown:
        raise ValueError(f"{key}: loss term {name!r} has no field {unknown}; its fields: {sorted(defaults)}")
    for field, value in spec.items():
        want = type(defaults[field])
        ok = isinstance(value, str) if want is str else isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"{key}.{field}: {value!r} is not a {want.__name__} (loss term {name!r})")
    return cls(**{k: float(v) if type(defaults[k]) is float else v for k, v in spec.items()})
