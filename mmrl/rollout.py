"""The data contract between policies, rewards and the trainer, and batched LM sampling.

A `Rollout` holds N samples of `[N, T]` decision units (tokens, image codes, action tokens or
denoising steps) with the sampler's log-probs, a mask and the unit budget the sampler worked
under. The trainer only ever sees this shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


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


def _move_list(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Move per-sample tensors, keeping rows that shared one tensor sharing one copy."""
    moved: dict[int, torch.Tensor] = {}
    for t in tensors:
        if id(t) not in moved:
            moved[id(t)] = t.to(device)
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
        self.past, self.next_pos = out.past_key_values, pos[:, -1:] + 1
        return out.logits[:, -1, :].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        # Tokens fed after a row's EOS come after all its real tokens, so causal attention keeps
        # them from touching anything that is trained; they can stay attendable.
        self.attn = torch.cat([self.attn, self.attn.new_ones(self.attn.shape[0], 1)], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attn, position_ids=self.next_pos,
                         past_key_values=self.past, use_cache=True)
        self.past, self.next_pos = out.past_key_values, self.next_pos + 1
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
            tok = torch.searchsorted(cdf, u, right=True).squeeze(-1)
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
