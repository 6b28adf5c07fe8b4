"""VL-Calibration's reward (Xiao, Xu, Gan 2026, arXiv 2604.09529), registered as `vl_calibration`.

Formulas, defaults and sources: `mmrl.algos.calibration` (module docstring). Per reply:
    R = accuracy_weight * I + brier_weight * R_cal + format_weight * fmt + vision_weight * R_vis
    I     = 1 if the final answer (the last \\boxed{..} by default) is correct, else 0
    R_cal = -(Phi(c_vis, c_reas) - I)^2, or -missing_penalty without readable confidences
    fmt   = 1 if the reply follows the decoupled format (`decoupled_format_ok`), else 0
    R_vis = -(c_vis - target)^2, or -missing_penalty without confidences or without a target
defaults 1.0, 2.0, 0.4, 0.4, missing_penalty 1.0 (the released code's `compute_score`). R already
holds the accuracy term: do not add `answer_accuracy` on top unless that is meant.

Contexts are dicts with "answer" (and "options" for multiple choice; judged as `answer_accuracy`
does, `mmrl.rewards.vqa.judge_answer`). The visual-certainty target of a reply comes from its
context: "visual_certainty" (a value in [0, 1], e.g. from `mmrl.algos.calibration.visual_certainty`),
else "vision_kl" and "vision_entropy" (the reply's mean per-token KL and entropy over its
`<vision>` tokens), which are turned into targets over the replies of the call that have them, as
the code does (log-ratio, z-score over the call, sigmoid: `certainty_from_stats`). A reply with
neither gets R_vis = -missing_penalty (counted as no_visual_target). Nothing here raises on a
malformed reply; each outcome is counted.

Metrics: correct, wrong, unparseable, no_answer, format_ok, bad_format, no_confidence,
bad_confidence, confidence_out_of_range, parse_failures (the sum of the last three),
no_visual_target; mean_vision_confidence, mean_reasoning_confidence, mean_confidence (Phi),
mean_brier ((Phi - I)^2) over replies with confidences; mean_visual_target over replies with one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmrl.algos.calibration import (
    calibration_terms,
    certainty_from_stats,
    decoupled_format_ok,
    harmonic_confidence,
    parse_confidences_with_reason,
)
from mmrl.config_checks import ConfigError
from mmrl.rewards import register_reward
from mmrl.rewards.vqa import ANSWER_FORMATS, MathJudge, check_choice, Counting, extract_answer, judge_answer

_PARSE_FAILURES = ("no_confidence", "bad_confidence", "confidence_out_of_range")


def _number(x: Any) -> float | None:
    """A finite float from a context value, else None."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


@register_reward("vl_calibration")
class VLCalibration(Counting):
    """VL-Calibration's reward: accuracy + Brier calibration of the harmonic-mean confidence +
    format + calibration of the visual confidence to the visual-certainty target (see the module)."""

    REASONS = ("correct", "wrong", "unparseable", "no_answer", "format_ok", "bad_format",
               *_PARSE_FAILURES, "no_visual_target")

    def __init__(
        self,
        accuracy_weight: float = 1.0,
        brier_weight: float = 2.0,
        format_weight: float = 0.4,
        vision_weight: float = 0.4,
        missing_penalty: float = 1.0,
        scale: float = 10.0,
        answer_format: str = "boxed",
        timeout_s: int = 5,
    ):
        check_choice(answer_format, ANSWER_FORMATS, "vl_calibration.answer_format")
        if not float(scale) > 0:
            raise ConfigError(f"vl_calibration.scale must be > 0, got {scale}")
        super().__init__()
        self.w_acc, self.w_brier = float(accuracy_weight), float(brier_weight)
        self.w_fmt, self.w_vis = float(format_weight), float(vision_weight)
        self.missing_penalty, self.scale = float(missing_penalty), float(scale)
        self.answer_format, self.judge = answer_format, MathJudge(timeout_s)
        self.stats: dict[str, float] = {}

    def _targets(self, contexts: list[Any]) -> list[float]:
        """The visual-certainty target of each reply (NaN: none)."""
        n = len(contexts)
        out = [math.nan] * n
        kl, ent, raw = [0.0] * n, [0.0] * n, [False] * n
        for i, ctx in enumerate(contexts):
            c = ctx if isinstance(ctx, dict) else {}
            given = _number(c.get("visual_certainty"))
            if given is not None:
                out[i] = given
                continue
            k, e = _number(c.get("vision_kl")), _number(c.get("vision_entropy"))
            if k is not None and e is not None:
                kl[i], ent[i], raw[i] = k, e, True
        if any(raw):
            t = certainty_from_stats(torch.tensor(kl, dtype=torch.float64), torch.tensor(ent, dtype=torch.float64),
                                     torch.tensor(raw))
            for i in range(n):
                if raw[i]:
                    out[i] = float(t[i])
        return out

    def __call__(self, contexts: list[Any], outputs: list[Any]) -> torch.Tensor:
        self._reset()
        n = len(outputs)
        if len(contexts) != n:
            raise ValueError(f"vl_calibration: {len(contexts)} contexts for {n} outputs")
        correct, fmt = [0.0] * n, [0.0] * n
        c_vis, c_reas = [math.nan] * n, [math.nan] * n
        for i, (ctx, text) in enumerate(zip(contexts, outputs)):
            ans = extract_answer(text, self.answer_format)
            verdict = "no_answer" if ans is None else judge_answer(ctx, ans, self.judge)
            self._count(verdict)
            correct[i] = float(verdict == "correct")
            ok = decoupled_format_ok(text, self.scale)
            self._count("format_ok" if ok else "bad_format")
            fmt[i] = float(ok)
            conf, reason = parse_confidences_with_reason(text, self.scale)
            if conf is None:
                self._count(reason)
            else:
                c_vis[i], c_reas[i] = conf
        targets = self._targets(contexts)
        cv, cr = torch.tensor(c_vis), torch.tensor(c_reas)
        y, t = torch.tensor(correct), torch.tensor(targets, dtype=torch.float32)
        parsed = torch.isfinite(cv)
        for i in range(n):
            if not math.isfinite(targets[i]):
                self._count("no_visual_target")
        r_cal, r_vis = calibration_terms(cv, cr, y, t, parsed=parsed, missing_penalty=self.missing_penalty)
        reward = self.w_acc * y + self.w_brier * r_cal + self.w_fmt * torch.tensor(fmt) + self.w_vis * r_vis
        self._summarise(cv, cr, y, t, parsed)
        return reward.to(torch.float32)

    def _summarise(self, cv: torch.Tensor, cr: torch.Tensor, y: torch.Tensor, t: torch.Tensor,
                   parsed: torch.Tensor) -> None:
        def mean(x: torch.Tensor) -> float:
            return float(x.mean()) if x.numel() else 0.0

        phi = harmonic_confidence(cv[parsed], cr[parsed])
        has_t = torch.isfinite(t)
        self.stats = {
            "mean_vision_confidence": mean(cv[parsed]),
            "mean_reasoning_confidence": mean(cr[parsed]),
            "mean_confidence": mean(phi),
            "mean_brier": mean((phi - y[parsed]).square()),
            "mean_visual_target": mean(t[has_t]),
        }

    def _reset(self) -> None:
        super()._reset()
        self.stats = {}

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["parse_failures"] = float(sum(self.counts.get(k, 0) for k in _PARSE_FAILURES))
        return {**out, **self.stats}
