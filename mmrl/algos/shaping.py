"""Reward shaping and sampling filters (docs/algorithms.md, "Reward shaping and sampling").

Pure, vectorised functions. The loops that use them (DAPO dynamic sampling: resample until the
batch holds enough groups with `nonconstant_groups`; GFPO's oversampling) live in the trainer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .advantages import GROUP_EPS, Groups, _prep_rewards, _zscore, groups_from_slots, make_groups
from .registry import AlgorithmError, as_bool_mask, check_finite, unknown_name_error

__all__ = [
    "overlong_penalty",
    "nonconstant_groups",
    "failed_groups",
    "one_row_per_group",
    "mask_truncated",
    "gfpo_keep",
    "gfpo_advantages",
    "redit",
    "success_rate_filter",
    "rank_within_group",
    "high_entropy_tokens",
]


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment (2503.14476), float [N], added to the reward.

    0 if len <= max_len - cache_len; ((max_len - cache_len) - len) / cache_len inside the window;
    -1 beyond max_len.
    """
    if not 0 < cache_len <= max_len:
        raise AlgorithmError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    length = torch.as_tensor(lengths).to(torch.float32)
    expected = float(max_len - cache_len)
    window = (expected - length) / float(cache_len)
    out = torch.where(length <= expected, torch.zeros_like(length), window)
    return torch.where(length > max_len, torch.full_like(length, -1.0), out)


def nonconstant_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """bool [N]: keep mask of DAPO dynamic sampling, True for members of groups whose rewards differ."""
    r = _prep_rewards(rewards)
    g = make_groups(group_ids, n=r.shape[0], device=r.device)
    return ~g.constant(r)


def failed_groups(rewards: Tensor, group_ids: Tensor, below: float) -> Tensor:
    """bool [N]: members of groups whose best reward is below `below` (every sample failed)."""
    r = _prep_rewards(rewards)
    g = make_groups(group_ids, n=r.shape[0], device=r.device)
    return g.gather(g.amax(r)) < below


def one_row_per_group(group_ids: Tensor) -> Tensor:
    """bool [N]: True for exactly one member of each group (to take a group's shared context once)."""
    g = make_groups(group_ids)
    return g.rep == torch.arange(len(g.rep), device=g.rep.device)


def mask_truncated(mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the rows of `mask` [N,T] whose response was truncated (bool [N]); dtype kept."""
    tr = torch.as_tensor(truncated, device=mask.device)
    if tr.shape != (mask.shape[0],):
        raise AlgorithmError(f"truncated has shape {tuple(tr.shape)}, expected ({mask.shape[0]},)")
    keep = ~tr.bool()
    return torch.where(keep[:, None], mask, torch.zeros_like(mask))


def rank_within_group(key: Tensor, groups: Groups) -> Tensor:
    """long [N]: 0-based rank of each sample inside its group by ascending `key`; ties by index."""
    n = key.shape[0]
    # Stable sort by key, then stable sort by group: within a group the key order survives.
    by_key = torch.argsort(key, stable=True)
    by_group = torch.argsort(groups.inverse[by_key], stable=True)
    perm = by_key[by_group]
    starts = torch.cumsum(groups.counts, 0) - groups.counts  # first sorted position of each group
    pos = torch.arange(n, device=key.device)
    rank = torch.empty_like(pos)
    rank[perm] = pos - starts[groups.inverse[perm]]
    return rank


def gfpo_keep(rewards: Tensor, group_ids: Tensor, k: int, metric: str, lengths: Tensor) -> Tensor:
    """GFPO (2508.09726) filter, bool [N]: keep the k best of each group by `metric`.

    `shortest`: smallest length; `reward_per_length`: highest reward / length. Ties go to the
    lower batch index, so the result is deterministic.
    """
    if k < 1:
        raise AlgorithmError(f"gfpo k must be >= 1, got {k}")
    r = _prep_rewards(rewards)
    length = torch.as_tensor(lengths, device=r.device).to(torch.float32)
    if length.shape != r.shape:
        raise AlgorithmError(f"lengths has shape {tuple(length.shape)}, expected {tuple(r.shape)}")
    if metric == "shortest":
        key = length
    elif metric == "reward_per_length":
        key = -(r / length.clamp_min(1.0))
    else:
        raise unknown_name_error("gfpo metric", metric, ("shortest", "reward_per_length"))
    g = make_groups(group_ids, n=r.shape[0], device=r.device)
    return rank_within_group(key, g) < k


def gfpo_advantages(rewards: Tensor, group_ids: Tensor, keep: Tensor, *, eps: float = GROUP_EPS) -> Tensor:
    """GRPO z-score using only the kept members' statistics; 0 for the filtered-out ones."""
    r = _prep_rewards(rewards)
    keep = torch.as_tensor(keep, device=r.device).bool()
    if keep.shape != r.shape:
        raise AlgorithmError(f"keep has shape {tuple(keep.shape)}, expected {tuple(r.shape)}")
    g = make_groups(group_ids, n=r.shape[0], device=r.device)
    # Put dropped samples in their own slots (group + G) so they do not touch kept statistics.
    inv = torch.where(keep, g.inverse, g.inverse + g.num_groups)
    adv = _zscore(r, groups_from_slots(inv, 2 * g.num_groups), eps)
    return torch.where(keep, adv, torch.zeros_like(adv))


def redit(
    rewards: Tensor, scale: float, kind: str = "gaussian", generator: torch.Generator | None = None
) -> Tensor:
    """ReDit (2506.18631): add zero-mean noise to discrete rewards.

    gaussian: N(0, scale^2); uniform: U(-scale, scale).
    """
    r = _prep_rewards(rewards)
    if scale < 0:
        raise AlgorithmError(f"redit scale must be >= 0, got {scale}")
    dev = generator.device if generator is not None else r.device  # a CPU generator works for CUDA rewards
    if kind == "gaussian":
        noise = torch.randn(r.shape, generator=generator, device=dev, dtype=r.dtype) * scale
    elif kind == "uniform":
        noise = (torch.rand(r.shape, generator=generator, device=dev, dtype=r.dtype) * 2 - 1) * scale
    else:
        raise unknown_name_error("redit kind", kind, ("gaussian", "uniform"))
    return r + noise.to(r.device)


def success_rate_filter(success: Any, group_ids: Tensor, low: float, high: float) -> Tensor:
    """bool [N]: keep groups whose mean success lies in [low, high] (SimpleVLA-RL / SRPO filtering)."""
    s = torch.as_tensor(success)
    s = s.to(torch.float32)
    if s.dim() != 1:
        raise AlgorithmError(f"success must be 1-D [N], got shape {tuple(s.shape)}")
    check_finite("success", s)
    if low > high:
        raise AlgorithmError(f"need low <= high, got low={low}, high={high}")
    g = make_groups(group_ids, n=s.shape[0], device=s.device)
    rate = g.gather(g.mean(s))
    return (rate >= low) & (rate <= high)


def high_entropy_tokens(entropy: Tensor, mask: Tensor, top_frac: float) -> Tensor:
    """The "forking tokens" of Wang et al. 2025 (arXiv 2506.01939), bool [N, T]: the `top_frac`
    share of masked-in tokens with the highest entropy (ties at the threshold are kept).

    The policy gradient over only these tokens leaves the near-certain ones alone: a negative
    advantage then does not push down tokens the policy had right (e.g. the copied cells of a
    drawn frame).
    """
    if not 0.0 < top_frac <= 1.0:
        raise AlgorithmError(f"top_frac must be in (0, 1], got {top_frac}")
    m = as_bool_mask(mask, entropy.shape)
    if top_frac == 1.0:
        return m
    n = int(m.sum())
    if n == 0:
        return m
    k = max(1, math.ceil(top_frac * n))
    threshold = entropy.detach()[m].float().topk(k).values[-1]
    return m & (entropy.detach().float() >= threshold)
