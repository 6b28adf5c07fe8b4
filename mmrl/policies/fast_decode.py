"""A lean decoder for Llama/Qwen-family causal LMs: the same weights, a static KV cache, no framework.

On small models, autoregressive sampling is bound by per-token Python overhead (mask building,
cache objects, module hooks), not arithmetic. This stepper reads the HF model's own parameters at
call time (so it always sees the latest update), runs the decoder math directly with one
preallocated KV buffer and `scaled_dot_product_attention`, and reuses the model's rotary module so
every RoPE variant HF supports stays exact. Anything it does not recognise falls back to the HF
forward (`FastDecoder.maybe` returns None). Parity with the HF forward is tested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmrl.rollout import SampleOutput, positions_from_mask, sample_tokens

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # HF's order for half precision: normalise in float32, cast back, then scale.
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

    @classmethod
    def maybe(cls, model) -> FastDecoder | None:
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return None
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "use_sliding_window", False):
            return None
        if getattr(cfg, "sliding_window", None) and cfg.model_type == "mistral":
            return None
        if not hasattr(model, "model") or not hasattr(model.model, "rotary_emb"):
            return None
        return cls(model)

    @torch.no_grad()
    def sample(self, input_ids, attention_mask, **kwargs) -> SampleOutput:
        stepper = _StaticCacheStepper(self, max_len=input_ids.shape[1] + kwargs["max_new_tokens"])
        return sample_tokens(self.model, input_ids, attention_mask, stepper=stepper, **kwargs)


class _StaticCacheStepper:
    def __init__(self, dec: FastDecoder, max_len: int):
        self.dec = dec
        self.max_len = max_len
        inner = dec.model.model
        self.embed = inner.embed_tokens.weight
        self.norm_w = inner.norm.weight
        self.head = dec.model.lm_head.weight
        self.rotary = inner.rotary_emb
        # Fused projections, rebuilt per sampling call so they carry the latest weights:
        # q|k|v in one matmul and gate|up in another cut the per-token op count by almost half.
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv_w=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                qkv_b=torch.cat(biases) if all(b is not None for b in biases) else None,
                o_w=a.o_proj.weight, o_b=a.o_proj.bias, scaling=a.scaling,
                q_norm=a.q_norm.weight if dec.qk_norm else None, k_norm=a.k_norm.weight if dec.qk_norm else None,
                gate_up_w=torch.cat([m.gate_proj.weight, m.up_proj.weight]), down_w=m.down_proj.weight,
            ))

    def _forward(self, ids: torch.Tensor, start: int, attn_mask: torch.Tensor) -> torch.Tensor:
        d = self.dec
        B, S = ids.shape
        h = F.embedding(ids, self.embed)
        cos = self.cos[:, start:start + S].unsqueeze(1)
        sin = self.sin[:, start:start + S].unsqueeze(1)
        end = start + S
        nq, nkv = d.n_heads, d.n_kv
        for i, L in enumerate(self.layers):
            x = _rms_norm(h, L["ln1"], d.eps)
            qkv = F.linear(x, L["qkv_w"], L["qkv_b"]).view(B, S, nq + 2 * nkv, d.head_dim).transpose(1, 2)
            q, k, v = qkv.split([nq, nkv, nkv], dim=1)
            if L["q_norm"] is not None:
                q = _rms_norm(q, L["q_norm"], d.eps)
                k = _rms_norm(k, L["k_norm"], d.eps)
                qk = _rotate(torch.cat([q, k], 1), cos, sin)
            else:
                qk = _rotate(qkv[:, : nq + nkv], cos, sin)
            q, k = qk.split([nq, nkv], dim=1)
            self.k_cache[i, :, :, start:end] = k
            self.v_cache[i, :, :, start:end] = v
            o = F.scaled_dot_product_attention(q, self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end],
                                               attn_mask=attn_mask, scale=L["scaling"], enable_gqa=nkv != nq)
            h = h + F.linear(o.transpose(1, 2).reshape(B, S, -1), L["o_w"], L["o_b"])
            x = _rms_norm(h, L["ln2"], d.eps)
            gate, up = F.linear(x, L["gate_up_w"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, L["down_w"])
        last = _rms_norm(h[:, -1], self.norm_w, d.eps)
        return F.linear(last, self.head).float()

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        d = self.dec
        B, P = input_ids.shape
        dtype, device = self.embed.dtype, input_ids.device
        layers = len(self.layers)
        self.k_cache = torch.zeros(layers, B, d.n_kv, self.max_len, d.head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        # Prompt positions skip the left padding; generated tokens continue from the last one.
        prompt_pos = positions_from_mask(attention_mask)
        pos = torch.cat([prompt_pos, prompt_pos[:, -1:] + torch.arange(1, self.max_len - P + 1, device=device)], 1)
        self.cos, self.sin = self.rotary(self.embed[:1], pos)
        self.key_valid = torch.ones(B, self.max_len, dtype=torch.bool, device=device)
        self.key_valid[:, :P] = attention_mask.bool()
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        mask = causal & self.key_valid[:, None, None, :P]
        # A left-pad query sees nothing; let it see itself so the softmax stays finite (output unused).
        mask = mask | torch.eye(P, dtype=torch.bool, device=device)
        self.cur = P
        return self._forward(input_ids, 0, mask)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        start = self.cur
        self.cur += 1
        mask = self.key_valid[:, None, None, : self.cur]
        return self._forward(tokens[:, None], start, mask)
