"""VL-Calibration: decoupled visual / reasoning confidence calibration (pure, vectorised pieces).

Xiao, Xu, Gan 2026, "VL-Calibration: Decoupled Confidence Calibration for Large Vision-Language
Models Reasoning", arXiv 2604.09529 (ACL 2026); code github.com/Mr-Loevan/VL-Calibration (EasyR1).

Sources read. The paper's abstract; a detailed third-party summary of its method (papernotes,
"ACL2026/.../vl-calibration_decoupled_confidence_calibration_for_large_vision-language_models.md",
English and Chinese); and the reward function of the released code (`compute_score`,
`calculate_batch_soft_labels`, `extract_confidence`, `format_reward`), found in the public code
index without its repository path (its tags, field names and dataset match the paper's). The
paper's own method section (formulas, hyper-parameter table) could not be read, nor the actor-side
code that computes the per-token KL / entropy or applies the token reweighting.

Output format (code's `format_reward` / `extract_confidence`):
    <think><vision>z_vis</vision><reasoning>z_reas</reasoning></think> \\boxed{y}
    <analysis>...</analysis>
    <confidence><vision_confidence>v</vision_confidence><reasoning_confidence>r</reasoning_confidence></confidence>
v, r are numbers in [0, 10] (`scale`); c_vis = v / 10, c_reas = r / 10. Whitespace around '<', '>'
and '/' is removed before parsing. A number outside [0, scale] counts as no confidence.

Overall confidence (paper, harmonic mean; code):
    Phi(c_vis, c_reas) = 2 c_vis c_reas / (c_vis + c_reas),   Phi = 0 when either is 0.

Intrinsic visual certainty, VCE (paper via the summary; normalisation from the code):
    per reply, over its visual-rationale tokens t (the `<vision>` span; `mask` here):
        H      = mean_t H_t,  H_t = entropy of the policy's next-token distribution (true image)
        D_KL   = mean_t kl_t, kl_t = per-token KL between the policy given the true image I and
                 given the perturbed image I~ (the summary: a randomly patch-masked image)
        S      = log(D_KL + eps) - log(H + eps)                       eps = 1e-8
        z      = (S - mean_B S) / std_B S   (population std over the batch B; z = 0 when std < 1e-6)
        target = sigmoid(z) in (0, 1), used as a stop-gradient label for c_vis.
    kl_t is estimated from the sampled token's log-probs under both images. The code labels the
    quantity "Reverse KL" (RLHF naming: KL(pi(.|I) || pi(.|I~)), pi(.|I~) as the reference); the
    estimator itself is in code we could not read. Default here: k3 = exp(d) - d - 1 with
    d = logp_perturbed - logp (verl/EasyR1's `low_var_kl`, unbiased and >= 0 under samples from
    pi(.|I)); k1/k2/abs are selectable. Negative estimates (k1) are clamped at 0 before the log.
    The code normalises over the whole reward batch; `group_ids` offers per-group normalisation.

Calibration reward (code's `compute_score`; paper: R_acc + R_cal + R_vis):
    R_cal = -(Phi - I)^2        (I = 1 if the answer is correct else 0)   or -1 if no confidence
    R_vis = -(c_vis - target)^2                                           or -1 if no confidence
                                                                          or no visual target
    R     = I + 2.0 R_cal + 0.4 fmt + 0.4 R_vis     (brier_weight 2.0, format_weight 0.4,
                                                     vision_calibration_weight 0.4, penalty 1.0)
`calibration_reward` returns the two calibration terms, brier_weight R_cal + vision_weight R_vis;
the registered reward `vl_calibration` (mmrl/rewards/calibration.py) adds I and fmt.

Token-level advantage reweighting, TAR (paper via the summary): only visual-rationale tokens with a
negative advantage are reweighted by their visual certainty, low certainty amplified (stronger
penalty on ungrounded visual claims), high certainty damped (protects valid perception); all other
tokens keep weight 1. The exact weight function, its constants and any clipping or normalisation
are NOT confirmed (the paper's formula was not readable). Implemented, as our choice:
    w_t = clip(1 + alpha (1 - 2 c_t), w_min, w_max)   on targeted tokens, 1 elsewhere, 0 on padding
    alpha = 0.5, w_min = 0, w_max = 2 (w in [0.5, 1.5] at the default; w = 1 at c = 1/2, the
    batch-average certainty after z-score + sigmoid); no renormalisation.
c_t is the reply's certainty broadcast over its tokens ([N]) or a per-token certainty ([N, T]);
`visual_certainty(level="token")` applies the VCE formula per token (S_t = log(kl_t + eps) -
log(H_t + eps), z-scored over the batch's masked tokens): also our assumption, not confirmed.

Not confirmed / not implemented: the perturbation (patch size, mask ratio) and which image tokens
it touches; the KL estimator and direction; TAR's formula and constants; the code's rank-based
fallback labels (entropy-only / KL-only ablations); the GRPO settings around these terms.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import Tensor

from .advantages import make_groups
from .kl import kl_penalty
from .registry import AlgorithmError, as_bool_mask, check_finite

__all__ = [
    "VCE_EPS",
    "STD_FLOOR",
    "KL_ESTIMATORS",
    "token_visual_kl",
    "certainty_from_stats",
    "visual_certainty",
    "certainty_token_weights",
    "harmonic_confidence",
    "parse_confidences",
    "parse_confidences_with_reason",
    "decoupled_format_ok",
    "calibration_terms",
    "calibration_reward",
]

VCE_EPS = 1e-8  # code: epsilon inside both logs
STD_FLOOR = 1e-6  # code: std below this gives z = 0 (target 0.5)
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


# ---------------------------------------------------------------- visual certainty (VCE)

def token_visual_kl(logp: Tensor, logp_perturbed: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate [N, T] of pi(.|I) to pi(.|I~) from the sampled tokens' log-probs.

    d = logp_perturbed - logp; k1 = -d, k2 = d^2/2, k3 = exp(d) - d - 1, abs = |d|
    (`mmrl.algos.kl.kl_penalty` with the perturbed policy as the reference). 0 where `mask` is
    False, whatever the inputs hold there (-inf, NaN). Detached.
    """
    if estimator not in KL_ESTIMATORS:
        raise AlgorithmError(f"kl estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")
    if logp_perturbed.shape != logp.shape:
        raise AlgorithmError(f"logp_perturbed has shape {tuple(logp_perturbed.shape)}, expected {tuple(logp.shape)}")
    m = as_bool_mask(mask, logp.shape)
    check_finite("logp", logp, m)
    check_finite("logp_perturbed", logp_perturbed, m)
    kl = kl_penalty(logp.detach(), logp_perturbed.detach(), estimator, m)
    return torch.where(m, kl, torch.zeros_like(kl))


def _slots(group_ids: Any, n: int, device: torch.device) -> tuple[Tensor, int]:
    if group_ids is None:
        return torch.zeros(n, dtype=torch.long, device=device), 1
    g = make_groups(group_ids, n=n, device=device)
    return g.inverse, g.num_groups


def _zscore_valid(x: Tensor, valid: Tensor, slot: Tensor, n_slots: int, std_floor: float) -> Tensor:
    """z-score of `x` (any shape) over its `valid` entries within slots (`slot` broadcast to x's
    shape); population std; z = 0 in a slot whose std < std_floor; 0 at invalid entries."""
    w = valid.to(torch.float64)
    xs = torch.where(valid, x.to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device))
    flat_slot = slot.expand_as(x).reshape(-1)

    def per_slot(v: Tensor) -> Tensor:
        return torch.zeros(n_slots, dtype=torch.float64, device=x.device).scatter_add_(0, flat_slot, v.reshape(-1))

    n = per_slot(w)
    mean = per_slot(xs) / n.clamp_min(1)
    dev = (xs - mean.index_select(0, flat_slot).view_as(x)) * w
    std = (per_slot(dev * dev) / n.clamp_min(1)).sqrt()
    flat = std.index_select(0, flat_slot).view_as(x)
    z = torch.where(flat >= std_floor, dev / flat.clamp_min(std_floor), torch.zeros_like(dev))
    return torch.where(valid, z, torch.zeros_like(z))


def _log_ratio_score(kl: Tensor, entropy: Tensor, eps: float) -> Tensor:
    return torch.log(kl.clamp_min(0) + eps) - torch.log(entropy.clamp_min(0) + eps)


def certainty_from_stats(
    kl: Tensor,
    entropy: Tensor,
    valid: Tensor | None = None,
    *,
    group_ids: Any = None,
    eps: float = VCE_EPS,
    std_floor: float = STD_FLOOR,
) -> Tensor:
    """The VCE target [N] from per-reply mean KL and mean entropy over the visual-rationale tokens.

    S = log(kl + eps) - log(entropy + eps); z-score over the `valid` replies of the batch (or of
    each group of `group_ids`), population std, z = 0 when std < std_floor; target = sigmoid(z).
    NaN for replies that are not `valid` (no visual tokens; the code scores those with the missing
    penalty). Values of invalid replies never enter the statistics.
    """
    kl, entropy = torch.as_tensor(kl), torch.as_tensor(entropy)
    if kl.dim() != 1 or entropy.shape != kl.shape:
        raise AlgorithmError(f"kl and entropy must both be [N], got {tuple(kl.shape)} and {tuple(entropy.shape)}")
    v = torch.ones_like(kl, dtype=torch.bool) if valid is None else as_bool_mask(valid, kl.shape, "valid")
    check_finite("kl", kl, v)
    check_finite("entropy", entropy, v)
    slot, n_slots = _slots(group_ids, kl.shape[0], kl.device)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    s = _log_ratio_score(torch.where(v, kl, zero), torch.where(v, entropy, zero), eps)
    z = _zscore_valid(s, v, slot, n_slots, std_floor)
    out = torch.sigmoid(z).to(kl.dtype if kl.dtype.is_floating_point else torch.float32)
    return torch.where(v, out, torch.full_like(out, math.nan))


def visual_certainty(
    logp: Tensor,
    logp_perturbed: Tensor,
    entropy: Tensor,
    mask: Tensor,
    *,
    kl_estimator: str = "k3",
    level: str = "sequence",
    group_ids: Any = None,
    eps: float = VCE_EPS,
    std_floor: float = STD_FLOOR,
) -> Tensor:
    """VL-Calibration's intrinsic visual certainty (VCE), detached.

    `logp`, `logp_perturbed`: [N, T] log-probs of the sampled tokens under the policy given the
    true and the perturbed image; `entropy`: [N, T] the policy's token entropy (true image);
    `mask`: bool [N, T], True on the visual-rationale tokens (the `<vision>` span) of each reply,
    False on padding and on every other token.

    level="sequence" (the paper's target for c_vis): [N], sigmoid of the batch z-score of
    log(mean kl + eps) - log(mean H + eps) over each reply's masked tokens (`certainty_from_stats`);
    NaN for a reply with no masked token.
    level="token" (our per-token variant for TAR, not confirmed): [N, T], sigmoid of the z-score of
    log(kl_t + eps) - log(H_t + eps) over all masked tokens of the batch (or group); 0 off the mask.
    """
    if level not in ("sequence", "token"):
        raise AlgorithmError(f"level must be 'sequence' or 'token', got {level!r}")
    m = as_bool_mask(mask, logp.shape)
    if entropy.shape != logp.shape:
        raise AlgorithmError(f"entropy has shape {tuple(entropy.shape)}, expected {tuple(logp.shape)}")
    check_finite("entropy", entropy, m)
    kl = token_visual_kl(logp, logp_perturbed, m, kl_estimator)
    ent = torch.where(m, entropy.detach(), torch.zeros_like(kl))
    if level == "sequence":
        n = m.sum(dim=1)
        denom = n.clamp_min(1).to(kl.dtype)
        return certainty_from_stats(kl.sum(dim=1) / denom, ent.sum(dim=1) / denom, n > 0,
                                    group_ids=group_ids, eps=eps, std_floor=std_floor)
    slot, n_slots = _slots(group_ids, logp.shape[0], logp.device)
    z = _zscore_valid(_log_ratio_score(kl, ent, eps), m, slot[:, None], n_slots, std_floor)
    out = torch.sigmoid(z).to(kl.dtype)
    return torch.where(m, out, torch.zeros_like(out))


# ---------------------------------------------------------------- token-level advantage reweighting (TAR)

def certainty_token_weights(
    certainty: Tensor,
    mask: Tensor,
    *,
    advantages: Tensor,
    target_mask: Tensor | None = None,
    alpha: float = 0.5,
    w_min: float = 0.0,
    w_max: float = 2.0,
) -> Tensor:
    """TAR weights [N, T] that multiply each token's advantage (detached).

    Targeted tokens: `mask` (response tokens; False = padding) & `target_mask` (the visual-rationale
    tokens; default: all of `mask`) & advantage < 0. There
        w = clip(1 + alpha * (1 - 2 c), w_min, w_max)
    with c the token's visual certainty in [0, 1] (`certainty` [N, T], or [N] broadcast over the
    reply); low certainty (c < 1/2) amplifies the negative advantage, high certainty damps it.
    Every other response token gets exactly 1, padding exactly 0. `advantages` is [N] or [N, T].
    The formula and constants are our reading of the paper's description (see the module docstring).
    """
    m = as_bool_mask(mask, tuple(mask.shape))
    if m.dim() != 2:
        raise AlgorithmError(f"mask must be [N, T], got shape {tuple(m.shape)}")
    n, t = m.shape
    if not 0 <= w_min <= w_max:
        raise AlgorithmError(f"need 0 <= w_min <= w_max, got {w_min}, {w_max}")
    c = certainty.detach()
    if c.dim() == 1 and c.shape[0] == n:
        c = c[:, None].expand(n, t)
    elif tuple(c.shape) != (n, t):
        raise AlgorithmError(f"certainty has shape {tuple(certainty.shape)}, expected ({n},) or ({n}, {t})")
    a = advantages.detach()
    if a.dim() == 1 and a.shape[0] == n:
        a = a[:, None].expand(n, t)
    elif tuple(a.shape) != (n, t):
        raise AlgorithmError(f"advantages has shape {tuple(advantages.shape)}, expected ({n},) or ({n}, {t})")
    tgt = m if target_mask is None else m & as_bool_mask(target_mask, (n, t), "target_mask")
    check_finite("advantages", a, tgt)
    tgt = tgt & (a < 0)
    check_finite("certainty", c, tgt)
    if bool(((c < 0) | (c > 1))[tgt].any()):
        raise AlgorithmError("certainty must lie in [0, 1] on the reweighted tokens")
    dtype = c.dtype if c.dtype.is_floating_point else torch.float32
    half = torch.full((), 0.5, dtype=dtype, device=c.device)
    cc = torch.where(tgt, c.to(dtype), half)
    w = (1.0 + float(alpha) * (1.0 - 2.0 * cc)).clamp(float(w_min), float(w_max))
    one, zero = torch.ones((), dtype=dtype, device=c.device), torch.zeros((), dtype=dtype, device=c.device)
    return torch.where(tgt, w, torch.where(m, one, zero))


# ---------------------------------------------------------------- decoupled confidences and reward

def harmonic_confidence(c_vis: Tensor, c_reas: Tensor) -> Tensor:
    """Phi = 2 c_vis c_reas / (c_vis + c_reas), 0 where either is 0 (code: the harmonic mean)."""
    c_vis, c_reas = torch.as_tensor(c_vis), torch.as_tensor(c_reas)
    prod = c_vis * c_reas
    zero = prod == 0
    total = torch.where(zero, torch.ones_like(prod), c_vis + c_reas)
    return torch.where(zero, torch.zeros_like(prod), 2 * prod / total)


_SPACES = re.compile(r"\s*([<>/])\s*")
_BLOCK = re.compile(r"<confidence>(.*?)</confidence>", re.DOTALL)
_VIS = re.compile(r"<vision_confidence>(.*?)</vision_confidence>", re.DOTALL)
_REAS = re.compile(r"<reasoning_confidence>(.*?)</reasoning_confidence>", re.DOTALL)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_FORMAT = re.compile(
    r"<think>.*?<vision>.*?</vision>.*?<reasoning>.*?</reasoning>.*?</think>.*?\\boxed\{.*?\}"
    r".*?<analysis>.*?</analysis>.*?<confidence>.*?</confidence>", re.DOTALL)


def _squeeze(text: str) -> str:
    return _SPACES.sub(r"\1", text)


def parse_confidences_with_reason(text: Any, scale: float = 10.0) -> tuple[tuple[float, float] | None, str]:
    """((c_vis, c_reas), "ok") from the first `<confidence>` block holding a `<vision_confidence>`
    followed by a `<reasoning_confidence>`, each a plain number in [0, scale], divided by `scale`;
    else (None, reason) with reason "no_confidence" (no such block), "bad_confidence" (a value is
    not a plain number) or "confidence_out_of_range"."""
    if not isinstance(text, str):
        return None, "no_confidence"
    for block in _BLOCK.findall(_squeeze(text)):
        v = _VIS.search(block)
        r = _REAS.search(block, v.end()) if v else None
        if v is None or r is None:
            continue
        vs, rs = v.group(1), r.group(1)
        if not (_NUMBER.fullmatch(vs) and _NUMBER.fullmatch(rs)):
            return None, "bad_confidence"
        vf, rf = float(vs), float(rs)
        if not (0.0 <= vf <= scale and 0.0 <= rf <= scale):
            return None, "confidence_out_of_range"
        return (vf / scale, rf / scale), "ok"
    return None, "no_confidence"


def parse_confidences(text: Any, scale: float = 10.0) -> tuple[float, float] | None:
    """(c_vis, c_reas) in [0, 1] stated by a reply, or None (see `parse_confidences_with_reason`)."""
    return parse_confidences_with_reason(text, scale)[0]


def decoupled_format_ok(text: Any, scale: float = 10.0) -> bool:
    """The code's format check: <think><vision>..</vision><reasoning>..</reasoning></think>, then
    \\boxed{..}, <analysis>..</analysis> and a <confidence> block, in that order, with both
    confidences readable (`parse_confidences`)."""
    if not isinstance(text, str):
        return False
    return _FORMAT.search(_squeeze(text)) is not None and parse_confidences(text, scale) is not None


def calibration_terms(
    c_vis: Tensor,
    c_reas: Tensor,
    correct: Tensor,
    vis_target: Tensor | None = None,
    *,
    parsed: Tensor | None = None,
    missing_penalty: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(R_cal, R_vis), each float [N].

    R_cal = -(Phi(c_vis, c_reas) - correct)^2 for replies with confidences (`parsed`, default:
    both confidences finite), else -missing_penalty. R_vis = -(c_vis - vis_target)^2 where the reply
    has confidences and a finite target, else -missing_penalty. Unparsed entries may hold NaN.
    """
    cv = torch.as_tensor(c_vis, dtype=torch.float32)
    cr = torch.as_tensor(c_reas, dtype=torch.float32)
    y = torch.as_tensor(correct).to(torch.float32)
    if cv.dim() != 1 or cr.shape != cv.shape or y.shape != cv.shape:
        raise AlgorithmError(f"c_vis, c_reas, correct must be [N] alike, got {tuple(cv.shape)}, "
                             f"{tuple(cr.shape)}, {tuple(y.shape)}")
    p = torch.isfinite(cv) & torch.isfinite(cr) if parsed is None else as_bool_mask(parsed, cv.shape, "parsed")
    check_finite("c_vis", cv, p)
    check_finite("c_reas", cr, p)
    check_finite("correct", y)
    if bool((((cv < 0) | (cv > 1) | (cr < 0) | (cr > 1)) & p).any()):
        raise AlgorithmError("confidences must lie in [0, 1]")
    zero = torch.zeros((), dtype=torch.float32)
    cv, cr = torch.where(p, cv, zero), torch.where(p, cr, zero)
    miss = torch.full_like(cv, -float(missing_penalty))
    r_cal = torch.where(p, -(harmonic_confidence(cv, cr) - y).square(), miss)
    if vis_target is None:
        return r_cal, miss
    t = torch.as_tensor(vis_target, dtype=torch.float32)
    if t.shape != cv.shape:
        raise AlgorithmError(f"vis_target has shape {tuple(t.shape)}, expected {tuple(cv.shape)}")
    has = p & torch.isfinite(t)
    r_vis = torch.where(has, -(cv - torch.where(has, t, zero)).square(), miss)
    return r_cal, r_vis


def calibration_reward(
    c_vis: Tensor,
    c_reas: Tensor,
    correct: Tensor,
    vis_target: Tensor | None = None,
    *,
    parsed: Tensor | None = None,
    brier_weight: float = 2.0,
    vision_weight: float = 0.4,
    missing_penalty: float = 1.0,
) -> Tensor:
    """VL-Calibration's calibration reward [N]: brier_weight * R_cal + vision_weight * R_vis
    (`calibration_terms`; code defaults 2.0, 0.4, missing penalty 1.0). Add the accuracy and
    format terms (weights 1.0 and 0.4 in the code) for the full reward, as `vl_calibration` does."""
    r_cal, r_vis = calibration_terms(c_vis, c_reas, correct, vis_target, parsed=parsed,
                                     missing_penalty=missing_penalty)
    return float(brier_weight) * r_cal + float(vision_weight) * r_vis
