"""A lean forward for Llama/Qwen-family causal LMs: the same weights, no framework overhead.

On small models, both sampling and the teacher-forced forward are bound by per-op Python
overhead (mask building, cache objects, module hooks), not arithmetic. This module reads the HF
model's own parameters at call time (so it always sees the latest update), runs the decoder math
directly (`scaled_dot_product_attention`, one preallocated KV buffer when decoding) and reuses the
model's rotary module so every RoPE variant HF supports stays exact. On small layers it also fuses
q|k|v and gate|up into one matmul each and transposes the decode step's weights once per sampling
call; those are copies of the weights, so above `FUSE_MAX_LAYER_PARAMS` (where the arithmetic, not
the op count, is the cost) every matmul reads the model's own weights through views instead: a
3B model would otherwise hold ~240 MiB of copies per layer, ~8.5 GiB in all, while sampling.
Gradients flow to the HF parameters, so the trainer can use it for the update too.
Anything it does not recognise falls back to the HF forward (`FastDecoder.maybe` returns None).
Parity with the HF forward, in values and gradients, is tested.

A Qwen-VL's language model is one of these decoders under mRoPE. Text tokens carry the same
position on the t/h/w axes, where mRoPE is plain RoPE, so after an HF prefill (vision + prompt) the
static-cache stepper decodes a VLM's completions too (`_StaticCacheStepper.load_prefix`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmrl.hf_compat import checkpointing_on
from mmrl.rollout import (
    SampleOutput,
    head_logprobs,
    positions_from_mask,
    sample_tokens,
    token_logprobs,
)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
# Qwen-VL language models (`model.model.language_model`): Qwen2-style and (Qwen3-VL) Qwen3-style
# decoders whose rotary module takes 3-D mRoPE positions.
VL_TEXT_MODEL_TYPES = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
_QK_NORM_TYPES = ("qwen3", "qwen3_vl_text")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # HF's order of operations: normalise in float32, cast back, then scale. `weight=None` leaves
    # the scale to the caller (the decode step folds it into the next matmul's weight).
    if x.dtype == torch.float32:  # one fused op, bit-identical to the steps below
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    xf = x.float()
    xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return xf if weight is None else weight * xf


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # HF's x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * signed_sin
    # (sin with its first half negated): three ops instead of seven, forward and backward.
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _text_body(model):
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal LM (`model.model`) or
    of a Qwen-VL (`model.model.language_model`); None when there is none."""
    inner = getattr(model, "model", None)
    body = getattr(inner, "language_model", inner)
    return body if hasattr(body, "rotary_emb") and hasattr(body, "layers") else None


class FastDecoder:
    # Fuse and pre-transpose a layer's weights (copies) only up to this many parameters a layer: the
    # demo models' sizes, where per-op overhead dominates (Qwen2.5-0.5B's layers have ~15M).
    FUSE_MAX_LAYER_PARAMS = 4_000_000

    def __init__(self, model, body=None):
        self.model = model  # gradients flow to its parameters; `lm_head` is read from it
        self.body = _text_body(model) if body is None else body
        layer = self.body.layers[0]
        self.fuse = sum(p.numel() for p in layer.parameters()) <= self.FUSE_MAX_LAYER_PARAMS
        cfg = self.body.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        # The attention module's own head_dim: Qwen2(.5)-VL's is hidden_size / heads, whatever the config says.
        attn = self.body.layers[0].self_attn
        self.head_dim = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None) or \
            cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.qk_norm = cfg.model_type in _QK_NORM_TYPES
        self.mrope = cfg.model_type in VL_TEXT_MODEL_TYPES
        self.dropout = float(getattr(cfg, "attention_dropout", 0.0) or 0.0)

    @classmethod
    def maybe(cls, model) -> FastDecoder | None:
        body = _text_body(model)
        cfg = getattr(body, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES + VL_TEXT_MODEL_TYPES:
            return None
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "use_sliding_window", False):
            return None
        if getattr(cfg, "sliding_window", None) and cfg.model_type == "mistral":
            return None
        if getattr(cfg, "mlp_bias", False) or not _plain_projections(body):
            return None  # e.g. LoRA or quantised layers: their weights are not `.weight` alone
        return cls(model, body)

    # ------------------------------------------------------------------ weights

    def fused_layers(self) -> list[dict]:
        """Per-layer weights. q|k|v and gate|up are one concatenated matrix each when `fuse` (a
        differentiable copy: `cat` passes gradients back to the HF parameters), else lists of the
        model's own weights (no copy), which `_linear` applies one by one."""
        layers = []
        join = torch.cat if self.fuse else list
        for layer in self.body.layers:
            a, m = layer.self_attn, layer.mlp
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv_w=join([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                qkv_b=torch.cat(biases) if all(b is not None for b in biases) else None,
                o_w=a.o_proj.weight, o_b=a.o_proj.bias, scaling=a.scaling,
                q_norm=a.q_norm.weight if self.qk_norm else None, k_norm=a.k_norm.weight if self.qk_norm else None,
                gate_up_w=join([m.gate_proj.weight, m.up_proj.weight]), down_w=m.down_proj.weight,
            ))
        return layers

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables of 1-D `positions` [B, S], from the model's own rotary module. Under mRoPE
        the three axes get the same position (a text token), so every section reads one table:
        axis 0 of Qwen2(.5)-VL's [3, B, S, D] output (Qwen3-VL interleaves it into [B, S, D])."""
        embed = self.body.embed_tokens.weight
        if self.mrope:
            cos, sin = self.body.rotary_emb(embed[:1], positions.expand(3, *positions.shape))
            if cos.dim() == 4:
                cos, sin = cos[0], sin[0]
        else:
            cos, sin = self.body.rotary_emb(embed[:1], positions)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        return cos.unsqueeze(1), signed_sin.unsqueeze(1)  # [B, 1, S, D]; see `_rotate`

    # ------------------------------------------------------------------ the decoder

    def hidden(self, layers: list[dict], ids: torch.Tensor, cos, sin, attn_mask: torch.Tensor,
               cache: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0,
               kv_out: list | None = None, prefix: tuple[list, torch.Tensor] | None = None) -> torch.Tensor:
        """Final-norm hidden states `[B, S, H]`. With `cache` (k, v buffers `[L, B, Hkv, Tmax, D]`),
        keys/values of positions `start:start+S` are written there and attention reads `:start+S`.
        `kv_out` collects each layer's (k, v) (with gradient); `prefix` = (such a list, row index
        [B]) puts row `prefix_index[b]`'s prefix keys/values before row b's own."""
        B, S = ids.shape
        nq, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        emb = self.body.embed_tokens
        # padding_idx as in nn.Embedding: HF never trains the pad row, and neither may we.
        h = F.embedding(ids, emb.weight, padding_idx=emb.padding_idx)
        end = start + S
        for i, L in enumerate(layers):
            x = _rms_norm(h, L["ln1"], self.eps)
            qkv = _linear(x, L["qkv_w"], L["qkv_b"]).view(B, S, nq + 2 * nkv, hd).transpose(1, 2)
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
            if kv_out is not None:
                kv_out.append((k, v))
            if prefix is not None:
                (pk, pv), index = prefix[0][i], prefix[1]
                k, v = torch.cat([pk[index], k], 2), torch.cat([pv[index], v], 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=L["scaling"], enable_gqa=nkv != nq)
            h = h + F.linear(o.transpose(1, 2).reshape(B, S, -1), L["o_w"], L["o_b"])
            x = _rms_norm(h, L["ln2"], self.eps)
            gate, up = _linear(x, L["gate_up_w"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, L["down_w"])
        return _rms_norm(h, self.body.norm.weight, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.lm_head.weight)

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep_last: int) -> torch.Tensor:
        """Teacher-forced final hidden states of the last `keep_last` positions, with gradient: the
        drop-in for the HF body's `last_hidden_state[:, -keep_last:]` (text only: a Qwen-VL's
        prompts go through its HF forward). `logits` projects them to the vocabulary."""
        S = input_ids.shape[1]
        cos, sin = self.rope(positions_from_mask(attention_mask))
        mask = _causal_padding_mask(attention_mask, S)
        h = self.hidden(self.fused_layers(), input_ids, cos, sin, mask)
        return h[:, S - keep_last:]

    def completion_hidden(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        """Teacher-forced final hidden states `[N, T, H]` of the positions that predict `units` [N, T]
        after left-padded prompts, with gradient. Rows with the same prompt (a GRPO group) share one
        prompt pass, and their completions attend to its keys and values: a group of G then costs
        one prompt, not G."""
        N, T = units.shape
        key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], 1)
        unique, index = torch.unique(key, dim=0, return_inverse=True)
        if len(unique) == N:  # nothing shared: one pass over prompt + completion
            ids = torch.cat([prompt_ids, units], 1)
            attn = torch.cat([prompt_mask, torch.ones_like(units)], 1)
            return self.forward_hidden(ids, attn, keep_last=T + 1)[:, :-1]
        Lp = prompt_ids.shape[1]
        p_ids, p_mask = unique[:, :Lp], unique[:, Lp:].to(prompt_mask.dtype)
        layers = self.fused_layers()
        p_pos = positions_from_mask(p_mask)
        cos, sin = self.rope(p_pos)
        prefix_kv: list = []
        h = self.hidden(layers, p_ids, cos, sin, _causal_padding_mask(p_mask, Lp), kv_out=prefix_kv)
        first = h[:, -1][index]  # the last prompt position predicts the first unit
        if T == 1:
            return first[:, None]
        S = T - 1  # the last unit predicts nothing we score
        pos = p_pos[index, -1:] + torch.arange(1, S + 1, device=units.device)
        cos, sin = self.rope(pos)
        causal = torch.ones(S, S, dtype=torch.bool, device=units.device).tril()
        mask = torch.cat([p_mask.bool()[index][:, None, None, :].expand(N, 1, S, Lp), causal.expand(N, 1, S, S)], -1)
        h = self.hidden(layers, units[:, :-1], cos, sin, mask, prefix=(prefix_kv, index))
        return torch.cat([first[:, None], h], 1)

    def stepper(self, max_len: int) -> _StaticCacheStepper:
        """A `sample_tokens` stepper over sequences of at most `max_len` (prompt + completion)."""
        return _StaticCacheStepper(self, max_len)

    @torch.no_grad()
    def sample(self, input_ids, attention_mask, **kwargs) -> SampleOutput:
        stepper = self.stepper(input_ids.shape[1] + kwargs["max_new_tokens"])
        return sample_tokens(self.model, input_ids, attention_mask, stepper=stepper, **kwargs)


def _sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(model.get_input_embeddings().weight, DTensor)


def completion_logprobs(model, fast: FastDecoder | None, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        units: torch.Tensor, *, temperature: float, suppress: torch.Tensor,
                        with_entropy: bool, window: slice | None = None,
                        chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced log-probs (and entropy) of `units[:, window]` (default: all T) after
    left-padded prompts, under softmax(logits / temperature) with `suppress` ids removed. The lean
    decoder runs when `fast` wraps `model` (gradients flow to its parameters); anything else (a
    frozen reference copy, dropout in training, LoRA, gradient checkpointing) takes the HF body's
    forward. Either gives the
    final hidden states of the positions that predict the window's units, and the output head
    turns them into log-probs `chunk` tokens at a time (`head_logprobs`): no `[N, T, V]` logits.
    Weights sharded by FSDP2 (whose gathering hooks only the whole model's forward runs) take the
    HF forward's logits, one micro-batch's at a time."""
    start, stop, _ = (window or slice(None)).indices(units.shape[1])
    units, T = units[:, :stop], stop - start  # later units cannot change a causal model's scores
    lean = (fast is not None and fast.model is model and not (model.training and fast.dropout > 0)
            and not checkpointing_on(model))  # the HF layers recompute, the lean ones keep
    ids = torch.cat([prompt_ids, units], 1)
    attn = torch.cat([prompt_mask, torch.ones_like(units)], 1)
    if _sharded(model):
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn), use_cache=False,
                       logits_to_keep=T + 1).logits[:, :-1].float()
        return token_logprobs(logits / temperature, units[:, start:], suppress.to(logits.device), with_entropy)
    if lean:
        hidden = fast.completion_hidden(prompt_ids, prompt_mask, units)[:, start:]
    else:
        hidden = causal_body(model)(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn),
                                    use_cache=False).last_hidden_state[:, -(T + 1):-1]
    head = model.get_output_embeddings()
    return head_logprobs(hidden, head.weight, units[:, start:], bias=head.bias, suppress=suppress,
                         temperature=temperature, with_entropy=with_entropy, chunk=chunk)


def causal_body(model):
    """The transformer under an HF model's output head (`Qwen2Model` of a `Qwen2ForCausalLM`, the
    vision + language `Qwen2_5_VLModel` of a Qwen2.5-VL), through a peft wrapper: its forward gives
    the final-norm hidden states the head reads."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hf.base_model


def _plain_projections(body) -> bool:
    """Every projection of every layer is a plain `nn.Linear` (LoRA and quantised wrappers are not)."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return all(type(getattr(part, n, None)) is torch.nn.Linear
               for layer in body.layers for part, ns in ((layer.self_attn, names[:4]), (layer.mlp, names[4:]))
               for n in ns)


def _causal_padding_mask(attention_mask: torch.Tensor, S: int) -> torch.Tensor:
    device = attention_mask.device
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    mask = causal & attention_mask.bool()[:, None, None, :]
    # A left-pad query sees nothing; let it see itself so the softmax stays finite (output unused).
    return mask | torch.eye(S, dtype=torch.bool, device=device)


class _StaticCacheStepper:
    """Prefill once, then one token per step into a preallocated KV buffer.

    The per-token step is written for a batch of single tokens: 2-D activations, weights
    transposed once per sampling call (a plain `mm` is about half the cost of `linear` on a 3-D
    input at this size), grouped-query attention as two batched matmuls without repeating the
    keys, and the rotary tables laid out per step. On small models every op saved is time saved.
    """

    def __init__(self, dec: FastDecoder, max_len: int):
        self.dec = dec
        self.max_len = max_len
        self.layers = dec.fused_layers()  # rebuilt per sampling call: always the latest weights
        self.step_layers = [_transposed(L, dec.fuse) for L in self.layers]
        norm, head_t = dec.body.norm.weight, dec.model.lm_head.weight.t()
        # folded and contiguous (a copy) on small models; a view and the norm applied apart on big ones
        self.final_norm = None if dec.fuse else norm
        self.lm_head_t = (norm[:, None] * head_t).contiguous() if dec.fuse else head_t

    def _allocate(self, attention_mask: torch.Tensor, first_pos: torch.Tensor) -> None:
        """Zeroed KV buffers for left-padded prompts `attention_mask` [B, P], and the rotary tables
        of the generated tokens: row b's k-th token sits at position `first_pos[b] + k`."""
        d = self.dec
        B, P = attention_mask.shape
        device = attention_mask.device
        dtype = d.body.embed_tokens.weight.dtype
        self.k_cache = torch.zeros(len(self.layers), B, d.n_kv, self.max_len, d.head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        cos, sin = d.rope(first_pos[:, None] + torch.arange(self.max_len - P, device=device))  # [B, 1, T - P, D]
        self.step_cos = cos.permute(2, 0, 1, 3).contiguous()  # [T - P, B, 1, D]: one `select` per step
        self.step_sin = sin.permute(2, 0, 1, 3).contiguous()
        # Additive key mask: -inf on left padding, 0 elsewhere (generated keys are always valid).
        key_bias = torch.zeros(B, 1, self.max_len, dtype=dtype, device=device)
        key_bias[:, 0, :P].masked_fill_(~attention_mask.bool(), float("-inf"))
        self.key_bias = key_bias.repeat_interleave(d.n_kv, 0)  # [B * Hkv, 1, T], rows as in k_flat
        # Per-layer [B * Hkv, T, D] views of the buffers: one `select` to write a step, one
        # `narrow` to read the prefix, no copies.
        self.k_layers = list(self.k_cache.view(len(self.layers), B * d.n_kv, self.max_len, d.head_dim).unbind(0))
        self.v_layers = list(self.v_cache.view(len(self.layers), B * d.n_kv, self.max_len, d.head_dim).unbind(0))
        self.prompt_len = self.cur = P

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        d = self.dec
        P = input_ids.shape[1]
        # Prompt positions skip the left padding; generated tokens continue from the last one.
        prompt_pos = positions_from_mask(attention_mask)
        self._allocate(attention_mask, prompt_pos[:, -1] + 1)
        cos, sin = d.rope(prompt_pos)
        h = d.hidden(self.layers, input_ids, cos, sin, _causal_padding_mask(attention_mask, P),
                     cache=(self.k_cache, self.v_cache), start=0)
        return d.logits(h[:, -1]).float()

    def load_prefix(self, kv: list[tuple[torch.Tensor, torch.Tensor]], attention_mask: torch.Tensor,
                    first_pos: torch.Tensor) -> None:
        """Decode after a prompt that another forward ran (a VLM's, with its vision inputs): `kv`
        holds each layer's rotated keys and values `[n, Hkv, P, D]` of n contexts, whose B / n
        rows are adjacent in `attention_mask` [B, P]; row b's first generated token sits at
        position `first_pos[b]`. The caller keeps the prompt's last logits."""
        self._allocate(attention_mask, first_pos)
        P = attention_mask.shape[1]
        for i, (k, v) in enumerate(kv):  # each context broadcast over its rows: no repeated copy
            self.k_cache[i, :, :, :P].unflatten(0, (k.shape[0], -1)).copy_(k.unsqueeze(1))
            self.v_cache[i, :, :, :P].unflatten(0, (v.shape[0], -1)).copy_(v.unsqueeze(1))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        d = self.dec
        t = self.cur
        self.cur += 1
        B = tokens.shape[0]
        nq, nkv, hd = d.n_heads, d.n_kv, d.head_dim
        group = nq // nkv
        cos, sin = self.step_cos[t - self.prompt_len], self.step_sin[t - self.prompt_len]  # [B, 1, D]
        bias = self.key_bias.narrow(2, 0, t + 1)
        h = d.body.embed_tokens.weight[tokens]
        for L, k_buf, v_buf in zip(self.step_layers, self.k_layers, self.v_layers):
            qkv = _project(_rms_norm(h, L["ln1_step"], d.eps), L["qkv_t"], L["qkv_b"]).view(B, nq + 2 * nkv, hd)
            qk, v = qkv.split([nq + nkv, nkv], 1)
            if L["q_norm"] is not None:
                q, k = qk.split([nq, nkv], dim=1)
                qk = torch.cat([_rms_norm(q, L["q_norm"], d.eps), _rms_norm(k, L["k_norm"], d.eps)], 1)
            q, k = _rotate(qk, cos, sin).split([nq, nkv], 1)
            k_buf.select(1, t).copy_(k.reshape(B * nkv, hd))
            v_buf.select(1, t).copy_(v.reshape(B * nkv, hd))
            keys, values = k_buf.narrow(1, 0, t + 1), v_buf.narrow(1, 0, t + 1)  # [B * Hkv, t+1, D]
            # Query heads that share a key/value head attend together: [B * Hkv, group, D].
            scores = torch.baddbmm(bias, q.reshape(B * nkv, group, hd), keys.transpose(1, 2), alpha=L["scaling"])
            o = torch.bmm(scores.softmax(-1), values).view(B, nq * hd)
            h = _project(o, L["o_t"], L["o_b"], residual=h)
            gate, up = _project(_rms_norm(h, L["ln2_step"], d.eps), L["gate_up_t"], None).chunk(2, dim=-1)
            h = torch.addmm(h, F.silu(gate) * up, L["down_t"])
        return (_rms_norm(h, self.final_norm, d.eps) @ self.lm_head_t).float()


def _linear(x: torch.Tensor, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` of a fused weight, or of a list of weights (their outputs concatenated: no weight copy)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = torch.cat([F.linear(x, w) for w in weight], -1)
    return out if bias is None else out + bias


def _project(x: torch.Tensor, weight_t: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """`residual + x @ weight_t + bias` in as few ops as the operands allow (`weight_t` a list:
    the parts' products concatenated)."""
    if not isinstance(weight_t, torch.Tensor):
        out = torch.cat([x @ w for w in weight_t], -1)
        return out if bias is None else out + bias
    if residual is not None and bias is not None:
        residual = residual + bias
    add = residual if residual is not None else bias
    return x @ weight_t if add is None else torch.addmm(add, x, weight_t)


def _transposed(L: dict, fuse: bool) -> dict:
    """A layer's weights as `x @ W` operands for the decode step. Fused: transposed once per
    sampling call (contiguous copies), with each RMSNorm scale folded into the matmul that follows
    it (one op fewer per norm; the same product up to float rounding). Not fused: transposed views
    of the model's weights (BLAS reads them as they are) and the norm scales applied to x."""
    out = dict(L)
    if not fuse:
        out.update(ln1_step=L["ln1"], ln2_step=L["ln2"], qkv_t=[w.t() for w in L["qkv_w"]], o_t=L["o_w"].t(),
                   gate_up_t=[w.t() for w in L["gate_up_w"]], down_t=L["down_w"].t())
        return out
    out["ln1_step"] = out["ln2_step"] = None
    out["qkv_t"] = (L["ln1"][:, None] * L["qkv_w"].t()).contiguous()
    out["o_t"] = L["o_w"].t().contiguous()
    out["gate_up_t"] = (L["ln2"][:, None] * L["gate_up_w"].t()).contiguous()
    out["down_t"] = L["down_w"].t().contiguous()
    return out
