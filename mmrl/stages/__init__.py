"""Stages: what a method adds to the trainer's step, each a small registered class.

The step is collect -> score -> advantages -> update (mmrl/trainer.py), and a method plugs into one
of them (mmrl/stages/base.py):

| kind                 | hook                                              | built in                          |
| -------------------- | ------------------------------------------------- | --------------------------------- |
| `RolloutStage`       | collect: contexts to sample again, rows to keep, what a batch shows | dynamic_sampling, success_rate_filter, prompt_replay, guidance |
| `RewardShaper`       | the total reward [N] shaped before the advantages | overlong_penalty, redit           |
| `AdvantageTransform` | the estimator's advantages reweighted             | gfpo, certainty_reweight          |
| `LossTerm`           | a per-unit term added to the policy loss          | kl_ref, entropy, perception_kl, entropy_masked |
| `AuxiliaryLoss`      | a loss of its own in each optimizer step          | sft_mix, guidance                 |

Each stage is a dataclass whose fields are its config, checked when the config loads (one line
naming the field and what is accepted), with a docstring citing its paper. Today's config keys map
to the built-in stages through one table (`LEGACY_KEYS`, `from_algo`); `algo.stages: [{name:
<registered>, <its fields>}]` adds any registered stage after them. A new method is one file that
registers its class (docs/architecture.md, "Add a stage").
"""

from __future__ import annotations

import dataclasses

from mmrl.config_checks import ConfigError
from mmrl.stages.base import (STAGES, AdvantageInputs, AdvantageTransform, AuxiliaryLoss, RewardShaper, RolloutStage,
                              Stage, Stages, build_stage, group_contexts, register_stage)
from mmrl.stages.guidance import Guidance
from mmrl.stages.loss_terms import Entropy, KLToReference, LossTerm, MaskedEntropy, PerceptionKL, TermInputs
from mmrl.stages.sampling import DynamicSampling, PromptReplay, SuccessRateFilter
from mmrl.stages.sft_mix import SFTMix
from mmrl.stages.shapers import OverlongPenalty, ReDit
from mmrl.stages.transforms import GFPO, CertaintyReweight

__all__ = ["STAGES", "LEGACY_KEYS", "AdvantageInputs", "AdvantageTransform", "AuxiliaryLoss", "CertaintyReweight",
           "DynamicSampling", "Entropy", "GFPO", "Guidance", "KLToReference", "LossTerm", "MaskedEntropy",
           "OverlongPenalty", "PerceptionKL", "PromptReplay", "ReDit", "RewardShaper", "RolloutStage", "SFTMix", "Stage",
           "Stages", "SuccessRateFilter", "TermInputs", "build_stage", "from_algo", "from_keys", "group_contexts",
           "list_stages", "register_stage"]

# Today's keys of AlgoConfig -> the stage they build (`from_algo`, in this order: the order each
# hook runs them, and the order the loss adds its terms, as before the stages).
LEGACY_KEYS: dict[str, str] = {
    "dynamic_sampling": "dynamic_sampling",
    "success_filter": "success_rate_filter",
    "prompt_replay, prompt_replay_size": "prompt_replay",
    "guide_below, guide_coef": "guidance",
    "overlong_cache_len": "overlong_penalty",
    "redit_scale, redit_kind": "redit",
    "gfpo_keep, gfpo_metric": "gfpo",
    "certainty_reweight": "certainty_reweight",
    "beta, kl_kind": "kl_ref",
    "entropy_coef, papo_entropy[0]": "entropy",
    "papo_gamma, papo_kl_max": "perception_kl",
    "papo_entropy[1]": "entropy_masked",
    "sft_coef, sft_batch_size": "sft_mix",
}


def list_stages() -> list[tuple[str, str, str, str]]:
    """(name, kinds, fields with defaults, the docstring's first sentence) of every registered stage."""
    rows = []
    for name, cls in sorted(STAGES.items()):
        kinds = "/".join(base.__name__ for base in (RolloutStage, RewardShaper, AdvantageTransform, LossTerm,
                                                    AuxiliaryLoss) if issubclass(cls, base))
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls) if f.init)
        summary = " ".join((cls.__doc__ or "").split()).split(". ")[0]
        rows.append((name, kinds, fields, summary))
    return rows


def from_keys(a, sft_batch_size: int) -> list[Stage]:
    """The built-in stages today's keys of the AlgoConfig `a` turn on (`LEGACY_KEYS`). The loss
    terms are always there (a term at 0 adds nothing but is logged)."""
    stages: list[Stage] = []
    if a.dynamic_sampling:
        stages.append(DynamicSampling())
    if a.success_filter is not None:
        stages.append(SuccessRateFilter(*a.success_filter))
    if a.prompt_replay > 0:
        stages.append(PromptReplay(share=a.prompt_replay, capacity=a.prompt_replay_size))
    if a.guide_below is not None:
        stages.append(Guidance(below=a.guide_below, coef=a.guide_coef))
    if a.overlong_cache_len > 0:
        stages.append(OverlongPenalty(cache_len=a.overlong_cache_len))
    if a.redit_scale > 0:
        stages.append(ReDit(scale=a.redit_scale, kind=a.redit_kind))
    if a.gfpo_keep > 0:
        stages.append(GFPO(keep=a.gfpo_keep, metric=a.gfpo_metric))
    if a.certainty_reweight > 0:
        stages.append(CertaintyReweight(alpha=a.certainty_reweight))
    stages += [KLToReference(beta=a.beta, kind=a.kl_kind),
               Entropy(weight=a.papo_entropy[0] - a.entropy_coef),
               PerceptionKL(gamma=a.papo_gamma, kl_max=a.papo_kl_max),
               MaskedEntropy(weight=a.papo_entropy[1])]
    if a.sft_coef > 0:
        stages.append(SFTMix(coef=a.sft_coef, batch_size=a.sft_batch_size or sft_batch_size))
    return stages


def from_algo(a, sft_batch_size: int) -> Stages:
    """The stages of the AlgoConfig `a`: today's keys (`from_keys`), then `a.stages`.
    `sft_batch_size` is `sft.batch_size` (the SFT mix's default batch). A ConfigError of one line
    for a bad spec or a stage configured twice."""
    try:
        items = from_keys(a, sft_batch_size)
    except ValueError as exc:
        raise ConfigError(f"algo: {exc}") from None
    items += [build_stage(spec, f"algo.stages.{i}") for i, spec in enumerate(a.stages)]
    names = [s.name for s in items]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"algo.stages: {twice} already in the run (set by its own keys, see "
                          f"mmrl.stages.LEGACY_KEYS); accepted: each stage once")
    return Stages(items)
