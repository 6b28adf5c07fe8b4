"""The update stage of the step: one RL update of the policy on a scored rollout and its advantages.

The policy loss (a registry name of mmrl.algos) plus the loss terms and auxiliary losses of
mmrl.stages, over `train.ppo_epochs` x `train.mini_batches` optimizer steps, each a sum of
micro-batches whose forward and backward hold one micro-batch's activations. Every term is
normalised by the whole optimizer step (all its micro-batches, all ranks), so neither
micro-batching nor the number of ranks changes the gradient.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from mmrl import algos, distributed
from mmrl.distributed import Dist
from mmrl.logger import say
from mmrl.rollout import Diverged, Rollout, token_budget_batches
from mmrl.run_config import RunConfig
from mmrl.stages import AdvantageInputs, LossTerm, Stages, TermInputs


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_adamw(params: list[torch.nn.Parameter], **kwargs) -> torch.optim.AdamW:
    """AdamW as one fused kernel over all parameters where torch has one (CPU and CUDA float
    tensors); the per-parameter loop it replaces is a dozen ops per tensor per step."""
    fused = all(p.dtype.is_floating_point and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, fused=fused, **kwargs)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    # foreach: one multi-tensor norm instead of one per parameter (torch only defaults to it on GPU).
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


class Updater:
    """Holds the optimizer and what the loss reads from the config; `update` runs one RL update."""

    def __init__(self, cfg: RunConfig, policy, task, dist: Dist, stages: Stages, autocast,
                 shuffle_gen: torch.Generator, sample_gen: torch.Generator, warn: Callable[..., None] | None = None):
        self.cfg, self.policy, self.task, self.dist, self.stages = cfg, policy, task, dist, stages
        self.autocast, self.shuffle_gen, self.sample_gen = autocast, shuffle_gen, sample_gen
        self.warn = warn or (lambda message, kind=None: say(f"warning: {message}"))  # MetricsLogger.warn's signature
        self.nonfinite = NonFiniteSteps(cfg.train.max_nonfinite_steps, dist, self.warn)
        self.device = policy.device
        self.loss_spec = algos.get_loss_spec(cfg.algo.loss)
        self.loss_params = dict(cfg.algo.loss_params)
        self.agg = self.loss_params.get("agg") or self.loss_spec.default_agg
        # Flow-GRPO's exact KL of Gaussian steps: a score of the policy's forward, from the
        # reference's step means, instead of an estimator on log-probs
        self.gaussian_kl = cfg.algo.beta > 0 and cfg.algo.kl_kind == algos.GAUSSIAN_KL
        self.loss_terms: list[LossTerm] = stages.of(LossTerm)
        self.term_names = tuple(term.name for term in self.loss_terms)
        self.masks_images = cfg.algo.masks_images or stages.needs_masked_images
        # How many rows each rank's value of a row-mean metric of the last update is over
        # (distributed.reduce_metrics weighs the ranks by it).
        self.metric_weights: dict[str, float] = {}
        self.params = [p for p in policy.model.parameters() if p.requires_grad]
        t = cfg.train
        self.optimizer = make_adamw(self.params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        updates_per_step = t.ppo_epochs * t.mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(t.warmup_steps * updates_per_step, t.steps * updates_per_step, t.min_lr_ratio))

    # ------------------------------------------------------------------ micro-batches

    def row_sizes(self, rollout: Rollout) -> torch.Tensor | None:
        """Each row's prompt and reply tokens [N, 2] when micro-batches are packed by length."""
        return self.policy.row_tokens(rollout) if self.cfg.train.max_tokens_per_micro else None

    def micro_batches(self, idx: torch.Tensor, sizes: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Rows `idx` in forward/backward micro-batches: `train.micro_batch_size` rows each, or packed
        by length under `train.max_tokens_per_micro` (`sizes`: `row_sizes` of the whole rollout)."""
        if len(idx) == 0:
            return []
        t = self.cfg.train
        if not t.max_tokens_per_micro:
            return list(idx.split(t.micro_batch_size or len(idx)))
        batches = [idx[b.to(idx.device)] for b in token_budget_batches(sizes[idx], t.max_tokens_per_micro,
                                                                        t.micro_batch_size)]
        if self.dist.fsdp:  # FSDP's collectives need the same number of forwards on every rank
            batches = split_largest(batches, distributed.all_max(self.dist, len(batches)))
        return batches

    def micro_part(self, rollout: Rollout, rows: torch.Tensor) -> Rollout:
        """The rows of one micro-batch; packed by length, without the padding no row of it needs."""
        part = rollout.select(rows)
        return self.policy.trim_padding(part) if self.cfg.train.max_tokens_per_micro else part

    @torch.no_grad()
    def in_micro_batches(self, rollout: Rollout, score: Callable[[torch.Tensor], Any]) -> Any:
        """`score(rows)` over the update's micro-batches of `rollout`, joined in row order (a tensor
        [N, ...] or a dict of them; units past a micro-batch's trimmed width are 0): a pass without
        gradient (the old log-probs, the reference, the certainty pass) then holds one micro-batch's
        activations, as the update itself does."""
        batches = self.micro_batches(torch.arange(len(rollout), device=self.device), self.row_sizes(rollout))
        parts = [score(rows) for rows in batches]
        order = torch.argsort(torch.cat(batches))
        T = rollout.mask.shape[1]

        def join(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([pad_units(x, T) for x in tensors])[order]

        if isinstance(parts[0], dict):
            return {k: join([p[k] for p in parts]) for k in parts[0]}
        return join(parts)

    def unit_budget(self, rollout: Rollout) -> int:
        """The length constant of seq-mean-token-sum-norm and overlong shaping: the sampler's unit
        budget, unless `algo.loss_params.max_response_len` sets it."""
        return self.loss_params.get("max_response_len", rollout.max_units)

    def unit_windows(self, T: int) -> list[slice]:
        """The windows along T that `train.unit_chunk` back-propagates one at a time (one: all T)."""
        c = self.cfg.train.unit_chunk
        if c <= 0 or c >= T:
            return [slice(0, T)]
        return [slice(a, min(a + c, T)) for a in range(0, T, c)]

    # ------------------------------------------------------------------ the loss of a micro-batch

    def trained_scores(self) -> tuple[str, ...]:
        """The per-unit scores the loss differentiates (the rest are only logged or used as weights)."""
        keys = ["logp"]
        for term in self.loss_terms:
            if term.coef != 0 and term.score not in keys:
                keys.append(term.score)
        return tuple(keys)

    def score_units(self, part: Rollout, masked: Rollout | None, window: slice | None = None,
                    ref_means: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Per-unit log-probs and entropies [n, T] (of `window`) of `part`, of `masked` (the same
        units with the images masked) when the update uses that pass, and with `ref_means` (the
        gaussian KL) the exact KL of each Gaussian step to the reference's, from the same forward."""
        with self.autocast:
            if ref_means is not None:
                logp, kl = self.policy.logprobs_and_kl(part, ref_means, units=window)
                scores = {"logp": logp, "entropy": torch.zeros_like(logp), "kl_ref": kl}  # a Gaussian's: constant
            else:
                logp, entropy = self.policy.logprobs(part, with_entropy=True, units=window)
                scores = {"logp": logp, "entropy": entropy}
            if masked is not None:
                with_entropy = "entropy_masked" in self.trained_scores()
                scores["logp_masked"], entropy_masked = self.policy.logprobs(masked, with_entropy=with_entropy,
                                                                             units=window)
                if with_entropy:
                    scores["entropy_masked"] = entropy_masked
        return scores

    def micro_loss(self, part: Rollout, scores: dict[str, torch.Tensor], mask: torch.Tensor, old_logp: torch.Tensor,
                   adv: torch.Tensor, ref_logp: torch.Tensor | None, denom: torch.Tensor,
                   weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch from its per-unit scores [n, T], every term aggregated with
        the same mask, `agg` mode and `denom` (the whole optimizer step's), and its metrics."""
        a, budget = self.cfg.algo, self.unit_budget(part)
        logp, entropy = scores["logp"], scores["entropy"]
        params = {**self.loss_params, "max_response_len": budget}
        pg_mask = algos.high_entropy_tokens(entropy.detach(), mask, a.entropy_top_frac)  # mask itself at 1.0
        loss, metrics = algos.policy_loss(a.loss, logp, old_logp, adv, pg_mask, denominator=denom, agg=self.agg,
                                          weights=weights, **{k: v for k, v in params.items() if k != "agg"})
        metrics = {k: float(v) for k, v in metrics.items()}

        inputs = TermInputs(scores, mask, ref_logp, self.trained_scores())
        for term in self.loss_terms:
            per_unit = term.per_unit(inputs)
            if per_unit is not None:
                value = algos.aggregate(per_unit, mask, self.agg, budget, denominator=denom)
                loss = loss + term.coef * value
                metrics[term.name] = value.item()
        return loss, metrics

    def backward_micro(self, part: Rollout, masked: Rollout | None, mask: torch.Tensor, old_logp: torch.Tensor,
                       adv: torch.Tensor, ref: torch.Tensor | None, denom: torch.Tensor,
                       weights: torch.Tensor | None = None) -> tuple[float, dict[str, float]]:
        """Backward of `micro_loss` on `part`; `ref` is the reference's log-probs, or with the
        gaussian KL its step means (an input of the scores, not of the loss); `weights` the
        mismatch correction's (see `correct_mismatch`). With several unit windows
        (`train.unit_chunk`), the loss is first taken on scores computed without graph, which gives
        its gradient with respect to every unit's scores; each window is then recomputed with graph
        and back-propagated against that gradient. The chain rule makes the parameter gradient the
        one-pass gradient for every loss and aggregation (sequence-level ratios included), while
        only one window's activations are alive at a time."""
        windows = self.unit_windows(part.units.shape[1])
        ref_means, ref_logp = (ref, None) if self.gaussian_kl else (None, ref)
        loss_inputs = (mask, old_logp, adv, ref_logp, denom, weights)
        if len(windows) == 1:
            loss, metrics = self.micro_loss(part, self.score_units(part, masked, ref_means=ref_means), *loss_inputs)
            loss.backward()
            return loss.item(), metrics
        trained = self.trained_scores()
        with torch.no_grad():
            pieces = [self.score_units(part, masked, w, ref_means) for w in windows]
        scores = {k: torch.cat([p[k] for p in pieces], 1).float().requires_grad_(k in trained) for k in pieces[0]}
        loss, metrics = self.micro_loss(part, scores, *loss_inputs)
        loss.backward()
        for w in windows:
            window_scores = self.score_units(part, masked, w, ref_means)
            term = sum(((window_scores[k] * scores[k].grad[:, w]).sum() for k in trained))
            if term.requires_grad:  # a policy may skip a window of untrained units (no graph)
                term.backward()
        return loss.item(), metrics

    # ------------------------------------------------------------------ before the epochs

    def masked_pass_scores(self, rollout: Rollout, masked: Rollout) -> dict[str, torch.Tensor]:
        """The per-unit scores [N, T] of `rollout` and of `masked` (its images masked), without graph."""
        return self.in_micro_batches(rollout, lambda rows: self.score_units(self.micro_part(rollout, rows),
                                                                           self.micro_part(masked, rows)))

    def correct_mismatch(self, rollout: Rollout, old_logp: torch.Tensor, mask: torch.Tensor
                         ) -> tuple[torch.Tensor, dict[str, float]]:
        """The TIS / MIS weights of the behaviour policy (the engine's log-probs, else the
        sampler's) against `old_logp`: [N] per sequence or [N, T] per unit, >= 0 and detached. The
        policy loss multiplies each unit's whole loss term by them (`algos.policy_loss(weights=)`),
        so a loss's own terms (KL-Cov's penalty) are weighted too and its choices (the tokens
        KL-Cov and Clip-Cov pick) are made on the unweighted advantages."""
        r = self.cfg.rollout
        level = r.correction_level
        if level == "auto":
            level = "sequence" if self.loss_spec.sequence_advantage else "token"
        behaviour = rollout.logp_beh if rollout.logp_beh is not None else rollout.logp_old
        weights, metrics = algos.mismatch_weights(old_logp, behaviour, mask, kind=r.correction, level=level,
                                                  cap=r.correction_cap)
        return weights, {f"correction/{k}": float(v) for k, v in metrics.items()}

    def pad_rows(self, rollout: Rollout, adv: torch.Tensor, filler: Rollout | None) -> tuple[Rollout, torch.Tensor]:
        """FSDP: pad this rank's rows to the most any rank has, with copies of a sampled row
        (`filler` when this rank kept none) whose units are all masked out (they add nothing to any
        loss term, normaliser or metric), so every rank runs the same forwards and backwards."""
        n_max = distributed.all_max(self.dist, len(rollout))
        if len(rollout) == n_max:
            return rollout, adv
        source = rollout if len(rollout) else filler
        pad = source.select(torch.zeros(n_max - len(rollout), dtype=torch.long, device=self.device))
        pad.mask = torch.zeros_like(pad.mask)
        pad.rewards = {k: v for k, v in pad.rewards.items() if k in rollout.rewards}
        padded = Rollout.concat([rollout, pad]) if len(rollout) else pad
        pad_adv = adv.new_zeros((n_max - len(rollout), *adv.shape[1:]))
        return padded, torch.cat([adv, pad_adv])

    def prepare(self, rollout: Rollout, adv: torch.Tensor, rewards: torch.Tensor) -> dict[str, Any]:
        """What every epoch of the update reads: the loss mask, the old log-probs (recomputed with
        `train.recompute_old_logp`), the reference's scores, the rollout with its images masked,
        the advantages after the transforms that need the policy's scores, and the mismatch
        correction's weights. `rewards`: the shaped rewards [N] the advantages came from."""
        a, N = self.cfg.algo, len(rollout)  # N 0: a rank that kept no rows while others did (replicate mode)
        mask = algos.mask_truncated(rollout.mask, rollout.truncated) if a.mask_truncated else rollout.mask
        old_logp = rollout.logp_old
        if self.cfg.train.recompute_old_logp and N:
            with self.autocast:
                old_logp = self.in_micro_batches(rollout, lambda rows: self.policy.logprobs(
                    self.micro_part(rollout, rows))[0])
        ref = None  # the reference's log-probs [N, T], or with the gaussian KL its step means [N, T, *unit_shape]
        if a.beta > 0 and N:
            reference = self.policy.reference_means if self.gaussian_kl else self.policy.reference_logprobs
            with self.autocast:
                ref = self.in_micro_batches(rollout, lambda rows: reference(self.micro_part(rollout, rows)))
        # One image mask per rollout, kept for every epoch of this update.
        masked = self.policy.mask_images(rollout, a.mask_prob, self.sample_gen) if self.masks_images and N else None
        x = AdvantageInputs(rollout, rewards, mask, lambda: self.masked_pass_scores(rollout, masked))
        for transform in self.stages.advantage_transforms:
            if transform.needs_policy_scores and N:
                adv = transform.transform(adv, x)
        correction, correction_metrics = None, {}
        if self.cfg.rollout.correction != "none" and N:
            correction, correction_metrics = self.correct_mismatch(rollout, old_logp, mask)
        return {"mask": mask, "old_logp": old_logp, "ref": ref, "masked": masked, "adv": adv,
                "correction": correction, "correction_metrics": correction_metrics, "sizes": self.row_sizes(rollout)}

    # ------------------------------------------------------------------ the update

    def update(self, rollout: Rollout, adv: torch.Tensor, rewards: torch.Tensor, filler: Rollout | None = None,
               step: int = 0) -> dict[str, float]:
        """One RL update at training step `step` on `rollout` with advantages `adv` (of the shaped
        `rewards`); its metrics."""
        t = self.cfg.train
        n_real = len(rollout)
        if self.dist.fsdp:  # FSDP's collectives need the same number of forwards on every rank
            rollout, adv = self.pad_rows(rollout, adv, filler)
            rewards = torch.cat([rewards, rewards.new_zeros(len(rollout) - n_real)])
        x = self.prepare(rollout, adv, rewards)
        sums: dict[str, float] = defaultdict(float)
        row_means: set[str] = set()  # metrics that are means over this rank's rows
        n_updates = 0
        self.policy.model.train()
        for _ in range(t.ppo_epochs):
            order = (torch.randperm(len(rollout), generator=self.shuffle_gen) if t.mini_batches > 1
                     else torch.arange(len(rollout)))
            for mb in order.to(self.device).tensor_split(t.mini_batches):
                if len(mb) == 0 and not self.dist.active:  # with ranks, every rank steps the optimizer together
                    continue
                self.optimizer_step_on(rollout, mb, n_real, x, sums, row_means, first=n_updates == 0, step=step)
                n_updates += 1
        averaged = ("loss", "grad_norm", *self.term_names,
                    *(s.metric for s in self.stages.auxiliary_losses if not s.first_step_only))
        out = {f"train/{k}": v / max(1, n_updates) if k in averaged else v for k, v in sums.items()}
        out["train/lr"] = self.scheduler.get_last_lr()[0]
        out.update(x["correction_metrics"])
        row_weighted = [*(f"train/{k}" for k in row_means), *x["correction_metrics"]]
        self.metric_weights = dict.fromkeys(row_weighted, float(n_real))
        adv = x["adv"]
        if n_real < len(rollout):  # drop the padding rows
            rollout, adv = rollout.select(torch.arange(n_real, device=self.device)), adv[:n_real]
        # Statistics of the whole batch: every rank's rows (a rank that kept none takes part too).
        # Advantages of [N, T] travel right-padded with zeros to the longest T, as Rollout.concat pads.
        (adv, lengths, truncated), _ = distributed.gather_rows(self.dist, [adv, rollout.lengths, rollout.truncated])
        if len(adv):
            out.update(batch_stats(adv, lengths, truncated))
        return out

    def optimizer_step_on(self, rollout: Rollout, mb: torch.Tensor, n_real: int, x: dict[str, Any],
                          sums: dict[str, float], row_means: set[str], first: bool, step: int = 0) -> None:
        """One optimizer step on the rows `mb` of `rollout` (the first `n_real` are not padding),
        adding its metrics to `sums`."""
        t, mask = self.cfg.train, x["mask"]
        # The normaliser of the whole optimizer step (all its micro-batches, all ranks), so neither
        # micro-batching nor the number of ranks changes the gradient. Divided by the world size
        # because the ranks' gradients are averaged, not summed.
        denom = algos.agg_denominator(mask[mb[mb < n_real]], self.agg, self.unit_budget(rollout))
        if self.dist.active:
            denom = distributed.all_sum(self.dist, denom) / self.dist.world
        self.optimizer.zero_grad(set_to_none=True)
        if first:
            self.auxiliary_backward(sums, first_step_only=True)
        step_loss = 0.0
        for micro in self.micro_batches(mb, x["sizes"]):
            part = self.micro_part(rollout, micro)
            T = part.units.shape[1]  # trimmed under train.max_tokens_per_micro

            def rows(v: torch.Tensor | None) -> torch.Tensor | None:
                return None if v is None else rows_of(v, micro, T)

            masked = None if x["masked"] is None else self.micro_part(x["masked"], micro)
            loss, metrics = self.backward_micro(part, masked, mask[micro, :T], x["old_logp"][micro, :T],
                                                rows(x["adv"]), None if x["ref"] is None else x["ref"][micro, :T],
                                                denom, rows(x["correction"]))
            sums["loss"] += loss
            step_loss += loss
            share = int((micro < n_real).sum()) / (max(1, n_real) * t.ppo_epochs)  # padding rows weigh nothing
            add_micro_metrics(sums, row_means, metrics, self.term_names, share)
        self.auxiliary_backward(sums, first_step_only=False)
        self.optimizer_step(sums, step, step_loss)

    def auxiliary_backward(self, sums: dict[str, float], first_step_only: bool) -> None:
        """Backward of the auxiliary losses (mmrl.stages) of one kind, their values added to `sums`."""
        for stage in self.stages.auxiliary_losses:
            if stage.first_step_only == first_step_only:
                with self.autocast:
                    out = stage.loss(self.policy, self.task)
                if out is not None:
                    out[0].backward()
                    sums[stage.metric] += out[1]

    def optimizer_step(self, sums: dict[str, float], step: int, loss: float = 0.0) -> None:
        """Average the gradient over ranks, clip it, step the optimizer and the schedule, adding the
        pre-clip norm to `sums["grad_norm"]`. A step whose norm or `loss` (this optimizer step's
        policy loss) is not finite is skipped instead (`NonFiniteSteps`); `sums["skipped_nonfinite"]`
        counts it."""
        distributed.average_gradients(self.dist, self.params)
        grad_norm = clip_grad_norm(self.params, self.cfg.train.grad_clip).item()
        sums["grad_norm"] += grad_norm
        applied = self.nonfinite.applies(grad_norm, loss, f"step {step}")
        sums["skipped_nonfinite"] += 0.0 if applied else 1.0
        if not applied:
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.optimizer.step()
        self.scheduler.step()


class NonFiniteSteps:
    """Whether an optimizer step applies: not when its loss or gradient norm (the one the clipping
    computes) is NaN / inf, a step that would write NaN into the weights; then it is skipped (the
    caller steps neither optimizer nor schedule) and named in a warning, and `limit` of them in a
    row (train.max_nonfinite_steps; 0: never) end the run with `Diverged`. Under torchrun every rank
    takes the same decision: the norm is of the averaged gradient (FSDP's clip takes the global one),
    the loss is each rank's own, so one small all-reduce per step."""

    def __init__(self, limit: int, dist: Dist, warn: Callable[..., None]):
        self.limit, self.dist, self.warn = limit, dist, warn
        self.in_a_row = 0

    def applies(self, grad_norm: float, loss: float, where: str) -> bool:
        finite = math.isfinite(grad_norm) and math.isfinite(loss)
        if self.dist.active:
            finite = not distributed.all_max(self.dist, int(not finite))
        if finite:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        values = f"loss {loss:g}, gradient norm {grad_norm:g}"
        if self.limit and self.in_a_row >= self.limit:
            raise Diverged(f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient norm (the "
                           f"last: {values}; train.max_nonfinite_steps: {self.limit})")
        self.warn(f"{where}: non-finite {values}; the optimizer step was skipped",
                  kind="non-finite loss or gradient norm (optimizer step skipped)")
        return False


def add_micro_metrics(sums: dict[str, float], row_means: set[str], metrics: dict[str, float],
                      term_names: tuple[str, ...], share: float) -> None:
    """Add one micro-batch's loss metrics to the step's: loss terms summed (normalised by the whole
    step already), extremes kept, the rest as means weighted by the micro-batch's `share` of rows."""
    for k, v in metrics.items():
        if k in term_names:
            sums[k] += v
        elif k.endswith("_max"):
            sums[k] = max(sums.get(k, v), v)
        elif k.endswith("_min"):
            sums[k] = min(sums.get(k, v), v)
        else:
            sums[k] += v * share
            row_means.add(k)


def batch_stats(adv: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """Advantage and length statistics of a batch (of at least one row)."""
    return {
        "adv/mean": adv.mean().item(), "adv/std": adv.std().item() if len(adv) > 1 else 0.0,
        "adv/min": adv.min().item(), "adv/max": adv.max().item(),
        "len/mean": lengths.float().mean().item(), "len/max": lengths.max().item(),
        "len/truncated_frac": truncated.float().mean().item(),
    }


def rows_of(x: torch.Tensor, rows: torch.Tensor, T: int) -> torch.Tensor:
    """Rows `rows` of a per-row [N] or per-unit [N, T'] tensor, units cut to the micro-batch's T."""
    return x[rows] if x.dim() == 1 else x[rows, :T]


def split_largest(batches: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`batches` split, the one with the most rows in halves each time, until there are `count`
    (at most the number of rows): every FSDP rank then runs the same number of micro-batches."""
    batches = list(batches)
    while len(batches) < count:
        i = max(range(len(batches)), key=lambda j: len(batches[j]))
        batches[i:i + 1] = list(batches[i].tensor_split(2))
    return batches


def pad_units(x: torch.Tensor, T: int) -> torch.Tensor:
    """`x` [n, t, ...] right-padded with zeros to t = T (a micro-batch trimmed to its longest reply)."""
    if x.dim() < 2 or x.shape[1] >= T:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], T - x.shape[1], *x.shape[2:]))], 1)
