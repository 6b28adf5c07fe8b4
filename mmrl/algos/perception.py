"""Perception-aware terms for multimodal policies: PAPO (arXiv 2507.06448).

PAPO scores the sampled tokens a second time with the image masked and *maximises* the per-token
divergence between the two distributions, so the policy is pushed to depend on what it sees:

    J_PAPO = J_loss - gamma * KL_prcp + eta_1 * H[pi(.|q, I)] + eta_2 * H[pi(.|q, I_mask)]   (as a loss)

    KL_prcp per token = k3 = exp(d) - d - 1,  d = log pi(o_t | q, I_mask, o_<t) - log pi(o_t | q, I, o_<t)

the k3 estimate of KL(pi(.|I) || pi(.|I_mask)) from tokens drawn under pi(.|I), non-negative and
unbiased. Both log-probs carry gradient. The term is aggregated with the same mask, `agg` mode and
normaliser as the policy loss (padding never counts; TRL's experimental trainer averages it over
padding too). Defaults follow the issue and the paper: gamma = 0.01, each 14-pixel patch blacked
with probability 0.6, the double entropy loss (eta_1, eta_2) off. `kl_max` > 0 clips k3 per token
(TRL clamps at 0.2 against the "KL hacking" the paper describes); 0 leaves it unclipped.
"""

from __future__ import annotations

import torch
from torch import Tensor


def perception_kl(logp: Tensor, logp_masked: Tensor, mask: Tensor, kl_max: float = 0.0) -> Tensor:
    """Per-token k3 estimate of KL(pi(.|image) || pi(.|masked image)) [N, T]; 0 on padding."""
    d = (logp_masked - logp).masked_fill(~mask, 0.0)
    k3 = torch.expm1(d) - d
    if kl_max > 0:
        k3 = k3.clamp(max=kl_max)
    return k3.masked_fill(~mask, 0.0)


def _dropped(shape: tuple[int, ...], prob: float, generator: torch.Generator | None,
             device: torch.device) -> Tensor:
    """A bool mask of `shape`, each entry True with probability `prob`, on `device`; the draw is made
    on the generator's device so a seeded mask does not depend on where the data lives."""
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"mask probability must be in [0, 1], got {prob}")
    drop = torch.rand(*shape, generator=generator, device=generator.device if generator else device)
    return (drop < prob).to(device)


def mask_patches(patches: Tensor, black: Tensor, prob: float, generator: torch.Generator | None = None) -> Tensor:
    """Each row of `patches` [P, D] (one vision patch, channel-major) replaced by `black` [D] (the
    normalised value of a black patch) with probability `prob`, independently."""
    drop = _dropped((patches.shape[0],), prob, generator, patches.device)
    return torch.where(drop[:, None], black.to(patches.dtype), patches)


def mask_squares(frames: Tensor, side: int, prob: float, generator: torch.Generator | None = None) -> Tensor:
    """Camera frames [..., H, W, C] with each `side` x `side` square of a grid from the top-left
    corner (partial at the edges) blacked with probability `prob`, independently per frame: PAPO's
    patch masking on raw frames, for policies whose rollouts keep images rather than patches."""
    if side < 1:
        raise ValueError(f"the masked squares' side must be >= 1 pixel, got {side}")
    *lead, H, W, _ = frames.shape
    keep = ~_dropped((*lead, -(-H // side), -(-W // side)), prob, generator, frames.device)
    keep = keep.repeat_interleave(side, -2)[..., :H, :].repeat_interleave(side, -1)[..., :W]
    return frames * keep[..., None].to(frames.dtype)
