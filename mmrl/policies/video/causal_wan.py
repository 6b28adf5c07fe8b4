"""Chunk-causal (streaming) Wan text-to-video on diffusers' stock `WanTransformer3DModel`.

Self-Forcing / CausVid (causal students of Wan2.1) generate a video chunk by chunk (a chunk = a few
latent frames), each chunk attending to a KV cache of the past ones. Diffusers has no such model, so
`CausalWan` wraps the stock transformer and runs its own submodules (patch embedding,
`condition_embedder`, the blocks, `norm_out` / `scale_shift_table` / `proj_out`) with its own forward.
Only attn1's processor is swapped (it falls back to the original one when the stock forward calls it);
parameter names are untouched, so converted causal-Wan checkpoints load with `from_pretrained(dir)`.

Conventions (as `mmrl.flow`): flow time t in [0, 1], x_t = (1 - t) x0 + t eps, the model predicts
v = eps - x0; the transformer sees `t * num_train_timesteps` (the scheduler's scale).

Three passes share one code path and agree numerically (tests/test_causal_wan.py):
* `forward_chunk`: one chunk against a `KVCache` (sampling, Self-Forcing rollouts);
* `forward_block_causal`: the whole video in one pass with a block-causal mask;
* `forward_teacher_forced`: [clean ; noisy] chunks in one pass (CausVid-style training, log-prob recompute).

Rotary positions: diffusers' `WanRotaryPosEmbed` has no frame offset (its forward always starts at
frame 0), so `_rotary` slices its precomputed cos/sin tables at the chunk's offset: chunk k's frames get
positions k * chunk_frames, ... The tables hold `rope_max_seq_len` positions per axis (after
patching), hence at most `rope_max_seq_len * patch_t` latent frames; past that a ValueError is raised.

Cost note: the one-pass forms use SDPA with an explicit [S_q, S_k] boolean mask (S = all tokens,
2S for teacher forcing) and per-token modulation (Wan 2.2 style); at full Wan sizes that is GBs of mask
and modulation activations, where a FlexAttention block mask or gradient checkpointing
(`enable_gradient_checkpointing`, train.gradient_checkpointing) helps.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CONFIG_NAME", "NUM_TRAIN_TIMESTEPS", "CausalSelfAttnProcessor", "CausalWan", "KVCache",
           "build_tiny_wan", "stream_ode"]

NUM_TRAIN_TIMESTEPS = 1000  # Wan's flow-match scheduler scale: timestep = t * 1000
CONFIG_NAME = "causal_wan.json"  # written next to the transformer's config.json by `save_pretrained`

KV = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------------


class KVCache:
    """Self-attention keys/values of past chunks, stored per chunk so history can be re-routed.

    Layout: `chunks[c][layer] = (k, v)`, each [B, heads, T, head_dim] (T = tokens of one chunk), keys
    after norm_k *and* rotary, so a chunk keeps its original position wherever it moves in the cache.
    `positions[c]` is the chunk index the chunk was written at (its rotary offset / chunk_frames),
    `frames[c]` its latent frames. Attention concatenates the chunks in list order (order does not
    change the result: positions are baked into the keys).

    `forward_chunk(..., write_cache=True)` appends in place; every other method returns a new cache
    sharing (not copying) tensors unless said otherwise. Nothing is detached implicitly: a cache
    written with grad enabled back-propagates into the chunks that wrote it.
    """

    def __init__(self) -> None:
        self.chunks: list[tuple[KV, ...]] = []
        self.positions: list[int] = []
        self.frames: list[int] = []

    # -- building ----------------------------------------------------------------------------------
    def append(self, kv: Sequence[KV], position: int, frames: int) -> None:
        """Add one chunk's per-layer (k, v) written at chunk index `position`."""
        kv = tuple((k, v) for k, v in kv)
        if self.chunks and len(kv) != self.num_layers:
            raise ValueError(f"chunk has {len(kv)} layers, the cache has {self.num_layers}")
        self.chunks.append(kv)
        self.positions.append(int(position))
        self.frames.append(int(frames))

    def _new(self, chunks, positions, frames) -> KVCache:
        out = KVCache()
        out.chunks, out.positions, out.frames = list(chunks), list(positions), list(frames)
        return out

    def take(self, indices: Sequence[int]) -> KVCache:
        """A cache of the chunks at `indices` (list order), e.g. [0, 2] drops chunk 1, [1, 0] reorders;
        rotary positions stay the original ones."""
        idx = [operator.index(i) for i in indices]
        for i in idx:
            if not -self.num_chunks <= i < self.num_chunks:
                raise IndexError(f"chunk {i} out of range for a cache of {self.num_chunks} chunks")
        return self._new([self.chunks[i] for i in idx], [self.positions[i] for i in idx],
                         [self.frames[i] for i in idx])

    def chunk_slice(self, start: int | None = None, end: int | None = None) -> KVCache:
        """Chunks [start, end) of the list (Python slice semantics), e.g. a sliding window."""
        return self.take(range(self.num_chunks)[start:end])

    def chunk(self, i: int) -> tuple[KV, ...]:
        """Chunk i's per-layer (k, v)."""
        return self.chunks[i]

    def select(self, rows: torch.Tensor | Sequence[int]) -> KVCache:
        """Batch rows `rows` (may repeat: one prompt's cache for a whole group)."""
        def pick(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=x.device))
        return self._map(pick)

    def detach(self) -> KVCache:
        return self._map(torch.Tensor.detach)

    def clone(self) -> KVCache:
        return self._map(torch.Tensor.clone)

    def to(self, *args, **kwargs) -> KVCache:
        return self._map(lambda x: x.to(*args, **kwargs))

    def _map(self, fn) -> KVCache:
        chunks = [tuple((fn(k), fn(v)) for k, v in c) for c in self.chunks]
        return self._new(chunks, self.positions, self.frames)

    # -- reading -----------------------------------------------------------------------------------
    def kv(self, layer: int) -> KV | None:
        """Layer `layer`'s keys/values of all chunks, concatenated: [B, heads, L, head_dim]."""
        if not self.chunks:
            return None
        if len(self.chunks) == 1:
            return self.chunks[0][layer]
        return (torch.cat([c[layer][0] for c in self.chunks], 2), torch.cat([c[layer][1] for c in self.chunks], 2))

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def num_frames(self) -> int:
        return sum(self.frames)

    @property
    def num_layers(self) -> int | None:
        return len(self.chunks[0]) if self.chunks else None

    @property
    def batch_size(self) -> int | None:
        return self.chunks[0][0][0].shape[0] if self.chunks else None

    @property
    def chunk_tokens(self) -> list[int]:
        return [c[0][0].shape[2] for c in self.chunks]

    def __repr__(self) -> str:
        return f"KVCache(chunks={self.num_chunks}, positions={self.positions}, frames={self.num_frames})"


# ----------------------------------------------------------------------------------------------------
# attn1 processor
# ----------------------------------------------------------------------------------------------------


@dataclass
class _AttnContext:
    """What the causal self-attention needs. It travels through the blocks' `rotary_emb` argument
    (the stock `WanTransformerBlock` hands that to attn1 only), so it needs no global state and
    survives gradient checkpointing's recompute."""

    cos: torch.Tensor  # [1, S, 1, head_dim]
    sin: torch.Tensor
    mask: torch.Tensor | None  # [S, L + S] bool (True = attend) or None (attend to everything)
    past: KVCache | None  # attended before the current tokens
    new_kv: list | None  # filled per layer with the current tokens' (k, v) when writing the cache


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotary, exactly as diffusers' `WanAttnProcessor` (x [B, S, H, D])."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


class CausalSelfAttnProcessor:
    """attn1 processor: Wan's self-attention (norm_q/norm_k across heads, rotary) over [cached past
    chunks ; current tokens] with an optional mask, recording the current K/V when asked. Called with
    a plain (cos, sin) tuple, as the stock forward does, it defers to the processor it replaced."""

    def __init__(self, layer_idx: int, fallback) -> None:
        self.layer_idx = layer_idx
        self.fallback = fallback

    # `set_attention_backend` / parallel configs reach the fallback (the stock path).
    @property
    def _attention_backend(self):
        return getattr(self.fallback, "_attention_backend", None)

    @_attention_backend.setter
    def _attention_backend(self, value):
        self.fallback._attention_backend = value

    @property
    def _parallel_config(self):
        return getattr(self.fallback, "_parallel_config", None)

    @_parallel_config.setter
    def _parallel_config(self, value):
        self.fallback._parallel_config = value

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        ctx = rotary_emb
        if not isinstance(ctx, _AttnContext):
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (z.unflatten(2, (attn.heads, -1)) for z in (q, k, v))
        q, k = _apply_rotary(q, ctx.cos, ctx.sin), _apply_rotary(k, ctx.cos, ctx.sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, H, S, D]
        if ctx.new_kv is not None:
            ctx.new_kv[self.layer_idx] = (k, v)
        past = ctx.past.kv(self.layer_idx) if ctx.past is not None else None
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


# ----------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------


class CausalWan(nn.Module):
    """A stock `WanTransformer3DModel` run chunk-causally: chunk k attends to chunks <= k.

    Videos are latents [B, C, F, H, W] with F a multiple of `chunk_frames`; text is the encoder's
    embeddings [B, L, text_dim]; every method returns the velocity v = eps - x0 in the input's layout.
    T2V only (no image conditioning)."""

    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS

    def __init__(self, transformer, chunk_frames: int, local_window: int | None = None, sink_chunks: int = 0) -> None:
        super().__init__()
        from diffusers import WanTransformer3DModel

        if not isinstance(transformer, WanTransformer3DModel):
            raise TypeError(f"CausalWan wraps a diffusers WanTransformer3DModel, got {type(transformer).__name__}")
        cfg = transformer.config
        if cfg.image_dim is not None or cfg.added_kv_proj_dim is not None:
            raise ValueError("CausalWan supports text-to-video Wan only; this transformer has image conditioning "
                             f"(image_dim={cfg.image_dim}, added_kv_proj_dim={cfg.added_kv_proj_dim})")
        self.patch_size = tuple(int(p) for p in cfg.patch_size)
        chunk_frames = operator.index(chunk_frames)
        if chunk_frames < 1 or chunk_frames % self.patch_size[0]:
            raise ValueError(f"chunk_frames must be a positive multiple of the temporal patch size "
                             f"{self.patch_size[0]}, got {chunk_frames}")
        if local_window is not None and operator.index(local_window) < 1 or operator.index(sink_chunks) < 0:
            raise ValueError(f"local_window must be None (all past chunks) or >= 1 and sink_chunks >= 0; "
                             f"got local_window={local_window!r}, sink_chunks={sink_chunks!r}")
        self.transformer = transformer
        self.chunk_frames = chunk_frames
        # LongLive-style local attention: a chunk sees the first `sink_chunks` chunks and the
        # `local_window` most recent past ones (None: every past chunk).
        self.local_window, self.sink_chunks = local_window, int(sink_chunks)
        self._install_processors()

    def context_chunks(self, chunk_index: int) -> list[int]:
        """The past chunks chunk `chunk_index` attends to (positions in a cache written in order);
        `cache.take(model.context_chunks(k))` is the cache the one-pass forms give chunk k."""
        if self.local_window is None:
            return list(range(chunk_index))
        return sorted(set(range(min(self.sink_chunks, chunk_index))) |
                      set(range(max(0, chunk_index - self.local_window), chunk_index)))

    def _sees(self, cid: torch.Tensor, include_self: bool) -> torch.Tensor:
        """bool [S, S]: query chunk q attends to key chunk k (k < q within the local window or the
        sink; k == q too when include_self)."""
        q, k = cid[:, None], cid[None, :]
        seen = (k < q) | (k == q) if include_self else k < q
        if self.local_window is not None:
            seen = seen & ((q - k <= self.local_window) | (k < self.sink_chunks))
        return seen

    # -- setup -------------------------------------------------------------------------------------
    def _install_processors(self) -> None:
        """Put a `CausalSelfAttnProcessor` on every attn1 (again if someone replaced it)."""
        for i, block in enumerate(self.transformer.blocks):
            proc = block.attn1.processor
            if isinstance(proc, CausalSelfAttnProcessor):
                if proc.layer_idx == i:
                    continue
                proc = proc.fallback
            block.attn1.set_processor(CausalSelfAttnProcessor(i, proc))

    def enable_gradient_checkpointing(self) -> None:
        """Recompute every block in the backward instead of keeping its activations (diffusers'
        switch on the stock transformer: non-reentrant `torch.utils.checkpoint`); `_blocks` takes it
        only under gradients. Same values and gradients."""
        self.transformer.enable_gradient_checkpointing()

    def disable_gradient_checkpointing(self) -> None:
        self.transformer.disable_gradient_checkpointing()

    @property
    def num_layers(self) -> int:
        return len(self.transformer.blocks)

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.patch_embedding.weight.device

    @property
    def max_frames(self) -> int:
        """Latent frames the rotary table covers: `rope_max_seq_len * patch_t`."""
        return self.transformer.rope.max_seq_len * self.patch_size[0]

    # -- checks ------------------------------------------------------------------------------------
    def _check_video(self, x: torch.Tensor, name: str) -> tuple[int, int, int, int]:
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            raise ValueError(f"{name} must be a video tensor [B, C, F, H, W], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        B, C, Fr, H, W = x.shape
        c_in = self.transformer.config.in_channels
        if C != c_in:
            raise ValueError(f"{name} has {C} channels, the transformer takes in_channels={c_in}")
        if Fr == 0 or Fr % self.chunk_frames:
            raise ValueError(f"{name} has {Fr} frames; it must be a positive multiple of chunk_frames="
                             f"{self.chunk_frames}")
        _, p_h, p_w = self.patch_size
        if H % p_h or W % p_w:
            raise ValueError(f"{name} is {H}x{W} (HxW); both must be divisible by the patch size {p_h}x{p_w}")
        return B, Fr, H, W

    def _check_text(self, text: torch.Tensor, batch: int) -> torch.Tensor:
        text_dim = self.transformer.config.text_dim
        if not isinstance(text, torch.Tensor) or text.dim() != 3 or text.shape[-1] != text_dim:
            shape = tuple(text.shape) if isinstance(text, torch.Tensor) else type(text).__name__
            raise ValueError(f"text must be embeddings [B, L, text_dim={text_dim}], got {shape}")
        if text.shape[0] != batch:
            raise ValueError(f"text has batch {text.shape[0]}, the video has batch {batch}; they must match "
                             "(repeat the prompt embeddings per sample)")
        return text.to(self.dtype)

    def _segment_time(self, t, batch: int, num_chunks: int, per_chunk: bool) -> torch.Tensor:
        """t as [B, 1] (one time per sample) or [B, num_chunks] (per chunk), float32."""
        t = torch.as_tensor(t, dtype=torch.float32, device=self.device)
        if t.dim() == 0:
            return t.expand(batch, 1)
        if t.dim() == 1 and t.shape[0] == batch:
            return t[:, None]
        if per_chunk and t.dim() == 2 and tuple(t.shape) == (batch, num_chunks):
            return t
        accepted = f"a scalar, [{batch}]" + (f" or [{batch}, {num_chunks}] (per chunk)" if per_chunk else "")
        raise ValueError(f"t must be {accepted}; got shape {tuple(t.shape)}")

    def _check_cache(self, cache: KVCache, batch: int, tokens: int, chunk_index: int) -> None:
        if not cache.num_chunks:
            return
        if cache.num_layers != self.num_layers:
            raise ValueError(f"cache has {cache.num_layers} layers, the model has {self.num_layers}")
        if cache.batch_size != batch:
            raise ValueError(f"cache holds batch {cache.batch_size}, x has batch {batch}; "
                             "use cache.select(rows) to pick or repeat rows")
        if any(n != tokens for n in cache.chunk_tokens):
            raise ValueError(f"cached chunks have {cache.chunk_tokens} tokens, this chunk has {tokens} "
                             "(a different frame count or height/width?)")
        if chunk_index <= max(cache.positions):
            raise ValueError(f"chunk_index={chunk_index} must come after every cached chunk (cached positions "
                             f"{cache.positions}); for an in-order cache it is cache.num_chunks={cache.num_chunks}")

    # -- pieces of the stock forward -------------------------------------------------------------
    def _rotary(self, frame_start: int, num_frames: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [1, S, 1, head_dim] for latent frames [frame_start, frame_start + num_frames) at HxW:
        `WanRotaryPosEmbed.forward` with a frame offset (it has none), read from its own tables."""
        rope = self.transformer.rope
        p_t, p_h, p_w = self.patch_size
        f0, ppf, pph, ppw = frame_start // p_t, num_frames // p_t, height // p_h, width // p_w
        limit = rope.max_seq_len
        if f0 + ppf > limit:
            raise ValueError(f"latent frames up to {frame_start + num_frames} exceed the rotary table: "
                             f"rope_max_seq_len={limit} positions x temporal patch {p_t} = {limit * p_t} frames "
                             "at most")
        if pph > limit or ppw > limit:
            raise ValueError(f"{height}x{width} is {pph}x{ppw} patches, past rope_max_seq_len={limit} positions")
        split = [rope.t_dim, rope.h_dim, rope.w_dim]
        out = []
        for table in (rope.freqs_cos, rope.freqs_sin):
            ft, fh, fw = table.split(split, dim=1)
            grid = torch.cat([ft[f0:f0 + ppf].view(ppf, 1, 1, -1).expand(ppf, pph, ppw, -1),
                              fh[:pph].view(1, pph, 1, -1).expand(ppf, pph, ppw, -1),
                              fw[:ppw].view(1, 1, ppw, -1).expand(ppf, pph, ppw, -1)], dim=-1)
            out.append(grid.reshape(1, ppf * pph * ppw, 1, -1))
        return out[0], out[1]

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        h = self.transformer.patch_embedding(x.to(self.dtype))
        return h.flatten(2).transpose(1, 2).contiguous()  # [B, S, dim]

    def _conditions(self, t_seg: torch.Tensor, text: torch.Tensor, seg_tokens: int):
        """temb / timestep_proj / projected text. One time per sample -> the stock [B] shapes
        (temb [B, dim], proj [B, 6, dim]); K per-segment times -> the stock per-token shapes (Wan 2.2:
        temb [B, S, dim], proj [B, S, 6, dim]), embedded per segment, then repeated over its tokens."""
        timestep = t_seg * self.num_train_timesteps
        embed = self.transformer.condition_embedder
        if timestep.shape[1] == 1:
            temb, proj, enc, _ = embed(timestep[:, 0], text, None)
            return temb, proj.unflatten(1, (6, -1)), enc
        temb, proj, enc, _ = embed(timestep.flatten(), text, None, timestep_seq_len=timestep.shape[1])
        temb = temb.repeat_interleave(seg_tokens, dim=1)
        proj = proj.repeat_interleave(seg_tokens, dim=1).unflatten(2, (6, -1))
        return temb, proj, enc

    def _blocks(self, h, enc, proj, ctx: _AttnContext) -> torch.Tensor:
        self._install_processors()
        tr = self.transformer
        if torch.is_grad_enabled() and tr.gradient_checkpointing:
            for block in tr.blocks:
                h = tr._gradient_checkpointing_func(block, h, enc, proj, ctx)
        else:
            for block in tr.blocks:
                h = block(h, enc, proj, ctx)
        return h

    def _head(self, h: torch.Tensor, temb: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        """norm_out with the output modulation, proj_out and unpatchify, as the stock forward."""
        tr = self.transformer
        table = tr.scale_shift_table.to(temb.device)
        if temb.dim() == 3:
            shift, scale = (table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (table + temb.unsqueeze(1)).chunk(2, dim=1)
        shift, scale = shift.to(h.device), scale.to(h.device)
        h = (tr.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
        h = tr.proj_out(h)
        p_t, p_h, p_w = self.patch_size
        h = h.reshape(h.shape[0], frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        return h.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def _chunk_ids(self, num_frames: int, height: int, width: int) -> torch.Tensor:
        """The chunk index of every token of a [num_frames, height, width] video (frame-major order)."""
        p_t, p_h, p_w = self.patch_size
        per_chunk = (self.chunk_frames // p_t) * (height // p_h) * (width // p_w)
        return torch.arange(num_frames // self.chunk_frames, device=self.device).repeat_interleave(per_chunk)

    # -- public passes -----------------------------------------------------------------------------
    def forward_chunk(self, x: torch.Tensor, t, text: torch.Tensor, cache: KVCache | None, chunk_index: int,
                      write_cache: bool = False) -> torch.Tensor:
        """v for one chunk x [B, C, chunk_frames, H, W] at flow time t (scalar or [B]) given text
        [B, L, text_dim], attending to `cache` (past chunks) and itself, at rotary frames
        chunk_index * chunk_frames onwards. With write_cache the chunk's K/V are appended to `cache`
        (Self-Forcing writes the *clean* chunk at t = 0 after denoising it)."""
        B, Fr, H, W = self._check_video(x, "x")
        if Fr != self.chunk_frames:
            raise ValueError(f"x has {Fr} frames; forward_chunk takes one chunk of chunk_frames={self.chunk_frames}")
        chunk_index = operator.index(chunk_index)
        if chunk_index < 0:
            raise ValueError(f"chunk_index must be >= 0, got {chunk_index}")
        if write_cache and cache is None:
            raise ValueError("write_cache=True needs a KVCache to write into (pass KVCache() for the first chunk)")
        text = self._check_text(text, B)
        t_seg = self._segment_time(t, B, 1, per_chunk=False)
        cos, sin = self._rotary(chunk_index * Fr, Fr, H, W)
        tokens = cos.shape[1]
        if cache is not None:
            self._check_cache(cache, B, tokens, chunk_index)
        temb, proj, enc = self._conditions(t_seg, text, tokens)
        # a snapshot of the past (the append below must not reach a checkpointed block's recompute)
        past = cache.chunk_slice() if cache is not None and cache.num_chunks else None
        ctx = _AttnContext(cos, sin, None, past, [None] * self.num_layers if write_cache else None)
        h = self._blocks(self._patchify(x), enc, proj, ctx)
        if write_cache:
            cache.append(ctx.new_kv, chunk_index, Fr)
        return self._head(h, temb, Fr, H, W)

    def forward_block_causal(self, x: torch.Tensor, t, text: torch.Tensor) -> torch.Tensor:
        """v for a whole video x [B, C, F, H, W] (F = num_chunks * chunk_frames) in one pass with a
        block-causal mask (chunk k attends to chunks <= k). t: scalar, [B] or [B, num_chunks]."""
        B, Fr, H, W = self._check_video(x, "x")
        text = self._check_text(text, B)
        num_chunks = Fr // self.chunk_frames
        t_seg = self._segment_time(t, B, num_chunks, per_chunk=True)
        cos, sin = self._rotary(0, Fr, H, W)
        temb, proj, enc = self._conditions(t_seg, text, cos.shape[1] // t_seg.shape[1])
        mask = None
        if num_chunks > 1:
            mask = self._sees(self._chunk_ids(Fr, H, W), include_self=True)
        h = self._blocks(self._patchify(x), enc, proj, _AttnContext(cos, sin, mask, None, None))
        return self._head(h, temb, Fr, H, W)

    def forward_teacher_forced(self, clean: torch.Tensor, noisy: torch.Tensor, t, text: torch.Tensor) -> torch.Tensor:
        """The CausVid-style training pass over [clean chunks ; noisy chunks] in one forward: clean
        chunks (t = 0) attend block-causally among themselves; noisy chunk k (at t[:, k]; t may also be
        a scalar or [B]) attends to clean chunks < k and to itself. Both halves share rotary positions.
        Returns v for the noisy chunks [B, C, F, H, W]; equals `forward_chunk` chunk by chunk with the
        cache written from the clean chunks at t = 0."""
        B, Fr, H, W = self._check_video(clean, "clean")
        if noisy.shape != clean.shape:
            raise ValueError(f"noisy {tuple(noisy.shape)} must have the shape of clean {tuple(clean.shape)}")
        text = self._check_text(text, B)
        num_chunks = Fr // self.chunk_frames
        t_seg = self._segment_time(t, B, num_chunks, per_chunk=True).expand(B, num_chunks)
        cos, sin = self._rotary(0, Fr, H, W)
        S = cos.shape[1]
        cos, sin = torch.cat([cos, cos], 1), torch.cat([sin, sin], 1)
        t_seg = torch.cat([torch.zeros_like(t_seg), t_seg], 1)  # [B, 2 * num_chunks]
        temb, proj, enc = self._conditions(t_seg, text, S // num_chunks)
        cid = self._chunk_ids(Fr, H, W)
        clean_to_clean = self._sees(cid, include_self=True)
        noisy_to_clean = self._sees(cid, include_self=False)
        noisy_to_noisy = cid[:, None] == cid[None, :]
        mask = torch.cat([torch.cat([clean_to_clean, torch.zeros_like(clean_to_clean)], 1),
                          torch.cat([noisy_to_clean, noisy_to_noisy], 1)], 0)
        h = torch.cat([self._patchify(clean), self._patchify(noisy)], 1)
        h = self._blocks(h, enc, proj, _AttnContext(cos, sin, mask, None, None))
        return self._head(h[:, S:], temb[:, S:], Fr, H, W)

    # -- persistence -------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """The transformer's own `save_pretrained` (config.json + weights) plus `causal_wan.json`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.transformer.save_pretrained(path)
        meta = {"chunk_frames": self.chunk_frames, "num_train_timesteps": self.num_train_timesteps,
                "local_window": self.local_window, "sink_chunks": self.sink_chunks}
        (path / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path, chunk_frames: int | None = None,
                        torch_dtype: torch.dtype | None = None, **attention) -> CausalWan:
        """Load a diffusers-format Wan transformer from a local folder (or its `transformer/`
        subfolder); nothing is downloaded. chunk_frames, local_window and sink_chunks default to the
        ones in causal_wan.json (`attention` keywords override the last two)."""
        from diffusers import WanTransformer3DModel

        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"CausalWan.from_pretrained: {root} is not a directory (a local folder with a "
                                    "diffusers WanTransformer3DModel's config.json and weights is required)")
        model_dir = root
        if not (root / "config.json").is_file() and (root / "transformer" / "config.json").is_file():
            model_dir = root / "transformer"
        config_file = model_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"CausalWan.from_pretrained: no config.json in {root} "
                                    f"(nor in {root / 'transformer'})")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"CausalWan.from_pretrained: cannot read {config_file}: {e}") from e
        name = config.get("_class_name", "WanTransformer3DModel") if isinstance(config, dict) else None
        if name != "WanTransformer3DModel":
            raise ValueError(f"CausalWan.from_pretrained: {config_file} describes {name!r}, "
                             "not a WanTransformer3DModel")
        if not any(model_dir.glob("diffusion_pytorch_model*.safetensors")) and \
                not any(model_dir.glob("diffusion_pytorch_model*.bin")):
            raise FileNotFoundError(f"CausalWan.from_pretrained: no weights (diffusion_pytorch_model*.safetensors "
                                    f"or .bin) in {model_dir}")
        meta_file = next((p / CONFIG_NAME for p in (model_dir, root) if (p / CONFIG_NAME).is_file()), None)
        meta = {}
        if meta_file is not None:
            try:
                meta = dict(json.loads(meta_file.read_text()))
            except (OSError, ValueError, TypeError) as e:
                raise ValueError(f"CausalWan.from_pretrained: cannot read {meta_file}: {e}") from e
        if chunk_frames is None:
            if "chunk_frames" not in meta:
                raise ValueError(f"CausalWan.from_pretrained: pass chunk_frames (no chunk_frames in a {CONFIG_NAME} "
                                 f"in {model_dir})")
            chunk_frames = int(meta["chunk_frames"])
        attention = {"local_window": meta.get("local_window"), "sink_chunks": meta.get("sink_chunks", 0), **attention}
        try:
            transformer = WanTransformer3DModel.from_pretrained(model_dir, torch_dtype=torch_dtype,
                                                                local_files_only=True)
        except Exception as e:  # diffusers raises OSError / ValueError / safetensors errors
            raise ValueError(f"CausalWan.from_pretrained: could not load a WanTransformer3DModel from {model_dir}: "
                             f"{type(e).__name__}: {e}") from e
        return cls(transformer, chunk_frames, **attention)


def build_tiny_wan(*, in_channels: int = 3, out_channels: int = 3, num_layers: int = 2, num_heads: int = 2,
                   head_dim: int = 16, ffn_dim: int = 64, text_dim: int = 32, freq_dim: int = 32,
                   patch_size: tuple[int, int, int] = (1, 2, 2), rope_max_seq_len: int = 32, chunk_frames: int = 2,
                   local_window: int | None = None, sink_chunks: int = 0, seed: int = 0) -> CausalWan:
    """A tiny random-weight Wan (the stock class, so the same code path as real weights) for CPU demos
    and tests; pixel space is fine. rope_max_seq_len bounds frames (x patch_t) and H/W patches."""
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(
            patch_size=tuple(patch_size), num_attention_heads=num_heads, attention_head_dim=head_dim,
            in_channels=in_channels, out_channels=out_channels, text_dim=text_dim, freq_dim=freq_dim,
            ffn_dim=ffn_dim, num_layers=num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=rope_max_seq_len)
    return CausalWan(transformer, chunk_frames, local_window, sink_chunks)


def stream_ode(model: CausalWan, noise: torch.Tensor, text: torch.Tensor, timesteps: Sequence[float]) -> torch.Tensor:
    """Streaming inference without a policy (Self-Forcing's loop): each chunk of `noise` [B, C, F, H, W]
    integrated by Euler steps over `timesteps` (1 -> 0) against the cache of its context chunks, then
    written to the cache at t = 0. Returns the video."""
    cf, ts = model.chunk_frames, [float(t) for t in timesteps]
    video, history = noise.clone(), KVCache()
    for k in range(noise.shape[2] // cf):
        sl = slice(k * cf, (k + 1) * cf)
        x, cache = noise[:, :, sl], history.take(model.context_chunks(k))
        for j in range(len(ts) - 1):
            x = x + model.forward_chunk(x, ts[j], text, cache, k) * (ts[j + 1] - ts[j])
        model.forward_chunk(x, 0.0, text, cache, k, write_cache=True)
        history.append(cache.chunk(-1), k, cf)
        video[:, :, sl] = x
    return video
