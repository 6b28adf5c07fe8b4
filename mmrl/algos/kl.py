"""KL-to-reference estimators (docs/algorithms.md, "KL and entropy").

With d = ref_logp - logp (samples from the current policy):
k1 = -d, k2 = d^2/2, k3 = exp(d) - d - 1 (unbiased and always >= 0), abs = |d|.
`gaussian` is the exact KL of Gaussian denoising steps, which flow policies compute from their step
means (`mmrl.flow.gaussian_kl`), not from log-probs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .losses import LOG_RATIO_CLAMP
from .registry import AlgorithmError, as_bool_mask, get_kl_spec, register_kl

__all__ = ["GAUSSIAN_KL", "kl_penalty"]


@register_kl("k1", citation="Schulman 2020, http://joschu.net/blog/kl-approx.html")
def _k1(d: Tensor) -> Tensor:
    """k1 = logp - ref_logp (unbiased, high variance, can be negative)."""
    return -d


@register_kl("k2", citation="Schulman 2020, http://joschu.net/blog/kl-approx.html")
def _k2(d: Tensor) -> Tensor:
    """k2 = (ref_logp - logp)^2 / 2 (biased, low variance)."""
    return 0.5 * d.square()


@register_kl("k3", citation="2402.03300 (Schulman 2020 estimator)")
def _k3(d: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1, d = ref_logp - logp (unbiased, >= 0; GRPO's choice).

    float32 exp overflows above d ~ 88: beyond LOG_RATIO_CLAMP exp continues as its tangent there,
    so k3 stays finite and still grows with d (its gradient keeps pulling logp towards the reference)."""
    over = (d - LOG_RATIO_CLAMP).clamp(min=0)
    return torch.expm1(d.clamp(max=LOG_RATIO_CLAMP)) + math.exp(LOG_RATIO_CLAMP) * over - d  # expm1: precision for small d


@register_kl("abs", citation="Schulman 2020, http://joschu.net/blog/kl-approx.html")
def _abs(d: Tensor) -> Tensor:
    """abs = |ref_logp - logp|."""
    return d.abs()


GAUSSIAN_KL = "gaussian"


@register_kl(GAUSSIAN_KL, citation="2505.05470 (Flow-GRPO's KL term)",
             description="exact KL of Gaussian denoising steps from their means (flow and diffusion policies)")
def _gaussian(d: Tensor) -> Tensor:
    """Not an estimator on log-probs: the trainer takes it from the policy's step means
    (`FlowPolicyBase.logprobs_and_kl`, `mmrl.flow.gaussian_kl`), and the config accepts it only
    for policies whose units are Gaussian steps."""
    raise AlgorithmError("kl_kind 'gaussian' is computed from a flow policy's step means (logprobs_and_kl), "
                         "not from log-probs")


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str, mask: Tensor | None = None) -> Tensor:
    """Per-token KL estimate [N,T] of the current policy to the reference (`kind` in k1/k2/k3/abs).

    Pass `mask` when padding may hold -inf: masked-out positions then get 0 (value and gradient)
    instead of NaN. Aggregate the result with `aggregate(...)` like the policy term.
    """
    spec = get_kl_spec(kind)
    if ref_logp.shape != logp.shape:
        raise AlgorithmError(f"ref_logp has shape {tuple(ref_logp.shape)}, expected {tuple(logp.shape)} like logp")
    d = ref_logp.detach() - logp
    if mask is not None:
        m = as_bool_mask(mask, logp.shape)
        zero = torch.zeros((), dtype=d.dtype, device=d.device)
        d = torch.where(m, ref_logp.detach(), zero) - torch.where(m, logp, zero)
    return spec.fn(d)
