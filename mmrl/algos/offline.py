"""Offline preference losses and the on-policy distillation advantage
(docs/algorithms.md, "Offline and distillation losses").

Inputs are *sequence* log-probs [B] (sum of token log-probs over the response), computed with
the same plumbing as the RL losses. Each loss returns `(loss, metrics)` like `policy_loss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .registry import AlgorithmError, check_finite, paired_mask, register_offline

__all__ = ["dpo_loss", "rpo_loss", "kto_loss", "opd_advantages"]


def _check_same(**tensors: Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise AlgorithmError(f"shape mismatch: {shapes}")
    for k, v in tensors.items():
        check_finite(k, v)


def _dpo_margin(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta):
    _check_same(
        chosen_logp=chosen_logp,
        rejected_logp=rejected_logp,
        ref_chosen_logp=ref_chosen_logp,
        ref_rejected_logp=ref_rejected_logp,
    )
    chosen_reward = beta * (chosen_logp - ref_chosen_logp.detach())
    rejected_reward = beta * (rejected_logp - ref_rejected_logp.detach())
    return chosen_reward, rejected_reward


@register_offline("dpo", citation="2305.18290")
def dpo_loss(
    chosen_logp: Tensor,
    rejected_logp: Tensor,
    ref_chosen_logp: Tensor,
    ref_rejected_logp: Tensor,
    beta: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO: mean of -log sigmoid(beta*((logp_w - ref_w) - (logp_l - ref_l)))."""
    cw, cl = _dpo_margin(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta)
    losses = -F.logsigmoid(cw - cl)
    metrics = {
        "reward_chosen": cw.detach().mean(),
        "reward_rejected": cl.detach().mean(),
        "reward_accuracy": (cw > cl).float().mean().detach(),
        "reward_margin": (cw - cl).detach().mean(),
    }
    return losses.mean(), metrics


@register_offline("rpo", citation="2405.16436")
def rpo_loss(
    chosen_logp: Tensor,
    rejected_logp: Tensor,
    ref_chosen_logp: Tensor,
    ref_rejected_logp: Tensor,
    beta: float = 0.1,
    alpha: float = 1.0,
    chosen_len: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """RPO: DPO + alpha * NLL of the chosen response (per token if `chosen_len` is given)."""
    dpo, metrics = dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta)
    nll = -chosen_logp
    if chosen_len is not None:
        nll = nll / torch.as_tensor(chosen_len, device=nll.device).to(nll.dtype).clamp_min(1)
    nll = nll.mean()
    metrics["nll_chosen"] = nll.detach()
    return dpo + alpha * nll, metrics


@register_offline("kto", citation="2402.01306")
def kto_loss(
    logp: Tensor,
    ref_logp: Tensor,
    desirable: Tensor,
    kl_ref: Tensor | float | None = None,
    beta: float = 0.1,
    lambda_d: float = 1.0,
    lambda_u: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO: lambda_y - v(x,y), v = lambda_D*sig(beta*(r - z0)) or lambda_U*sig(beta*(z0 - r)).

    r = logp - ref_logp; z0 = max(0, kl_ref), detached. The paper estimates kl_ref from mismatched
    (x, y') pairs; pass it in. If None, the batch mean of r (clamped at 0, detached) is used.
    """
    _check_same(logp=logp, ref_logp=ref_logp)
    d = torch.as_tensor(desirable, device=logp.device).bool()
    if d.shape != logp.shape:
        raise AlgorithmError(f"desirable has shape {tuple(d.shape)}, expected {tuple(logp.shape)}")
    r = logp - ref_logp.detach()
    z0 = r.detach().mean() if kl_ref is None else torch.as_tensor(kl_ref, device=r.device, dtype=r.dtype)
    z0 = z0.detach().clamp_min(0)
    v = torch.where(d, lambda_d * torch.sigmoid(beta * (r - z0)), lambda_u * torch.sigmoid(beta * (z0 - r)))
    lam = torch.where(d, torch.full_like(r, lambda_d), torch.full_like(r, lambda_u))
    return (lam - v).mean(), {"kl_ref": z0, "reward": (beta * r).detach().mean()}


@register_offline("opd", citation="G-OPD, 'Learning beyond Teacher' (on-policy distillation)")
def opd_advantages(logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation as RL: token advantage A[i,t] = -(logp - teacher_logp), 0 off-mask."""
    m = paired_mask("logp", logp, "teacher_logp", teacher_logp, mask)
    adv = teacher_logp.detach() - logp.detach()
    return torch.where(m, adv, torch.zeros_like(adv))
