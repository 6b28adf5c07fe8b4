"""Training-inference mismatch corrections, TIS and MIS (docs/algorithms.md, "Training-inference
mismatch").

Rollouts sampled by an inference engine (vLLM) or a KV-cached bf16 sampler carry behaviour
log-probs `logp_beh` that differ from the trainer's log-probs `logp_old` of the same weights, so
"on-policy" training is slightly off-policy. Each token (or sequence) is reweighted by the
importance ratio rho = pi_old / pi_beh:

    TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"):
        w = min(rho, C)
    MIS (Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
        Training-Inference Mismatch"):
        w = rho * 1[rho <= C]      (units whose ratio exceeds C are rejected)

Both sources are blog posts (no arXiv id): fengyao.notion.site/off-policy-rl and
yingru.notion.site/When-Speed-Kills-Stability-271211a558b7808d8b12d403fd15edda.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .kl import kl_penalty
from .losses import LOG_RATIO_CLAMP
from .registry import AlgorithmError, as_bool_mask, check_finite, unknown_name_error

__all__ = ["CORRECTIONS", "CORRECTION_LEVELS", "mismatch_weights"]

CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis")
CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence")


def _check_args(logp_old: Tensor, logp_beh: Tensor, kind: str, level: str, cap: float) -> float:
    if kind not in CORRECTIONS:
        raise unknown_name_error("correction", kind, CORRECTIONS)
    if level not in CORRECTION_LEVELS:
        raise unknown_name_error("correction level", level, CORRECTION_LEVELS)
    try:
        c = float(cap)
    except (TypeError, ValueError):
        raise AlgorithmError(f"correction cap must be a number > 1, got {cap!r}") from None
    # C <= 1 would cut (or reject) units whose trainer probability is not above the sampler's.
    if isinstance(cap, bool) or not c > 1:
        raise AlgorithmError(f"correction cap must be > 1, got {cap!r}")
    for name, x in (("logp_old", logp_old), ("logp_beh", logp_beh)):
        if not isinstance(x, Tensor):
            raise AlgorithmError(f"{name} must be a tensor, got {type(x).__name__}")
    if logp_old.dim() != 2:
        raise AlgorithmError(f"logp_old must be [N, T], got shape {tuple(logp_old.shape)}")
    if logp_beh.shape != logp_old.shape:
        shapes = f"{tuple(logp_beh.shape)}, expected {tuple(logp_old.shape)}"
        raise AlgorithmError(f"logp_beh has shape {shapes} like logp_old")
    return c


def _apply(kind: str, ratio: Tensor, over: Tensor, cap: float) -> Tensor:
    """TIS / MIS weight from the (clamped) ratio and the bool map of where the ratio exceeds C."""
    if kind == "tis":
        return torch.where(over, torch.full_like(ratio, cap), ratio)
    return torch.where(over, torch.zeros_like(ratio), ratio)  # mis


def mismatch_weights(
    logp_old: Tensor,
    logp_beh: Tensor,
    mask: Tensor,
    kind: str = "tis",
    level: str = "token",
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached importance weights and metrics for the training-inference mismatch.

    `logp_old` (the trainer's log-probs, the PPO ratio's base) and `logp_beh` (the sampler's) are
    [N, T]; `mask` is bool (or 0/1) [N, T]. Masked-out positions may hold anything, -inf included.
    With d_t = logp_old_t - logp_beh_t:

    - level "token": rho_t = exp(d_t); returns weights of shape [N, T], 0 at masked-out positions.
    - level "sequence": rho_i = exp(sum over masked t of d_t) (log-ratio clamped to [-20, 20]);
      returns weights of shape [N], one per row (so losses that need one advantage per sequence,
      gspo / gmpo, still get one); rows with no masked unit get weight 1.

    kind "tis": w = min(rho, cap); "mis": w = rho if rho <= cap else 0; "none": all-ones weights
    ([N, T] or [N]) with the metrics still computed, to watch the mismatch without correcting.
    `cap` must be > 1. Weights are float32 (or the inputs' wider float dtype), on the inputs'
    device, and never carry a gradient.

    Metrics (detached 0-dim tensors):
    - `mismatch_kl`: mean over masked units of the k3 estimate exp(d) - d - 1 of KL(pi_beh || pi_old)
      (samples come from pi_beh); per token at both levels; 0 with no masked unit.
    - `mismatch_ratio_max`: max of rho over masked units (token) or over rows with a masked unit
      (sequence); 1 with none.
    - `truncated_frac` (tis) / `masked_frac` (mis): share of masked units (token) or of rows with a
      masked unit (sequence) whose ratio exceeds cap; 0 with none.
    """
    c = _check_args(logp_old, logp_beh, kind, level, cap)
    m = as_bool_mask(mask, logp_old.shape)
    check_finite("logp_old", logp_old, m)
    check_finite("logp_beh", logp_beh, m)

    with torch.no_grad():
        dtype = torch.promote_types(logp_old.dtype, torch.float32)  # bf16 log-probs computed in fp32
        zero = torch.zeros((), dtype=dtype, device=logp_old.device)
        # Replace padding (possibly -inf) before any arithmetic so no NaN appears anywhere.
        lo = torch.where(m, logp_old.detach().to(dtype), zero)
        lb = torch.where(m, logp_beh.detach().to(dtype), zero)
        d = lo - lb  # 0 at masked-out positions
        # Compare in log space on the unclamped log-ratio: the clamp below must not hide a rejection.
        log_cap = math.log(c)

        n_units = m.sum()
        k3 = kl_penalty(lb, lo, "k3")  # kl_penalty's d = ref - logp = lo - lb; 0 where d = 0
        metrics: dict[str, Tensor] = {"mismatch_kl": k3.sum() / n_units.clamp_min(1).to(dtype)}

        if level == "token":
            ratio = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            over = (d > log_cap) & m
            sel, n_sel = m, n_units
            if kind == "none":
                weights = torch.ones_like(d)
            else:
                weights = torch.where(m, _apply(kind, ratio, over, c), zero)
        else:
            s = d.sum(dim=-1)
            ratio = torch.exp(s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            sel = m.any(dim=-1)
            n_sel = sel.sum()
            over = (s > log_cap) & sel
            # A row with no masked unit has s = 0, so rho = 1 and it keeps weight 1 under tis and mis.
            weights = torch.ones_like(s) if kind == "none" else _apply(kind, ratio, over, c)

        one = torch.ones((), dtype=dtype, device=d.device)
        # ratio > 0, so the 0 put at unselected entries never wins the max.
        metrics["mismatch_ratio_max"] = torch.where(sel, ratio, zero).amax() if bool(sel.any()) else one
        if kind != "none":
            frac = over.sum().to(dtype) / n_sel.clamp_min(1).to(dtype)
            metrics["truncated_frac" if kind == "tis" else "masked_frac"] = frac
    return weights, {k: v.detach().reshape(()) for k, v in metrics.items()}
