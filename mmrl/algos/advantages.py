"""Advantage estimators (docs/algorithms.md, "Advantage estimators").

All group statistics are segment reductions (`scatter_add_` / `scatter_reduce_`) over a slot
label per sample: the ids themselves when they are small non-negative integers, else a verified
hash of them (no sort). No Python loop over samples or groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .registry import (
    AlgorithmError,
    as_bool_mask,
    check_finite,
    check_known_params,
    get_advantage_spec,
    register_advantage,
)

__all__ = ["Groups", "make_groups", "groups_from_slots", "compute_advantages"]

GROUP_EPS = 1e-6  # docs/algorithms.md: std_g + 1e-6
WHITEN_EPS = 1e-8  # docs/algorithms.md: reinforce_pp whitening


@dataclass(frozen=True)
class Groups:
    """Group structure of a batch, built once by `make_groups` and shared by the statistics.

    `inverse[i]` in [0, num_groups) is the slot of sample i's group and `rep[i]` the index of one
    fixed member of that group. Slots may be empty (ids are hashed or used directly as slots rather
    than sorted); every statistic is safe for empty slots and they are never gathered back.
    """

    inverse: Tensor  # long [N]
    num_groups: int
    counts: Tensor  # long [G], group sizes
    rep: Tensor  # long [N], a member of the same group

    def gather(self, per_group: Tensor) -> Tensor:
        """Broadcast a per-group value [G] (or [G, k]) back to samples."""
        return per_group.index_select(0, self.inverse)

    def sum(self, x: Tensor) -> Tensor:
        out = torch.zeros(self.num_groups, dtype=x.dtype, device=x.device)
        return out.scatter_add_(0, self.inverse, x)

    def mean(self, x: Tensor) -> Tensor:
        return self.sum(x) / self.counts.clamp_min(1).to(x.dtype)

    def centred(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """`(x - mean_g per sample [N], unbiased var_g [G])`; exactly 0 in constant groups.

        Moments are taken of x shifted by a member of its group: equal values then give exact
        zeros (plain `x - sum/n` leaves rounding noise that `/ (std + eps)` would blow up), and
        the one-pass variance has no cancellation.
        """
        d = x - x.index_select(0, self.rep)
        s1, s2 = self.sum(d), self.sum(d * d)
        n = self.counts.to(x.dtype)
        mean_d = s1 / n.clamp_min(1)
        var = ((s2 - s1 * mean_d) / (n - 1).clamp_min(1)).clamp_min_(0)
        return d - self.gather(mean_d), var

    def std(self, x: Tensor) -> Tensor:
        """Unbiased (n-1) std per group [G]; 0 for groups of one."""
        return safe_sqrt(self.centred(x)[1])

    def amax(self, x: Tensor) -> Tensor:
        out = torch.full((self.num_groups,), float("-inf"), dtype=x.dtype, device=x.device)
        return out.scatter_reduce_(0, self.inverse, x, reduce="amax", include_self=True)

    def amin(self, x: Tensor) -> Tensor:
        out = torch.full((self.num_groups,), float("inf"), dtype=x.dtype, device=x.device)
        return out.scatter_reduce_(0, self.inverse, x, reduce="amin", include_self=True)

    def constant(self, x: Tensor) -> Tensor:
        """bool [N]: the sample's group has all-equal values (includes groups of one)."""
        return self.gather(self.amax(x) == self.amin(x))


def safe_sqrt(v: Tensor) -> Tensor:
    """sqrt of a variance. Clamped at the smallest normal float: sqrt(0) runs ~10x slower on some
    CPUs, and sqrt(tiny) ~ 1e-19 vanishes next to the 1e-6 eps it is added to."""
    return v.clamp_min(torch.finfo(v.dtype).tiny).sqrt_()


# Odd 64-bit multipliers for Fibonacci-style hashing (as signed int64; products wrap mod 2^64).
_HASH_MULS = (-7046029254386353131, -4658895280553007687, 7640891576956012809)


def _hash_slots(ids: Tensor) -> Tensor:
    """Label each sample with the index of one member of its group, without sorting.

    Each round hashes the ids into a table of sample indices; a sample whose table entry points at
    a sample with the same id takes that entry as its label (so different ids never share one,
    and all members of an id land in the same round). Ids that lose a collision are rehashed into
    a fresh table; leftovers after the last round go through torch.unique. Labels lie in [0, N).
    """
    n = ids.numel()
    slot = torch.arange(n, device=ids.device)
    rem: Tensor | None = None  # sample indices still unlabelled (None: all)
    keys = ids
    for mul in _HASH_MULS:
        bits = max(4, (8 * keys.numel() - 1).bit_length())  # table >= 8x the keys left: few collisions
        h = ((keys * mul) >> (64 - bits)) & ((1 << bits) - 1)
        cand = slot if rem is None else rem
        table = torch.empty(1 << bits, dtype=ids.dtype, device=ids.device).scatter_(0, h, cand)
        owner = table.index_select(0, h)
        ok = ids.index_select(0, owner) == keys
        if rem is None:
            slot = owner
        else:
            slot[rem[ok]] = owner[ok]
        if bool(ok.all()):
            return slot
        rem = (~ok).nonzero().squeeze(1) if rem is None else rem[~ok]
        keys = ids.index_select(0, rem)
    _, inv = torch.unique(keys, return_inverse=True)
    first = torch.full((int(inv.max().item()) + 1,), n, dtype=ids.dtype, device=ids.device)
    first.scatter_reduce_(0, inv, rem, reduce="amin")
    slot[rem] = first.index_select(0, inv)
    return slot


def make_groups(group_ids: Any, n: int | None = None, device: torch.device | None = None) -> Groups:
    """Build `Groups` from arbitrary (unsorted, sparse, negative) integer ids. No sort, no loop over groups."""
    ids = torch.as_tensor(group_ids, device=device)
    if ids.dim() != 1:
        raise AlgorithmError(f"group_ids must be 1-D [N], got shape {tuple(ids.shape)}")
    if n is not None and ids.shape[0] != n:
        raise AlgorithmError(f"group_ids has shape {tuple(ids.shape)}, expected ({n},) like rewards")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise AlgorithmError(f"group_ids must be an integer tensor, got dtype {ids.dtype}")
    ids = ids.long()
    size = ids.numel()
    if size == 0:
        return Groups(ids, 0, torch.zeros(0, dtype=torch.long, device=ids.device), ids)
    lo, hi = torch.aminmax(ids)
    lo_i, hi_i = int(lo.item()), int(hi.item())
    if lo_i >= 0 and hi_i < 2 * size + 64:
        return groups_from_slots(ids, hi_i + 1)  # small non-negative ids are their own slots
    slot = _hash_slots(ids)  # the label is itself a member's index
    return groups_from_slots(slot, size, rep=slot)


def groups_from_slots(slot: Tensor, n_slots: int, rep: Tensor | None = None) -> Groups:
    """`Groups` from slot labels in [0, n_slots) (equal label = same group)."""
    if rep is None:
        # One scatter leaves some member's index in every used slot.
        member = torch.empty(n_slots, dtype=torch.long, device=slot.device)
        member.scatter_(0, slot, torch.arange(slot.numel(), device=slot.device))
        rep = member.index_select(0, slot)
    counts = torch.zeros(n_slots, dtype=torch.long, device=slot.device)
    counts.scatter_add_(0, slot, torch.ones_like(slot))
    return Groups(slot, n_slots, counts, rep)


def _prep_rewards(rewards: Any) -> Tensor:
    r = torch.as_tensor(rewards)
    if r.dim() != 1:
        raise AlgorithmError(f"rewards must be 1-D [N], got shape {tuple(r.shape)}")
    if not r.dtype.is_floating_point or r.dtype in (torch.float16, torch.bfloat16):
        r = r.float()
    # Fast path: a NaN/inf anywhere makes the sum non-finite; only then count them exactly.
    if not bool(torch.isfinite(r.sum())):
        check_finite("rewards", r)
    return r


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor, **params: Any) -> Tensor:
    """Per-sequence advantages [N] from outcome rewards [N] and group ids [N] with estimator `name`."""
    spec = get_advantage_spec(name)
    check_known_params("advantage", name, params, spec.params)
    r = _prep_rewards(rewards)
    groups = make_groups(group_ids, n=r.shape[0], device=r.device)
    with torch.no_grad():
        out = spec.fn(r, groups, **params)
    return out


# ---------------------------------------------------------------------------------------------
# Outcome-reward estimators: fn(rewards [N], groups, **params) -> [N]
# ---------------------------------------------------------------------------------------------


def _zscore(r: Tensor, g: Groups, eps: float) -> Tensor:
    dev, var = g.centred(r)  # dev is exactly 0 in constant groups and groups of one
    return dev / g.gather(safe_sqrt(var).add_(eps))


@register_advantage("grpo", citation="2402.03300")
def grpo_advantage(rewards: Tensor, groups: Groups, *, eps: float = GROUP_EPS) -> Tensor:
    """Group z-score (R - mean_g) / (std_g + eps), unbiased std; 0 for a group of one."""
    return _zscore(rewards, groups, eps)


@register_advantage("dr_grpo", citation="2503.20783")
def dr_grpo_advantage(rewards: Tensor, groups: Groups) -> Tensor:
    """Dr. GRPO: R - mean_g (no std division)."""
    return groups.centred(rewards)[0]


@register_advantage("rloo", citation="2402.14740")
def rloo_advantage(rewards: Tensor, groups: Groups) -> Tensor:
    """RLOO: R - mean of the other G-1 members of the group; 0 for a group of one."""
    # R - (sum - R)/(n-1) = n/(n-1) * (R - mean); a group of one has R - mean = 0.
    n = groups.gather(groups.counts).to(rewards.dtype)
    return groups.centred(rewards)[0] * (n / (n - 1).clamp_min(1))


@register_advantage("w_reinforce", citation="2506.01347")
def w_reinforce_advantage(rewards: Tensor, groups: Groups, *, lam: float = 0.1) -> Tensor:
    """W-REINFORCE: the reward itself, positive ones scaled by lam (no baseline; lam 0 = NSR)."""
    # No group baseline: a group whose samples all failed still pushes its failures down, which
    # frees probability for the alternatives instead of sharpening what already works.
    return torch.where(rewards > 0, lam * rewards, rewards)


def _whiten_over_tokens(x: Tensor, mask: Tensor | None) -> Tensor:
    """Whiten per-sequence values [N] as if broadcast to each sequence's masked tokens."""
    if mask is None:
        w = torch.ones_like(x)
    else:
        if mask.dim() != 2 or mask.shape[0] != x.shape[0]:
            raise AlgorithmError(f"mask has shape {tuple(mask.shape)}, expected ({x.shape[0]}, T)")
        w = as_bool_mask(mask, mask.shape).sum(dim=1).to(x.dtype)
    # A sequence value broadcast to len_i tokens: token-weighted mean / unbiased var over tokens.
    n_tok = w.sum()
    mean = (w * x).sum() / n_tok.clamp_min(1)
    var = (w * (x - mean).square()).sum() / (n_tok - 1).clamp_min(1)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS)


@register_advantage("reinforce_pp", citation="2501.03262")
def reinforce_pp_advantage(rewards: Tensor, groups: Groups, *, mask: Tensor | None = None) -> Tensor:
    """REINFORCE++ (group baseline): R - mean_g, whitened over all masked tokens of the batch."""
    return _whiten_over_tokens(dr_grpo_advantage(rewards, groups), mask)


@register_advantage("reinforce_pp_batch", citation="2501.03262")
def reinforce_pp_batch_advantage(rewards: Tensor, groups: Groups, *, mask: Tensor | None = None) -> Tensor:
    """REINFORCE++ (batch baseline): R whitened over all masked tokens of the batch; no group mean."""
    # Without a group baseline a group whose samples all failed sits below the batch mean and is
    # pushed down, where GRPO gives it zero advantage.
    return _whiten_over_tokens(rewards, mask)


@register_advantage("passk", citation="2503.19595")
def passk_advantage(
    rewards: Tensor, groups: Groups, *, norm_by_std: bool = False, eps: float = GROUP_EPS
) -> Tensor:
    """Only the group's unique best gets R_best - max of the others (0 on ties / groups of one)."""
    gmax = groups.amax(rewards)
    is_max = rewards == groups.gather(gmax)
    n_max = groups.sum(is_max.to(rewards.dtype))
    # Second best = max over the members below the max (-inf if none).
    below = torch.where(is_max, torch.full_like(rewards, float("-inf")), rewards)
    second = groups.amax(below)
    unique_best = is_max & (groups.gather(n_max) == 1) & (groups.gather(groups.counts) > 1)
    gap = groups.gather(gmax - second)
    adv = torch.where(unique_best, gap, torch.zeros_like(rewards))
    if norm_by_std:
        adv = adv / (groups.gather(groups.std(rewards)) + eps)
    return adv


@register_advantage("mapo", citation="2509.18849")
def mapo_advantage(
    rewards: Tensor, groups: Groups, *, success_threshold: float = 1.0, eps: float = GROUP_EPS
) -> Tensor:
    """MAPO: (1-lam(p))*z-score + lam(p)*(R-mean)/mean, lam(p) = 1-4p(1-p), p = group success rate."""
    dev, var = groups.centred(rewards)
    z = dev / groups.gather(safe_sqrt(var).add_(eps))
    mean = rewards - dev
    apd = dev / (mean + eps)  # advantage percent deviation
    p = groups.gather(groups.mean((rewards >= success_threshold).to(rewards.dtype)))
    lam = 1.0 - 4.0 * p * (1.0 - p)  # trajectory certainty: 1 when all succeed or all fail
    return (1.0 - lam) * z + lam * apd
