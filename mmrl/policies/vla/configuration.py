"""Typed `model.params` of the VLA policies (lerobot-style: configuration apart from modeling).

One dataclass per backbone, the adapter's `CONFIG`. Its fields are exactly the `model.params` keys
the adapter reads, with the policy's defaults and types, which `PolicyBase.check_params` checks at
config load; `__post_init__` checks the values and names the bad key.

A checkpoint written by a policy's `save` carries its settings in a JSON file next to the weights
(`ACTION_VLA_CONFIG_NAME`, `SMOLVLA_CONFIG_NAME`); `from_config` lays the run's params over them:
`Config(**{**read_saved_config(path, name), **params})`.

No torch or transformers import here: configs load and validate cheaply.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ACTION_TOKEN_MODES = ("special", "vocab_tail")
NOISE_SCHEDULERS = ("DDPM", "DDIM")  # lerobot's Diffusion Policy noise_scheduler_type
VISION_TOWERS = ("qwen_vl", "conv_keypoints")  # the model's own ViT, or `conv_keypoints.ConvKeypointsEncoder`
DEFAULT_PROMPT = "What action should the robot take to {instruction}?"
# Saved-config file names inside a checkpoint directory (unchanged, so old checkpoints load).
ACTION_VLA_CONFIG_NAME = "action_vla.json"
SMOLVLA_CONFIG_NAME = "mmrl_smolvla.json"
DIFFUSION_CONFIG_NAME = "mmrl_diffusion.json"

C = TypeVar("C")


def _at_least(cfg: Any, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def _camera_list(cameras: Any) -> list[str] | None:
    if isinstance(cameras, str):
        raise ValueError(f"cameras must be a list of camera names, got {cameras!r}")
    return [str(c) for c in cameras] if cameras else None


def param_names(cls: type) -> frozenset[str]:
    """The `model.params` keys of a config dataclass: its field names."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def resolve_config(cls: type[C], config: C | None, params: dict[str, Any]) -> C:
    """`config` (default: `cls()`) with `params` laid over it, validated once."""
    if config is None:
        return cls(**params)
    return dataclasses.replace(config, **params) if params else config


def read_saved_config(directory: str | Path, name: str) -> dict[str, Any]:
    """The settings a policy's `save` wrote to `directory / name` ({} when there are none)."""
    path = Path(directory) / name
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass
class ActionTokenVLAConfig:
    """`model.params` of `action_vla` (`ActionTokenVLAPolicy`)."""

    action_dim: int = 7
    chunk_size: int = 8  # K actions per chunk: K * action_dim tokens
    n_bins: int = 256
    action_low: float | list[float] = -1.0  # per dim or one for all (e.g. dataset statistics)
    action_high: float | list[float] = 1.0
    action_tokens: str = "special"  # one of ACTION_TOKEN_MODES
    cameras: list[str] | None = None  # None: every camera the observation has
    prompt_template: str = DEFAULT_PROMPT  # must contain {instruction}
    max_chunks: int = 64
    system_prompt: str | None = None
    min_image_tokens: int | None = None  # None: the processor's own (a tiny build uses 4 and 16)
    max_image_tokens: int | None = None
    vision: str = "qwen_vl"  # one of VISION_TOWERS: the model's own vision tower or a conv keypoint net
    shift_pad: int = 4  # conv_keypoints: DrQ random shift of up to this many pixels in SFT (0: none)
    # conv_keypoints: keypoints per image, one LM token each, so it must equal the image's token count;
    # None: the count the processor gives the task's camera images (task.image_size)
    n_keypoints: int | None = None
    # conv_keypoints: weight of an auxiliary SFT loss that regresses the expert's action chunk from
    # the tower's tokens through a small MLP head (0: off). Without it SFT leaves the policy
    # image-blind on random layouts; with it the tower learns where things are (docs/vla_experiments.md).
    aux_action_loss: float = 0.0
    # conv_keypoints: FiLM-condition the conv tower on the instruction (each conv block's features
    # scaled and shifted by a linear map of the prompt's mean token embedding, RT-1's FiLM
    # EfficientNet), so the keypoints can find the named object rather than every object
    film: bool = False
    # read by `from_config` only
    arch: str = "qwen2_5_vl"  # the tiny backbone (model.source: tiny)
    freeze_vision: bool = False

    def __post_init__(self) -> None:
        if self.action_tokens not in ACTION_TOKEN_MODES:
            raise ValueError(f"unknown action_tokens {self.action_tokens!r}; valid: {', '.join(ACTION_TOKEN_MODES)}")
        if self.vision not in VISION_TOWERS:
            raise ValueError(f"unknown vision {self.vision!r}; valid: {', '.join(VISION_TOWERS)}")
        _at_least(self, 1, "action_dim", "chunk_size", "max_chunks", "n_keypoints")
        _at_least(self, 0, "shift_pad")
        if self.aux_action_loss < 0 or (self.aux_action_loss > 0 and self.vision != "conv_keypoints"):
            raise ValueError(f"aux_action_loss must be >= 0 and needs vision: conv_keypoints (its tokens feed the "
                             f"head); got {self.aux_action_loss} with vision {self.vision!r}")
        if self.film and self.vision != "conv_keypoints":
            raise ValueError(f"film conditions the conv_keypoints tower; got vision {self.vision!r}")
        _at_least(self, 2, "n_bins")
        if "{instruction}" not in self.prompt_template:
            raise ValueError(f"prompt_template must contain {{instruction}}, got {self.prompt_template!r}")
        self.cameras = _camera_list(self.cameras)


@dataclass
class SmolVLAConfig:
    """`model.params` of `smolvla` (`SmolVLAPolicy`). The sizes only shape a `model.source: tiny`
    build; a pretrained directory carries its own."""

    eta: float = 0.7  # SDE noise level of the Flow-GRPO steps (> 0)
    num_steps: int | None = None  # denoising steps; None: the model's (10 for a tiny build)
    n_action_steps: int | None = None  # actions executed per chunk; None: the model's
    cameras: list[str] | None = None  # None: the model's image features (a tiny build: front)
    max_chunks: int = 64
    batched_recompute: bool = True  # one denoise_step over all steps of all chunks when recomputing
    # read by `from_config` only
    chunk_size: int = 8
    state_dim: int = 8
    action_dim: int = 7
    image_size: int = 64
    train_expert_only: bool = True
    dataset_stats: dict[str, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.eta <= 0:
            raise ValueError(f"eta must be > 0 for a stochastic policy with log-probs, got {self.eta}")
        _at_least(self, 1, "num_steps", "n_action_steps", "max_chunks", "chunk_size", "state_dim", "action_dim",
                  "image_size")
        self.cameras = _camera_list(self.cameras)


@dataclass
class DiffusionPolicyConfig:
    """`model.params` of `diffusion` (`DiffusionActionPolicy`: lerobot's Diffusion Policy trained
    with DPPO). The sizes only shape a `model.source: tiny` build; a pretrained directory carries
    its own. lerobot's Diffusion Policy reads no language: the task must show its goal in the image."""

    eta: float = 1.0  # DDIM noise level of the sampled chain (1: DDPM's posterior, 0: deterministic DDIM)
    min_std: float = 0.1  # DPPO's floor on each denoising step's std (> 0: every step has a log-prob)
    num_steps: int | None = None  # denoising steps; None: the model's num_inference_steps (a tiny build: 10)
    n_action_steps: int | None = None  # actions executed per chunk; None: the model's
    cameras: list[str] | None = None  # None: the model's image features (a tiny build: front)
    max_chunks: int = 64
    # read by `from_config` only (a tiny build)
    horizon: int = 8  # actions per sampled chunk; a multiple of 2 ** (len(down_dims) - 1)
    state_dim: int = 8
    action_dim: int = 7
    image_size: int = 64
    down_dims: list[int] = field(default_factory=lambda: [32, 64])  # the 1-D U-Net's widths
    keypoints: int = 16  # spatial soft-argmax keypoints of the ResNet-18 image encoder
    # images are resized to this square before the ResNet (lerobot's resize_shape): its 32x
    # downsampling leaves an (encoder_size / 32)^2 map for the soft-argmax, 3 x 3 at 96 px as for
    # lerobot's PushT crop (84 px). At 64 px the map is 2 x 2, too coarse to place anything.
    encoder_size: int = 96
    noise_scheduler: str = "DDIM"  # lerobot's noise_scheduler_type: DDPM or DDIM
    num_train_timesteps: int = 100
    dataset_stats: dict[str, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.eta < 0 or self.min_std <= 0:
            raise ValueError(f"need eta >= 0 and min_std > 0 (the last denoising step has no noise of its own, so "
                             f"min_std gives it a log-prob); got eta={self.eta}, min_std={self.min_std}")
        if self.noise_scheduler not in NOISE_SCHEDULERS:
            raise ValueError(f"unknown noise_scheduler {self.noise_scheduler!r}; valid: {', '.join(NOISE_SCHEDULERS)}")
        _at_least(self, 1, "num_steps", "n_action_steps", "max_chunks", "horizon", "state_dim", "action_dim",
                  "image_size", "keypoints", "num_train_timesteps")
        _at_least(self, 64, "encoder_size")
        if not self.down_dims or self.horizon % 2 ** (len(self.down_dims) - 1):
            raise ValueError(f"horizon {self.horizon} must be a multiple of 2 ** (len(down_dims) - 1) "
                             f"(the U-Net halves it per stage); down_dims={self.down_dims}")
        self.cameras = _camera_list(self.cameras)


ACTION_VLA_PARAMS = param_names(ActionTokenVLAConfig)

__all__ = [
    "ACTION_TOKEN_MODES",
    "ACTION_VLA_CONFIG_NAME",
    "ACTION_VLA_PARAMS",
    "DEFAULT_PROMPT",
    "DIFFUSION_CONFIG_NAME",
    "DiffusionPolicyConfig",
    "NOISE_SCHEDULERS",
    "SMOLVLA_CONFIG_NAME",
    "ActionTokenVLAConfig",
    "SmolVLAConfig",
    "VISION_TOWERS",
    "param_names",
    "read_saved_config",
    "resolve_config",
]
