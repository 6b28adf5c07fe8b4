"""KVPO (arXiv 2605.14278): KV-cache history routing, Trajectory Velocity Energy, the branch
softmax and anchor-relative advantages, as small pure tensor functions. The objective is the
registry's clipped loss on the branch log-probs (configs/video_kvpo.yaml).

Spec, defaults and sources: docs/kvpo.md. Layout: one *group* = one prompt + one shared initial
noise, holding G routed branches and one anchor (unperturbed) row; rows of a group share a
`group_id` and `is_anchor` marks the anchor. Group statistics are segment reductions over
`group_ids` (`make_groups`): no Python loop over samples or groups (only over the few named reward
components / signals).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .advantages import Groups, make_groups, safe_sqrt
from .registry import AlgorithmError, check_finite, register_advantage

__all__ = [
    "sample_history_routes",
    "tve_step_weights",
    "first_steps_mask",
    "trajectory_velocity_energy",
    "branch_logprobs",
    "anchor_relative_advantages",
    "fuse_signal_advantages",
    "anchor_advantages",
    "SIGMA_EPS",
    "FUSION_MODES",
]

SIGMA_EPS = 1e-8  # (r - r_anchor) / (std + 1e-8) and fusion std + 1e-8 (T _anchor_advantage, _normalize_...)
FUSION_MODES = ("none", "std", "zscore")
DEFAULT_SIGNAL_WEIGHTS = {"local": 1.0, "global": 0.5}  # advantage_fusion_{local,global}_weight


# ---------------------------------------------------------------------------------------------
# 1. Causal History Routing
# ---------------------------------------------------------------------------------------------


def _int_arg(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AlgorithmError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise AlgorithmError(f"{name} must be >= {minimum}, got {value}")
    return value


def sample_history_routes(
    num_past_chunks: int,
    window: int,
    keep_nearest: int,
    num_branches: int,
    generator: torch.Generator | None = None,
    *,
    sink: int = 0,
    history_limit: int | None = None,
    dispersed: bool = True,
) -> Tensor:
    """History entries each row attends to: long [G+1, sink+window], row 0 the anchor, rows sorted.

    Anchor (identity route): `sink ∪ {T-window..T-1}`. Branch g: `sink ∪ O_g ∪ {T-m..T-1}` with
    `O_g` (n = window - m entries) drawn from the older pool `[max(sink, T - history_limit), T-m)`:
    dispersed -> one permutation π of the pool, `O_g = pool[π[(g*shift + i) % |pool|]]`, i < n,
    shift = max(1, |pool| // G); otherwise independent draws. Entries keep their absolute index
    (= position). Deterministic given `generator`.
    """
    T = _int_arg("num_past_chunks", num_past_chunks, 0)
    L = _int_arg("window", window, 1)
    m = _int_arg("keep_nearest", keep_nearest, 0)
    G = _int_arg("num_branches", num_branches, 1)
    s = _int_arg("sink", sink, 0)
    if m > L:
        raise AlgorithmError(f"keep_nearest ({m}) must be <= window ({L})")
    if T < s + L:
        raise AlgorithmError(
            f"num_past_chunks ({T}) must be >= sink + window ({s} + {L}): the route needs a full window"
        )
    device = generator.device if generator is not None else torch.device("cpu")
    p0 = s
    if history_limit is not None:
        p0 = max(s, T - _int_arg("history_limit", history_limit, 0))
    pool = torch.arange(p0, max(p0, T - m), device=device)
    n, P = L - m, pool.numel()
    if P < n:
        raise AlgorithmError(
            f"older pool [{p0}, {T - m}) has {P} entries, fewer than window - keep_nearest = {n}"
        )
    if n == 0:
        older = torch.empty(G, 0, dtype=torch.long, device=device)
    elif dispersed:
        perm = torch.randperm(P, generator=generator, device=device)
        shift = max(1, P // G)
        idx = (torch.arange(G, device=device)[:, None] * shift + torch.arange(n, device=device)) % P
        older = pool[perm[idx]]
    else:
        keys = torch.rand(G, P, generator=generator, device=device)
        older = pool[keys.argsort(dim=1)[:, :n]]
    older = older.sort(dim=1).values
    sinks = torch.arange(s, device=device)
    nearest = torch.arange(T - m, T, device=device)
    branches = torch.cat([sinks.expand(G, s), older, nearest.expand(G, m)], dim=1)
    anchor = torch.cat([sinks, torch.arange(T - L, T, device=device)])
    return torch.cat([anchor[None], branches], dim=0)


# ---------------------------------------------------------------------------------------------
# 2. Trajectory Velocity Energy and the branch policy
# ---------------------------------------------------------------------------------------------


def tve_step_weights(sigmas: Any, sigma_floor: float = 1.0, space: str = "x0") -> Tensor:
    """Per-step TVE weight w_k: x0 -> t^2 / (2 max(t, floor)^2) (the code's x0 Gaussian log-density);
    velocity -> 1 / (2 max(t, floor)^2)."""
    t = torch.as_tensor(sigmas, dtype=torch.float32) if not isinstance(sigmas, Tensor) else sigmas
    if not t.is_floating_point():
        t = t.float()
    if space not in ("x0", "velocity"):
        raise AlgorithmError(f"space must be 'x0' or 'velocity', got {space!r}")
    if not sigma_floor >= 0:
        raise AlgorithmError(f"sigma_floor must be >= 0, got {sigma_floor}")
    check_finite("sigmas", t)
    if bool((t < 0).any()):
        raise AlgorithmError("sigmas must be >= 0")
    denom = 2.0 * t.clamp_min(sigma_floor).square().clamp_min(1e-10)  # T: max(sigma^2, 1e-10)
    return t.square() / denom if space == "x0" else 1.0 / denom


def first_steps_mask(num_steps: int, grad_steps: int, num_blocks: int = 1) -> Tensor:
    """bool [num_blocks*num_steps] (block-major): step k of every block carries gradient iff k < grad_steps."""
    _int_arg("num_steps", num_steps, 1)
    _int_arg("grad_steps", grad_steps, 0)
    _int_arg("num_blocks", num_blocks, 1)
    return (torch.arange(num_steps) < grad_steps).repeat(num_blocks)


def _per_step(name: str, x: Tensor | None, N: int, S: int, device: torch.device) -> Tensor | None:
    """Broadcast a [S] or [N, S] per-step tensor to [N, S]."""
    if x is None:
        return None
    x = torch.as_tensor(x, device=device)
    if tuple(x.shape) == (S,):
        return x.expand(N, S)
    if tuple(x.shape) == (N, S):
        return x
    raise AlgorithmError(f"{name} has shape {tuple(x.shape)}, expected ({S},) or ({N}, {S})")


def trajectory_velocity_energy(
    v_branch: Tensor,
    v_replay: Tensor,
    step_weights: Tensor | None = None,
    grad_mask: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """TVE [N] = sum_s w_s * mean_elements (v_replay - sg(v_branch))^2.

    `v_branch` [N, S, ...]: the velocities the branch trajectory used (routed context, old policy);
    `v_replay` [N, S, ...]: the policy's velocities at the same states in the unperturbed context.
    S enumerates (block, step). `grad_mask` [S]/[N,S]: steps whose `v_replay` keeps its gradient
    (others are detached); `valid` [N,S]: steps that exist (padding gets weight 0).
    """
    if v_branch.shape != v_replay.shape:
        raise AlgorithmError(
            f"v_branch {tuple(v_branch.shape)} and v_replay {tuple(v_replay.shape)} must have the same shape"
        )
    if v_replay.dim() < 2:
        raise AlgorithmError(f"velocities must be [N, S, ...], got shape {tuple(v_replay.shape)}")
    N, S = v_replay.shape[:2]
    dev = v_replay.device
    dtype = torch.promote_types(v_replay.dtype, torch.float32)
    v = v_replay.to(dtype)
    target = v_branch.detach().to(dtype)
    gm = _per_step("grad_mask", grad_mask, N, S, dev)
    if gm is not None:
        gm = gm if gm.dtype == torch.bool else gm != 0
        v = torch.where(gm.reshape(N, S, *([1] * (v.dim() - 2))), v, v.detach())
    energy = (v - target).square().reshape(N, S, -1).mean(dim=-1)  # [N, S]
    w = _per_step("step_weights", step_weights, N, S, dev)
    w = torch.ones(N, S, dtype=dtype, device=dev) if w is None else w.to(dtype)
    ok = _per_step("valid", valid, N, S, dev)
    if ok is not None:
        ok = ok if ok.dtype == torch.bool else ok != 0
        w = torch.where(ok, w, torch.zeros((), dtype=dtype, device=dev))
        energy = torch.where(ok, energy, torch.zeros((), dtype=dtype, device=dev))
    return (w * energy).sum(dim=1)


def _rows(name: str, x: Any, n: int, device: torch.device | None = None) -> Tensor:
    t = torch.as_tensor(x, device=device)
    if t.dim() != 1 or t.shape[0] != n:
        raise AlgorithmError(f"{name} has shape {tuple(t.shape)}, expected ({n},)")
    return t


def _anchor_mask(is_anchor: Any, n: int, device: torch.device) -> Tensor:
    if is_anchor is None:
        return torch.zeros(n, dtype=torch.bool, device=device)
    a = _rows("is_anchor", is_anchor, n, device)
    return a if a.dtype == torch.bool else a != 0


def _segment_logsumexp(z: Tensor, keep: Tensor, groups: Groups) -> Tensor:
    """logsumexp of z over the `keep` rows of each group, per group [num_groups] (finite for empty groups)."""
    neg_inf = torch.full((), float("-inf"), dtype=z.dtype, device=z.device)
    m = groups.amax(torch.where(keep, z.detach(), neg_inf))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    shifted = torch.where(keep, z - groups.gather(m), torch.zeros_like(z))  # masked before exp
    e = torch.where(keep, shifted.exp(), torch.zeros_like(z))
    return groups.sum(e).clamp_min(torch.finfo(z.dtype).tiny).log() + m


def branch_logprobs(
    tve: Tensor,
    group_ids: Any,
    temperature: float = 1.0,
    is_anchor: Any = None,
) -> Tensor:
    """log π(g) = -TVE_g/τ - logsumexp_{g' in group, not anchor}(-TVE_g'/τ); 0 on anchor rows."""
    if not temperature > 0:
        raise AlgorithmError(f"temperature must be > 0, got {temperature}")
    if tve.dim() != 1:
        raise AlgorithmError(f"tve must be 1-D [N], got shape {tuple(tve.shape)}")
    n = tve.shape[0]
    groups = make_groups(group_ids, n, device=tve.device)
    keep = ~_anchor_mask(is_anchor, n, tve.device)
    check_finite("tve", tve, keep)
    dtype = torch.promote_types(tve.dtype, torch.float32)
    z = torch.where(keep, -tve.to(dtype) / temperature, torch.zeros((), dtype=dtype, device=tve.device))
    lse = _segment_logsumexp(z, keep, groups)
    return torch.where(keep, z - groups.gather(lse), torch.zeros_like(z))


# ---------------------------------------------------------------------------------------------
# 3. Anchor-relative advantages
# ---------------------------------------------------------------------------------------------


def _groups_with_one_anchor(group_ids: Any, is_anchor: Any, n: int, device: torch.device) -> tuple[Groups, Tensor]:
    groups = make_groups(group_ids, n, device=device)
    anchor = _anchor_mask(is_anchor, n, device)
    per_group = groups.sum(anchor.long())
    used = groups.counts > 0
    if bool((per_group[used] != 1).any()):
        raise AlgorithmError("every group needs exactly one anchor row (is_anchor)")
    return groups, anchor


def _reward(name: str, r: Any, n: int, device: torch.device | None) -> Tensor:
    t = _rows(f"rewards[{name!r}]", r, n, device)
    if not t.dtype.is_floating_point or t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    check_finite(f"rewards[{name!r}]", t)
    return t.detach()


def _first_device(rewards: Mapping[str, Any]) -> torch.device | None:
    for r in rewards.values():
        if isinstance(r, Tensor):
            return r.device
    return None


def anchor_relative_advantages(
    rewards: Mapping[str, Tensor],
    is_anchor: Any,
    group_ids: Any,
    weights: Mapping[str, float] | None = None,
) -> Tensor:
    """A(g) = sum_c w_c (r_c(g) - r_c(anchor)) / (std_unbiased(r_c over group incl. anchor) + 1e-8); 0 on anchors.

    `weights` maps component name -> w_c (default 1; names not in `rewards` are ignored, so one map
    can serve both signals).
    """
    if not rewards:
        raise AlgorithmError("rewards must name at least one component")
    n = len(next(iter(rewards.values())))
    dev = _first_device(rewards)
    groups, anchor = _groups_with_one_anchor(group_ids, is_anchor, n, dev or torch.device("cpu"))
    total: Tensor | None = None
    for name, raw in rewards.items():  # a loop over the few reward components, not over samples
        r = _reward(name, raw, n, dev)
        r_anchor = groups.gather(groups.sum(torch.where(anchor, r, torch.zeros_like(r))))
        sigma = groups.gather(groups.std(r)) + SIGMA_EPS
        adv = (r - r_anchor) / sigma * float((weights or {}).get(name, 1.0))
        total = adv if total is None else total + adv
    assert total is not None
    return torch.where(anchor, torch.zeros_like(total), total)


def _fusion_normalise(a: Tensor, branch: Tensor, groups: Groups, mode: str) -> Tensor:
    """none: A; std: A / (std + 1e-8); zscore: (A - mean) / (std + 1e-8); population stats over branch rows."""
    if mode == "none":
        return a
    zero = torch.zeros_like(a)
    cnt = groups.sum(branch.to(a.dtype)).clamp_min(1)
    mean = groups.gather(groups.sum(torch.where(branch, a, zero)) / cnt)
    d = torch.where(branch, a - mean, zero)
    std = groups.gather(safe_sqrt(groups.sum(d * d) / cnt))
    flat = std <= SIGMA_EPS  # T: a (near-)constant signal is left unscaled
    if mode == "std":
        return torch.where(flat, a, a / (std + SIGMA_EPS))
    return torch.where(flat, a - mean, (a - mean) / (std + SIGMA_EPS))


def fuse_signal_advantages(
    signal_advs: Mapping[str, Tensor],
    is_anchor: Any,
    group_ids: Any,
    signal_weights: Mapping[str, float] | None = None,
    fusion: str = "std",
    adv_clip: float = 2.5,
) -> Tensor:
    """A(g) = clamp(sum_sig w_sig N_fusion(A_sig)(g), +-adv_clip) (no clamp if adv_clip <= 0); 0 on anchors."""
    if fusion not in FUSION_MODES:
        raise AlgorithmError(f"unknown fusion {fusion!r}; valid: {', '.join(FUSION_MODES)}")
    if not signal_advs:
        raise AlgorithmError("signal_advs must name at least one signal")
    weights = DEFAULT_SIGNAL_WEIGHTS if signal_weights is None else signal_weights
    n = len(next(iter(signal_advs.values())))
    dev = _first_device(signal_advs) or torch.device("cpu")
    groups = make_groups(group_ids, n, device=dev)
    anchor = _anchor_mask(is_anchor, n, dev)
    fused: Tensor | None = None
    for name, raw in signal_advs.items():  # loop over the (<= 2) signals
        if name not in weights:
            raise AlgorithmError(f"no weight for signal {name!r}; signal_weights has {sorted(weights)}")
        a = _reward(name, raw, n, dev)
        part = _fusion_normalise(a, ~anchor, groups, fusion) * float(weights[name])
        fused = part if fused is None else fused + part
    assert fused is not None
    if adv_clip > 0:
        fused = fused.clamp(-adv_clip, adv_clip)
    return torch.where(anchor, torch.zeros_like(fused), fused)


def _check_signals(rewards_by_signal: Mapping[str, Mapping[str, Tensor]]) -> None:
    if not rewards_by_signal:
        raise AlgorithmError("rewards_by_signal must name at least one signal ('local' / 'global')")
    for comps in rewards_by_signal.values():
        if not isinstance(comps, Mapping) or not comps:
            raise AlgorithmError("each signal maps component name -> reward tensor [N]")


def anchor_advantages(
    rewards_by_signal: Mapping[str, Mapping[str, Tensor]],
    is_anchor: Any,
    group_ids: Any,
    component_weights: Mapping[str, float] | None = None,
    signal_weights: Mapping[str, float] | None = None,
    fusion: str = "std",
    adv_clip: float = 2.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KVPO advantages [N] and the per-signal anchor-relative ones: {signal: {component: r [N]}} -> fuse -> clip."""
    _check_signals(rewards_by_signal)
    per_signal = {sig: anchor_relative_advantages(comps, is_anchor, group_ids, component_weights)
                  for sig, comps in rewards_by_signal.items()}
    fused = fuse_signal_advantages(per_signal, is_anchor, group_ids, signal_weights, fusion, adv_clip)
    return fused, per_signal


# ---------------------------------------------------------------------------------------------
# 4. The registry's view: KVPO's advantages as an estimator every loss can use
# ---------------------------------------------------------------------------------------------


def first_row_of_group(groups: Groups) -> Tensor:
    """bool [N]: the first row (in batch order) of each group."""
    n = groups.inverse.shape[0]
    idx = torch.arange(n, device=groups.inverse.device)
    first = torch.full((groups.num_groups,), n, dtype=torch.long, device=idx.device)
    first = first.scatter_reduce(0, groups.inverse, idx, reduce="amin", include_self=True)
    return idx == groups.gather(first)


@register_advantage("kvpo_anchor", citation="2605.14278")
def kvpo_anchor_advantage(rewards: Tensor, groups: Groups, *, fusion: str = "std", adv_clip: float = 2.5) -> Tensor:
    """KVPO: (r - r_anchor) / std of the group, fused over its branches (`fusion`) and clipped; the
    anchor is the first row of each group (the `video_gen` policy's kv_routing rollouts put it there)."""
    anchor = first_row_of_group(groups)
    adv, _ = anchor_advantages({"global": {"total": rewards}}, anchor, groups.inverse, signal_weights={"global": 1.0},
                               fusion=fusion, adv_clip=adv_clip)
    return adv
