"""The data contract between policies, rewards and the trainer, and batched LM sampling.

A `Rollout` holds N samples of `[N, T]` decision units (tokens, image codes, action tokens or
denoising steps) with the sampler's log-probs, a mask and the unit budget the sampler worked
under. The trainer only ever sees this shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from mmrl.hf_compat import cache_kwargs, cache_of
from mmrl.run_config import LOGPROB_CHUNK_LOGITS


class Diverged(RuntimeError):
    """The policy's numbers are no longer finite (NaN / inf): its loss, gradient or outputs. Its
    weights have diverged, so training cannot go on; the trainer ends the run in one line naming
    the newest checkpoint, without saving the diverged weights (mmrl.run_control.TrainingDiverged)."""


class NonFiniteSampling(Diverged):
    """Sampling met non-finite log-probs or actions: the policy's outputs, hence its weights, diverged."""


@dataclass
class Rollout:
    units: torch.Tensor  # [N, T, ...] tokens, codes or SDE states
    logp_old: torch.Tensor  # float [N, T], the sampler's log-probs
    mask: torch.Tensor  # bool [N, T], units that are trained
    truncated: torch.Tensor  # bool [N], hit the unit budget without finishing
    # The most units a row could have had (max_new_tokens; episode chunks x tokens per chunk;
    # denoising steps x chunks): the constant of length-normalised losses and overlong shaping.
    max_units: int
    contexts: list[Any] = field(default_factory=list)  # per-sample context (prompt, answer, env state)
    # What `logprobs` needs; dim 0 = N. A list value holds one tensor per sample (ragged data such
    # as a VLM's flat pixel patches); rows may share one tensor object, and `select`/`concat`
    # index the list instead of the tensor.
    extras: dict[str, torch.Tensor | list[torch.Tensor]] = field(default_factory=dict)
    rewards: dict[str, torch.Tensor] = field(default_factory=dict)  # named components, [N] each
    # int [N]: rows with one id form a group. Policies return rows context-major (the G samples of
    # a context adjacent); the trainer stamps the ids (`stamp_groups`), the one place they are made.
    group_ids: torch.Tensor | None = None
    # float [N, T]: an external engine's log-probs of the sampled units (vLLM), when they are not the
    # trainer's; the behaviour policy of the mismatch correction (rollout.correction). None: the
    # sampler's own, logp_old.
    logp_beh: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.mask.shape[0]

    def stamp_groups(self, group_size: int, first_id: int = 0) -> Rollout:
        """Set group ids `first_id, first_id + 1, ...`, one per `group_size` adjacent rows."""
        n = len(self)
        if n % group_size:
            raise ValueError(f"{n} rows do not split into groups of {group_size}")
        self.group_ids = torch.arange(first_id, first_id + n // group_size,
                                      device=self.mask.device).repeat_interleave(group_size)
        return self

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)

    def select(self, index: torch.Tensor) -> Rollout:
        """Rows `index` (an int index or bool mask over N), every per-sample field alike."""
        if index.dtype == torch.bool:
            index = index.nonzero().squeeze(-1)
        idx_list = index.tolist()
        take = lambda t: t[index.to(t.device)]  # noqa: E731
        return Rollout(
            units=take(self.units),
            logp_old=take(self.logp_old),
            mask=take(self.mask),
            truncated=take(self.truncated),
            max_units=self.max_units,
            group_ids=None if self.group_ids is None else take(self.group_ids),
            logp_beh=None if self.logp_beh is None else take(self.logp_beh),
            contexts=[self.contexts[i] for i in idx_list] if self.contexts else [],
            extras={k: [v[i] for i in idx_list] if isinstance(v, list) else take(v) for k, v in self.extras.items()},
            rewards={k: take(v) for k, v in self.rewards.items()},
        )

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """Join rollouts sampled separately (e.g. DAPO's re-sampling); pads T to the longest."""
        if len(parts) == 1:
            return parts[0]
        T = max(p.units.shape[1] for p in parts)

        def pad(t: torch.Tensor, value) -> torch.Tensor:
            if t.dim() < 2 or t.shape[1] == T:
                return t
            shape = (t.shape[0], T - t.shape[1], *t.shape[2:])
            return torch.cat([t, t.new_full(shape, value)], 1)

        out = {}
        for f in fields(Rollout):
            vals = [getattr(p, f.name) for p in parts]
            if f.name == "contexts":
                out[f.name] = [c for v in vals for c in v]
            elif f.name in ("extras", "rewards"):
                pad_fn = _left_pad_cat if f.name == "extras" else torch.cat
                out[f.name] = {k: pad_fn([v[k] for v in vals]) for k in vals[0]}
            elif f.name == "mask":
                out[f.name] = torch.cat([pad(v, False) for v in vals])
            elif f.name == "units":
                out[f.name] = torch.cat([pad(v, 0) for v in vals])
            elif f.name == "logp_old":
                out[f.name] = torch.cat([pad(v, 0.0) for v in vals])
            elif f.name == "logp_beh":
                out[f.name] = None if any(v is None for v in vals) else torch.cat([pad(v, 0.0) for v in vals])
            elif f.name == "max_units":
                out[f.name] = max(vals)
            elif f.name == "group_ids":
                out[f.name] = None if any(v is None for v in vals) else torch.cat(vals)
            else:
                out[f.name] = torch.cat(vals)
        return Rollout(**out)

    def to(self, device) -> Rollout:
        mv = lambda t: t.to(device)  # noqa: E731
        return replace(
            self,
            group_ids=None if self.group_ids is None else mv(self.group_ids),
            logp_beh=None if self.logp_beh is None else mv(self.logp_beh),
            units=mv(self.units),
            logp_old=mv(self.logp_old),
            mask=mv(self.mask),
            truncated=mv(self.truncated),
            extras={k: _move_list(v, device) if isinstance(v, list) else mv(v) for k, v in self.extras.items()},
            rewards={k: mv(v) for k, v in self.rewards.items()},
        )


def unit_spans(mask: torch.Tensor) -> torch.Tensor:
    """Long [N]: the index after each row's last True of `mask` [N, T] (0 for an empty row)."""
    position = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.long() * position).amax(1) if mask.shape[1] else mask.new_zeros(mask.shape[0], dtype=torch.long)


def token_budget_batches(sizes: torch.Tensor, budget: int, max_rows: int = 0) -> list[torch.Tensor]:
    """Rows packed into micro-batches by length (verl's dynamic batch size): `sizes` [N, 2] is each
    row's prompt and reply tokens; a micro-batch pads every row to its longest prompt and longest
    reply, so it costs rows x (max prompt + max reply) tokens, kept <= `budget` (and rows <= `max_rows`
    when > 0). Longest rows first, greedily; returns row indices. A row over the budget alone is an
    error: no micro-batch may exceed it."""
    order = torch.argsort(sizes.sum(1), descending=True, stable=True).tolist()
    p, r = sizes[:, 0].tolist(), sizes[:, 1].tolist()
    batches, rows, max_p, max_r = [], [], 0, 0
    for i in order:
        if p[i] + r[i] > budget:
            raise ValueError(f"train.max_tokens_per_micro {budget} is below one row's {p[i]} prompt + {r[i]} reply "
                             f"tokens; set it to at least {p[i] + r[i]} (or 0: row-count micro-batches)")
        mp, mr = max(max_p, p[i]), max(max_r, r[i])
        if rows and ((len(rows) + 1) * (mp + mr) > budget or len(rows) == max_rows):
            batches.append(rows)
            rows, mp, mr = [], p[i], r[i]
        rows.append(i)
        max_p, max_r = mp, mr
    if rows:
        batches.append(rows)
    return [torch.tensor(b, dtype=torch.long) for b in batches]


def _move_list(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Move per-sample tensors, keeping rows that shared one tensor sharing one copy (other values,
    e.g. a VLM's prompt text and images, stay where they are)."""
    moved: dict[int, torch.Tensor] = {}
    for t in tensors:
        if id(t) not in moved:
            moved[id(t)] = t.to(device) if isinstance(t, torch.Tensor) else t
    return [moved[id(t)] for t in tensors]


def _left_pad_cat(tensors: list[torch.Tensor] | list[list[torch.Tensor]]) -> torch.Tensor | list[torch.Tensor]:
    """Concatenate along dim 0, left-padding dim 1 with zeros (prompts are left-padded; 0 = masked).
    Per-sample lists are joined as lists."""
    if isinstance(tensors[0], list):
        return [t for part in tensors for t in part]
    if tensors[0].dim() < 2:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    padded = [torch.cat([t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:])), t], 1) for t in tensors]
    return torch.cat(padded)


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B, T] generated ids, pad after the end
    logp: torch.Tensor  # [B, T] log-probs of the tokens under softmax(logits / temperature)
    mask: torch.Tensor  # bool [B, T], through the first EOS
    truncated: torch.Tensor  # bool [B], no EOS within the budget


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus filtering; removed entries become -inf (never multiplied by a mask)."""
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = torch.where(drop, torch.full_like(logits, float("-inf")), logits)
    return logits


def token_logprobs(logits: torch.Tensor, units: torch.Tensor, suppress: torch.Tensor | None,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `units` [N, T] under logits [N, T, V] with `suppress` ids removed (-inf).
    `logits` are the model's own (finite); masking goes through `suppress`."""
    raw = logits
    if suppress is not None and suppress.numel():
        logits = logits.index_fill(-1, suppress, float("-inf"))
    lse = logits.logsumexp(-1)
    logp = logits.gather(-1, units.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        probs = (logits - lse.unsqueeze(-1)).exp()
        # Suppressed entries have probability 0: pair them with their finite raw logits so
        # neither the value nor the gradient meets 0 * inf.
        entropy = lse - (probs * raw).sum(-1)
    return logp, entropy


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, units: torch.Tensor, *, bias: torch.Tensor | None = None,
                  suppress: torch.Tensor | None = None, temperature: float = 1.0, with_entropy: bool = False,
                  chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of `units` [N, T] under the output head (`weight` [V, H], `bias`) applied to
    the final hidden states `hidden` [N, T, H] and divided by `temperature`, computed `chunk` tokens at
    a time (0: as many as make `LOGPROB_CHUNK_LOGITS` logits): the logits of one chunk exist at once,
    in the forward and again in the backward (which recomputes them), never `[N, T, V]` nor a float32
    copy of it. Values and gradients are the one-pass ones. Returns float32 log-probs [N, T] and,
    `with_entropy`, entropies [N, T]."""
    N, T, H = hidden.shape
    chunk = chunk or max(1, LOGPROB_CHUNK_LOGITS // weight.shape[0])
    if N * T <= chunk:  # one chunk: plain autograd over the logits, the same ops as one pass
        logits = torch.nn.functional.linear(hidden, weight, bias).float()
        return token_logprobs(logits / temperature if temperature != 1.0 else logits, units, suppress, with_entropy)
    if suppress is None:
        suppress = torch.zeros(0, dtype=torch.long, device=hidden.device)
    logp, entropy = _HeadLogprobs.apply(hidden.reshape(N * T, H), weight, bias, units.reshape(N * T),
                                        suppress.to(hidden.device), float(temperature), bool(with_entropy), chunk)
    return logp.view(N, T), entropy.view(N, T) if with_entropy else None


class _HeadLogprobs(torch.autograd.Function):
    """The chunked output head of `head_logprobs`. The backward recomputes each chunk's logits and
    differentiates log p(u) = z_u - lse(z) and H = lse(z) - sum_j p_j z_j by hand:
    d logp / dz = onehot(u) - p,  dH / dz = -p (z - sum_j p_j z_j), with z = logits / temperature.
    Two [chunk, V] float32 buffers are alive at a time (the logits, reused in place, and p)."""

    @staticmethod
    def _chunk_logits(h, weight, bias, temperature):
        """The scaled logits of a chunk, float32 [n, V] (a fresh tensor the caller may overwrite)."""
        z = torch.nn.functional.linear(h, weight, bias).float()
        return z.div_(temperature) if temperature != 1.0 else z

    @staticmethod
    def _probs(z, suppress):
        """(lse [n], p [n, V]) of logits `z` with the suppressed ids removed; `z` is left with 0 at
        those ids (finite where p = 0, so p * z stays finite)."""
        if suppress.numel():
            z.index_fill_(-1, suppress, float("-inf"))
        lse = z.logsumexp(-1)
        p = (z - lse[:, None]).exp_()
        if suppress.numel():
            z.index_fill_(-1, suppress, 0.0)
        return lse, p

    @staticmethod
    def _expected(p, z):
        """sum_j p_j z_j per row, without a [n, V] product."""
        return (p.unsqueeze(1) @ z.unsqueeze(2)).view(-1)

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, bias, units, suppress, temperature, with_entropy, chunk):
        logp = hidden.new_empty(len(units), dtype=torch.float32)
        entropy = hidden.new_zeros(len(units) if with_entropy else 0, dtype=torch.float32)
        for lo in range(0, len(units), chunk):
            sl = slice(lo, lo + chunk)
            z = _HeadLogprobs._chunk_logits(hidden[sl], weight, bias, temperature)
            picked = z.gather(-1, units[sl, None]).squeeze(-1)
            if suppress.numel():  # a suppressed unit has probability 0
                picked = picked.masked_fill(torch.isin(units[sl], suppress), float("-inf"))
            lse, p = _HeadLogprobs._probs(z, suppress)
            logp[sl] = picked - lse
            if with_entropy:
                entropy[sl] = lse - _HeadLogprobs._expected(p, z)
            del z, p
        ctx.save_for_backward(hidden, weight, bias, units, suppress)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        return logp, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, units, suppress = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        use_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        for lo in range(0, len(units), ctx.chunk):
            sl = slice(lo, lo + ctx.chunk)
            h = hidden[sl]
            z = _HeadLogprobs._chunk_logits(h, weight, bias, ctx.temperature)
            _, p = _HeadLogprobs._probs(z, suppress)
            g = grad_logp[sl, None]
            if use_entropy:  # z becomes the gradient in place: -g_H p (z - E_p z) - g_logp p
                ez = _HeadLogprobs._expected(p, z)[:, None]
                gz = z.sub_(ez).mul_(p).mul_(-grad_entropy[sl, None]).sub_(p.mul_(g))
            else:
                gz = p.mul_(-g)
            del z, p
            # z_u of a suppressed unit is the constant -inf (as index_fill makes it): no gradient to it
            hit = g * ~torch.isin(units[sl, None], suppress) if suppress.numel() else g
            gz.scatter_add_(-1, units[sl, None], hit)
            if ctx.temperature != 1.0:
                gz.div_(ctx.temperature)
            if need_h:
                grad_h[sl] = gz.to(h.dtype) @ weight.to(h.dtype)
            if need_w:
                grad_w.addmm_(gz.t(), h.float())
            if grad_b is not None:
                grad_b += gz.sum(0)
            del gz
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


class HFStepper:
    """Next-token logits from any Hugging Face causal LM, with its own KV cache."""

    def __init__(self, model, model_kwargs: dict[str, Any] | None = None):
        self.model = model
        self.model_kwargs = model_kwargs or {}

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.attn = attention_mask
        pos = positions_from_mask(attention_mask)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **self.model_kwargs)
        self.past, self.next_pos = cache_of(out), pos[:, -1:] + 1
        return out.logits[:, -1, :].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        # Tokens fed after a row's EOS come after all its real tokens, so causal attention keeps
        # them from touching anything that is trained; they can stay attendable.
        self.attn = torch.cat([self.attn, self.attn.new_ones(self.attn.shape[0], 1)], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attn, position_ids=self.next_pos,
                         use_cache=True, **cache_kwargs(self.model, self.past))
        self.past, self.next_pos = cache_of(out), self.next_pos + 1
        return out.logits[:, -1, :].float()


def through_first_eos(is_eos: torch.Tensor) -> torch.Tensor:
    """The unit mask of sampled rows [N, T]: a unit is real up to and including its row's first EOS
    (every unit of a row without one)."""
    return (is_eos.long().cumsum(1) - is_eos.long()) == 0


def sample_tokens(*args, **kwargs) -> SampleOutput:
    """See `_sample_tokens`. Runs under inference mode (less per-op bookkeeping than no_grad,
    ~15% per token on small models) and returns ordinary tensors the trainer can use."""
    with torch.inference_mode():
        out = _sample_tokens(*args, **kwargs)
    return SampleOutput(tokens=out.tokens.clone(), logp=out.logp.clone(), mask=out.mask.clone(),
                        truncated=out.truncated.clone())


def _sample_tokens(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    suppress_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
    stepper=None,
) -> SampleOutput:
    """Batched autoregressive sampling with a KV cache, from left-padded prompts.

    `stepper` supplies next-token logits (`prefill`, then `step` per token); by default the HF
    model's own forward. The returned log-probs are those of softmax(logits / temperature) over
    the vocabulary with `suppress_token_ids` removed: exactly the distribution the trainer
    recomputes with teacher forcing. Top-k / top-p only narrow which token is drawn; they do not
    enter the log-prob, so old_logp and the trainer's logp agree at equal weights.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    greedy = temperature == 0
    stepper = stepper or HFStepper(model)
    B, device = input_ids.shape[0], input_ids.device
    eos = torch.tensor(eos_token_ids, device=device)
    suppress = torch.tensor(suppress_token_ids or [], dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    # Per-token work is kept to the draw itself: tokens and log-probs are collected in lists and
    # the pad / mask bookkeeping after each row's EOS is done once at the end. Tokens drawn after
    # a row's EOS are fed back but never trained (causal attention keeps them out of the row's
    # real tokens) and are replaced by padding below.
    drawn_tokens, drawn_logps = [], []
    logits = stepper.prefill(input_ids, attention_mask)
    for t in range(max_new_tokens):
        scaled = logits if greedy or temperature == 1.0 else logits / temperature
        if suppress.numel():
            scaled = scaled.index_fill(-1, suppress, float("-inf"))
        logp_all = scaled.log_softmax(-1)
        if greedy:
            tok = scaled.argmax(-1)
        else:
            probs = _filter_logits(scaled, top_k, top_p).softmax(-1) if (top_k or top_p < 1.0) else logp_all.exp()
            # Inverse-CDF draw: one uniform per row and a binary search, several times cheaper
            # per token than torch.multinomial. Scaling u by the row total keeps it strictly
            # below the last cumulative value, and `right=True` never lands on a p = 0 entry.
            cdf = probs.cumsum(-1)
            u = torch.rand((B, 1), generator=generator, device=device, dtype=cdf.dtype) * cdf[:, -1:]
            # Clamped: non-finite logits (diverged weights) make the cdf NaN and the search land past
            # the vocabulary; the token stays a valid id and its NaN log-prob is what the collector checks.
            tok = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
        drawn_tokens.append(tok)
        drawn_logps.append(logp_all.gather(-1, tok[:, None]).squeeze(-1))
        finished |= tok == eos[0] if len(eos) == 1 else torch.isin(tok, eos)
        # Checking for "all done" costs a host sync; every 4th token is often enough.
        if t == max_new_tokens - 1 or (t % 4 == 3 and bool(finished.all())):
            break
        logits = stepper.step(tok)
    tokens = torch.stack(drawn_tokens, 1)
    is_eos = tokens == eos[0] if len(eos) == 1 else torch.isin(tokens, eos)
    mask = through_first_eos(is_eos)
    return SampleOutput(tokens=tokens.masked_fill(~mask, pad_token_id), logp=torch.stack(drawn_logps, 1) * mask,
                        mask=mask, truncated=~finished)
