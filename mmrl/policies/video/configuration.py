"""Typed `model.params` of the video generator policy (`video_gen`), lerobot-style: the settings
apart from the modeling code, checked on load, no torch import.

Sampling: each chunk of `chunk_frames` frames is denoised in `num_steps` flow steps (t from 1 to 0,
warped by `shift`) with a KV cache of the clean past chunks. RL explores either with the reverse
SDE (`exploration: sde`; `noise_schedule: flow_grpo` is Flow-GRPO's eta sqrt(t / (1 - t)),
`constant` is DanceGRPO's eta) or, for KVPO, by re-routing the history cache from the same initial
noise under the deterministic ODE (`exploration: kv_routing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmrl.flow import NOISE_SCHEDULES

EXPLORATIONS = ("sde", "kv_routing")
TVE_SPACES = ("x0", "velocity")  # docs/kvpo.md section 3
VIDEO_CONFIG_NAME = "mmrl_video.json"  # the settings `save` writes beside the weights


@dataclass
class VideoGenConfig:
    num_steps: int = 8  # denoising steps per chunk
    shift: float = 1.0  # SD3 timestep shift (> 1 spends more steps near the noise)
    eta: float = 0.7  # SDE noise level
    noise_schedule: str = "flow_grpo"  # one of mmrl.flow.NOISE_SCHEDULES
    exploration: str = "sde"  # one of EXPLORATIONS
    # Flow-GRPO's timestep subsampling: this share of the denoising steps (at least one) is trained
    # per rollout, drawn afresh each rollout; the others carry no loss and cost no backward.
    train_fraction: float = 1.0
    # Flow-GRPO-Fast / MixGRPO: the SDE noise only at the trained steps, the ODE at the others, so a
    # group's reward differences come from the steps the update trains (and the rest stay clean).
    sde_only_trained: bool = False
    guidance_scale: float = 1.0  # classifier-free guidance (1 = off); SFT drops the prompt cfg_dropout of the time
    cfg_dropout: float = 0.1
    text_max_length: int = 16  # prompt tokens (padded with zeros, as Wan's pipeline does)
    # KVPO (docs/kvpo.md): every group is an anchor (the generator's own local-attention history)
    # and group_size - 1 branches that re-route the history of each chunk: the sink chunks and the
    # `keep_nearest` most recent past chunks stay, the rest of the window is drawn from older
    # chunks. The generator needs a local window (tiny: local_window, sink_chunks). A branch's
    # log-prob is the softmax over its group of -TVE / tve_temperature, TVE replayed with the
    # gradient through the first `tve_grad_steps` denoising steps.
    keep_nearest: int = 1
    tve_grad_steps: int = 2
    tve_temperature: float = 1.0
    tve_space: str = "x0"
    # The tiny generator (model.source: tiny): a WanTransformer3DModel in pixel space.
    chunk_frames: int = 2
    tiny: dict[str, Any] = field(default_factory=dict)  # build_tiny_wan sizes: num_layers, num_heads, head_dim, ...

    def __post_init__(self):
        if self.noise_schedule not in NOISE_SCHEDULES:
            raise ValueError(f"model.params.noise_schedule: invalid value {self.noise_schedule!r}; "
                             f"valid: {', '.join(NOISE_SCHEDULES)}")
        if self.exploration not in EXPLORATIONS:
            raise ValueError(f"model.params.exploration: invalid value {self.exploration!r}; valid: {', '.join(EXPLORATIONS)}")
        for name in ("num_steps", "chunk_frames", "text_max_length"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"model.params.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.keep_nearest < 0 or self.tve_grad_steps < 0 or not self.tve_temperature > 0:
            raise ValueError(f"model.params: need keep_nearest >= 0, tve_grad_steps >= 0 and tve_temperature > 0; got "
                             f"{self.keep_nearest}, {self.tve_grad_steps}, {self.tve_temperature}")
        if self.tve_space not in TVE_SPACES:
            raise ValueError(f"model.params.tve_space: invalid value {self.tve_space!r}; valid: {', '.join(TVE_SPACES)}")
        if not 0.0 < self.train_fraction <= 1.0:
            raise ValueError(f"model.params.train_fraction must be in (0, 1], got {self.train_fraction!r}")
        if self.eta < 0 or self.shift <= 0 or self.guidance_scale < 1.0 or not 0.0 <= self.cfg_dropout < 1.0:
            raise ValueError(f"model.params: need eta >= 0, shift > 0, guidance_scale >= 1 and cfg_dropout in [0, 1); "
                             f"got eta={self.eta}, shift={self.shift}, guidance_scale={self.guidance_scale}, "
                             f"cfg_dropout={self.cfg_dropout}")
