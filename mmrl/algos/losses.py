"""Policy losses and loss aggregation (docs/algorithms.md, "Policy losses").

Every loss is a small pure function returning a per-token term L[i,t] (a sequence-level term is
broadcast to its tokens); `policy_loss` validates inputs, calls it and aggregates with
`aggregate`, whose normaliser can be made global over micro-batches via `denominator=`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .registry import (
    AGG_MODES,
    AlgorithmError,
    as_bool_mask,
    check_finite,
    check_known_params,
    get_loss_spec,
    register_loss,
    unknown_name_error,
)

__all__ = ["aggregate", "agg_denominator", "policy_loss", "LOG_RATIO_CLAMP"]

# exp(l) is evaluated on l clamped to +-20 (ratio in [2e-9, 4.9e8]); beyond that float32 exp
# overflows soon and an inf ratio turns gradients into NaN (0 * inf). Values are unchanged inside.
LOG_RATIO_CLAMP = 20.0


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------


def _check_agg(agg: str, max_response_len: float | None) -> None:
    if agg not in AGG_MODES:
        raise unknown_name_error("aggregation", agg, AGG_MODES)
    if agg == "seq-mean-token-sum-norm":
        if max_response_len is None:
            raise AlgorithmError(
                "agg 'seq-mean-token-sum-norm' needs max_response_len (the configured response budget)"
            )
        if not max_response_len > 0:
            raise AlgorithmError(f"max_response_len must be > 0, got {max_response_len}")


def agg_numerator(per_token: Tensor, mask: Tensor, agg: str) -> Tensor:
    """The row-additive numerator of `agg` (sum over rows of each row's contribution)."""
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    masked = torch.where(mask, per_token, zero)  # where, not *: a NaN/-inf at padding stays out
    if agg == "seq-mean-token-mean":
        lens = mask.sum(dim=-1).to(per_token.dtype)
        return (masked.sum(dim=-1) / lens.clamp_min(1)).sum()
    return masked.sum()


def agg_denominator(mask: Tensor, agg: str, max_response_len: float | None = None) -> Tensor:
    """The local normaliser of `agg` as a 0-dim float tensor.

    token-mean: sum(mask); seq-mean-token-mean: number of rows with len > 0;
    seq-mean-token-sum: N; seq-mean-token-sum-norm: N * max_response_len.
    Sum it over all micro-batches (and ranks) of an optimizer step and pass the total as
    `denominator=` to make the normaliser global.
    """
    _check_agg(agg, max_response_len)
    m = mask if mask.dtype == torch.bool else mask != 0
    if agg == "token-mean":
        den = m.sum()
    elif agg == "seq-mean-token-mean":
        den = (m.sum(dim=-1) > 0).sum()
    elif agg == "seq-mean-token-sum":
        den = torch.tensor(m.shape[0], device=m.device)
    else:
        den = torch.tensor(m.shape[0] * float(max_response_len), device=m.device)  # type: ignore[arg-type]
    return den.to(torch.float32)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    agg: str,
    max_response_len: float | None = None,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """Scalar `numerator / denominator` of a [N,T] per-token term under aggregation `agg`.

    A zero denominator (nothing masked in) gives 0, not NaN.
    """
    _check_agg(agg, max_response_len)
    if per_token.shape != mask.shape:
        raise AlgorithmError(f"per_token has shape {tuple(per_token.shape)}, mask has {tuple(mask.shape)}")
    m = mask if mask.dtype == torch.bool else mask != 0
    num = agg_numerator(per_token, m, agg)
    if denominator is None:
        den = agg_denominator(m, agg, max_response_len)
    else:
        den = torch.as_tensor(denominator, device=num.device)
    den = den.to(num.dtype)
    # den is a count (>= 1) or 0; when 0 the numerator is 0 too, so divide by 1 instead.
    return num / torch.where(den > 0, den, torch.ones_like(den))


# ---------------------------------------------------------------------------------------------
# Helpers shared by the losses (inputs already sanitised: 0 at masked-out positions)
# ---------------------------------------------------------------------------------------------


def _exp_clamped(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1).to(x.dtype)


def _row_lens(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return mask.sum(dim=-1).to(dtype)


def _seq_advantage(adv: Tensor, mask: Tensor, loss: str) -> Tensor:
    """Per-sequence advantage [N] from the broadcast [N,T] one; token-varying advantages are an error."""
    lens = _row_lens(mask, adv.dtype)
    seq = adv.sum(dim=-1) / lens.clamp_min(1)  # adv is 0 at masked-out positions
    if adv.numel() == 0:
        return seq
    spread = torch.where(mask, (adv - seq[:, None]).abs(), torch.zeros_like(adv)).amax()
    if float(spread) > 1e-5 * (1.0 + float(seq.abs().max())):
        raise AlgorithmError(
            f"loss {loss!r} needs one advantage per sequence, but advantages vary along tokens; "
            f"use 'gspo_token' for token-level advantages"
        )
    return seq


def _ppo_clip(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """-min(r*A, clip(r)*A) and the bool map of where the clip is active (gradient cut)."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    active = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
    # Where active, min() picks the clipped branch: a constant, so no gradient flows.
    term = torch.where(active, -ratio.clamp(lo, hi) * adv, -ratio * adv)
    return term, active


def _ratio_metrics(ratio: Tensor, sel: Tensor) -> dict[str, Tensor]:
    if not bool(sel.any()):
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        return {"ratio_min": one, "ratio_mean": one.clone(), "ratio_max": one.clone()}
    r = ratio.detach()[sel]
    return {"ratio_min": r.min(), "ratio_mean": r.mean(), "ratio_max": r.max()}


def _seq_ratio(log_ratio: Tensor, lens: Tensor) -> Tensor:
    """Length-normalised sequence ratio exp(mean_t l) [N]; `log_ratio` is 0 at masked-out positions."""
    return _exp_clamped(log_ratio.sum(dim=-1) / lens.clamp_min(1))


def _check_eps(eps_low: float | None, eps_high: float | None) -> None:
    if eps_low is not None and not 0 <= eps_low < 1:
        raise AlgorithmError(f"eps_low must be in [0, 1), got {eps_low}")
    if eps_high is not None and not eps_high >= 0:
        raise AlgorithmError(f"eps_high must be >= 0, got {eps_high}")


# ---------------------------------------------------------------------------------------------
# Losses. Signature: fn(logp, old_logp, adv, mask, **params) -> (per_token [N,T], metrics)
# ---------------------------------------------------------------------------------------------


def _token_clip(logp, old_logp, adv, mask, eps_low, eps_high) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The PPO clipped term of the token ratio, where its clip is active, and clip_frac over `mask`."""
    _check_eps(eps_low, eps_high)
    ratio = _exp_clamped(logp - old_logp)
    term, active = _ppo_clip(ratio, adv, eps_low, eps_high)
    return term, active, {"clip_frac": _masked_mean(active.to(ratio.dtype), mask)}


# GRPO, Dr. GRPO and DAPO share the PPO clipped term; they differ in defaults and aggregation only.
@register_loss(
    "dapo",
    default_agg="token-mean",
    citation="2503.14476",
    defaults={"eps_low": 0.2, "eps_high": 0.28},
    description="DAPO: PPO clipped term with clip-higher (0.2/0.28) and token-mean aggregation.",
)
@register_loss(
    "dr_grpo",
    default_agg="seq-mean-token-sum-norm",
    citation="2503.20783",
    defaults={"eps_low": 0.2, "eps_high": 0.2},
    description="Dr. GRPO: the PPO clipped term, summed per sequence and divided by N * max_response_len.",
)
@register_loss(
    "grpo",
    default_agg="seq-mean-token-mean",
    citation="1707.06347, 2402.03300",
    defaults={"eps_low": 0.2, "eps_high": 0.2},
    aliases=("ppo",),
)
def grpo_loss(logp, old_logp, adv, mask, *, eps_low, eps_high):
    """PPO clipped surrogate -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)."""
    term, _, metrics = _token_clip(logp, old_logp, adv, mask, eps_low, eps_high)
    return term, metrics


@register_loss(
    "dual_clip",
    default_agg="seq-mean-token-mean",
    citation="1912.09729",
    defaults={"eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": 3.0},
)
def dual_clip_loss(logp, old_logp, adv, mask, *, eps_low, eps_high, dual_clip_c):
    """Dual-clip PPO: the PPO term, capped at -c*A when A < 0."""
    if not dual_clip_c > 1:
        raise AlgorithmError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    term, metrics = grpo_loss(logp, old_logp, adv, mask, eps_low=eps_low, eps_high=eps_high)
    cap = -dual_clip_c * adv
    capped = (adv < 0) & (term > cap)
    term = torch.where(capped, cap, term)
    metrics["dual_clip_frac"] = _masked_mean(capped.to(term.dtype), mask)
    return term, metrics


@register_loss(
    "gspo",
    default_agg="seq-mean-token-mean",
    citation="2507.18071",
    defaults={"eps_low": 3e-4, "eps_high": 4e-4},
    sequence_advantage=True,
)
def gspo_loss(logp, old_logp, adv, mask, *, eps_low, eps_high):
    """GSPO: clip the length-normalised sequence ratio s_i = exp(mean_t l); sequence term on each token."""
    _check_eps(eps_low, eps_high)
    lens = _row_lens(mask, logp.dtype)
    seq_adv = _seq_advantage(adv, mask, "gspo")
    s = _seq_ratio(logp - old_logp, lens)
    term, active = _ppo_clip(s, seq_adv, eps_low, eps_high)
    rows = lens > 0
    metrics = {"clip_frac": _masked_mean(active.to(s.dtype), rows), **_ratio_metrics(s, rows)}
    return term[:, None].expand_as(logp), metrics


@register_loss(
    "gspo_token",
    default_agg="seq-mean-token-mean",
    citation="2507.18071",
    defaults={"eps_low": 3e-4, "eps_high": 4e-4},
)
def gspo_token_loss(logp, old_logp, adv, mask, *, eps_low, eps_high):
    """GSPO-token: s_it = sg(s_i) * exp(logp - sg(logp)), clipped per token; token advantages allowed."""
    _check_eps(eps_low, eps_high)
    lens = _row_lens(mask, logp.dtype)
    s = _seq_ratio(logp - old_logp, lens)
    s_tok = s.detach()[:, None] * torch.exp(logp - logp.detach())
    term, active = _ppo_clip(s_tok, adv, eps_low, eps_high)
    rows = lens > 0
    metrics = {"clip_frac": _masked_mean(active.to(s.dtype), mask), **_ratio_metrics(s, rows)}
    return term, metrics


@register_loss(
    "gmpo",
    default_agg="seq-mean-token-mean",
    citation="2507.20673",
    defaults={"eps_low": 0.4, "eps_high": 0.4},
    sequence_advantage=True,
)
def gmpo_loss(logp, old_logp, adv, mask, *, eps_low, eps_high):
    """GMPO: geometric mean of token ratios, clipped in log space by sgn(A); term -A_i * rho_i."""
    if not (eps_low >= 0 and eps_high >= 0):
        raise AlgorithmError(f"gmpo eps_low/eps_high must be >= 0, got {eps_low}/{eps_high}")
    lens = _row_lens(mask, logp.dtype)
    seq_adv = _seq_advantage(adv, mask, "gmpo")
    sgn = torch.sign(seq_adv)[:, None]
    l = logp - old_logp
    l_clip = l.clamp(-eps_low, eps_high)
    # sgn*min(sgn*l, sgn*clip(l)): the clipped value wins exactly when it is the smaller one.
    active = (sgn * l > sgn * l_clip) & mask
    l_tilde = torch.where(active, l_clip, l)
    rho = _seq_ratio(torch.where(mask, l_tilde, torch.zeros_like(l)), lens)
    term = -seq_adv * rho
    rows = lens > 0
    seq_ratio = _seq_ratio(l, lens)
    metrics = {"clip_frac": _masked_mean(active.to(l.dtype), mask), **_ratio_metrics(seq_ratio, rows)}
    return term[:, None].expand_as(logp), metrics


@register_loss(
    "sapo",
    default_agg="seq-mean-token-mean",
    citation="2511.20347",
    defaults={"tau_pos": 1.0, "tau_neg": 1.05},
)
def sapo_loss(logp, old_logp, adv, mask, *, tau_pos, tau_neg):
    """SAPO soft gate: -(4/tau) * sigmoid(tau*(r-1)) * A, tau = tau_pos if A > 0 else tau_neg."""
    if not (tau_pos > 0 and tau_neg > 0):
        raise AlgorithmError(f"tau_pos/tau_neg must be > 0, got {tau_pos}/{tau_neg}")
    ratio = _exp_clamped(logp - old_logp)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    term = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    return term, {"clip_frac": torch.zeros((), dtype=term.dtype, device=term.device)}


@register_loss(
    "cispo",
    default_agg="token-mean",
    citation="2506.13585",
    defaults={"eps_low": None, "eps_high": 4.0},
)
def cispo_loss(logp, old_logp, adv, mask, *, eps_low, eps_high):
    """CISPO: -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp; every token keeps a gradient."""
    _check_eps(eps_low, eps_high)
    ratio = _exp_clamped(logp - old_logp).detach()
    weight = ratio.clamp(max=1.0 + eps_high)
    clipped = ratio > 1.0 + eps_high
    if eps_low is not None:
        weight = weight.clamp(min=1.0 - eps_low)
        clipped = clipped | (ratio < 1.0 - eps_low)
    term = -weight * adv * logp
    return term, {"clip_frac": _masked_mean(clipped.to(term.dtype), mask)}


def _centred_cov(logp: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """(logp - mean logp) * (A - mean A), means over masked tokens; logp detached."""
    lp = logp.detach()
    return (lp - _masked_mean(lp, mask)) * (adv - _masked_mean(adv, mask))


def _select_k(keys: Tensor, eligible: Tensor, k: int) -> Tensor:
    """bool map of the k eligible entries with the largest keys (fewer if fewer are eligible)."""
    k = min(k, int(eligible.sum().item()))
    sel = torch.zeros_like(eligible)
    if k > 0:
        flat = torch.where(eligible, keys, torch.full_like(keys, float("-inf"))).flatten()
        sel.view(-1)[torch.topk(flat, k).indices] = True
    return sel & eligible


@register_loss(
    "clip_cov",
    default_agg="token-mean",
    citation="2505.22617",
    defaults={
        "eps_low": 0.2,
        "eps_high": 0.2,
        "clip_cov_ratio": 2e-4,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
        "generator": None,
    },
)
def clip_cov_loss(
    logp, old_logp, adv, mask, *, eps_low, eps_high, clip_cov_ratio, clip_cov_lb, clip_cov_ub, generator
):
    """Clip-Cov: PPO term; a random few tokens with centred covariance in [lb, ub] get no gradient."""
    term, active, metrics = _token_clip(logp, old_logp, adv, mask, eps_low, eps_high)
    cov = _centred_cov(logp, adv, mask)
    # Tokens the PPO clip already cut have no gradient left to detach; like the authors' code,
    # they do not use up the sample.
    eligible = mask & ~active & (cov >= clip_cov_lb) & (cov <= clip_cov_ub)
    n_masked = int(mask.sum().item())
    k = max(1, math.floor(clip_cov_ratio * n_masked)) if n_masked else 0
    # Uniform random subset of size k among the eligible: top-k of i.i.d. uniform keys. Drawn on
    # the generator's device so a CPU generator also works for CUDA inputs.
    gen_device = generator.device if generator is not None else logp.device
    keys = torch.rand(logp.shape, generator=generator, device=gen_device).to(logp.device)
    sel = _select_k(keys, eligible, k)
    term = torch.where(sel, term.detach(), term)
    metrics["cov_selected"] = sel.sum().to(term.dtype)
    return term, metrics


@register_loss(
    "kl_cov",
    default_agg="token-mean",
    citation="2505.22617",
    defaults={"kl_cov_ratio": 2e-4, "kl_cov_coef": 0.1},
)
def kl_cov_loss(logp, old_logp, adv, mask, *, kl_cov_ratio, kl_cov_coef):
    """KL-Cov: -r*A; the top-k tokens by centred covariance add kl_cov_coef * |logp - old_logp|."""
    l = logp - old_logp
    term = -_exp_clamped(l) * adv
    cov = _centred_cov(logp, adv, mask)
    n_masked = int(mask.sum().item())
    k = max(1, math.floor(kl_cov_ratio * n_masked)) if n_masked else 0
    sel = _select_k(cov, mask, k)
    term = torch.where(sel, term + kl_cov_coef * l.abs(), term)
    return term, {
        "clip_frac": torch.zeros((), dtype=term.dtype, device=term.device),
        "cov_selected": sel.sum().to(term.dtype),
    }


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def _validate_inputs(logp, old_logp, advantages, mask) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        if not isinstance(x, torch.Tensor):
            raise AlgorithmError(f"{name} must be a tensor, got {type(x).__name__}")
    if logp.dim() != 2:
        raise AlgorithmError(f"logp must be [N,T], got shape {tuple(logp.shape)}")
    if old_logp.shape != logp.shape:
        raise AlgorithmError(f"old_logp has shape {tuple(old_logp.shape)}, expected {tuple(logp.shape)} like logp")
    m = as_bool_mask(mask, logp.shape)
    n = logp.shape[0]
    if advantages.shape == (n,):
        adv_rows = m.any(dim=-1)
        check_finite("advantages", advantages, adv_rows)
    elif advantages.shape == logp.shape:
        check_finite("advantages", advantages, m)
    else:
        raise AlgorithmError(
            f"advantages has shape {tuple(advantages.shape)}, expected ({n},) or {tuple(logp.shape)}"
        )
    check_finite("logp", logp, m)
    check_finite("old_logp", old_logp, m)
    return logp, old_logp, advantages, m


def policy_loss(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **params: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregated policy loss `name` and detached 0-dim metrics.

    `weights` (optional; [N] per sequence or [N, T] per unit; >= 0, detached) multiply each unit's
    whole loss term before aggregation: the importance weights of a training-inference mismatch
    correction, as verl applies its rollout IS weights. What a loss chooses from the advantages
    (KL-Cov's and Clip-Cov's covariance-ranked tokens) sees them unweighted.

    Metrics always include clip_frac, approx_kl (mean over masked tokens of the k3 estimator
    exp(old-new) - (old-new) - 1 of KL(old || new)), ratio_min / ratio_mean / ratio_max (token
    ratio over masked tokens; the sequence ratio for gspo, gspo_token and gmpo).
    """
    spec = get_loss_spec(name)
    check_known_params("loss", spec.name, params, spec.accepted_params)
    agg = params.pop("agg", None) or spec.default_agg
    max_response_len = params.pop("max_response_len", None)
    denominator = params.pop("denominator", None)
    weights = params.pop("weights", None)
    _check_agg(agg, max_response_len)
    kwargs = {**spec.defaults, **params}

    logp, old_logp, advantages, m = _validate_inputs(logp, old_logp, advantages, mask)
    dtype = torch.promote_types(logp.dtype, torch.float32)  # bf16/fp16 inputs computed in fp32
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    # Padding may hold -inf; replace it before any arithmetic so no NaN reaches values or grads.
    lp = torch.where(m, logp.to(dtype), zero)
    olp = torch.where(m, old_logp.detach().to(dtype), zero)
    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(lp)
    adv = torch.where(m, adv, zero)

    out = spec.fn(lp, olp, adv, m, **kwargs)
    per_token, metrics = out if isinstance(out, tuple) else (out, {})
    if per_token.shape != lp.shape:
        raise AlgorithmError(
            f"loss {spec.name!r} returned a per-token term of shape {tuple(per_token.shape)}, expected {tuple(lp.shape)}"
        )
    if weights is not None:
        w = weights.detach().to(dtype)
        per_token = per_token * (w[:, None] if w.dim() == 1 else w)
    loss = aggregate(per_token, m, agg, max_response_len, denominator)

    with torch.no_grad():
        d = olp - lp.detach()
        k3 = torch.expm1(d.clamp(max=LOG_RATIO_CLAMP)) - d
        base = {"approx_kl": _masked_mean(k3, m), "clip_frac": zero.clone()}
        base.update(_ratio_metrics(_exp_clamped(-d), m))
        base.update(metrics)
        metrics = {k: torch.as_tensor(v, device=lp.device).detach().reshape(()) for k, v in base.items()}
    return loss, metrics
