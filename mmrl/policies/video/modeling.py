"""`video_gen`: a chunk-causal text-to-video generator (`CausalWan`) as a policy.

A rollout generates the video chunk by chunk: each chunk is denoised in K flow steps against the KV
cache of the clean past chunks, then written to the cache at t = 0 (Self-Forcing's streaming
rollout). The decision units are the K x C (steps x chunks) denoising transitions, laid out
step-major (unit j * C + k is step j of chunk k), so a `train.unit_chunk` of C back-propagates one
denoising step of every chunk at a time.

Log-probs are recomputed teacher-forced: one `forward_teacher_forced` pass per step over
[clean video ; the video at step j] gives every chunk's velocity at that step with the history it
saw while sampling (the cache is a function of the clean chunks and the weights), so the gradient
also flows through the history, as in the sampled computation. Exploration is the reverse SDE of
`mmrl.flow` (Flow-GRPO's or DanceGRPO's noise level); `train_fraction` < 1 trains a random subset
of the steps per rollout (Flow-GRPO's timestep subsampling) and skips the others' compute.

Model space: the tiny generator works on pixels in [-1, 1]; a checkpoint with a `vae/` folder
(`AutoencoderKLWan`) works on its normalised latents, and `decode` returns frames either way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmrl.flow import flow_timesteps, gaussian_kl, gaussian_logprob, ode_step, sde_step
from mmrl.policies.base import FlowPolicyBase, UnitSteps, eval_mode, without_call_state
from mmrl.policies.video.causal_wan import CausalWan, KVCache, build_tiny_wan
from mmrl.policies.video.configuration import VIDEO_CONFIG_NAME, VideoGenConfig
from mmrl.policies.vla.configuration import read_saved_config, resolve_config
from mmrl.rollout import Rollout

TEXT_ENCODER_DIR, TOKENIZER_DIR, TRANSFORMER_DIR, VAE_DIR = "text_encoder", "tokenizer", "transformer", "vae"
TINY_TEXT = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 4}  # the tiny UMT5 encoder


def build_tiny_parts(prompts: list[str], *, vocab_size: int = 300, seed: int = 0, chunk_frames: int = 2,
                     latent: bool = False, **tiny) -> tuple[CausalWan, nn.Module, Any, nn.Module | None]:
    """(generator, text encoder, tokenizer, VAE or None) of a tiny text-to-video model built from
    configs: a tokenizer trained on `prompts`, a 1-layer UMT5 encoder, a `build_tiny_wan` generator
    (sizes in `tiny`) and, with `latent`, a tiny `AutoencoderKLWan` (Wan's 4x temporal, 8x spatial
    compression, 4 latent channels) so the generator works on latents as a real Wan does."""
    from transformers import UMT5Config, UMT5EncoderModel

    from mmrl.tiny import build_tokenizer

    tokenizer = build_tokenizer(prompts, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                                   **TINY_TEXT))
        vae = None
        if latent:
            from diffusers import AutoencoderKLWan

            vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                   latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    channels = {"in_channels": 4, "out_channels": 4} if latent else {}
    generator = build_tiny_wan(chunk_frames=chunk_frames, seed=seed, **{"text_dim": TINY_TEXT["d_model"], **channels,
                                                                        **tiny})
    return generator, text_encoder, tokenizer, vae


def pixels_to_unit(frames: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 [B, F, H, W, 3] (or [F, H, W, 3]) -> float [B, 3, F, H, W] in [-1, 1]."""
    x = torch.as_tensor(np.asarray(frames))
    if x.dim() == 4:
        x = x[None]
    if x.dim() != 5 or x.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [B, F, H, W, 3] or [F, H, W, 3], got shape {tuple(x.shape)}")
    return x.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def unit_to_pixels(x: torch.Tensor) -> np.ndarray:
    """float [B, 3, F, H, W] in [-1, 1] -> uint8 [B, F, H, W, 3]."""
    return ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).cpu().numpy()


class VideoGenPolicy(FlowPolicyBase):
    """`model` is the `CausalWan` (trained); the text encoder (UMT5) and the VAE are frozen."""

    CONFIG = VideoGenConfig
    GRADIENT_CHECKPOINTING = True  # the Wan blocks (`CausalWan.enable_gradient_checkpointing`)

    @classmethod
    def supports_gaussian_kl(cls, params: dict) -> bool:
        """SDE exploration only: KVPO's units (`kv_routing`) are branches of a deterministic ODE."""
        return params.get("exploration", VideoGenConfig.exploration) == "sde"

    def __init__(self, generator: CausalWan, text_encoder: nn.Module, tokenizer, config: VideoGenConfig | None = None,
                 *, num_frames: int, height: int, width: int, vae: nn.Module | None = None, **params):
        c = self.config = resolve_config(VideoGenConfig, config, params)
        self.model, self.tokenizer, self.vae = generator, tokenizer, vae
        self.text_encoder = text_encoder.eval().requires_grad_(False)
        if vae is not None:
            vae.eval().requires_grad_(False)
        if c.chunk_frames != generator.chunk_frames:
            raise ValueError(f"model.params.chunk_frames={c.chunk_frames} but the generator was built with "
                             f"chunk_frames={generator.chunk_frames}")
        self.shape = self._model_shape(num_frames, height, width)  # (channels, frames, H, W) in model space
        self.num_chunks = self.shape[1] // c.chunk_frames
        self.timesteps = flow_timesteps(c.num_steps, shift=c.shift)
        self._text: dict[str, torch.Tensor] = {}
        self.reference = None

    def enable_gradient_checkpointing(self) -> None:
        """train.gradient_checkpointing: diffusers' switch on the Wan transformer (non-reentrant
        `torch.utils.checkpoint`), which `CausalWan._blocks` honours for every pass under gradients
        (teacher-forced log-probs, KVPO's replay, SFT); sampling under no_grad keeps no activations
        anyway and runs the blocks plainly. The cache a chunk writes is snapshotted before its
        blocks run, so a recompute sees the cache as the forward did. Same values and gradients."""
        self.model.enable_gradient_checkpointing()

    # ------------------------------------------------------------------ construction

    def _model_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        channels = self.model.transformer.config.in_channels
        if self.vae is None:
            frames, h, w = num_frames, height, width
        else:  # Wan's VAE: 4x temporal (plus the first frame), 8x spatial
            t_scale, s_scale = self.vae.config.scale_factor_temporal, self.vae.config.scale_factor_spatial
            if (num_frames - 1) % t_scale or height % s_scale or width % s_scale:
                raise ValueError(f"with a VAE, num_frames - 1 must be a multiple of {t_scale} and the image size of "
                                 f"{s_scale}; got {num_frames} frames of {height}x{width}")
            frames, h, w = (num_frames - 1) // t_scale + 1, height // s_scale, width // s_scale
        cf = self.config.chunk_frames
        if frames % cf:
            raise ValueError(f"{frames} model frames do not split into chunks of chunk_frames={cf}")
        return channels, frames, h, w

    @classmethod
    def from_config(cls, cfg, task, device="cpu") -> VideoGenPolicy:
        """`model.source: tiny` builds a tiny pixel-space CausalWan and UMT5 encoder with a tokenizer
        trained on the task's prompts (sizes in `model.params.tiny`); `pretrained` loads `model.path`
        laid out as a diffusers Wan pipeline (transformer/, text_encoder/, tokenizer/, optional vae/)."""
        m, params = cfg.model, dict(cfg.model.params)
        cls.check_params(params)
        saved = read_saved_config(m.path, VIDEO_CONFIG_NAME) if m.source == "pretrained" else {}
        c = VideoGenConfig(**{**saved, **params})
        size = dict(num_frames=task.num_frames, height=task.image_size, width=task.image_size)
        dtype = getattr(torch, m.dtype)
        if m.source == "pretrained":
            policy = cls.from_pretrained(m.path, c, device=device, dtype=dtype, **size)
        else:
            generator, text_encoder, tokenizer, vae = build_tiny_parts(
                task.corpus(), vocab_size=m.tokenizer_vocab_size, seed=cfg.train.seed, chunk_frames=c.chunk_frames,
                **c.tiny)
            policy = cls(generator, text_encoder, tokenizer, c, vae=vae, **size)
        policy.model.to(device=device, dtype=dtype)
        policy.text_encoder.to(device)
        if policy.vae is not None:
            policy.vae.to(device)
        return policy

    @classmethod
    def from_pretrained(cls, path: str | Path, config: VideoGenConfig | None = None, *, device="cpu",
                        dtype: torch.dtype = torch.float32, num_frames: int, height: int, width: int) -> VideoGenPolicy:
        from transformers import AutoTokenizer, UMT5EncoderModel

        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"model.path {root} does not exist (a local diffusers Wan pipeline folder)")
        for sub in (TRANSFORMER_DIR, TEXT_ENCODER_DIR, TOKENIZER_DIR):
            if not (root / sub).is_dir():
                raise FileNotFoundError(f"model.path {root} has no {sub}/ folder: a video checkpoint is laid out as a "
                                        f"diffusers Wan pipeline ({TRANSFORMER_DIR}/, {TEXT_ENCODER_DIR}/, "
                                        f"{TOKENIZER_DIR}/, optional {VAE_DIR}/)")
        config = config or VideoGenConfig(**read_saved_config(root, VIDEO_CONFIG_NAME))
        generator = CausalWan.from_pretrained(root / TRANSFORMER_DIR, chunk_frames=config.chunk_frames)
        text_encoder = UMT5EncoderModel.from_pretrained(root / TEXT_ENCODER_DIR, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(root / TOKENIZER_DIR, local_files_only=True)
        vae = None
        if (root / VAE_DIR).is_dir():
            from diffusers import AutoencoderKLWan

            vae = AutoencoderKLWan.from_pretrained(root / VAE_DIR, local_files_only=True)
        return cls(generator, text_encoder, tokenizer, config, num_frames=num_frames, height=height, width=width,
                   vae=vae)

    def save(self, directory: str | Path) -> None:
        """A diffusers-Wan-pipeline-like folder that `from_pretrained` (and `model.path`) loads."""
        directory = Path(directory)
        self.model.save_pretrained(directory / TRANSFORMER_DIR)
        self.text_encoder.save_pretrained(directory / TEXT_ENCODER_DIR)
        without_call_state(self.tokenizer)
        self.tokenizer.save_pretrained(directory / TOKENIZER_DIR)
        if self.vae is not None:
            self.vae.save_pretrained(directory / VAE_DIR)
        settings = {k: v for k, v in vars(self.config).items() if k != "tiny"}
        (directory / VIDEO_CONFIG_NAME).write_text(json.dumps(settings, indent=2))

    # ------------------------------------------------------------------ conditioning and model space

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, L, D] text embeddings, padded positions zeroed (as Wan's pipeline does); cached per prompt."""
        new = sorted({p for p in prompts if p not in self._text})
        if new:
            tok = self.tokenizer(new, padding="max_length", truncation=True, max_length=self.config.text_max_length,
                                 return_tensors="pt")
            ids, mask = tok.input_ids.to(self.device), tok.attention_mask.to(self.device)
            with torch.no_grad():
                emb = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            emb = emb * mask[..., None]
            self._text.update({p: e.to(self.model.dtype) for p, e in zip(new, emb)})
        return torch.stack([self._text[p] for p in prompts])

    @property
    def guided(self) -> bool:
        return self.config.guidance_scale > 1.0

    def _conditioning(self, text: torch.Tensor) -> torch.Tensor:
        """The rows the generator runs on: the prompts, then (with guidance) the empty prompt for each."""
        if not self.guided:
            return text
        return torch.cat([text, self.encode_prompts([""]).expand_as(text)])

    def _guide(self, v: torch.Tensor) -> torch.Tensor:
        if not self.guided:
            return v
        cond, uncond = v.chunk(2)
        return uncond + self.config.guidance_scale * (cond - uncond)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if self.guided else x

    @torch.no_grad()
    def to_model_space(self, frames) -> torch.Tensor:
        x = pixels_to_unit(frames).to(self.device)
        if self.vae is None:
            return x.to(self.model.dtype)
        latents = self.vae.encode(x.to(self.vae.dtype)).latent_dist.mean
        mean, std = self._latent_stats(latents)
        return ((latents - mean) / std).to(self.model.dtype)

    @torch.no_grad()
    def to_pixels(self, x: torch.Tensor) -> np.ndarray:
        if self.vae is None:
            return unit_to_pixels(x)
        mean, std = self._latent_stats(x)
        return unit_to_pixels(self.vae.decode((x * std + mean).to(self.vae.dtype)).sample)

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.vae.config
        shape = (1, cfg.z_dim, 1, 1, 1)
        return (torch.tensor(cfg.latents_mean, device=like.device, dtype=like.dtype).view(shape),
                torch.tensor(cfg.latents_std, device=like.device, dtype=like.dtype).view(shape))

    # ------------------------------------------------------------------ sampling

    def _chunk(self, k: int) -> slice:
        cf = self.config.chunk_frames
        return slice(k * cf, (k + 1) * cf)

    def denoise(self, model: nn.Module, text: torch.Tensor, noise: torch.Tensor, eta: float,
                generator: torch.Generator | None = None, route_groups: int = 0, sde_steps: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generate from `noise` [B, C, F, H, W] chunk by chunk: returns the states [B, K+1, C, F, H, W]
        (noise first, the video last), the step log-probs [B, K * C] (zeros when eta = 0: the ODE) and
        bool [B, C], the chunks whose history was re-routed. Each chunk attends to the generator's
        context (`context_chunks`); with `route_groups` = G, rows come in groups of G whose first row
        keeps it (the anchor) and the others re-route it (KVPO's causal history routing). `sde_steps`
        (bool [K]) limits the SDE to those steps; the others take the ODE step."""
        B, K, C = noise.shape[0], self.config.num_steps, self.num_chunks
        ts = self.timesteps.tolist()
        states = noise.new_zeros(B, K + 1, *noise.shape[1:])
        logp = noise.new_zeros(B, K * C, dtype=torch.float32)
        routed = torch.zeros(B, C, dtype=torch.bool, device=noise.device)
        cond, history = self._conditioning(text), KVCache()
        for k in range(C):
            sl = self._chunk(k)
            x = noise[:, :, sl]
            states[:, 0, :, sl] = x
            if route_groups:
                cache, routed[:, k] = self._routed_history(history, k, B, route_groups, generator)
            else:
                cache = history.take(model.context_chunks(k))
            for j in range(K):
                v = self._guide(model.forward_chunk(self._rows(x), ts[j], cond, cache, k))
                dt = ts[j + 1] - ts[j]
                if eta > 0 and (sde_steps is None or bool(sde_steps[j])):
                    x, mean, std = sde_step(x, v, ts[j], dt, eta, generator=generator,
                                            noise_schedule=self.config.noise_schedule)
                    logp[:, j * C + k] = gaussian_logprob(x.float(), mean.float(), std.float())
                else:
                    x = ode_step(x, v, dt)
                states[:, j + 1, :, sl] = x
            model.forward_chunk(self._rows(x), 0.0, cond, cache, k, write_cache=True)
            history.append(cache.chunk(-1), k, self.config.chunk_frames)
        return states, logp, routed

    def _routed_history(self, history: KVCache, k: int, n: int, group_size: int, generator: torch.Generator | None
                        ) -> tuple[KVCache, torch.Tensor]:
        """The cache each row attends to at chunk k under KVPO's routing, and bool [B] rows whose
        route differs from the anchor's. Routes are drawn per group (`sample_history_routes`);
        entries keep their rotary positions, so a routed chunk is seen where it was written."""
        from mmrl.algos.kvpo import sample_history_routes

        model, c = self.model, self.config
        window, sink = model.local_window, model.sink_chunks
        anchor = model.context_chunks(k)
        same = torch.zeros(n, dtype=torch.bool, device=self.device)
        if window is None or k < sink + window:
            return history.take(anchor), same  # the older pool cannot fill the window yet
        gen = _cpu(generator)
        routes = torch.cat([sample_history_routes(k, window, c.keep_nearest, group_size - 1, gen, sink=sink)
                            for _ in range(n // group_size)]).to(self.device)  # [n, sink + window], a loop over prompts
        differs = (routes != torch.as_tensor(anchor, device=self.device)).any(-1)
        rows = routes.repeat(2, 1) if self.guided else routes
        batch = torch.arange(rows.shape[0], device=self.device)
        keys = [torch.stack([history.chunk(i)[layer][0] for i in range(k)]) for layer in range(history.num_layers)]
        values = [torch.stack([history.chunk(i)[layer][1] for i in range(k)]) for layer in range(history.num_layers)]
        routed = KVCache()  # slot i of row b holds past chunk rows[b, i]: [k, B, heads, T, d] gathered per slot
        for slot in range(rows.shape[1]):
            pick = rows[:, slot], batch
            routed.append([(kl[pick], vl[pick]) for kl, vl in zip(keys, values)], int(rows[:, slot].max()),
                          self.config.chunk_frames)
        return routed, differs

    def initial_noise(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        return torch.randn(n, *self.shape, generator=generator, device=self.device, dtype=self.model.dtype)

    def trained_steps(self, generator: torch.Generator | None) -> torch.Tensor:
        """bool [K]: the denoising steps this rollout trains (all, or a random `train_fraction` of them)."""
        K = self.config.num_steps
        n = max(1, math.ceil(self.config.train_fraction * K))
        keep = torch.zeros(K, dtype=torch.bool)
        keep[torch.randperm(K, generator=_cpu(generator))[:n]] = True
        return keep

    @torch.no_grad()
    def sample(self, contexts: list[dict], group_size: int, generator: torch.Generator | None = None,
               temperature: float | None = None) -> Rollout:
        """`group_size` videos per prompt from independent noise; temperature 0 samples the ODE."""
        rows = [c for c in contexts for _ in range(group_size)]
        text = self.encode_prompts([c["prompt"] for c in rows])
        if self.config.exploration == "kv_routing" and temperature != 0:
            return self._sample_branches(contexts, rows, text, group_size, generator)
        eta = 0.0 if temperature == 0 else self.config.eta
        K, C, N = self.config.num_steps, self.num_chunks, len(rows)
        steps = self.trained_steps(generator) if eta > 0 and self.config.sde_only_trained else None
        with eval_mode(self.model):
            states, logp, _ = self.denoise(self.model, text, self.initial_noise(N, generator), eta, generator,
                                           sde_steps=steps)
        if steps is None:
            steps = self.trained_steps(generator) if eta > 0 else torch.ones(K, dtype=torch.bool)
        mask = steps.repeat_interleave(C)[None].expand(N, K * C).to(self.device)
        return Rollout(units=torch.arange(K * C, device=self.device).expand(N, -1), logp_old=logp, mask=mask,
                       truncated=torch.zeros(N, dtype=torch.bool, device=self.device), max_units=K * C, contexts=rows,
                       extras={"states": states, "text": text})

    def _sample_branches(self, contexts: list[dict], rows: list[dict], text: torch.Tensor, group_size: int,
                         generator: torch.Generator | None) -> Rollout:
        """KVPO's rollout: per prompt one initial noise, an anchor and group_size - 1 routed branches
        under the ODE. One unit per row: the branch; its log-prob is the group softmax of -TVE."""
        if group_size < 2:
            raise ValueError(f"exploration: kv_routing needs sampling.group_size >= 2 (an anchor and a branch), "
                             f"got {group_size}")
        if self.model.local_window is None:
            raise ValueError("exploration: kv_routing re-routes a local attention window; build the generator with "
                             "one (model.params.tiny.local_window, sink_chunks) or load one that has it")
        noise = self.initial_noise(len(contexts), generator).repeat_interleave(group_size, 0)
        with eval_mode(self.model):
            states, _, routed = self.denoise(self.model, text, noise, 0.0, generator, route_groups=group_size)
        N = len(rows)
        is_anchor = torch.arange(N, device=self.device) % group_size == 0
        rollout = Rollout(units=torch.zeros(N, 1, dtype=torch.long, device=self.device),
                          logp_old=torch.zeros(N, 1, device=self.device), mask=~is_anchor[:, None],
                          truncated=torch.zeros(N, dtype=torch.bool, device=self.device), max_units=1, contexts=rows,
                          extras={"states": states, "text": text, "routed": routed, "is_anchor": is_anchor})
        rollout.logp_old = self._branch_logprobs(self.model, rollout, torch.arange(N, device=self.device) // group_size)
        return rollout

    def _branch_logprobs(self, model: nn.Module, rollout: Rollout, group_ids: torch.Tensor) -> torch.Tensor:
        """[N, 1] KVPO branch log-probs: log-softmax over each group's branches of -TVE / temperature,
        TVE = sum over routed chunks and steps of w_t mean (v_theta - v_branch)^2, v_theta replayed
        teacher-forced in the unrouted history (docs/kvpo.md section 3)."""
        from mmrl.algos.kvpo import branch_logprobs, first_steps_mask, trajectory_velocity_energy, tve_step_weights

        c, K, C = self.config, self.config.num_steps, self.num_chunks
        states, text, routed = rollout.extras["states"], rollout.extras["text"], rollout.extras["routed"]
        anchor = rollout.extras["is_anchor"]
        _, counts = torch.unique(group_ids, return_counts=True)
        if bool((counts != counts[0]).any()) or int(anchor.sum()) != len(counts):
            raise ValueError("KVPO's branch softmax needs whole groups together: keep train.mini_batches 1 and "
                             "train.micro_batch_size 0 or a multiple of sampling.group_size")
        ts = self.timesteps.tolist()
        clean, cond = states[:, K], self._conditioning(text)
        replay, branch = [], []
        for j in range(K):  # the first tve_grad_steps steps keep their graph; the rest are constants
            with torch.set_grad_enabled(torch.is_grad_enabled() and j < c.tve_grad_steps):
                replay.append(self._guide(model.forward_teacher_forced(self._rows(clean), self._rows(states[:, j]),
                                                                       ts[j], cond)))
            branch.append((states[:, j + 1] - states[:, j]) / (ts[j + 1] - ts[j]))  # the ODE step's velocity

        def per_chunk_step(vs: list[torch.Tensor]) -> torch.Tensor:  # K x [N, ch, F, H, W] -> [N, C*K, ...]
            v = torch.stack(vs, 1)
            v = v.reshape(v.shape[0], K, v.shape[2], C, c.chunk_frames, *v.shape[4:]).permute(0, 3, 1, 2, 4, 5, 6)
            return v.reshape(v.shape[0], C * K, *v.shape[3:]).float()  # chunk-major, as the step weights

        tve = trajectory_velocity_energy(
            per_chunk_step(branch), per_chunk_step(replay),
            step_weights=tve_step_weights(self.timesteps[:-1], space=c.tve_space).repeat(C).to(self.device),
            grad_mask=first_steps_mask(K, c.tve_grad_steps, C).to(self.device),
            valid=routed[:, :, None].expand(-1, C, K).reshape(-1, C * K))
        return branch_logprobs(tve, group_ids, c.tve_temperature, is_anchor=anchor)[:, None]

    @torch.no_grad()
    def generate(self, contexts: list[dict], generator: torch.Generator | None = None) -> list[np.ndarray]:
        """One video per context with the deterministic ODE: uint8 [F, H, W, 3] each."""
        return self.decode(self.sample(contexts, 1, generator, temperature=0.0))

    def decode(self, rollout: Rollout) -> list[np.ndarray]:
        return list(self.to_pixels(rollout.extras["states"][:, -1]))

    # ------------------------------------------------------------------ log-probs

    CHUNK_DIMS = (1, 3, 4, 5)  # a unit's elements in the per-chunk layout [N, ch, C, F/C, H, W]

    def _step(self, model: nn.Module, states: torch.Tensor, text: torch.Tensor, j: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_next, mean, std) of step j of every chunk, teacher-forced on the clean video, in the
        per-chunk layout [N, ch, C, F/C, H, W] (float32)."""
        N, C, K = states.shape[0], self.num_chunks, self.config.num_steps
        ts = self.timesteps.tolist()
        clean, x, x_next = states[:, K], states[:, j], states[:, j + 1]
        v = self._guide(model.forward_teacher_forced(self._rows(clean), self._rows(x), ts[j], self._conditioning(text)))
        _, mean, std = sde_step(x, v, ts[j], ts[j + 1] - ts[j], self.config.eta, noise=torch.zeros_like(x),
                                noise_schedule=self.config.noise_schedule)

        def by_chunk(y: torch.Tensor) -> torch.Tensor:  # [N, ch, F, H, W] -> [N, ch, C, F/C, H, W]
            return y.float().reshape(N, y.shape[1], C, self.config.chunk_frames, *y.shape[3:])

        return by_chunk(x_next), by_chunk(mean), std.float()

    def _unit_steps(self, model: nn.Module, rollout: Rollout, window: slice | None = None,
                    ref_means: torch.Tensor | None = None, with_means: bool = False) -> UnitSteps:
        """Scores of units `window` (default, and `with_means`: all); unit j * C + k is step j of
        chunk k, its means the chunk's slice [ch, F/C, H, W] of the step's mean."""
        if "routed" in rollout.extras:  # a KVPO rollout: one unit per branch
            if ref_means is not None or with_means:
                raise ValueError("KVPO's branch units are not Gaussian steps: algo.kl_kind gaussian does not apply")
            groups = rollout.group_ids
            if groups is None:
                raise ValueError("KVPO's branch log-probs need the rollout's group ids (the trainer stamps them)")
            return UnitSteps(self._branch_logprobs(model, rollout, groups))
        N, C, K = len(rollout), self.num_chunks, self.config.num_steps
        window = slice(0, K * C) if window is None or with_means else window
        states, text = rollout.extras["states"], rollout.extras["text"]
        logp = torch.zeros(N, K * C, device=self.device)
        kl = torch.zeros_like(logp) if ref_means is not None else None
        ch, F, H, W = self.shape
        means = torch.zeros(N, K * C, ch, F // C, H, W, device=self.device) if with_means else None
        trained = rollout.mask.view(N, K, C).any(-1).any(0)  # steps some row trains
        for j in range(window.start // C, math.ceil(window.stop / C)):
            if not trained[j]:
                continue
            x_next, mean, std = self._step(model, states, text, j)
            cols = slice(j * C, (j + 1) * C)
            logp[:, cols] = gaussian_logprob(x_next, mean, std, reduce_dims=self.CHUNK_DIMS)
            if kl is not None:
                ref = ref_means[:, cols].transpose(1, 2)  # [N, C, ch, ...] -> the per-chunk layout
                kl[:, cols] = gaussian_kl(mean, ref, std, reduce_dims=self.CHUNK_DIMS)
            if means is not None:
                means[:, cols] = mean.detach().transpose(1, 2)
        return UnitSteps(logp[:, window], None if kl is None else kl[:, window], means)

    # ------------------------------------------------------------------ pretraining

    def sft_loss(self, contexts: list[dict]) -> torch.Tensor:
        """Flow matching on the contexts' target clips, teacher-forced as the rollout sees them: each
        chunk at its own random t against the clean past chunks; the prompt dropped `cfg_dropout` of
        the time so the unconditional velocity (guidance) is learnt too."""
        try:
            x0 = self.to_model_space(np.stack([c["target"] for c in contexts]))
        except KeyError:
            raise ValueError("sft_loss needs a 'target' clip (uint8 [F, H, W, 3]) in every context") from None
        B, C = x0.shape[0], self.num_chunks
        prompts = [c["prompt"] for c in contexts]
        if self.config.cfg_dropout > 0:
            drop = torch.rand(B) < self.config.cfg_dropout
            prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        text = self.encode_prompts(prompts)
        t = torch.rand(B, C, device=self.device, dtype=x0.dtype)
        t_frames = t.repeat_interleave(self.config.chunk_frames, 1).view(B, 1, -1, 1, 1)
        eps = torch.randn_like(x0)
        x_t = (1 - t_frames) * x0 + t_frames * eps
        v = self.model.forward_teacher_forced(x0, x_t, t, text)
        return (v.float() - (eps - x0).float()).pow(2).mean()


def _cpu(generator: torch.Generator | None) -> torch.Generator | None:
    """A CPU generator drawn from `generator` (randperm on CPU needs one)."""
    if generator is None or generator.device.type == "cpu":
        return generator
    return torch.Generator().manual_seed(int(torch.randint(2 ** 62, (1,), generator=generator, device=generator.device)))
