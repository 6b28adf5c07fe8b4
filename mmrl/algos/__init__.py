"""mmrl.algos: the algorithm core (advantages, policy losses, KL, aggregation, shaping).

Pure, vectorised tensor functions with name registries; see docs/algorithms.md.
"""

from .registry import (
    AGG_MODES,
    AlgorithmError,
    AdvantageSpec,
    LossSpec,
    get_advantage_spec,
    get_loss_spec,
    list_algorithms,
    register_advantage,
    register_loss,
)
from .advantages import Groups, compute_advantages, make_groups
from .losses import agg_denominator, aggregate, policy_loss
from .kl import GAUSSIAN_KL, kl_penalty
from . import shaping
from .shaping import (
    failed_groups,
    gfpo_advantages,
    gfpo_keep,
    high_entropy_tokens,
    mask_truncated,
    nonconstant_groups,
    one_row_per_group,
    overlong_penalty,
    redit,
    success_rate_filter,
)
from .perception import mask_patches, perception_kl
from .calibration import certainty_token_weights, visual_certainty
from .correction import CORRECTIONS, CORRECTION_LEVELS, mismatch_weights
from . import kvpo  # noqa: F401  (registers the kvpo_anchor estimator; the KVPO functions live in mmrl.algos.kvpo)

__all__ = [
    "AGG_MODES",
    "GAUSSIAN_KL",
    "AlgorithmError",
    "CORRECTIONS",
    "CORRECTION_LEVELS",
    "AdvantageSpec",
    "LossSpec",
    "Groups",
    "agg_denominator",
    "certainty_token_weights",
    "aggregate",
    "compute_advantages",
    "failed_groups",
    "get_advantage_spec",
    "get_loss_spec",
    "gfpo_advantages",
    "gfpo_keep",
    "high_entropy_tokens",
    "kl_penalty",
    "list_algorithms",
    "make_groups",
    "mask_patches",
    "mask_truncated",
    "mismatch_weights",
    "nonconstant_groups",
    "one_row_per_group",
    "overlong_penalty",
    "perception_kl",
    "policy_loss",
    "redit",
    "register_advantage",
    "register_loss",
    "shaping",
    "success_rate_filter",
    "visual_certainty",
]
