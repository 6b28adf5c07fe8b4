"""An action-token VLA (OpenVLA / OpenVLA-OFT style) on a Qwen-VL backbone, trained with
trajectory-level GRPO (SimpleVLA-RL, SRPO).

Actions: each of the A dims is cut into `n_bins` (256) uniform bins over [low, high] (per dim, e.g.
dataset statistics) and each bin is one reserved token id, so an action chunk of K steps is K*A
tokens decoded autoregressively. The reserved ids are either added special tokens `<act_0>` ...
(`action_tokens="special"`, what the tiny models use) or the last `n_bins` rows of the output
embedding (`"vocab_tail"`, OpenVLA's choice; on Qwen checkpoints these are padded rows no text
token uses). Sampling and training both take the softmax over the action ids only (logits / T), so
the sampler's log-probs are exactly the teacher-forced ones. A sampled token maps back to its bin
centre.

Trajectory-level GRPO: `sample(contexts, G)` runs whole episodes. A context is a task initial state:

    {"task": "push", "init_state_id": 3, ...}                 (MuJoCo tabletop, mmrl.envs.tabletop)
    {"suite": "libero_spatial", "task_id": 0, "init_state_id": 3}                  (LIBERO)

optionally with "seed". G copies of each go into a vector env (mmrl.envs.vector), and the loop
observation -> `act` -> `step_chunk` runs until every env is done or `max_chunks` is hit. The
Rollout's units are all action tokens of a trajectory ([N, chunks*K*A]); the mask covers the
chunks that were executed (tokens of sub-steps after the episode ended inside a chunk are
masked); `extras["obs_images"]` keeps, per trajectory, the uint8 camera images at every decision
step plus the final one ([chunks+1, cameras, H, W, 3]), from which `logprobs` re-encodes each
chunk's prompt and recomputes every chunk's token log-probs in one batched forward. `decode` gives
{"success", "frames" (first camera), "length" (env steps), "instruction"} per trajectory, what the
`success` and `srpo_progress` rewards read.

SFT contexts (`sft_loss`) hold the observation images, the language task and the expert chunk
[K, A], read by `mmrl.policies.vla.processor.parse_sft_context` (the keys are listed there). The
bins, the `<act_i>` tokens and the context parsing live in `processor`, the typed `model.params`
(`ActionTokenVLAConfig`) in `configuration`.

Vision (`vision`): the backbone's own Qwen-VL tower, or `conv_keypoints`: a small conv net ending in
spatial soft-argmax keypoints (one LM token per keypoint, `vla.conv_keypoints`) in its place, with
DrQ random shifts in `sft_loss` only: rollouts and their teacher-forced recompute see unshifted images.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmrl.episodes import episode_slices, run_episodes, task_env_factory
from mmrl.policies.base import apply_lora, checkpoint_dir, eval_mode
from mmrl.policies.fast_decode import causal_body
from mmrl.policies.qwen_vl import (
    QwenVLPolicy,
    VLStepper,
    rope_owner,
    rope_positions,
    vision_inputs,
)
from mmrl.policies.vla.configuration import (
    ACTION_VLA_CONFIG_NAME,
    ACTION_VLA_PARAMS,
    ActionTokenVLAConfig,
    read_saved_config,
    resolve_config,
)
from mmrl.policies.vla.conv_keypoints import (
    conv_encoder,
    image_token_count,
    install_conv_keypoints,
    load_conv_keypoints,
)
from mmrl.policies.vla.processor import (
    ActionBins,
    acted_chunks,
    action_token_names,
    add_action_tokens,
    decode_episodes,
    instruction_corpus,
    observation_images,
    parse_sft_context,
)
from mmrl.rollout import Rollout, head_logprobs


@dataclass
class ActOutput:
    actions: torch.Tensor  # float [B, K, A], bin centres
    tokens: torch.Tensor  # long [B, K*A], absolute token ids
    logp: torch.Tensor  # float [B, K*A], log-probs under softmax over the action ids of logits / T


# ----------------------------------------------------------------------------- the policy


class ActionTokenVLAPolicy(QwenVLPolicy):
    """`config` holds the `model.params` (`ActionTokenVLAConfig`); keywords given as `params`
    override its fields (or build it alone)."""

    can_mask_images = True  # on the camera frames its rollouts keep per chunk (`mask_images`)
    TOKEN_BUDGET = False  # a row is an episode of per-chunk observations, not one prompt + reply

    CONFIG = ActionTokenVLAConfig

    def __init__(self, model: nn.Module, processor, config: ActionTokenVLAConfig | None = None, *,
                 temperature: float = 1.0, env_factory: Callable[[list[dict]], Any] | None = None, **params):
        c = resolve_config(ActionTokenVLAConfig, config, params)
        c = self.config = self._check_vision(model, c)
        super().__init__(model, processor, temperature=temperature, max_new_tokens=c.chunk_size * c.action_dim,
                         system_prompt=c.system_prompt, min_image_tokens=c.min_image_tokens,
                         max_image_tokens=c.max_image_tokens)
        self.action_dim, self.chunk_size, self.n_bins = c.action_dim, c.chunk_size, c.n_bins
        self.bins = ActionBins(c.action_low, c.action_high, c.n_bins, c.action_dim)
        self.action_tokens = c.action_tokens
        self.token_start = self._action_token_start()
        self.cameras = c.cameras
        self.prompt_template = c.prompt_template
        self.max_chunks = c.max_chunks
        self.env_factory = env_factory

    @staticmethod
    def _check_vision(model: nn.Module, c: ActionTokenVLAConfig) -> ActionTokenVLAConfig:
        """`c.vision` must name the model's tower; a conv tower's keypoint count goes into `c` (what
        `save` writes)."""
        enc = conv_encoder(model)
        if (enc is not None) != (c.vision == "conv_keypoints"):
            has = "a conv_keypoints" if enc is not None else "its Qwen-VL"
            raise ValueError(f"vision is {c.vision!r} but the model has {has} vision tower; build it with "
                             "from_config / from_pretrained, or install_conv_keypoints(model, n_keypoints) first")
        if enc is None:
            return c
        if c.film != (enc.film is not None):
            raise ValueError(f"film is {c.film} but the model's conv tower was built "
                             f"{'with' if enc.film is not None else 'without'} FiLM")
        if c.n_keypoints not in (None, enc.n_keypoints):
            raise ValueError(f"n_keypoints is {c.n_keypoints} but the model's conv tower has {enc.n_keypoints}")
        return dataclasses.replace(c, n_keypoints=enc.n_keypoints)

    def _action_token_start(self) -> int:
        n_rows = self.model.get_output_embeddings().weight.shape[0]
        if self.action_tokens == "vocab_tail":
            if n_rows < self.n_bins:
                raise ValueError(f"vocab_tail needs >= {self.n_bins} vocabulary rows, the model has {n_rows}")
            return n_rows - self.n_bins
        vocab = self.tokenizer.get_vocab()
        names = action_token_names(self.n_bins)
        missing = [t for t in names if t not in vocab]
        if missing:
            raise ValueError(f"the tokenizer lacks {len(missing)} action tokens (e.g. {missing[0]}); call "
                             "add_action_tokens(tokenizer) and resize the model's embeddings, or use "
                             "action_tokens='vocab_tail'")
        ids = [vocab[t] for t in names]
        if ids != list(range(ids[0], ids[0] + self.n_bins)) or ids[-1] >= n_rows:
            raise ValueError(f"action tokens must have contiguous ids inside the model's {n_rows} rows; "
                             f"got {ids[0]}..{ids[-1]}")
        return ids[0]

    @property
    def tokens_per_chunk(self) -> int:
        return self.chunk_size * self.action_dim

    def tokens_to_actions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Absolute token ids [B, K*A] -> continuous actions [B, K, A] (bin centres)."""
        bins = (tokens - self.token_start).view(tokens.shape[0], self.chunk_size, self.action_dim)
        return self.bins.to_actions(bins)

    def actions_to_tokens(self, actions: torch.Tensor) -> torch.Tensor:
        """Continuous [B, K, A] -> absolute token ids [B, K*A]."""
        return (self.bins.to_bins(actions) + self.token_start).flatten(1)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg, task, device="cpu") -> ActionTokenVLAPolicy:
        """`model.source: tiny` builds a tiny Qwen-VL (`model.params.arch`, sizes in `model.tiny`) with
        a local tokenizer plus `<act_i>` tokens; `pretrained` loads `model.path` (a directory saved by
        `save`, whose settings the params override, or a plain Qwen-VL checkpoint with
        `action_tokens: vocab_tail`). Episodes run in the task's env (`task_env_factory`)."""
        m, params = cfg.model, dict(cfg.model.params)
        cls.check_params(params)
        saved = read_saved_config(m.path, ACTION_VLA_CONFIG_NAME) if m.source == "pretrained" else {}
        c = ActionTokenVLAConfig(**{**saved, **params})  # validated once, before a model is built
        dtype = getattr(torch, m.dtype)
        if m.source == "pretrained":
            model, processor = cls._load_model(m.path, dtype, c, saved)
        else:
            from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer

            corpus = instruction_corpus(task, c.prompt_template)
            tokenizer = add_action_tokens(build_tokenizer(corpus, vocab_size=m.tokenizer_vocab_size), c.n_bins)
            min_tokens = 4 if c.min_image_tokens is None else c.min_image_tokens
            max_tokens = 16 if c.max_image_tokens is None else c.max_image_tokens
            processor = build_qwen_vl_processor(tokenizer, c.arch, min_tokens, max_tokens)
            model = build_tiny_qwen_vl(tokenizer, c.arch, seed=cfg.train.seed, **m.tiny).to(dtype)
        if c.vision == "conv_keypoints" and conv_encoder(model) is None:  # a fresh conv tower
            n_keypoints = c.n_keypoints or _camera_token_count(task, c, processor)
            install_conv_keypoints(model, n_keypoints, augment_pad=c.shift_pad, seed=cfg.train.seed,
                                   aux_dim=_aux_dim(c), film=c.film)
        if c.freeze_vision:
            rope_owner(model).visual.requires_grad_(False)
        model = apply_lora(model, m).to(device)
        env_factory = task_env_factory(task)
        return cls(model, processor, c, temperature=cfg.sampling.temperature, env_factory=env_factory)

    @classmethod
    def _load_model(cls, path: str | Path, dtype: torch.dtype, c: ActionTokenVLAConfig, saved: dict[str, Any]):
        """(model, processor) of a checkpoint directory. One that `save` wrote with a conv tower has
        no ViT weights: the model is built with a fresh ViT, which the conv tower then replaces
        before its own weights are loaded."""
        if saved.get("vision") != "conv_keypoints":
            return cls.load_pretrained(path, dtype)
        if c.vision != "conv_keypoints":
            raise ValueError(f"{path} holds a conv_keypoints vision tower; vision {c.vision!r} cannot load it")
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report would list every ViT weight as missing
        try:
            model, processor = cls.load_pretrained(path, dtype)
        finally:
            hf_logging.set_verbosity(level)
        # The saved head's shape decides whether it is rebuilt (its weights are in the checkpoint).
        aux_dim = _aux_dim(ActionTokenVLAConfig(**{k: v for k, v in saved.items() if k in ACTION_VLA_PARAMS}))
        install_conv_keypoints(model, c.n_keypoints or saved["n_keypoints"], augment_pad=c.shift_pad,
                               aux_dim=aux_dim, film=bool(saved.get("film", False)))
        load_conv_keypoints(model, checkpoint_dir(path))
        return model, processor

    @classmethod
    def from_pretrained(cls, path: str | Path, device="cpu", dtype: torch.dtype = torch.float32,
                        **kwargs) -> ActionTokenVLAPolicy:
        """A directory `save` wrote (its settings, overridden by `kwargs`), or a plain Qwen-VL checkpoint."""
        saved = read_saved_config(path, ACTION_VLA_CONFIG_NAME)
        merged = {**saved, **kwargs}
        c = ActionTokenVLAConfig(**{k: v for k, v in merged.items() if k in ACTION_VLA_PARAMS})
        model, processor = cls._load_model(path, dtype, c, saved)
        if c.vision == "conv_keypoints" and conv_encoder(model) is None:
            if c.n_keypoints is None:
                raise ValueError("a plain checkpoint with vision: conv_keypoints needs n_keypoints (the camera "
                                 "image's token count)")
            install_conv_keypoints(model, c.n_keypoints, augment_pad=c.shift_pad, aux_dim=_aux_dim(c), film=c.film)
        return cls(model.to(device), processor, c, **{k: v for k, v in kwargs.items() if k not in ACTION_VLA_PARAMS})

    def save(self, directory: str | Path) -> None:
        super().save(directory)
        cfg = {"action_dim": self.action_dim, "chunk_size": self.chunk_size, "n_bins": self.n_bins,
               "action_low": self.bins.low.tolist(), "action_high": self.bins.high.tolist(),
               "action_tokens": self.action_tokens, "cameras": self.cameras, "prompt_template": self.prompt_template,
               "vision": self.config.vision}
        if self.config.vision == "conv_keypoints":  # what loading needs to rebuild the tower before its weights
            cfg.update(n_keypoints=self.config.n_keypoints, shift_pad=self.config.shift_pad,
                       aux_action_loss=self.config.aux_action_loss, film=self.config.film)
        (Path(directory) / ACTION_VLA_CONFIG_NAME).write_text(json.dumps(cfg, indent=2))

    # ------------------------------------------------------------------ observations -> prompts

    def _prompt(self, instruction: str) -> str:
        return self.prompt_template.format(instruction=instruction)

    def _vl_contexts(self, images: list[list[np.ndarray]], instructions: Sequence[str]) -> list[dict]:
        return [{"frame": list(imgs), "prompt": self._prompt(str(ins))} for imgs, ins in zip(images, instructions)]

    # ------------------------------------------------------------------ acting

    @torch.no_grad()
    def act(self, observations: dict | Any, instructions: Sequence[str], generator: torch.Generator | None = None,
            temperature: float | None = None) -> ActOutput:
        """One action chunk per row. `observations` holds "images" {camera: uint8 [B, H, W, 3]} (a
        dict, or an object with an `images` attribute such as the vector env's ObsBatch)."""
        arr = observation_images(observations, self.cameras)
        if len(arr) != len(instructions):
            raise ValueError(f"{len(arr)} observations but {len(instructions)} instructions")
        return self._act_images(arr, instructions, generator, temperature)

    def _act_images(self, images: np.ndarray, instructions: Sequence[str], generator, temperature) -> ActOutput:
        temperature = self.temperature if temperature is None else temperature
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        enc = self.encode(self._vl_contexts(list(images), instructions))
        stepper = VLStepper(self.model, enc["mm_token_type_ids"], vision_inputs(enc["pixel_values"],
                                                                                enc["image_grid_thw"]), 1)
        # Inference mode costs less per op than no_grad; the outputs are cloned out of it below.
        with eval_mode(self.model), torch.inference_mode(), self._instruction_film(enc):
            tokens_t, logp_t = self._decode_chunk(stepper, enc, temperature, generator)
        tokens_t, logp_t = tokens_t.clone(), logp_t.clone()
        return ActOutput(actions=self.tokens_to_actions(tokens_t), tokens=tokens_t, logp=logp_t)

    def _decode_chunk(self, stepper: VLStepper, enc: dict[str, Any], temperature: float,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K*A action tokens with a KV cache, drawn from softmax(logits / T) over the action ids only."""
        lo, L = self.token_start, self.tokens_per_chunk
        logits = stepper.prefill(enc["prompt_ids"], enc["prompt_mask"])
        tokens, logps = [], []
        for j in range(L):
            z = logits[:, lo:lo + self.n_bins]
            if temperature == 0:
                drawn = z.argmax(-1)
                logp_all = z.log_softmax(-1)
            else:
                logp_all = (z / temperature).log_softmax(-1) if temperature != 1.0 else z.log_softmax(-1)
                # NaN logits (diverged weights) would stop multinomial with an error that names nothing
                # (a device assert on CUDA): the draw stays valid, its NaN log-prob is what the collector checks.
                drawn = torch.multinomial(logp_all.exp().nan_to_num(1.0), 1, generator=generator).squeeze(-1)
            tokens.append(drawn + lo)
            logps.append(logp_all.gather(-1, drawn[:, None]).squeeze(-1))
            if j < L - 1:
                logits = stepper.step(tokens[-1])
        return torch.stack(tokens, 1), torch.stack(logps, 1)

    def _instruction_film(self, enc: dict[str, Any], model: nn.Module | None = None):
        """The conv tower's FiLM conditioning for `enc`'s images, when the tower has FiLM: each row's
        mean input embedding over its prompt's text tokens (the image placeholders and padding left
        out), repeated for the row's images (cameras)."""
        model = model or self.model
        conv = conv_encoder(model)
        if conv is None or conv.film is None:
            return nullcontext()
        ids = enc["prompt_ids"]
        text = (enc["prompt_mask"].bool() & (enc["mm_token_type_ids"] == 0)).unsqueeze(-1)
        emb = model.get_input_embeddings()(ids)
        cond = (emb * text).sum(1) / text.sum(1).clamp_min(1)
        per_row = torch.tensor([len(g) for g in enc["image_grid_thw"]], device=cond.device)
        return conv.conditioned(cond.repeat_interleave(per_row, 0))

    # ------------------------------------------------------------------ teacher forcing

    def _chunk_logprobs(self, model: nn.Module, enc: dict[str, Any], tokens: torch.Tensor, with_entropy: bool,
                        temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [M, K*A] of action chunks `tokens` after the encoded prompts, over the action ids."""
        L = tokens.shape[1]
        ids = torch.cat([enc["prompt_ids"], tokens], 1)
        attn = torch.cat([enc["prompt_mask"], torch.ones_like(tokens)], 1)
        mm = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(tokens)], 1)
        vision = vision_inputs(enc["pixel_values"], enc["image_grid_thw"])
        pos = rope_positions(model, ids, attn, mm, vision.get("image_grid_thw"))
        with self._instruction_film(enc, model):
            hidden = causal_body(model)(input_ids=ids, attention_mask=attn, position_ids=pos, mm_token_type_ids=mm,
                                        use_cache=False, **vision).last_hidden_state[:, -(L + 1):-1]
        t = self.temperature if temperature is None else temperature
        # The head's rows of the action ids only: the distribution is over the action bins.
        head, bins = model.get_output_embeddings(), slice(self.token_start, self.token_start + self.n_bins)
        return head_logprobs(hidden, head.weight[bins], tokens - self.token_start,
                             bias=None if head.bias is None else head.bias[bins],
                             temperature=t if t not in (0.0, 1.0) else 1.0,  # greedy rollouts are scored at 1
                             with_entropy=with_entropy, chunk=self.logprob_chunk)

    def logprobs_of(self, observations: dict | Any, instructions: Sequence[str], tokens: torch.Tensor,
                    with_entropy: bool = False, model: nn.Module | None = None):
        """Teacher-forced log-probs [B, K*A] of action tokens for one observation per row."""
        arr = observation_images(observations, self.cameras)
        enc = self.encode(self._vl_contexts(list(arr), instructions))
        return self._chunk_logprobs(model or self.model, enc, tokens.to(self.device), with_entropy)

    def _rollout_logprobs(self, model: nn.Module, rollout: Rollout, with_entropy: bool, window: slice | None = None):
        """[N, T] log-probs of `rollout.units[:, window]`: one forward per episode chunk that the
        window touches (a window of whole chunks costs nothing extra)."""
        N, L = len(rollout), self.tokens_per_chunk
        S = rollout.units.shape[1] // L
        rows, steps, start, stop = acted_chunks(rollout.mask, L, window)
        chunks = rollout.units.view(N, S, L)
        out = torch.zeros(N, S, L, device=self.device)
        ent_out = torch.zeros(N, S, L, device=self.device) if with_entropy else None
        if len(rows):
            obs = rollout.extras["obs_images"]
            imgs = [obs[n][s].cpu().numpy() for n, s in zip(rows.tolist(), steps.tolist())]
            instr = [rollout.contexts[n]["instruction"] for n in rows.tolist()]
            enc = self.encode(self._vl_contexts(imgs, instr))
            logp, ent = self._chunk_logprobs(model, enc, chunks[rows, steps], with_entropy)
            out = out.index_put((rows, steps), logp)
            if with_entropy:
                ent_out = ent_out.index_put((rows, steps), ent)
        # Unexecuted sub-steps of a final chunk were scored with it; report 0 there, like unacted chunks.
        m = rollout.mask[:, start:stop]
        out = torch.where(m, out.view(N, S * L)[:, start:stop], 0.0)
        return out, None if ent_out is None else torch.where(m, ent_out.view(N, S * L)[:, start:stop], 0.0)

    def logprobs(self, rollout: Rollout, with_entropy: bool = False, units: slice | None = None):
        return self._rollout_logprobs(self.model, rollout, with_entropy, window=units)

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        with self.reference_module() as ref:
            return self._rollout_logprobs(ref, rollout, False)[0]

    # ------------------------------------------------------------------ episodes

    @torch.no_grad()
    def sample(self, contexts: list[dict], group_size: int, generator: torch.Generator | None = None,
               temperature: float | None = None) -> Rollout:
        """Whole episodes, G per context, at most the env factory's `max_envs` at a time."""
        return Rollout.concat([self._sample_episodes(part, group_size, generator, temperature)
                               for part in episode_slices(contexts, group_size, self.env_factory)])

    def _sample_episodes(self, contexts: list[dict], group_size: int, generator: torch.Generator | None,
                         temperature: float | None) -> Rollout:
        G = group_size
        K, A, L = self.chunk_size, self.action_dim, self.tokens_per_chunk

        def act(images: np.ndarray, states: np.ndarray, instructions: list[str]):
            out = self._act_images(images, instructions, generator, temperature)
            return out.actions, out

        ep = run_episodes(self.env_factory, [dict(c) for c in contexts for _ in range(G)], act, self.max_chunks,
                          self.cameras)
        N, S, dev = len(ep.rows), len(ep.steps), self.device
        tokens = torch.full((N, S, L), self.token_start, dtype=torch.long, device=dev)
        logp = torch.zeros(N, S, L, device=dev)
        mask = torch.zeros(N, S, L, dtype=torch.bool, device=dev)
        for s, (idx, out, executed) in enumerate(ep.steps):
            rows = torch.as_tensor(idx, device=dev)
            tokens[rows, s], logp[rows, s] = out.tokens, out.logp
            # Tokens of sub-steps the env never ran (the episode ended inside the chunk) are not trained.
            sub_ok = torch.as_tensor(np.arange(K)[None] < executed[:, None], device=dev)
            mask[rows, s] = sub_ok.repeat_interleave(A, 1)
        return Rollout(
            units=tokens.view(N, S * L), logp_old=logp.view(N, S * L), mask=mask.view(N, S * L),
            truncated=torch.as_tensor(~ep.done, device=dev),  # cut by max_chunks, not ended by the env
            max_units=self.max_chunks * L, contexts=ep.rows, extras=ep.extras(dev))

    def decode(self, rollout: Rollout) -> list[dict[str, Any]]:
        return decode_episodes(rollout)

    def mask_images(self, rollout: Rollout, prob: float, generator: torch.Generator | None = None) -> Rollout:
        """The rollout with every camera frame's patch-size squares (the processor's patch side, in
        the frame's pixels) blacked with probability `prob`, independently per frame: PAPO's masked
        context for an episode. Whichever vision tower runs then sees the masked frames; the units
        (the sampled action tokens) are unchanged."""
        from dataclasses import replace

        from mmrl.algos.perception import mask_squares

        if "obs_images" not in rollout.extras:
            raise ValueError(f"{type(self).__name__}: this rollout carries no camera frames (obs_images) to mask")
        side = int(self.processor.image_processor.patch_size)
        frames = [mask_squares(f, side, prob, generator) for f in rollout.extras["obs_images"]]
        return replace(rollout, extras={**rollout.extras, "obs_images": frames})

    # ------------------------------------------------------------------ SFT

    def sft_loss(self, contexts: list[dict], generator: torch.Generator | None = None) -> torch.Tensor:
        """Mean cross-entropy of the discretised expert chunks (over the action ids, temperature 1).
        A conv keypoint tower shifts the images randomly here (DrQ, drawn from `generator`; only in
        train mode), and nowhere else. In train mode with `aux_action_loss` > 0, plus that weight
        times the mean squared error of the tower's auxiliary head on the expert chunk (actions
        scaled to [-1, 1]); in eval mode the loss is the cross-entropy alone, so own-vs-shuffled
        image comparisons (`grounding_loss`) measure the language model's use of the images."""
        ex = [parse_sft_context(c, i, self.cameras, self.action_dim, self.chunk_size) for i, c in enumerate(contexts)]
        actions = torch.stack([e.actions for e in ex])
        tokens = self.actions_to_tokens(actions).to(self.device)
        valid = torch.stack([e.valid for e in ex]).repeat_interleave(self.action_dim, 1).to(self.device)
        enc = self.encode(self._vl_contexts([e.images for e in ex], [e.instruction for e in ex]))
        conv = conv_encoder(self.model)
        with conv.augmenting(generator, self.config.shift_pad) if conv is not None else nullcontext():
            logp, _ = self._chunk_logprobs(self.model, enc, tokens, False, temperature=1.0)
            loss = -torch.where(valid, logp, 0.0).sum() / valid.sum().clamp_min(1)
            if self.config.aux_action_loss > 0 and self.model.training:
                vision = vision_inputs(enc["pixel_values"], enc["image_grid_thw"])
                with self._instruction_film(enc):
                    pred = conv.aux_predict(vision["pixel_values"].to(conv.dtype), vision["image_grid_thw"],
                                            len(ex)).float()
                target = self.bins.normalise(actions).flatten(1).to(pred.device)
                aux = torch.where(valid, (pred - target) ** 2, 0.0).sum() / valid.sum().clamp_min(1)
                loss = loss + self.config.aux_action_loss * aux
        return loss


def _aux_dim(c: ActionTokenVLAConfig) -> int:
    """Outputs of the conv tower's auxiliary head: one action chunk, or 0 (no head)."""
    return c.chunk_size * c.action_dim if c.aux_action_loss > 0 else 0


def _camera_token_count(task: Any, c: ActionTokenVLAConfig, processor: Any) -> int:
    """Image tokens the processor gives the task's camera images (`task.image_size`): the keypoint
    count of a fresh conv tower."""
    size = getattr(task, "image_size", None)
    if size is None:
        raise ValueError("vision: conv_keypoints needs model.params.n_keypoints (the camera image's token count) "
                         "when the task has no image_size")
    h, w = (size, size) if isinstance(size, int) else size
    return image_token_count(processor.image_processor, int(h), int(w), c.min_image_tokens, c.max_image_tokens)


__all__ = ["ActOutput", "ActionTokenVLAPolicy"]
