"""lerobot's Diffusion Policy (a ResNet image encoder with spatial soft-argmax keypoints and a 1-D
conditional U-Net that denoises an action chunk) trained with DPPO (arXiv 2409.00588).

DPPO treats the K denoising steps of every chunk as the inner level of a two-level MDP: each step
x_t -> x_prev is a Gaussian (`mmrl.flow.diffusion_step`: the DDIM step with noise level eta, whose
eta = 1 case is DDPM's posterior, with DPPO's floor `min_std` on the std) with an exact log-prob, and
the policy-gradient loss (GRPO, PPO-clip, ...) runs over the steps as units, the environment's
reward the same for all of a trajectory's steps. The units are laid out as SmolVLA's
(`mmrl.policies.vla.processor.denoising_rollout`): `units[n, s*K + k]` is the chunk after step k of
chunk s, `extras["x_init"][n][s]` its starting noise, and `logprobs` recomputes every step
teacher-forced (the observation encoder with gradient, all K steps of all chunks in one U-Net call).
`temperature=0` (evaluation) runs the deterministic DDIM sampler (eta = 0).

lerobot samples with `DiffusionModel.conditional_sample` (the scheduler's own `step`); here the same
U-Net and observation encoder run inside our step so that each has a log-prob. Observations reach the
model through lerobot's pre-processor (normalise images and state) and actions leave through its
post-processor (unnormalise), so a pretrained Diffusion Policy and its statistics work unchanged.

Limits, each named by an error: one observation step (`n_obs_steps: 1`; the episode runner shows
the policy the current frame only), and no language (lerobot's Diffusion Policy reads none, so the
task must show its goal in the image).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmrl.episodes import task_env_factory
from mmrl.flow import diffusion_chain, diffusion_step, gaussian_logprob
from mmrl.policies.base import eval_mode
from mmrl.policies.vla.configuration import (
    DIFFUSION_CONFIG_NAME,
    DiffusionPolicyConfig,
    read_saved_config,
    resolve_config,
)
from mmrl.policies.vla.lerobot_policy import LeRobotChunkPolicy, build_lerobot, load_lerobot, robot_features
from mmrl.policies.vla.processor import parse_sft_context
from mmrl.rollout import Rollout

OBS_STATE, OBS_IMAGES = "observation.state", "observation.images"


def build_tiny_diffusion(cameras: Sequence[str] = ("front",), *, state_dim: int = 8, action_dim: int = 7,
                         horizon: int = 8, n_action_steps: int | None = None, num_steps: int = 10,
                         image_size: int = 64, encoder_size: int | None = 96, down_dims: Sequence[int] = (32, 64),
                         keypoints: int = 16,
                         noise_scheduler: str = "DDIM", num_train_timesteps: int = 100, seed: int = 0,
                         device: str = "cpu", dataset_stats: dict[str, dict[str, Any]] | None = None):
    """A small lerobot Diffusion Policy (ResNet-18 encoder with group norm on images resized to
    `encoder_size`, no pretrained weights, so no download): (lerobot policy, pre-processor,
    post-processor)."""
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    cfg = DiffusionConfig(
        n_obs_steps=1, horizon=horizon, n_action_steps=n_action_steps or horizon, drop_n_last_frames=0,
        pretrained_backbone_weights=None, use_group_norm=True, crop_shape=None,
        resize_shape=(encoder_size, encoder_size) if encoder_size else None,
        spatial_softmax_num_keypoints=keypoints, down_dims=tuple(down_dims), kernel_size=3,
        diffusion_step_embed_dim=32, noise_scheduler_type=noise_scheduler, num_train_timesteps=num_train_timesteps,
        num_inference_steps=num_steps, device=device, **robot_features(cameras, image_size, state_dim, action_dim))
    return build_lerobot(DiffusionPolicy, cfg, seed, device, dataset_stats)


def load_diffusion(path: str | Path, device: str = "cpu"):
    """A Diffusion Policy directory written by lerobot or by `DiffusionActionPolicy.save`: (lerobot
    policy, pre-processor, post-processor) on `device`."""
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    def no_download(cfg) -> None:  # the checkpoint has the weights; never fetch torchvision's
        cfg.pretrained_backbone_weights = None

    return load_lerobot(path, device, DiffusionPolicy, adjust=no_download)


class DiffusionActionPolicy(LeRobotChunkPolicy):
    """`model` is the lerobot DiffusionPolicy (the trainable module); `config` the `model.params`
    (`DiffusionPolicyConfig`), keywords given as `params` override its fields."""

    CONFIG = DiffusionPolicyConfig
    CONFIG_NAME = DIFFUSION_CONFIG_NAME

    def __init__(self, model: nn.Module, preprocessor, postprocessor, config: DiffusionPolicyConfig | None = None, *,
                 env_factory: Callable[[list[dict]], Any] | None = None, **params):
        c = self.config = resolve_config(DiffusionPolicyConfig, config, params)
        cfg = model.config
        if cfg.n_obs_steps != 1:
            raise ValueError(f"this Diffusion Policy reads n_obs_steps={cfg.n_obs_steps} observations; the episode "
                             f"runner gives the current one only, so n_obs_steps must be 1")
        if cfg.env_state_feature is not None:
            raise ValueError("this Diffusion Policy reads observation.environment_state, which the envs do not give")
        self.model, self.preprocessor, self.postprocessor = model, preprocessor, postprocessor
        self.eta, self.min_std = c.eta, c.min_std
        self.num_steps = int(c.num_steps or model.diffusion.num_inference_steps)
        self.n_action_steps = int(c.n_action_steps or cfg.n_action_steps)
        if not 1 <= self.n_action_steps <= cfg.horizon:
            raise ValueError(f"n_action_steps must be in [1, horizon={cfg.horizon}], got {self.n_action_steps}")
        feature_cams = [k[len(OBS_IMAGES) + 1:] for k in cfg.image_features]
        self.cameras = c.cameras or feature_cams
        if sorted(self.cameras) != sorted(feature_cams):
            raise ValueError(f"cameras {self.cameras} must be this Diffusion Policy's image features {feature_cams}")
        self.max_chunks = c.max_chunks
        self.env_factory = env_factory
        self.clip_sample = float(cfg.clip_sample_range) if cfg.clip_sample else None
        self.timesteps, self.alpha_bar, self.alpha_bar_prev = diffusion_chain(model.diffusion.noise_scheduler,
                                                                              self.num_steps)
        self.reference = None

    @property
    def chunk_shape(self) -> tuple[int, int]:
        return self.model.config.horizon, self.model.config.action_feature.shape[0]

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg, task, device="cpu") -> DiffusionActionPolicy:
        """`model.source: tiny` builds a small Diffusion Policy (sizes in `model.params`);
        `pretrained` loads `model.path` saved by `save` (whose settings the params override) or by lerobot."""
        m, params = cfg.model, dict(cfg.model.params)
        cls.check_params(params)
        saved = read_saved_config(m.path, DIFFUSION_CONFIG_NAME) if m.source == "pretrained" else {}
        c = DiffusionPolicyConfig(**{**saved, **params})
        env_factory = task_env_factory(task)
        dev = str(torch.device(device))
        if m.source == "pretrained":
            return cls(*load_diffusion(m.path, dev), c, env_factory=env_factory)
        cams = c.cameras or ["front"]
        model, pre, post = build_tiny_diffusion(
            cams, state_dim=c.state_dim, action_dim=c.action_dim, horizon=c.horizon, n_action_steps=c.n_action_steps,
            num_steps=c.num_steps or 10, image_size=c.image_size, encoder_size=c.encoder_size,
            down_dims=c.down_dims, keypoints=c.keypoints,
            noise_scheduler=c.noise_scheduler, num_train_timesteps=c.num_train_timesteps, seed=cfg.train.seed,
            device=dev, dataset_stats=c.dataset_stats)
        return cls(model, pre, post, c, env_factory=env_factory, cameras=cams)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", **kwargs) -> DiffusionActionPolicy:
        return cls(*load_diffusion(path, device), **{**read_saved_config(path, DIFFUSION_CONFIG_NAME), **kwargs})

    def saved_settings(self) -> dict[str, Any]:
        return {"eta": self.eta, "min_std": self.min_std, "num_steps": self.num_steps,
                "n_action_steps": self.n_action_steps, "cameras": self.cameras}

    # ------------------------------------------------------------------ observations and the chain

    def _batch(self, images: np.ndarray, states: np.ndarray, actions: torch.Tensor | None = None) -> dict[str, Any]:
        """uint8 images [B, C, H, W, 3] (C = self.cameras), states [B, D] (and expert actions for SFT)
        -> lerobot's batch, pre-processed (normalised), images stacked as [B, 1, C, 3, H, W]."""
        img = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 1, 4, 2, 3).float() / 255.0
        batch: dict[str, Any] = {f"{OBS_IMAGES}.{c}": img[:, i] for i, c in enumerate(self.cameras)}
        batch[OBS_STATE] = torch.as_tensor(np.asarray(states), dtype=torch.float32)
        if actions is not None:
            batch["action"] = actions
        batch = self.preprocessor(batch)
        keys = list(self.model.config.image_features)  # the model's camera order
        batch[OBS_IMAGES] = torch.stack([batch[k] for k in keys], 1)[:, None]
        batch[OBS_STATE] = batch[OBS_STATE][:, None]
        return batch

    def _noise_fn(self, model: nn.Module, batch: dict[str, Any], repeat: int = 1):
        """(x [B*repeat, ...], timestep [B*repeat] long) -> the U-Net's output, conditioned on the
        encoded observations (each repeated `repeat` times, sample-major)."""
        cond = model.diffusion._prepare_global_conditioning(batch)
        if repeat > 1:
            cond = cond.repeat_interleave(repeat, 0)
        return lambda x, t: model.diffusion.unet(x, t, global_cond=cond)

    def _step(self, model_output: torch.Tensor, x: torch.Tensor, k: int | torch.Tensor, eta: float,
              noise: torch.Tensor | None = None, generator: torch.Generator | None = None):
        dev = x.device
        return diffusion_step(x, model_output, self.alpha_bar.to(dev)[k], self.alpha_bar_prev.to(dev)[k], eta=eta,
                              prediction_type=self.model.config.prediction_type, clip_sample=self.clip_sample,
                              min_std=self.min_std, noise=noise, generator=generator)

    def _sample_chunks(self, batch: dict[str, Any], generator: torch.Generator | None, stochastic: bool,
                       noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """States [B, K+1, horizon, A] and per-step log-probs [B, K] (zeros for deterministic DDIM)."""
        eps_fn = self._noise_fn(self.model, batch)
        B = batch[OBS_STATE].shape[0]
        x = noise if noise is not None else torch.randn(B, *self.chunk_shape, generator=generator, device=self.device)
        states, logps = [x], []
        for k in range(self.num_steps):
            out = eps_fn(x, self.timesteps[k].to(self.device).expand(B))
            if stochastic:
                x, mean, std = self._step(out, x, k, self.eta, generator=generator)
                logps.append(gaussian_logprob(x, mean, std))
            else:
                x = self._step(out, x, k, 0.0, noise=torch.zeros_like(x))[1]
                logps.append(torch.zeros(B, device=x.device))
            states.append(x)
        return torch.stack(states, 1), torch.stack(logps, 1)

    def _actions(self, x0: torch.Tensor) -> torch.Tensor:
        """Normalised chunk [B, horizon, A] -> env actions [B, n_action_steps, A] (unnormalised)."""
        return self.postprocessor(x0[:, :self.n_action_steps]).float()

    def _act_arrays(self, images, states, instructions, generator, temperature) -> dict[str, torch.Tensor]:
        """The instructions are ignored: lerobot's Diffusion Policy reads no language."""
        with eval_mode(self.model), torch.inference_mode():
            states_t, logp = self._sample_chunks(self._batch(images, states), generator,
                                                 stochastic=temperature != 0.0)
        states_t, logp = states_t.clone(), logp.clone()  # out of inference mode
        return {"actions": self._actions(states_t[:, -1]), "states": states_t, "logp": logp}

    # ------------------------------------------------------------------ teacher forcing

    def _chain_steps(self, model: nn.Module, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Step means and stds of the chains: one U-Net call over all K steps of every chain."""
        images, states, _, chains = inputs
        M, K = chains.shape[0], self.num_steps
        with eval_mode(model):  # the inputs the sampler saw (a random crop would break parity)
            eps_fn = self._noise_fn(model, self._batch(images, states), repeat=K)
            x = chains[:, :-1].reshape(M * K, *self.chunk_shape)  # sample-major: row m*K + k
            k = torch.arange(K, device=self.device).repeat(M)
            _, mean, std = self._step(eps_fn(x, self.timesteps.to(self.device)[k]), x, k, self.eta,
                                      noise=torch.zeros_like(x))
        return mean, std

    # ------------------------------------------------------------------ SFT

    def sft_loss(self, contexts: list[dict]) -> torch.Tensor:
        """lerobot's denoising loss on expert chunks (train mode: its random crop, if configured).
        Contexts hold images, "state" (or "observation.state") and the expert chunk [horizon, A]
        (`parse_sft_context` lists the keys); an instruction is ignored."""
        ex = [parse_sft_context(c, i, self.cameras, self.chunk_shape[1], self.chunk_shape[0],
                                default_instruction="", need_state=True) for i, c in enumerate(contexts)]
        batch = self._batch(np.stack([np.stack(e.images) for e in ex]), np.stack([e.state for e in ex]),
                            actions=torch.stack([e.actions for e in ex]))
        batch["action_is_pad"] = ~torch.stack([e.valid for e in ex]).to(self.device)
        return self.model.diffusion.compute_loss(batch)
