"""Trajectory rewards for robot policies: the 0/1 `success` reward and SRPO's progress reward.

Both read what a robot policy's `decode` returns: one dict per trajectory with "success" (bool),
"frames" (uint8 [T, H, W, 3], the camera at each decision step and the final one) and "length";
a precomputed "embedding" ([D]) is used instead of the frames when present.

SRPO (Fei et al., "SRPO: Self-Referential Policy Optimization for Vision-Language-Action Models",
arXiv 2511.15605), as read here: a successful trajectory earns 1. A failed one earns a progress
reward from how close it came to this batch's own successes, measured in the latent space of a
video world model (V-JEPA 2 in the paper): the successful trajectories' embeddings are clustered
with DBSCAN, each cluster is represented by its centre (the mean of its members), a failure's
distance is the L2 distance to the nearest centre, and that distance is squashed by a sigmoid after
normalising it over the batch's failures, so a closer failure earns more and every failure stays
below a success. The authors' implementation (siiRL, `compute_embodied_reward`) does this per task,
with DBSCAN(eps=0.5, min_samples=2), min-max normalisation and 0.6 * sigmoid(10 (0.5 - d)).

What we do (the choices are ours where the paper leaves them open):
* groups: rewards are computed per group of trajectories (the adapter groups by the context's task
  name, `group_key`); a success of another task is no reference.
* normalisation: z = (d - mean(d)) / (std(d) + eps) over the group's failures, and
  reward = alpha * sigmoid(-steepness * z), so failures lie in (0, alpha) with alpha = 0.8 < 1;
  the failure at the mean distance gets alpha / 2.
* DBSCAN noise: a success DBSCAN calls noise is still a success, so it serves as its own (singleton)
  centre (`keep_noise=True`); with `keep_noise=False` noise is dropped unless nothing else is left.
* `dbscan_eps=None` picks eps from the data: twice the median distance of a success to its
  (min_samples - 1)-th nearest other success (a k-distance rule), so typical neighbours join, a
  success twice as isolated as usual is noise, and the clustering does not depend on the
  embedding's scale.
* no success in a group: there is no reference, so its failures get 0 (the plain success reward;
  the success-rate filter drops such groups anyway).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from mmrl.rewards import register_reward

logger = logging.getLogger(__name__)

Frames = Sequence[np.ndarray | torch.Tensor] | np.ndarray | torch.Tensor  # N x uint8 [T, H, W, 3]


# ----------------------------------------------------------------------------- encoders


class TrajectoryEncoder(Protocol):
    def encode(self, frames: Frames) -> torch.Tensor:
        """One embedding per trajectory: N uint8 videos [T_i, H, W, 3] (or one [N, T, H, W, 3] array)
        -> float [N, D]."""


def _videos(frames: Frames) -> list[np.ndarray]:
    """The trajectories as a list of uint8 [T, H, W, 3] arrays, checked."""
    if isinstance(frames, (np.ndarray, torch.Tensor)) and frames.ndim == 5:
        frames = list(frames)
    out = []
    for i, f in enumerate(frames):
        f = f.detach().cpu().numpy() if isinstance(f, torch.Tensor) else np.asarray(f)
        if f.dtype != np.uint8 or f.ndim != 4 or f.shape[-1] != 3 or f.shape[0] < 1:
            raise ValueError(f"trajectory {i}: expected uint8 frames [T>=1, H, W, 3], got dtype {f.dtype} shape {f.shape}")
        out.append(f)
    return out


def _frame_index(T: int, n: int) -> np.ndarray:
    """n indices spread uniformly over T frames, first and last included (repeats when T < n)."""
    return np.linspace(0, T - 1, n).round().astype(int)


class PixelTrajectoryEncoder:
    """A tiny, deterministic CPU encoder: `num_frames` keyframes spread over the trajectory (first
    and last included), each area-averaged to `size` x `size` RGB in [0, 1], concatenated. No
    learned weights, so it measures where things are in the picture over time, nothing more; it is
    the stand-in for a world model in tests and the CPU demo."""

    def __init__(self, num_frames: int = 4, size: int = 8):
        if num_frames < 1 or size < 1:
            raise ValueError(f"num_frames and size must be >= 1, got {num_frames} and {size}")
        self.num_frames, self.size = num_frames, size

    @property
    def dim(self) -> int:
        return self.num_frames * 3 * self.size * self.size

    def encode(self, frames: Frames) -> torch.Tensor:
        feats = []
        for video in _videos(frames):
            key = torch.from_numpy(video[_frame_index(len(video), self.num_frames)]).permute(0, 3, 1, 2).float()
            feats.append(torch.nn.functional.adaptive_avg_pool2d(key / 255.0, self.size).flatten())
        return torch.stack(feats)


class PretrainedVideoEncoder:
    """A video model loaded from a local directory with transformers (V-JEPA 2, VideoMAE and other
    `AutoModel` video encoders; no hub access): each trajectory is subsampled to the model's clip
    length, run through its processor and encoder, and the last hidden state is mean-pooled over
    tokens. Meant for the GPU; `batch_size` trajectories per forward."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 num_frames: int | None = None, batch_size: int = 8):
        from transformers import AutoModel

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"video encoder path {path} has no config.json: not a saved model directory")
        self.model = AutoModel.from_pretrained(path, dtype=dtype).to(device).eval().requires_grad_(False)
        self.processor = self._load_processor(path)
        cfg = self.model.config
        self.num_frames = int(num_frames or getattr(cfg, "frames_per_clip", None) or getattr(cfg, "num_frames", 16))
        self.batch_size = batch_size
        self.device, self.dtype = torch.device(device), dtype

    @staticmethod
    def _load_processor(path: Path):
        from transformers import AutoImageProcessor, AutoVideoProcessor

        errors = []
        for cls in (AutoVideoProcessor, AutoImageProcessor):
            try:
                return cls.from_pretrained(path)
            except (OSError, ValueError, KeyError) as exc:
                errors.append(f"{cls.__name__}: {exc}")
        raise FileNotFoundError(f"no video or image processor config in {path}: {'; '.join(errors)}")

    def _inputs(self, clips: list[np.ndarray]) -> dict[str, torch.Tensor]:
        from transformers import BaseVideoProcessor

        if isinstance(self.processor, BaseVideoProcessor):
            enc = self.processor(videos=clips, return_tensors="pt")
        else:  # an image processor over lists of frames (VideoMAE)
            enc = self.processor([list(c) for c in clips], return_tensors="pt")
        return {k: v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device)
                for k, v in enc.items() if isinstance(v, torch.Tensor)}

    @torch.no_grad()
    def encode(self, frames: Frames) -> torch.Tensor:
        clips = [v[_frame_index(len(v), self.num_frames)] for v in _videos(frames)]
        extra = {"skip_predictor": True} if self.model.config.model_type == "vjepa2" else {}
        out = []
        for i in range(0, len(clips), self.batch_size):
            hidden = self.model(**self._inputs(clips[i:i + self.batch_size]), **extra).last_hidden_state
            out.append(hidden.float().mean(1).cpu())
        return torch.cat(out)


def make_encoder(encoder: str = "pixel", **kwargs) -> TrajectoryEncoder:
    """"pixel" -> PixelTrajectoryEncoder(**kwargs); anything else is a local model directory for
    PretrainedVideoEncoder(path, **kwargs)."""
    if encoder == "pixel":
        return PixelTrajectoryEncoder(**kwargs)
    return PretrainedVideoEncoder(encoder, **kwargs)


# ----------------------------------------------------------------------------- the progress reward


def _auto_eps(x: np.ndarray, min_samples: int) -> float:
    """Twice the median distance of a point to its (min_samples - 1)-th nearest other point."""
    d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
    np.fill_diagonal(d, np.inf)
    k = min(max(min_samples - 1, 1), len(x) - 1)
    eps = 2.0 * float(np.median(np.sort(d, 1)[:, k - 1]))
    return eps if eps > 0 else 1e-12  # duplicates: any positive eps joins them


def _centres(success_emb: np.ndarray, dbscan_eps: float | None, min_samples: int,
             keep_noise: bool) -> tuple[np.ndarray, dict[str, Any]]:
    from sklearn.cluster import DBSCAN

    n = len(success_emb)
    eps = _auto_eps(success_emb, min_samples) if dbscan_eps is None and n > 1 else (dbscan_eps or 1.0)
    labels = DBSCAN(eps=eps, min_samples=min_samples).fit(success_emb).labels_
    clusters = sorted(set(labels.tolist()) - {-1})
    centres = [success_emb[labels == c].mean(0) for c in clusters]
    noise = success_emb[labels == -1]
    if keep_noise or not centres:
        centres += list(noise)
    return np.stack(centres), {"n_clusters": len(clusters), "n_noise": len(noise), "eps": eps}


def srpo_progress_reward(embeddings: torch.Tensor | np.ndarray, success: torch.Tensor | np.ndarray, alpha: float = 0.8,
                         steepness: float = 1.0, eps: float = 1e-6, dbscan_eps: float | None = None,
                         min_samples: int = 2, keep_noise: bool = True,
                         groups: Sequence[Any] | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """SRPO rewards [N] for trajectories with `embeddings` [N, D] and `success` [N] (bool): 1 for a
    success, alpha * sigmoid(-steepness * z) for a failure with z its standardised distance to the
    nearest success cluster centre (module docstring). `groups` ([N] keys) computes each group
    separately. Returns (rewards, info) with info["n_clusters"] summed over groups."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1) so a failure earns less than a success, got {alpha}")
    if steepness <= 0 or eps <= 0 or min_samples < 1:
        raise ValueError(f"need steepness > 0, eps > 0, min_samples >= 1; got {steepness}, {eps}, {min_samples}")
    emb = (embeddings.detach().cpu().double().numpy() if isinstance(embeddings, torch.Tensor)
           else np.asarray(embeddings, np.float64))
    succ = success.detach().cpu().numpy() if isinstance(success, torch.Tensor) else np.asarray(success)
    succ = succ.astype(bool)
    if emb.ndim != 2 or succ.shape != (emb.shape[0],):
        raise ValueError(f"need embeddings [N, D] and success [N], got shapes {emb.shape} and {succ.shape}")
    if not np.isfinite(emb).all():
        raise ValueError("embeddings contain NaN or inf")
    keys = np.zeros(len(emb), int) if groups is None else np.unique(np.asarray(groups, dtype=object).astype(str),
                                                                    return_inverse=True)[1]
    if len(keys) != len(emb):
        raise ValueError(f"groups has {len(keys)} entries for {len(emb)} trajectories")
    rewards = succ.astype(np.float64)  # failures start at 0, kept when a group has no success
    info: dict[str, Any] = {"n_clusters": 0, "n_noise": 0, "n_success": int(succ.sum()), "n_groups": 0,
                            "n_groups_without_success": 0}
    for g in np.unique(keys):
        idx = np.nonzero(keys == g)[0]
        s_idx, f_idx = idx[succ[idx]], idx[~succ[idx]]
        info["n_groups"] += 1
        if len(s_idx) == 0:
            info["n_groups_without_success"] += 1
            continue
        centres, ginfo = _centres(emb[s_idx], dbscan_eps, min_samples, keep_noise)
        info["n_clusters"] += ginfo["n_clusters"]
        info["n_noise"] += ginfo["n_noise"]
        if len(f_idx) == 0:
            continue
        dist = np.sqrt(((emb[f_idx, None] - centres[None]) ** 2).sum(-1)).min(1)
        z = (dist - dist.mean()) / (dist.std() + eps)
        rewards[f_idx] = alpha / (1 + np.exp(steepness * z))  # alpha * sigmoid(-steepness z)
    info["mean_failure_reward"] = float(rewards[~succ].mean()) if (~succ).any() else math.nan
    return torch.tensor(rewards, dtype=torch.float32), info


# ----------------------------------------------------------------------------- reward adapters

_ENCODERS: dict[str, TrajectoryEncoder] = {}


def _get_encoder(encoder: str, encoder_params: dict[str, Any]) -> TrajectoryEncoder:
    key = json.dumps([encoder, encoder_params], sort_keys=True, default=str)
    if key not in _ENCODERS:
        _ENCODERS[key] = make_encoder(encoder, **encoder_params)
    return _ENCODERS[key]


def _success(outputs: list[dict], name: str) -> torch.Tensor:
    for i, o in enumerate(outputs):
        if not isinstance(o, dict) or "success" not in o:
            raise TypeError(f"reward {name!r}: output {i} is not a trajectory dict with 'success' "
                            f"(got {type(o).__name__}); use it with a robot policy (action_vla, smolvla)")
    return torch.tensor([bool(o["success"]) for o in outputs], dtype=torch.float32)


@register_reward("success")
def success_reward(contexts, outputs) -> torch.Tensor:
    """1 for a trajectory that reached the task's success condition, else 0."""
    return _success(outputs, "success")


@register_reward("srpo_progress")
def srpo_progress_adapter(contexts, outputs, *, alpha: float = 0.8, steepness: float = 1.0, eps: float = 1e-6,
                          dbscan_eps: float | None = None, min_samples: int = 2, keep_noise: bool = True,
                          group_key: str | None = "task", encoder: str = "pixel",
                          encoder_params: dict[str, Any] | None = None) -> torch.Tensor:
    """SRPO's reward from decoded trajectories; `encoder` is "pixel" or a local video-model directory.
    Trajectories are grouped by `contexts[i][group_key]` when every context has it. The last call's
    cluster statistics are kept in `srpo_progress_adapter.last_info` (and logged at debug level)."""
    success = _success(outputs, "srpo_progress").bool()
    if all("embedding" in o for o in outputs):
        emb = torch.stack([torch.as_tensor(o["embedding"], dtype=torch.float32).flatten() for o in outputs])
    else:
        missing = [i for i, o in enumerate(outputs) if "frames" not in o]
        if missing:
            raise KeyError(f"reward 'srpo_progress': output {missing[0]} has neither 'frames' nor 'embedding'")
        emb = _get_encoder(encoder, dict(encoder_params or {})).encode([o["frames"] for o in outputs])
    groups = None
    if group_key and contexts and all(isinstance(c, dict) and group_key in c for c in contexts):
        groups = [c[group_key] for c in contexts]
    rewards, info = srpo_progress_reward(emb, success, alpha=alpha, steepness=steepness, eps=eps,
                                         dbscan_eps=dbscan_eps, min_samples=min_samples, keep_noise=keep_noise,
                                         groups=groups)
    srpo_progress_adapter.last_info = info
    logger.debug("srpo_progress: %s", info)
    return rewards


srpo_progress_adapter.last_info = {}
