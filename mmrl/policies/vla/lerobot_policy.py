"""What the adapters of lerobot's generative action heads share (SmolVLA's flow expert, the
Diffusion Policy's U-Net): building a lerobot policy with its pre/post-processors offline, loading a
saved one, and the adapter skeleton whose units are the denoising steps of every executed chunk.

A subclass writes `_act_arrays(images, states, instructions, generator, temperature)` (one chunk
per row: {"actions", "states" [B, K+1, *chunk_shape], "logp" [B, K]}), `_chain_steps` (the
teacher-forced step means of chosen chunks), `sft_loss`, `chunk_shape` and `saved_settings`;
episodes, decoding, the per-unit scores and saving are here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmrl.episodes import as_numpy, episode_slices, run_episodes
from mmrl.flow import gaussian_kl, gaussian_logprob
from mmrl.policies.base import FlowPolicyBase, UnitSteps, eval_mode
from mmrl.policies.vla.processor import (
    acted_chunks,
    decode_episodes,
    denoising_inputs,
    denoising_rollout,
    observation_field,
    observation_images,
)
from mmrl.rollout import Rollout


def robot_features(cameras: Sequence[str], image_size: int, state_dim: int, action_dim: int) -> dict[str, Any]:
    """lerobot's `input_features` / `output_features` of a policy that sees `cameras` (square RGB
    images), reads a state vector and acts in `action_dim` dims."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    return {"input_features": {**{f"observation.images.{c}": PolicyFeature(FeatureType.VISUAL, (3, image_size, image_size))
                                  for c in cameras},
                               "observation.state": PolicyFeature(FeatureType.STATE, (state_dim,))},
            "output_features": {"action": PolicyFeature(FeatureType.ACTION, (action_dim,))}}


def build_lerobot(policy_cls, cfg, seed: int, device: str, dataset_stats: dict[str, dict[str, Any]] | None = None):
    """`policy_cls(cfg)` initialised from `seed` (the global RNG untouched), with lerobot's
    pre/post-processors: (policy on `device`, pre-processor, post-processor)."""
    from lerobot.policies.factory import make_pre_post_processors

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = policy_cls(cfg)
    pre, post = make_pre_post_processors(cfg, dataset_stats=dataset_stats)
    return policy.to(device), pre, post


def load_lerobot(path: str | Path, device: str, policy_cls, *, adjust=None,
                 preprocessor_overrides: dict[str, Any] | None = None):
    """A lerobot policy directory (written by lerobot or by an adapter's `save`) of `policy_cls`:
    (policy, pre-processor, post-processor) on `device`. `adjust(cfg)` edits the loaded config
    before the weights load."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors

    path = Path(path)
    kind = policy_cls.name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a saved lerobot {kind} policy directory")
    cfg = PreTrainedConfig.from_pretrained(path)
    if getattr(cfg, "type", kind) != kind:
        raise ValueError(f"{path} holds a {cfg.type!r} policy, not {kind!r}")
    cfg.device = str(device)
    if adjust is not None:
        adjust(cfg)
    model = policy_cls.from_pretrained(path, config=cfg).to(device)
    overrides = {"device_processor": {"device": str(device)}, **(preprocessor_overrides or {})}
    pre, post = make_pre_post_processors(cfg, pretrained_path=str(path), preprocessor_overrides=overrides)
    return model, pre, post


class LeRobotChunkPolicy(FlowPolicyBase):
    """A lerobot policy (`model`, with `preprocessor` / `postprocessor`) whose action chunks are
    sampled by a chain of Gaussian denoising steps: the units of a rollout are those steps
    (`processor.denoising_rollout`)."""

    CONFIG_NAME = ""  # the adapter's settings file beside the lerobot weights
    cameras: list[str]
    max_chunks: int
    num_steps: int
    env_factory = None

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def saved_settings(self) -> dict[str, Any]:
        """The adapter's own settings that `save` writes beside the lerobot files."""
        raise NotImplementedError

    def _chain_steps(self, model: nn.Module, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The step means [M*K, *chunk_shape] (sample-major: row m*K + k is chunk m's step k) and
        their stds (broadcasting against them) of the M chains in `inputs` (`denoising_inputs`:
        images, states, instructions, chains [M, K+1, *chunk_shape]), with gradient."""
        raise NotImplementedError

    def _unit_steps(self, model: nn.Module, rollout: Rollout, window: slice | None = None,
                    ref_means: torch.Tensor | None = None, with_means: bool = False) -> UnitSteps:
        """Scores of the denoising steps `window` (default: all; `with_means`: all): one pass over
        every chunk the window touches (a window of whole chunks costs nothing extra)."""
        N, K, chunk = len(rollout), self.num_steps, self.chunk_shape
        S = rollout.units.shape[1] // K
        rows, steps, start, stop = acted_chunks(rollout.mask, K, None if with_means else window)
        zeros = lambda *shape: torch.zeros(N, S, K, *shape, device=self.device)  # noqa: E731
        logp, kl, means = zeros(), zeros() if ref_means is not None else None, zeros(*chunk) if with_means else None
        if len(rows):
            inputs = denoising_inputs(rollout, rows, steps, K, self.device)  # (images, states, instructions, chains)
            mean, std = self._chain_steps(model, inputs)
            chains = inputs[3]  # [M, K+1, *chunk]: each chain's start, then the state after each step
            M, x_next = len(rows), chains[:, 1:].reshape(-1, *chunk)
            logp = logp.index_put((rows, steps), gaussian_logprob(x_next, mean, std).view(M, K))
            if kl is not None:
                ref = ref_means.view(N, S, K, *chunk)[rows, steps].reshape(M * K, *chunk)
                kl = kl.index_put((rows, steps), gaussian_kl(mean, ref, std).view(M, K))
            if means is not None:
                means = means.index_put((rows, steps), mean.detach().view(M, K, *chunk).to(means.dtype))

        def units(x: torch.Tensor) -> torch.Tensor:
            return torch.where(rollout.mask[:, start:stop], x.view(N, S * K)[:, start:stop], 0.0)

        return UnitSteps(units(logp), None if kl is None else units(kl),
                         None if means is None else means.view(N, S * K, *chunk))

    def _act_arrays(self, images: np.ndarray, states: np.ndarray, instructions: list[str],
                    generator: torch.Generator | None, temperature: float | None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @torch.no_grad()
    def act(self, observations: dict | Any, instructions: Sequence[str] | None = None,
            generator: torch.Generator | None = None, temperature: float | None = None) -> dict[str, torch.Tensor]:
        """One chunk per row: {"actions" [B, n_action_steps, A], "states" [B, K+1, *chunk_shape],
        "logp" [B, K]}. `observations` has "images" {camera: uint8 [B, H, W, 3]} and "state" [B, D]."""
        images = observation_images(observations, self.cameras)
        states = as_numpy(observation_field(observations, "state"))
        return self._act_arrays(images, states, list(instructions or []), generator, temperature)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.model.save_pretrained(directory)
        self.preprocessor.save_pretrained(directory)
        self.postprocessor.save_pretrained(directory)
        (directory / self.CONFIG_NAME).write_text(json.dumps(self.saved_settings(), indent=2))

    @torch.no_grad()
    def sample(self, contexts: list[dict], group_size: int, generator: torch.Generator | None = None,
               temperature: float | None = None) -> Rollout:
        """Whole episodes, G per context, at most the env factory's `max_envs` at a time;
        `temperature=0` samples deterministically (evaluation)."""
        return Rollout.concat([self._sample_episodes(part, group_size, generator, temperature)
                               for part in episode_slices(contexts, group_size, self.env_factory)])

    def _sample_episodes(self, contexts: list[dict], group_size: int, generator: torch.Generator | None,
                         temperature: float | None) -> Rollout:
        def act(images: np.ndarray, states: np.ndarray, instructions: list[str]):
            out = self._act_arrays(images, states, instructions, generator, temperature)
            return out["actions"], out

        ep = run_episodes(self.env_factory, [dict(c) for c in contexts for _ in range(group_size)], act,
                          self.max_chunks, self.cameras)
        return denoising_rollout(ep, self.num_steps, self.chunk_shape, self.max_chunks, self.device)

    def decode(self, rollout: Rollout) -> list[dict[str, Any]]:
        return decode_episodes(rollout)


__all__ = ["LeRobotChunkPolicy", "build_lerobot", "load_lerobot", "robot_features"]
