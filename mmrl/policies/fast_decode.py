"""A lean forward for Llama/Qwen-family causal LMs: the same weights, no framework overhead.

On small models, both sampling and the teacher-forced forward are bound by per-op Python
overhead (mask building, cache objects, module hooks), not arithmetic. This module reads the HF
model's own parameters at call time (so it always sees the latest update), runs the decoder math
directly (fused q|k|v and gate|up projections, `scaled_dot_product_attention`, one preallocated
KV buffer when decoding) and reuses the model's rotary module so every RoPE variant HF supports
stays exact. Gradients flow to the HF parameters, so the trainer can use it for the update too.
Anything it does not recognise falls back to the HF forward (`FastDecoder.maybe` returns None).
Parity with the HF forward, in values and gradients, is tested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmrl.rollout import SampleOutput, positions_from_mask, sample_tokens

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's order of operations: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class FastDecoder:
    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.qk_norm = cfg.model_type == "qwen3"
        self.dropout = float(getattr(cfg, "attention_dropout", 0.0) or 0.0)

    @classmethod
    def maybe(cls, model) -> FastDecoder | None:
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return None
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "use_sliding_window", False):
            return None
        if getattr(cfg, "sliding_window", None) and cfg.model_type == "mistral":
            return None
        if getattr(cfg, "mlp_bias", False) or not hasattr(model, "model") or not hasattr(model.model, "rotary_emb"):
            return None
        return cls(model)

    # ------------------------------------------------------------------ weights

    def fused_layers(self) -> list[dict]:
        """Per-layer weights with q|k|v and gate|up concatenated (differentiable: `cat` passes
        gradients back to the HF parameters)."""
        layers = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv_w=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                qkv_b=torch.cat(biases) if all(b is not None for b in biases) else None,
                o_w=a.o_proj.weight, o_b=a.o_proj.bias, scaling=a.scaling,
                q_norm=a.q_norm.weight if self.qk_norm else None, k_norm=a.k_norm.weight if self.qk_norm else None,
                gate_up_w=torch.cat([m.gate_proj.weight, m.up_proj.weight]), down_w=m.down_proj.weight,
            ))
        return layers

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.model.model.embed_tokens.weight
        cos, sin = self.model.model.rotary_emb(embed[:1], positions)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, D]

    # ------------------------------------------------------------------ the decoder

    def hidden(self, layers: list[dict], ids: torch.Tensor, cos, sin, attn_mask: torch.Tensor,
               cache: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0) -> torch.Tensor:
        """Final-norm hidden states `[B, S, H]`. With `cache` (k, v buffers `[L, B, Hkv, Tmax, D]`),
        keys/values of positions `start:start+S` are written there and attention reads `:start+S`."""
        B, S = ids.shape
        nq, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        emb = self.model.model.embed_tokens
        # padding_idx as in nn.Embedding: HF never trains the pad row, and neither may we.
        h = F.embedding(ids, emb.weight, padding_idx=emb.padding_idx)
        end = start + S
        for i, L in enumerate(layers):
            x = _rms_norm(h, L["ln1"], self.eps)
            qkv = F.linear(x, L["qkv_w"], L["qkv_b"]).view(B, S, nq + 2 * nkv, hd).transpose(1, 2)
            q, k, v = qkv.split([nq, nkv, nkv], dim=1)
            if L["q_norm"] is not None:
                q = _rms_norm(q, L["q_norm"], self.eps)
                k = _rms_norm(k, L["k_norm"], self.eps)
                q, k = _rotate(torch.cat([q, k], 1), cos, sin).split([nq, nkv], dim=1)
            else:
                q, k = _rotate(qkv[:, : nq + nkv], cos, sin).split([nq, nkv], dim=1)
            if cache is not None:
                k_cache, v_cache = cache
                k_cache[i, :, :, start:end] = k
                v_cache[i, :, :, start:end] = v
                k, v = k_cache[i, :, :, :end], v_cache[i, :, :, :end]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=L["scaling"], enable_gqa=nkv != nq)
            h = h + F.linear(o.transpose(1, 2).reshape(B, S, -1), L["o_w"], L["o_b"])
            x = _rms_norm(h, L["ln2"], self.eps)
            gate, up = F.linear(x, L["gate_up_w"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, L["down_w"])
        return _rms_norm(h, self.model.model.norm.weight, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.lm_head.weight)

    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep_last: int) -> torch.Tensor:
        """Teacher-forced logits of the last `keep_last` positions, with gradient: the drop-in for
        `model(input_ids, attention_mask, position_ids, logits_to_keep=keep_last).logits`."""
        S = input_ids.shape[1]
        cos, sin = self.rope(positions_from_mask(attention_mask))
        mask = _causal_padding_mask(attention_mask, S)
        h = self.hidden(self.fused_layers(), input_ids, cos, sin, mask)
        return self.logits(h[:, S - keep_last:])

    @torch.no_grad()
    def sample(self, input_ids, attention_mask, **kwargs) -> SampleOutput:
        stepper = _StaticCacheStepper(self, max_len=input_ids.shape[1] + kwargs["max_new_tokens"])
        return sample_tokens(self.model, input_ids, attention_mask, stepper=stepper, **kwargs)


def _causal_padding_mask(attention_mask: torch.Tensor, S: int) -> torch.Tensor:
    device = attention_mask.device
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    mask = causal & attention_mask.bool()[:, None, None, :]
    # A left-pad query sees nothing; let it see itself so the softmax stays finite (output unused).
    return mask | torch.eye(S, dtype=torch.bool, device=device)


class _StaticCacheStepper:
    """Prefill once, then one token per step into a preallocated KV buffer."""

    def __init__(self, dec: FastDecoder, max_len: int):
        self.dec = dec
        self.max_len = max_len
        self.layers = dec.fused_layers()  # rebuilt per sampling call: always the latest weights

    def _last_logits(self, ids, start, mask):
        S = ids.shape[1]
        cos, sin = self.cos[:, :, start:start + S], self.sin[:, :, start:start + S]
        h = self.dec.hidden(self.layers, ids, cos, sin, mask, cache=(self.k_cache, self.v_cache), start=start)
        return self.dec.logits(h[:, -1]).float()

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        d = self.dec
        B, P = input_ids.shape
        device = input_ids.device
        dtype = d.model.model.embed_tokens.weight.dtype
        self.k_cache = torch.zeros(len(self.layers), B, d.n_kv, self.max_len, d.head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        # Prompt positions skip the left padding; generated tokens continue from the last one.
        prompt_pos = positions_from_mask(attention_mask)
        pos = torch.cat([prompt_pos, prompt_pos[:, -1:] + torch.arange(1, self.max_len - P + 1, device=device)], 1)
        self.cos, self.sin = d.rope(pos)
        self.key_valid = torch.ones(B, self.max_len, dtype=torch.bool, device=device)
        self.key_valid[:, :P] = attention_mask.bool()
        self.cur = P
        return self._last_logits(input_ids, 0, _causal_padding_mask(attention_mask, P))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        start = self.cur
        self.cur += 1
        return self._last_logits(tokens[:, None], start, self.key_valid[:, None, None, : self.cur])
