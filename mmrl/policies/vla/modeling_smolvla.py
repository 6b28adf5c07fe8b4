"""lerobot's SmolVLA (a SmolVLM backbone with a flow-matching action expert) as a GRPO policy.

lerobot samples with `VLAFlowMatching.sample_actions` under `no_grad`: it fills a KV cache with the
prefix (images, language, state) once, then integrates `denoise_step` with plain Euler from t = 1
(noise) to t = 0. Here we drive the same pieces ourselves and replace each Euler step by the
marginal-preserving SDE step of `mmrl.flow` (Flow-GRPO), so every denoising step is a Gaussian with
an exact log-prob. The units of a trajectory are its denoising steps, K per chunk and S chunks per
trajectory: `units[n, s*K + k]` is the state x_{k+1} [chunk, max_action_dim] after step k of chunk s,
`extras["x_init"][n][s]` the chunk's starting noise, and `logprobs` recomputes every step's
log-prob teacher-forced (prefix with gradient, all K steps of all chunks in one batched
`denoise_step`). `temperature=0` (evaluation) samples with the deterministic Euler ODE instead.

Episodes run exactly as for the action-token VLA (`mmrl.episodes.run_episodes`): G copies
of each context's initial state in a vector env, `n_action_steps` actions of each sampled chunk
executed per `step_chunk`. Observations reach the model through lerobot's own pre-processor
(tokenise the instruction, normalise the state) and the actions leave through its post-processor
(unnormalise), so a pretrained SmolVLA and its dataset statistics work unchanged.

`train.gradient_checkpointing` recomputes each joint VLM/expert layer of lerobot's layer loop in
the backward (`enable_smolvla_gradient_checkpointing`): the prefix and every denoising step keep
only their layer inputs, with the same log-probs and gradients; sampling is unchanged.

Offline tiny models (tests, CPU demo): `build_tiny_smolvla` writes a tiny SmolVLM folder (config,
processor config, tokenizer) and builds SmolVLA on it with `load_vlm_weights=False`; given a local
folder, lerobot makes no network call.

The typed `model.params` (`SmolVLAConfig`) live in `mmrl.policies.vla.configuration`; SFT contexts
are read by `mmrl.policies.vla.processor.parse_sft_context`, the same reader as the action-token VLA's.
"""

from __future__ import annotations

import shutil
import types
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmrl.episodes import task_env_factory
from mmrl.flow import flow_timesteps, gaussian_logprob, ode_step, sde_step
from mmrl.policies.base import UnitSteps, eval_mode
from mmrl.policies.vla.configuration import (
    SMOLVLA_CONFIG_NAME,
    SmolVLAConfig,
    read_saved_config,
    resolve_config,
)
from mmrl.policies.vla.lerobot_policy import LeRobotChunkPolicy, build_lerobot, load_lerobot, robot_features
from mmrl.policies.vla.processor import instruction_corpus, parse_sft_context
from mmrl.rollout import Rollout

VLM_DIR = "vlm"  # a tiny model's SmolVLM folder, inside the build and checkpoint directories
SMOLVLM_SPECIAL_TOKENS = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                          "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}


# ----------------------------------------------------------------------------- tiny offline build


def build_tiny_smolvlm_dir(directory: str | Path, corpus: Sequence[str], image_size: int = 32, patch_size: int = 8,
                           hidden_size: int = 64, num_layers: int = 2, vocab_size: int = 320, scale: int = 2,
                           text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None) -> Path:
    """Write a tiny SmolVLM (config.json, processor_config.json, tokenizer files) that
    `SmolVLAConfig(vlm_model_name=directory, load_vlm_weights=False)` builds on, with no hub access.
    `text` / `vision` override the SmolVLM text / vision config sizes and `scale` its pixel-shuffle
    factor (bench/real_shapes.py builds SmolVLM2-500M's widths this way)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    from mmrl.tiny import build_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base = build_tokenizer(list(corpus), vocab_size=vocab_size)
    base.add_tokens(list(SMOLVLM_SPECIAL_TOKENS.values()), special_tokens=True)
    # Named extra special tokens give the attributes SmolVLA reads (tokenizer.fake_image_token_id, ...).
    PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            extra_special_tokens=SMOLVLM_SPECIAL_TOKENS).save_pretrained(directory)
    tok = AutoTokenizer.from_pretrained(directory)
    if image_size % (patch_size * scale):
        raise ValueError(f"image_size {image_size} must be a multiple of patch_size * {scale} = {patch_size * scale}")
    seq_len = (image_size // patch_size) ** 2 // scale ** 2
    image_processor = SmolVLMImageProcessor(size={"longest_edge": image_size}, do_image_splitting=False,
                                            max_image_size={"longest_edge": image_size})
    SmolVLMProcessor(image_processor=image_processor, tokenizer=tok, video_processor=SmolVLMVideoProcessor(),
                     image_seq_len=seq_len).save_pretrained(directory)
    text = {**dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=hidden_size // 4, max_position_embeddings=512), **(text or {})}
    vision = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
              **(vision or {}), "image_size": image_size, "patch_size": patch_size}
    SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=scale,
                  image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id
                  ).save_pretrained(directory)
    return directory


def build_tiny_smolvla(directory: str | Path, corpus: Sequence[str], *, cameras: Sequence[str] = ("front",),
                       state_dim: int = 8, action_dim: int = 7, chunk_size: int = 8, n_action_steps: int | None = None,
                       num_steps: int = 10, image_size: int = 64, vlm_image_size: int = 32, seed: int = 0,
                       device: str = "cpu", train_expert_only: bool = True,
                       dataset_stats: dict[str, dict[str, Any]] | None = None):
    """A tiny SmolVLA (about 0.25M parameters) on a tiny SmolVLM written to `directory / "vlm"`;
    returns (lerobot policy, pre-processor, post-processor)."""
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy as LeRobotSmolVLA

    vlm = build_tiny_smolvlm_dir(Path(directory) / VLM_DIR, corpus, image_size=vlm_image_size)
    cfg = SmolVLAConfig(
        vlm_model_name=str(vlm), load_vlm_weights=False, chunk_size=chunk_size,
        n_action_steps=n_action_steps or chunk_size, max_state_dim=state_dim, max_action_dim=action_dim,
        resize_imgs_with_padding=(vlm_image_size, vlm_image_size), num_steps=num_steps, device=device,
        train_expert_only=train_expert_only, **robot_features(cameras, image_size, state_dim, action_dim))
    return build_lerobot(LeRobotSmolVLA, cfg, seed, device, dataset_stats)


def load_smolvla(path: str | Path, device: str = "cpu"):
    """A SmolVLA directory written by lerobot or by `SmolVLAPolicy.save`: (lerobot policy,
    pre-processor, post-processor) on `device`. A tiny model's SmolVLM folder (`vlm/`) comes along."""
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy as LeRobotSmolVLA

    vlm = Path(path) / VLM_DIR
    if not vlm.is_dir():
        return load_lerobot(path, device, LeRobotSmolVLA)

    def use_local_vlm(cfg) -> None:  # a tiny model carries its VLM folder along
        cfg.vlm_model_name = str(vlm)

    return load_lerobot(path, device, LeRobotSmolVLA, adjust=use_local_vlm,
                        preprocessor_overrides={"tokenizer_processor": {"tokenizer_name": str(vlm)}})


# ----------------------------------------------------------------------------- gradient checkpointing


class _LayerCache:
    """The view of lerobot's KV cache (`DynamicCache`) that its per-layer attention functions use
    (`update(k, v, layer_idx)` appends, `layers[i].keys/values` reads), for one layer and built from
    the tensors it held before the layer ran. It keeps nothing across calls, so a checkpointed
    layer's recompute sees the cache as the forward did; the layer's new K/V are left in `new` for
    the caller to write into the real cache, outside the checkpoint."""

    def __init__(self, layer_idx: int, keys: torch.Tensor | None, values: torch.Tensor | None, truthy: bool):
        self.layers = {layer_idx: types.SimpleNamespace(keys=keys, values=values)}
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None
        self._truthy = truthy  # lerobot's cross-attention layers test `not past_key_values`

    def __bool__(self) -> bool:
        return self._truthy

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.new = (keys, values)
        past = self.layers[layer_idx]
        if past.keys is None:
            return keys, values
        return torch.cat([past.keys, keys], dim=-2), torch.cat([past.values, values], dim=-2)


def _joint_layer(vwe, model_layers, layer_idx: int, self_attn: bool, inputs_embeds: list, position_ids,
                 attention_mask, batch_size: int, head_dim: int, use_cache, has_cache: bool, truthy: bool,
                 past_keys, past_values):
    """One layer of `SmolVLMWithExpertModel.forward` (VLM and expert streams together): the joint
    attention through lerobot's own `forward_attn_layer` / `forward_cross_attn_layer` against a
    `_LayerCache`, then each stream's o_proj, residual and MLP as lerobot's loop writes them.
    Returns (the streams' outputs, the new (k, v) to append to the cache, or (None, None))."""
    cache = _LayerCache(layer_idx, past_keys, past_values, truthy) if has_cache else None
    attend = vwe.forward_attn_layer if self_attn else vwe.forward_cross_attn_layer
    att_outputs, _ = attend(model_layers, inputs_embeds, layer_idx, position_ids, attention_mask, batch_size,
                            head_dim, use_cache=use_cache, past_key_values=cache)
    outputs_embeds, start = [], 0
    for i, hidden_states in enumerate(inputs_embeds):
        layer = model_layers[i][layer_idx]
        att_output = att_outputs[i] if i < len(att_outputs) else att_outputs[0]  # in case of self_attn
        if hidden_states is None:
            outputs_embeds.append(None)
            continue
        if layer is None:
            outputs_embeds.append(hidden_states)
            continue
        end = start + hidden_states.shape[1]
        if att_output.dtype != layer.self_attn.o_proj.weight.dtype:
            att_output = att_output.to(layer.self_attn.o_proj.weight.dtype)
        out_emb = layer.self_attn.o_proj(att_output[:, start:end])
        out_emb += hidden_states
        after_first_residual = out_emb.clone()
        out_emb = layer.mlp(layer.post_attention_layernorm(out_emb))
        out_emb += after_first_residual
        outputs_embeds.append(out_emb)
        start = end if len(att_outputs) == 1 else 0
    new = cache.new if cache is not None and cache.new is not None else (None, None)
    return outputs_embeds, new


def _checkpointed_forward(vwe, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                          use_cache=None):
    """`SmolVLMWithExpertModel.forward` with every joint layer under `torch.utils.checkpoint`
    (non-reentrant) when gradients are on; lerobot's own forward otherwise (sampling). The KV cache
    is read before and written after each checkpointed layer, so recomputing a layer in the
    backward neither sees a later cache state nor appends to it again."""
    if not torch.is_grad_enabled():
        return type(vwe).forward(vwe, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
    from torch.utils import checkpoint as ckpt
    from transformers import DynamicCache

    models = [vwe.get_vlm_model().text_model, vwe.lm_expert]
    model_layers = vwe.get_model_layers(models)
    batch_size = [h for h in inputs_embeds if h is not None][-1].shape[0]
    fill_kv_cache = use_cache and past_key_values is None
    if fill_kv_cache:
        past_key_values = DynamicCache()
    head_dim = vwe.vlm.config.text_config.head_dim
    for layer_idx in range(vwe.num_vlm_layers):
        self_attn = bool(fill_kv_cache or "cross" not in vwe.attention_mode
                         or (vwe.self_attn_every_n_layers > 0 and layer_idx % vwe.self_attn_every_n_layers == 0))
        past_keys = past_values = None
        has_cache = past_key_values is not None
        if has_cache and layer_idx < len(past_key_values.layers):
            held = past_key_values.layers[layer_idx]
            if getattr(held, "is_initialized", True) and held.keys is not None:
                past_keys, past_values = held.keys, held.values
        inputs_embeds, (k, v) = ckpt.checkpoint(
            _joint_layer, vwe, model_layers, layer_idx, self_attn, inputs_embeds, position_ids, attention_mask,
            batch_size, head_dim, use_cache, has_cache, bool(past_key_values) if has_cache else False,
            past_keys, past_values, use_reentrant=False)
        if k is not None:
            past_key_values.update(k, v, layer_idx)
    outputs_embeds = [None if h is None else models[i].norm(h) for i, h in enumerate(inputs_embeds)]
    return outputs_embeds, past_key_values


def enable_smolvla_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute, in the backward, every joint VLM/expert layer of a lerobot SmolVLA (its own layer
    loop, `_checkpointed_forward`) and every layer of its vision encoder (Hugging Face's switch,
    which acts while that encoder trains: `freeze_vision_encoder: false`). Only under gradients:
    sampling (no_grad / inference_mode) runs lerobot's forward unchanged. The switch is the
    instance's `forward`, which `copy.deepcopy` (the KL reference) carries to the copy."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    vwe = model.model.vlm_with_expert
    vwe.forward = types.MethodType(_checkpointed_forward, vwe)
    for module in vwe.get_vlm_model().vision_model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.gradient_checkpointing = True
            module._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)


# ----------------------------------------------------------------------------- the adapter


class SmolVLAPolicy(LeRobotChunkPolicy):
    """`model` is the lerobot SmolVLAPolicy (the trainable module); `config` the `model.params`
    (`SmolVLAConfig`: `eta` is the SDE noise level), keywords given as `params` override its fields."""

    CONFIG = SmolVLAConfig
    CONFIG_NAME = SMOLVLA_CONFIG_NAME
    GRADIENT_CHECKPOINTING = True  # lerobot's joint VLM/expert layer loop, checkpointed per layer

    def __init__(self, model: nn.Module, preprocessor, postprocessor, config: SmolVLAConfig | None = None, *,
                 env_factory: Callable[[list[dict]], Any] | None = None, **params):
        c = self.config = resolve_config(SmolVLAConfig, config, params)
        cfg = model.config
        self.model, self.preprocessor, self.postprocessor = model, preprocessor, postprocessor
        self.eta = c.eta
        self.num_steps = int(c.num_steps or cfg.num_steps)
        self.n_action_steps = int(c.n_action_steps or cfg.n_action_steps)
        if not 1 <= self.n_action_steps <= cfg.chunk_size:
            raise ValueError(f"n_action_steps must be in [1, chunk_size={cfg.chunk_size}], got {self.n_action_steps}")
        feature_cams = [k[len("observation.images."):] for k in cfg.image_features]
        self.cameras = c.cameras or feature_cams
        missing = [cam for cam in self.cameras if cam not in feature_cams]
        if missing:
            raise ValueError(f"camera(s) {missing} are not image features of this SmolVLA ({feature_cams})")
        self.max_chunks = c.max_chunks
        self.env_factory = env_factory
        self.batched_recompute = c.batched_recompute
        self.timesteps = flow_timesteps(self.num_steps)
        self.reference = None

    def enable_gradient_checkpointing(self) -> None:
        """train.gradient_checkpointing: `enable_smolvla_gradient_checkpointing` (same values and
        gradients; the prefix and every denoising step recompute their layers in the backward)."""
        enable_smolvla_gradient_checkpointing(self.model)

    @property
    def chunk_shape(self) -> tuple[int, int]:
        return self.model.config.chunk_size, self.model.config.max_action_dim

    @property
    def action_dim(self) -> int:
        return self.model.config.action_feature.shape[0]

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg, task, device="cpu") -> SmolVLAPolicy:
        """`model.source: tiny` builds a tiny SmolVLA offline in `<train.output_dir>/tiny_smolvla`
        (sizes in `model.params`); `pretrained` loads `model.path` saved by `save` (whose settings
        the params override) or by lerobot."""
        m, params = cfg.model, dict(cfg.model.params)
        cls.check_params(params)
        saved = read_saved_config(m.path, SMOLVLA_CONFIG_NAME) if m.source == "pretrained" else {}
        c = SmolVLAConfig(**{**saved, **params})  # validated once, before a model is built
        env_factory = task_env_factory(task)
        dev = str(torch.device(device))
        if m.source == "pretrained":
            model, pre, post = load_smolvla(m.path, dev)
            return cls(model, pre, post, c, env_factory=env_factory)
        cams = c.cameras or ["front"]
        model, pre, post = build_tiny_smolvla(
            Path(cfg.train.output_dir) / "tiny_smolvla", instruction_corpus(task), cameras=cams,
            num_steps=10 if c.num_steps is None else c.num_steps, n_action_steps=c.n_action_steps,
            seed=cfg.train.seed, device=dev, chunk_size=c.chunk_size, state_dim=c.state_dim, action_dim=c.action_dim,
            image_size=c.image_size, train_expert_only=c.train_expert_only, dataset_stats=c.dataset_stats)
        return cls(model, pre, post, c, env_factory=env_factory, cameras=cams)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", **kwargs) -> SmolVLAPolicy:
        model, pre, post = load_smolvla(path, device)
        return cls(model, pre, post, **{**read_saved_config(path, SMOLVLA_CONFIG_NAME), **kwargs})

    def saved_settings(self) -> dict[str, Any]:
        return {"eta": self.eta, "num_steps": self.num_steps, "n_action_steps": self.n_action_steps,
                "cameras": self.cameras}

    def save(self, directory: str | Path) -> None:
        super().save(directory)
        vlm, directory = Path(self.model.config.vlm_model_name), Path(directory)
        if vlm.is_dir() and vlm.resolve() != (directory / VLM_DIR).resolve():
            shutil.copytree(vlm, directory / VLM_DIR, dirs_exist_ok=True)

    # ------------------------------------------------------------------ the prefix and the velocity

    def _batch(self, images: np.ndarray, states: np.ndarray, instructions: Sequence[str],
               actions: torch.Tensor | None = None) -> dict[str, Any]:
        """uint8 images [B, C, H, W, 3] (C = self.cameras), states [B, D] (and expert actions for SFT)
        -> the lerobot batch, pre-processed (instruction tokenised, state and actions normalised)."""
        img = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 1, 4, 2, 3).float() / 255.0
        batch: dict[str, Any] = {f"observation.images.{c}": img[:, i] for i, c in enumerate(self.cameras)}
        batch["observation.state"] = torch.as_tensor(np.asarray(states), dtype=torch.float32)
        batch["task"] = [str(s) for s in instructions]
        if actions is not None:
            batch["action"] = actions
        return self.preprocessor(batch)

    def _prefix(self, model: nn.Module, batch: dict[str, Any]):
        """Embed images + language + state and fill the KV cache: (prefix pad mask, cache)."""
        from lerobot.policies.common.vla_utils import make_att_2d_masks

        flow = model.model
        images, img_masks = model.prepare_images(batch)
        state = model.prepare_state(batch)
        embs, pad, att = flow.embed_prefix(images, img_masks, batch["observation.language.tokens"],
                                           batch["observation.language.attention_mask"], state=state)
        _, cache = flow.vlm_with_expert.forward(attention_mask=make_att_2d_masks(pad, att),
                                                position_ids=torch.cumsum(pad, dim=1) - 1, past_key_values=None,
                                                inputs_embeds=[embs, None], use_cache=True)
        return pad, cache

    @staticmethod
    def _velocity(model: nn.Module, pad: torch.Tensor, cache) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda x, t: model.model.denoise_step(prefix_pad_masks=pad, past_key_values=cache, x_t=x, timestep=t)

    def _sample_chunks(self, batch: dict[str, Any], generator: torch.Generator | None, stochastic: bool,
                       noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """States [B, K+1, chunk, A_max] and per-step log-probs [B, K] (zeros for the ODE)."""
        pad, cache = self._prefix(self.model, batch)
        v_fn = self._velocity(self.model, pad, cache)
        B = pad.shape[0]
        x = noise if noise is not None else torch.randn(B, *self.chunk_shape, generator=generator, device=self.device)
        ts = self.timesteps.to(self.device)
        states, logps = [x], []
        for k in range(self.num_steps):
            t, dt = float(ts[k]), float(ts[k + 1] - ts[k])
            v = v_fn(x, ts[k].expand(B))
            if stochastic:
                x, mean, std = sde_step(x, v, t, dt, self.eta, generator=generator)
                logps.append(gaussian_logprob(x, mean, std))
            else:
                x = ode_step(x, v, dt)
                logps.append(torch.zeros(B, device=x.device))
            states.append(x)
        return torch.stack(states, 1), torch.stack(logps, 1)

    def _actions(self, x0: torch.Tensor) -> torch.Tensor:
        """Model-space chunk [B, chunk, A_max] -> env actions [B, n_action_steps, A] (unnormalised)."""
        return self.postprocessor(x0[:, :self.n_action_steps, :self.action_dim]).float()

    def _act_arrays(self, images, states, instructions, generator, temperature) -> dict[str, torch.Tensor]:
        # inference mode costs less per op than no_grad; the outputs are cloned out of it
        with eval_mode(self.model), torch.inference_mode(), self._full_precision():
            states_t, logp = self._sample_chunks(self._batch(images, states, instructions), generator,
                                                 stochastic=temperature != 0.0)
        states_t, logp = states_t.clone(), logp.clone()
        return {"actions": self._actions(states_t[:, -1]), "states": states_t, "logp": logp}

    # ------------------------------------------------------------------ teacher forcing

    def _full_precision(self):
        """Autocast off: a step's log-prob averages ~chunk*A terms scaled by 1/std, so bf16 velocities
        that differ between the sampler's and the trainer's batch shapes would break the
        sampled-equals-recomputed invariant. The expert is small; it runs in the weights' dtype."""
        return torch.autocast(self.device.type, enabled=False)

    def _unit_steps(self, model: nn.Module, rollout: Rollout, window: slice | None = None,
                    ref_means: torch.Tensor | None = None, with_means: bool = False) -> UnitSteps:
        with self._full_precision():
            return super()._unit_steps(model, rollout, window, ref_means, with_means)

    def _chain_steps(self, model: nn.Module, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Step means and stds of the chains given each row's prefix (images, state, instruction)."""
        images, obs_states, instructions, states = inputs
        pad, cache = self._prefix(model, self._batch(images, obs_states, instructions))
        M, K = states.shape[0], self.num_steps
        ts = self.timesteps.to(states.device)
        if self.batched_recompute:  # one denoise_step over all M*K transitions (sample-major rows)
            cache.batch_repeat_interleave(K)
            v_fn = self._velocity(model, pad.repeat_interleave(K, 0), cache)
            x = states[:, :-1].reshape(M * K, *states.shape[2:])
            t, dt = ts[:-1].repeat(M), (ts[1:] - ts[:-1]).repeat(M)
            _, mean, std = sde_step(x, v_fn(x, t), t, dt, self.eta, noise=torch.zeros_like(x))
            return mean, std
        v_fn = self._velocity(model, pad, cache)
        means, stds = [], []
        for k in range(K):
            x, t, dt = states[:, k], ts[k].expand(M), (ts[k + 1] - ts[k]).expand(M)  # per-row times: std [M, 1, ...]
            _, mean, std = sde_step(x, v_fn(x, t), t, dt, self.eta, noise=torch.zeros_like(x))
            means.append(mean)
            stds.append(std)
        return torch.stack(means, 1).flatten(0, 1), torch.stack(stds, 1).flatten(0, 1)  # sample-major, as batched

    # ------------------------------------------------------------------ SFT

    def sft_loss(self, contexts: list[dict]) -> torch.Tensor:
        """lerobot's flow-matching loss on expert chunks. Contexts hold images, "state" (or
        "observation.state"), the instruction (default "") and the expert chunk [chunk, A]
        (`parse_sft_context` lists the keys)."""
        ex = [parse_sft_context(c, i, self.cameras, self.action_dim, self.model.config.chunk_size,
                                default_instruction="", need_state=True) for i, c in enumerate(contexts)]
        batch = self._batch(np.stack([np.stack(e.images) for e in ex]), np.stack([e.state for e in ex]),
                            [e.instruction for e in ex], actions=torch.stack([e.actions for e in ex]))
        batch["action_is_pad"] = ~torch.stack([e.valid for e in ex]).to(self.device)
        loss, _ = self.model.forward(batch)
        return loss
