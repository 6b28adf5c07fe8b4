"""Verifiable rewards for the text-to-video domain (clips of `mmrl.envs.video.clips`), and a
CLIP-style text-video score.

Each context is a dict with "spec" (a `ClipSpec`, or a dict of its fields) or, failing that, a
"prompt" it is parsed from. Each output is one video: uint8 ``[F, H, W, 3]`` (RGB, channels last,
square frames, F >= 2), a float array in [0, 1] of that shape, or a torch tensor of either; a batch
may also be one ``[N, F, H, W, 3]`` array. Rewards are float32 ``Tensor[N]`` in [0, 1], higher is
better; videos of one shape are scored together, vectorised, and a video's reward never depends on
the others in the batch.

Pixel model. A rendered pixel is ``p = bg + a * (c - bg)``: the background colour blended with one
palette colour ``c`` by the shape's coverage ``a`` (anti-aliased edges). Each pixel is explained by
the palette colour whose segment ``[bg, c]`` passes closest to it (in RGB, 0..255): with
``a_c = clip((p - bg).(c - bg) / |c - bg|^2, 0, 1)`` the colour is ``argmin_c |p - bg - a_c (c - bg)|``
and its *mass* is ``a_c``. Pixels closer than ``BG_TOLERANCE`` (20) to the background are
background (mass 0), so faint noise does not count, except next to (8-neighbourhood) a core pixel
(at least ``CORE_DISTANCE``, 60, from the background), where only ``EDGE_TOLERANCE`` (1) is: the
faint anti-aliased edges of an object still count. A pixel's *foreground mass* is
``min(1, |p - bg| / |c - bg|)`` (= ``a_c`` on the segment, more for an off-palette colour). For the
crisp pixels of an unblended frame this is exactly "nearest palette colour or background"; for
blended edge pixels it recovers the coverage, so areas and centroids are sub-pixel exact on true
clips.

Components (S = ``shape_px(size)``, the shape's box side, 4 px at 16 px; t = 0..F-1; defaults in
brackets):

* ``video_colour(area_tolerance=2)`` = mean_t share_t * presence_t, with share_t = (mass of the
  prompted colour) / (foreground mass) (0 on an empty frame) and presence_t =
  exp(-0.5 (ln(area_t / A) / ln(area_tolerance))^2), area_t the prompted colour's mass and
  A = ``shape_area`` of the prompted shape (presence 0 on an empty frame; 0.61 at area_tolerance
  times too large or too small). The shape itself is not checked (only its area).
* ``video_motion(sigma=0.5, min_area=0.25)`` = (n_present / F) * exp(-|d - T|^2 / (2 (sigma S)^2)):
  the prompted colour's centroid is tracked on the frames where its area is at least min_area A
  (the others count as failures; fewer than 2 present frames score 0); d = v (F - 1) with v its
  least-squares velocity over the present frames, T = direction * ``speed_px`` * (F - 1) (e.g.
  10.5 px right for "right quickly" over 8 frames at 16 px). sigma is in shape sizes (2 px at
  16 px: a static or wrong-speed clip scores about 0.03). Drift across the direction is penalised
  by the same norm.
* ``video_smoothness(jerk_scale=0.25, area_scale=0.25, background_scale=0.02, jerk_free=0.0625,
  min_area=0.25)`` = exp(-(J / jerk_scale + G / area_scale + B / background_scale)) on the
  foreground mass (any colour): J = mean_t max(0, |c_{t+1} - 2 c_t + c_{t-1}| / S - jerk_free) over
  the triples of frames where the object is present (area >= min_area A; jerk_free, 0.25 px at
  16 px, lets through the centroid's sub-pixel rendering jitter of true clips, up to 0.13 px);
  G = mean_t |a_{t+1} - a_t| / mean_t a_t (area flicker; it also catches frames where the object
  vanishes); B = mean_t mean |x_{t+1} - x_t| / 255 over the pixels that are background in both
  frames (background flicker). A video whose mean foreground area is below min_area A scores 0.

``temporal_consistency(videos)`` is a report metric, not a reward (see its docstring).
``clip_score`` (a `Reward`) loads a local CLIP checkpoint; transformers is imported only there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.envs.video.clips import (
    BACKGROUND,
    COLOURS,
    PALETTE,
    SPEEDS,
    ClipSpec,
    direction_vector,
    shape_area,
    shape_px,
    speed_px,
)
from mmrl.rewards import Reward, register_reward

BG_TOLERANCE = 20.0  # RGB distance (0..255) below which a pixel is background ...
EDGE_TOLERANCE = 1.0  # ... unless it touches a core pixel: then only this close is background
CORE_DISTANCE = 60.0  # RGB distance from which a pixel is object core (about 30% coverage or more)
_BG = np.asarray(BACKGROUND, np.float32)
_U = np.asarray([PALETTE[c] for c in COLOURS], np.float32) - _BG  # [K, 3] palette directions from bg
_U2 = (_U * _U).sum(1)  # [K]
_VIDEO_FORM = "[F, H, W, 3] (RGB, channels last, square frames, F >= 2; uint8, or float in [0, 1])"


# ---------------------------------------------------------------------------------------------
# Inputs


def _video(v: Any, i: int) -> np.ndarray:
    """One video as float32 [F, H, W, 3] in 0..255."""
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        v = v.float().numpy() if v.is_floating_point() else v.numpy()
    a = np.asarray(v)
    if a.ndim != 4 or a.shape[-1] != 3:
        raise ValueError(f"video {i} has shape {tuple(a.shape)}; expected {_VIDEO_FORM}")
    if a.shape[0] < 2 or a.shape[1] != a.shape[2] or a.shape[1] < 1:
        raise ValueError(f"video {i} has shape {tuple(a.shape)}; expected {_VIDEO_FORM}")
    if a.dtype == np.uint8:
        return a.astype(np.float32)
    if np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all():
            raise ValueError(f"video {i} has non-finite values; expected {_VIDEO_FORM}")
        top = float(a.max()) if a.size else 0.0
        if top > 1.5:
            raise ValueError(f"video {i} is float with max {top:g}; float videos must be in [0, 1] "
                             f"(pass uint8 for 0..255)")
        return np.clip(a.astype(np.float32), 0.0, 1.0) * 255.0
    raise ValueError(f"video {i} has dtype {a.dtype}; expected uint8 or float in [0, 1], shape {_VIDEO_FORM}")


def _videos(outputs: Any) -> list[np.ndarray]:
    if isinstance(outputs, (np.ndarray, torch.Tensor)):
        if outputs.ndim != 5:
            raise ValueError(f"a batch array of videos has shape {tuple(outputs.shape)}; expected [N] + {_VIDEO_FORM}")
        outputs = list(outputs)
    return [_video(v, i) for i, v in enumerate(outputs)]


def _spec(ctx: Any, i: int) -> ClipSpec:
    if not isinstance(ctx, dict):
        raise ValueError(f"context {i} is a {type(ctx).__name__}; expected a dict with 'spec' (a ClipSpec) or 'prompt'")
    spec = ctx.get("spec")
    if isinstance(spec, ClipSpec):
        return spec
    if isinstance(spec, dict):
        return ClipSpec(**spec)
    if spec is not None:
        raise ValueError(f"context {i} has spec {spec!r}; expected a ClipSpec or a dict of its fields")
    prompt = ctx.get("prompt")
    if isinstance(prompt, str):
        return ClipSpec.from_prompt(prompt)
    raise ValueError(f"context {i} has neither 'spec' (a ClipSpec) nor a 'prompt' str; keys: {sorted(ctx)}")


def _inputs(contexts: Sequence[Any], outputs: Any) -> tuple[list[ClipSpec], list[np.ndarray]]:
    videos = _videos(outputs)
    if len(contexts) != len(videos):
        raise ValueError(f"got {len(contexts)} contexts for {len(videos)} videos")
    return [_spec(c, i) for i, c in enumerate(contexts)], videos


def _groups(videos: list[np.ndarray]) -> list[tuple[list[int], np.ndarray]]:
    """Indices of the videos sharing a shape, with their stack [B, F, H, W, 3]."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, v in enumerate(videos):
        by_shape.setdefault(v.shape, []).append(i)
    return [(idx, np.stack([videos[i] for i in idx])) for idx in by_shape.values()]


def _score(contexts, outputs, per_group) -> torch.Tensor:
    """Run `per_group(specs, batch) -> [B]` over the shape groups; assemble Tensor[N]."""
    specs, videos = _inputs(contexts, outputs)
    out = np.zeros(len(videos), np.float32)
    for idx, batch in _groups(videos):
        out[idx] = per_group([specs[i] for i in idx], batch)
    return torch.from_numpy(np.clip(out, 0.0, 1.0))


# ---------------------------------------------------------------------------------------------
# Pixel decomposition


def _near(mask: np.ndarray) -> np.ndarray:
    """`mask` [..., H, W] dilated by one pixel (8-neighbourhood)."""
    pad = np.pad(mask, [(0, 0)] * (mask.ndim - 2) + [(1, 1), (1, 1)])
    h, w = mask.shape[-2:]
    out = np.zeros_like(mask)
    for dy in range(3):
        for dx in range(3):
            out |= pad[..., dy:dy + h, dx:dx + w]
    return out


def _decompose(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [..., H, W, 3] float 0..255 -> (colour index [..., H, W] int, colour mass, foreground mass)."""
    d = x - _BG
    dot = d @ _U.T  # [..., K]
    a = np.clip(dot / _U2, 0.0, 1.0)
    dd = (d * d).sum(-1, keepdims=True)
    resid2 = dd - 2.0 * a * dot + a * a * _U2  # |d - a u|^2
    label = resid2.argmin(-1)
    mass = np.take_along_axis(a, label[..., None], -1)[..., 0]
    dist = np.sqrt(dd[..., 0])
    fg = (dist >= BG_TOLERANCE) | (_near(dist >= CORE_DISTANCE) & (dist >= EDGE_TOLERANCE))
    fg_mass = np.where(fg, np.minimum(1.0, dist / np.sqrt(_U2)[label]), 0.0)
    return label, np.where(fg, mass, 0.0), fg_mass


def _target_mass(specs: list[ClipSpec], batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mass of each video's prompted colour [B, F, H, W], foreground mass [B, F, H, W])."""
    label, mass, fg = _decompose(batch)
    want = np.array([COLOURS.index(s.colour) for s in specs]).reshape(-1, 1, 1, 1)
    return np.where(label == want, mass, 0.0), fg


def _centroids(mass: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mass [B, F, H, W] -> (area [B, F], centroid (x, y) [B, F, 2]; NaN where area is 0)."""
    size = mass.shape[-1]
    centres = np.arange(size) + 0.5
    area = mass.sum((-2, -1))
    with np.errstate(invalid="ignore", divide="ignore"):
        cx = (mass.sum(-2) * centres).sum(-1) / area
        cy = (mass.sum(-1) * centres).sum(-1) / area
    return area, np.stack([cx, cy], -1)


def _areas(specs: list[ClipSpec], size: int) -> np.ndarray:
    return np.array([shape_area(s.shape, size) for s in specs], np.float64)


# ---------------------------------------------------------------------------------------------
# Rewards


@register_reward("video_colour")
def video_colour(contexts: Sequence[Any], outputs: Any, area_tolerance: float = 2.0) -> torch.Tensor:
    """Does the prompted colour make up the object, at about the prompted shape's area? (see module doc)"""
    if not area_tolerance > 1.0:
        raise ValueError(f"area_tolerance must be > 1 (a ratio), got {area_tolerance!r}")

    def per_group(specs, batch):
        target, fg = _target_mass(specs, batch)
        area, fg_area = target.sum((-2, -1)), fg.sum((-2, -1))  # [B, F]
        expected = _areas(specs, batch.shape[2])[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(fg_area > 0, area / fg_area, 0.0)
            log_ratio = np.log(area / expected)
            presence = np.where(area > 0, np.exp(-0.5 * (log_ratio / math.log(area_tolerance)) ** 2), 0.0)
        return (share * presence).mean(-1)

    return _score(contexts, outputs, per_group)


@register_reward("video_motion")
def video_motion(contexts: Sequence[Any], outputs: Any, sigma: float = 0.5, min_area: float = 0.25) -> torch.Tensor:
    """Does the prompted-colour object move in the prompted direction by the prompted amount?
    `sigma` is in shape sizes (2 px at 16 px); see the module doc for the formula."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0 (in shape sizes), got {sigma!r}")
    if not 0 < min_area <= 1:
        raise ValueError(f"min_area must be in (0, 1] (a fraction of the shape's area), got {min_area!r}")

    def per_group(specs, batch):
        size, frames = batch.shape[2], batch.shape[1]
        target, _ = _target_mass(specs, batch)
        area, centroid = _centroids(target)
        present = area >= min_area * _areas(specs, size)[:, None]  # [B, F]
        velocity, n_present = _ls_velocity(centroid, present)
        goal = np.stack([direction_vector(s.direction) * speed_px(s.speed, size) for s in specs]) * (frames - 1)
        err2 = ((velocity * (frames - 1) - goal) ** 2).sum(-1)
        sig = sigma * shape_px(size)
        reward = (n_present / frames) * np.exp(-err2 / (2 * sig * sig))
        return np.where(n_present >= 2, reward, 0.0)

    return _score(contexts, outputs, per_group)


def _ls_velocity(centroid: np.ndarray, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares velocity [B, 2] of centroid [B, F, 2] over the present frames, and their count [B]."""
    w = present.astype(np.float64)
    n = w.sum(-1)
    t = np.arange(present.shape[1], dtype=np.float64)
    c = np.where(present[..., None], centroid, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        t_mean = (w * t).sum(-1) / n
        c_mean = c.sum(1) / n[:, None]
        dt = (t[None] - t_mean[:, None]) * w
        var = (dt * (t[None] - t_mean[:, None])).sum(-1)
        cov = (dt[..., None] * (c - c_mean[:, None, :])).sum(1)
        v = cov / var[:, None]
    return np.where((n >= 2)[:, None], v, 0.0), n


@register_reward("video_smoothness")
def video_smoothness(contexts: Sequence[Any], outputs: Any, jerk_scale: float = 0.25, area_scale: float = 0.25,
                     background_scale: float = 0.02, jerk_free: float = 0.0625, min_area: float = 0.25) -> torch.Tensor:
    """Temporal smoothness: no jerky object motion, no flicker of its area or of the background
    (see the module doc). Scales: jerk in shape sizes per frame^2, area change relative to the mean
    area, background change as a fraction of 255."""
    for name, val in (("jerk_scale", jerk_scale), ("area_scale", area_scale), ("background_scale", background_scale)):
        if not val > 0:
            raise ValueError(f"{name} must be > 0, got {val!r}")
    if not 0 < min_area <= 1:
        raise ValueError(f"min_area must be in (0, 1] (a fraction of the shape's area), got {min_area!r}")
    if not jerk_free >= 0:
        raise ValueError(f"jerk_free must be >= 0 (in shape sizes), got {jerk_free!r}")

    def per_group(specs, batch):
        size = batch.shape[2]
        _, _, fg = _decompose(batch)
        area, centroid = _centroids(fg)  # [B, F], [B, F, 2]
        expected = _areas(specs, size)
        present = area >= min_area * expected[:, None]
        # jerk over triples of present frames
        second = centroid[:, 2:] - 2 * centroid[:, 1:-1] + centroid[:, :-2]
        ok = present[:, 2:] & present[:, 1:-1] & present[:, :-2]
        norm = np.sqrt((np.where(ok[..., None], second, 0.0) ** 2).sum(-1)) / shape_px(size)
        norm = np.where(ok, np.maximum(0.0, norm - jerk_free), 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            jerk = np.where(ok.sum(-1) > 0, norm.sum(-1) / ok.sum(-1), 0.0)
            mean_area = area.mean(-1)
            flicker = np.abs(np.diff(area, axis=-1)).mean(-1) / mean_area
        # background flicker: pixels that are background in both frames
        bg = fg == 0
        both = bg[:, 1:] & bg[:, :-1]  # [B, F-1, H, W]
        change = np.abs(np.diff(batch, axis=1)).mean(-1)  # [B, F-1, H, W]
        count = both.sum((-2, -1))
        with np.errstate(invalid="ignore", divide="ignore"):
            per_pair = np.where(count > 0, (change * both).sum((-2, -1)) / count, 0.0)
        background = per_pair.mean(-1) / 255.0
        score = np.exp(-(jerk / jerk_scale + flicker / area_scale + background / background_scale))
        return np.where(mean_area >= min_area * expected, score, 0.0)

    return _score(contexts, outputs, per_group)


def temporal_consistency(videos: Any, max_shift: int | None = None) -> np.ndarray:
    """How much each frame is a translate of the previous one: float64 [N] in [0, 1] (report metric).

    For consecutive frames x_t, x_{t+1}: r_t = min over integer shifts s (|dx|, |dy| <= max_shift;
    exposed pixels filled with the background colour) of sum |x_{t+1} - shift_s(x_t)| divided by
    sum |x_{t+1} - bg| + sum |shift_s(x_t) - bg| (the change if the two frames' contents did not
    overlap at all, so each ratio is in [0, 1]; sums over pixels and channels); the metric is
    1 - mean_t r_t. 1: every frame is an exact integer translate of the previous one (a static clip
    too); 0: consecutive frames share nothing (e.g. the object jumps by more than max_shift, or
    appears from nothing). Two pure-background frames count as consistent. `max_shift` defaults to
    the fastest speed rounded up, plus 1 (3 px at 16 px). Sub-pixel motion of
    anti-aliased clips leaves a residual: true clips at 16 px score 0.78-0.94 (lowest for a
    quick triangle, highest for a slow square), so compare it between models, not to 1."""
    if max_shift is not None and (isinstance(max_shift, bool) or not isinstance(max_shift, (int, np.integer))
                                  or max_shift < 0):
        raise ValueError(f"max_shift must be an int >= 0, got {max_shift!r}")
    vids = _videos(videos)
    out = np.zeros(len(vids), np.float64)
    for idx, batch in _groups(vids):
        b, f, h, w, _ = batch.shape
        m = int(math.ceil(max(speed_px(s, h) for s in SPEEDS))) + 1 if max_shift is None else int(max_shift)
        prev, nxt = batch[:, :-1], batch[:, 1:]
        nxt_content = np.abs(nxt - _BG).sum((-3, -2, -1))  # [B, F-1]
        padded = np.broadcast_to(_BG, (b, f - 1, h + 2 * m, w + 2 * m, 3)).copy()
        padded[:, :, m:m + h, m:m + w] = prev
        r = np.ones((b, f - 1))
        for dy in range(-m, m + 1):
            for dx in range(-m, m + 1):
                shifted = padded[:, :, m - dy:m - dy + h, m - dx:m - dx + w]
                diff = np.abs(nxt - shifted).sum((-3, -2, -1))
                content = nxt_content + np.abs(shifted - _BG).sum((-3, -2, -1))
                with np.errstate(invalid="ignore", divide="ignore"):
                    r = np.minimum(r, np.where(content > 0, diff / content, 0.0))
        out[idx] = 1.0 - np.clip(r, 0.0, 1.0).mean(-1)
    return out


# ---------------------------------------------------------------------------------------------
# CLIP-style score


@register_reward("clip_score")
class ClipScore(Reward):
    """CLIP text-video similarity from a local checkpoint directory (`CLIPModel` + `CLIPProcessor`).

    Per video: cos = mean over the chosen frames (`frames`: "all", or "middle" = frame F // 2) of the
    cosine between the frame's image embedding and the prompt's text embedding; reward =
    clip(0.5 + 0.5 * scale * cos, 0, 1) (scale 1: (cos + 1) / 2; real CLIP cosines sit around
    0.2-0.35, so a scale of 2-3 spreads them). The prompt is the context's "prompt", else its spec's.
    Nothing is downloaded (`local_files_only=True`). metrics(): cosine_mean, cosine_min, cosine_max.
    """

    def __init__(self, path: str, frames: str = "all", scale: float = 1.0, batch_size: int = 64, device: str = "cpu"):
        if frames not in ("all", "middle"):
            raise ValueError(f"clip_score: frames must be 'all' or 'middle', got {frames!r}")
        if not scale > 0:
            raise ValueError(f"clip_score: scale must be > 0, got {scale!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"clip_score: batch_size must be an int >= 1, got {batch_size!r}")
        root = Path(path).expanduser()
        if not (root / "config.json").is_file():
            raise FileNotFoundError(f"clip_score: no CLIP checkpoint at {str(root)!r} (expected a directory with "
                                    f"config.json from save_pretrained; nothing is downloaded)")
        from transformers import CLIPModel, CLIPProcessor

        self.path, self.frames, self.scale = str(root), frames, float(scale)
        self.batch_size, self.device = batch_size, device
        self.model = CLIPModel.from_pretrained(str(root), local_files_only=True).to(device).eval()
        self.processor = CLIPProcessor.from_pretrained(str(root), local_files_only=True)
        self._last = np.zeros(0)

    @staticmethod
    def _features(out: Any) -> torch.Tensor:
        feats = out if isinstance(out, torch.Tensor) else out.pooler_output
        return torch.nn.functional.normalize(feats.float(), dim=-1)

    @torch.no_grad()
    def __call__(self, contexts: list[Any], outputs: list[Any]) -> torch.Tensor:
        videos = _videos(outputs)
        if len(contexts) != len(videos):
            raise ValueError(f"got {len(contexts)} contexts for {len(videos)} videos")
        prompts = []
        for i, ctx in enumerate(contexts):
            prompt = ctx.get("prompt") if isinstance(ctx, dict) else None
            prompts.append(prompt if isinstance(prompt, str) else _spec(ctx, i).prompt)
        images, owner = [], []
        for i, v in enumerate(videos):
            chosen = v if self.frames == "all" else v[v.shape[0] // 2:v.shape[0] // 2 + 1]
            images += [np.rint(frame).astype(np.uint8) for frame in chosen]
            owner += [i] * len(chosen)
        unique = sorted(set(prompts))
        text = self.processor(text=unique, padding=True, return_tensors="pt")
        text = {k: t.to(self.device) for k, t in text.items() if k in ("input_ids", "attention_mask")}
        text_emb = self._features(self.model.get_text_features(**text))  # [P, D]
        image_emb = []
        for start in range(0, len(images), self.batch_size):
            pix = self.processor(images=images[start:start + self.batch_size], return_tensors="pt")["pixel_values"]
            image_emb.append(self._features(self.model.get_image_features(pixel_values=pix.to(self.device))))
        image_emb = torch.cat(image_emb)  # [sum F, D]
        which = torch.tensor([unique.index(prompts[i]) for i in owner], device=image_emb.device)
        cos = (image_emb * text_emb[which]).sum(-1).cpu().double()
        owner_t = torch.tensor(owner)
        per_video = torch.zeros(len(videos), dtype=torch.float64).index_add_(0, owner_t, cos)
        per_video /= torch.bincount(owner_t, minlength=len(videos)).double()
        self._last = per_video.numpy()
        return (0.5 + 0.5 * self.scale * per_video).clamp(0.0, 1.0).float()

    def metrics(self) -> dict[str, float]:
        if self._last.size == 0:
            return {}
        return {"cosine_mean": float(self._last.mean()), "cosine_min": float(self._last.min()),
                "cosine_max": float(self._last.max())}
