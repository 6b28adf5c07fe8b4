"""The domain-agnostic RL trainer: contexts -> G samples each -> rewards -> advantages -> update.

It knows a policy only through `sample`, `logprobs`, `decode`, `sft_loss`, `reference_logprobs`
and `model`, and a task only through `next_batch`, `eval_batch`, `sft_batch` and its
`state_dict`. Every domain runs through this one loop; the algorithm is a registry name.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl import algos, distributed, loss_terms
from mmrl.checkpoint import (atomic_write_text, check_same_run, discard_run, find_latest, load_whole_checkpoint,
                             resolve_checkpoint, rng_state, save_checkpoint, save_sharded_checkpoint, set_rng_state,
                             write_run_config)
from mmrl.config import RunConfig
from mmrl.distributed import Dist
from mmrl.logger import MetricsLogger, SilentLogger, say
from mmrl.prompt_replay import PromptReplay
from mmrl.rewards import Reward, RewardFailure, build_reward
from mmrl.rollout import Rollout, token_budget_batches


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and distributed.launched():  # under torchrun: this rank's GPU
        return torch.device("cuda", distributed.local_rank())
    return torch.device(name)


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


class TrainingInterrupted(Exception):
    """SIGINT / SIGTERM stopped training at a step boundary after saving `checkpoint`."""

    def __init__(self, signal_name: str, where: str, checkpoint: Path):
        super().__init__(f"{signal_name} {where}: checkpoint {checkpoint}")
        self.signal_name, self.where, self.checkpoint = signal_name, where, checkpoint


class TrainingFailed(Exception):
    """A fault training cannot go on through (a reward's judge that is down) ended it `where`, after
    saving `checkpoint` (resuming from it re-runs the step the fault stopped)."""

    def __init__(self, reason: str, where: str, checkpoint: Path):
        super().__init__(f"{reason}; stopped {where}; checkpoint saved to {checkpoint}")
        self.reason, self.where, self.checkpoint = reason, where, checkpoint


class StopRequest:
    """While entered (main thread only), SIGINT and SIGTERM ask the training loop to stop at its next
    step boundary, where it saves a checkpoint; a second SIGINT stops at once, without one."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        self.signal_name = None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        say(f"{self.signal_name}: stopping at the end of this step with a checkpoint "
            "(Ctrl-C again stops at once, without one)")

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


# Rank r's sampling generators are seeded seed + r * RANK_SEED_STRIDE (rank 0: the single-process seeds).
RANK_SEED_STRIDE = 1_000_003


class Trainer:
    def __init__(self, cfg: RunConfig, policy, task, log: MetricsLogger | None = None, dist: Dist | None = None):
        self.cfg = cfg
        self.policy = policy
        self.task = task
        self.device = policy.device
        self.out_dir = Path(cfg.train.output_dir)
        # One process unless launched by torchrun (then this rank's share; see mmrl.distributed)
        self.dist = dist or distributed.current(cfg.train.fsdp)
        self.rewards = self.build_rewards()
        self.loss_spec = algos.get_loss_spec(cfg.algo.loss)
        self.loss_params = dict(cfg.algo.loss_params)
        self.agg = self.loss_params.get("agg") or self.loss_spec.default_agg
        self.advantage = cfg.algo.resolved_advantage()
        if cfg.algo.beta > 0:
            self.policy.enable_reference()
        # Flow-GRPO's exact KL of Gaussian steps: a score of the policy's forward, from the
        # reference's step means, instead of an estimator on log-probs
        self.gaussian_kl = cfg.algo.beta > 0 and cfg.algo.kl_kind == algos.GAUSSIAN_KL
        # What the update adds to the policy loss (mmrl.loss_terms). Their values are normalised by
        # the whole optimizer step: summed over its micro-batches, averaged over steps and ranks.
        self.loss_terms = loss_terms.from_algo(cfg.algo)
        self.term_names = tuple(term.name for term in self.loss_terms)
        self.distribute_model()
        self.params = [p for p in policy.model.parameters() if p.requires_grad]
        t = cfg.train
        self.optimizer = make_adamw(self.params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        updates_per_step = t.ppo_epochs * t.mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(t.warmup_steps * updates_per_step, t.steps * updates_per_step, t.min_lr_ratio))
        rank_seed = t.seed + RANK_SEED_STRIDE * self.dist.rank
        self.sample_gen = torch.Generator(device=self.device).manual_seed(rank_seed)
        self.shuffle_gen = torch.Generator().manual_seed(rank_seed + 1)
        self.sft_mix_rng = np.random.default_rng(rank_seed + 3)  # the expert batches of algo.sft_coef
        self.step = 0
        self.group_offset = 0
        self.sft_done = cfg.sft.steps == 0
        self.sft_progress: dict[str, Any] | None = None  # the SFT loop's own state while it runs
        self.stop = StopRequest()
        self.eval_history: list[dict[str, Any]] = []
        self.failed_contexts: list[Any] = []  # see collect
        # How many items each rank's value of a metric is a mean over (see distributed.reduce_metrics).
        self.metric_weights: dict[str, float] = {}
        self.summed_metrics: set[str] = set()  # rewards' per-call counts: summed over ranks
        self.reward_fault: RewardFailure | None = None  # under torchrun, raised on every rank at once (raise_faults)
        self.replay = PromptReplay(cfg.algo.prompt_replay_size) if cfg.algo.prompt_replay > 0 else None
        if log is None:  # rank 0 logs for the run
            log = (MetricsLogger(self.out_dir, tensorboard=t.tensorboard, wandb=t.wandb, wandb_project=t.wandb_project,
                                 config=cfg.to_dict()) if self.dist.is_main else SilentLogger())
        self.log = log
        self.filler: Rollout | None = None  # FSDP: a row to pad a rank's batch with (see pad_rows)
        if cfg.algo.masks_images and not policy.can_mask_images:  # say so before SFT, not at the first update
            raise ValueError(f"algo.papo_gamma, algo.papo_entropy and algo.certainty_reweight need a policy whose "
                             f"rollouts carry images to mask (qwen_vl); {type(policy).__name__} cannot")
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=t.bf16 and self.device.type == "cuda")

    # ------------------------------------------------------------------ state

    def distribute_model(self) -> None:
        """Under torchrun: shard the policy (and its reference) with FSDP2 when `train.fsdp`, else
        start every replica from rank 0's weights."""
        if not self.dist.active:
            return
        if self.dist.fsdp:
            distributed.shard(self.policy.model, self.cfg.train.bf16)
            if getattr(self.policy, "reference", None) is not None:
                distributed.shard(self.policy.reference, self.cfg.train.bf16)
        else:
            distributed.broadcast_parameters(self.dist, self.policy.model)

    def whole_model(self):
        """The context in which ranks may run different numbers of forwards (see full_parameters)."""
        if not self.dist.fsdp:
            return contextlib.nullcontext()
        return distributed.full_parameters(self.policy.model, getattr(self.policy, "reference", None))

    def state_dict(self, with_optimizer: bool = True) -> dict[str, Any]:
        """Everything but the weights; in a multi-process run, this rank's (the optimizer is saved
        sharded beside it)."""
        state = {
            "step": self.step,
            "group_offset": self.group_offset,
            "sft_done": self.sft_done,
            "sft_progress": self.sft_progress,
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state({"sample": self.sample_gen, "shuffle": self.shuffle_gen}),
            "sft_mix_rng": self.sft_mix_rng.bit_generator.state,
            "task": self.task.state_dict(),
            "eval_history": self.eval_history,
            "replay": self.replay.state_dict() if self.replay is not None else None,
            "rewards": [reward.state_dict() for _, _, reward in self.rewards],
        }
        if with_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def save(self) -> Path:
        if self.dist.active:
            return save_sharded_checkpoint(self.out_dir, self.step, self.policy.model, self.optimizer,
                                           self.state_dict(with_optimizer=False), self.dist)
        return save_checkpoint(self.out_dir, self.step, self.policy.model, self.state_dict())

    def resume(self, path: str | Path | None = None) -> Path | None:
        """Load the checkpoint at `path` (default: the newest whole one of this run); returns its path.
        A checkpoint written by another number of ranks loads too: weights and optimizer are
        re-sharded, the data cursor is global; a rank without its own saved RNG state starts new
        sampling streams (so the continuation is not bit-exact, see README.md, Scaling)."""
        path = resolve_checkpoint(path)[1] if path else find_latest(self.out_dir)
        if path is None:
            return None
        state = load_whole_checkpoint(path, self.policy.model, optimizer=self.optimizer, rank=self.dist.rank)
        self.step, self.group_offset, self.sft_done = state["step"], state["group_offset"], state["sft_done"]
        self.sft_progress = state.get("sft_progress")
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], {"sample": self.sample_gen, "shuffle": self.shuffle_gen})
        if state.get("sft_mix_rng") is not None:
            self.sft_mix_rng.bit_generator.state = state["sft_mix_rng"]
        if state.get("rank") not in (None, self.dist.rank):  # another rank's streams: do not share them
            rank_seed = self.cfg.train.seed + RANK_SEED_STRIDE * self.dist.rank + self.step
            self.sample_gen.manual_seed(rank_seed)
            self.shuffle_gen.manual_seed(rank_seed + 1)
        self.task.load_state_dict(state["task"])
        self.eval_history = state["eval_history"]
        if self.replay is not None and state.get("replay"):
            self.replay.load_state_dict(state["replay"])
        for (_, _, reward), reward_state in zip(self.rewards, state.get("rewards", [])):
            reward.load_state_dict(reward_state)
        self.log.truncate_after(self.step)
        return Path(path)

    def step_start(self) -> dict[str, Any]:
        """What collecting a batch moves (data cursor, group ids, sampling streams, replay buffer,
        reward draws), to put back when a fault ends the step: its checkpoint then resumes the step."""
        return {"group_offset": self.group_offset,
                "rng": rng_state({"sample": self.sample_gen, "shuffle": self.shuffle_gen}),
                "task": copy.deepcopy(self.task.state_dict()),
                "replay": self.replay.state_dict() if self.replay is not None else None,  # a copy of the list
                "rewards": [copy.deepcopy(reward.state_dict()) for _, _, reward in self.rewards]}

    def restore_step_start(self, state: dict[str, Any]) -> None:
        self.group_offset = state["group_offset"]
        set_rng_state(state["rng"], {"sample": self.sample_gen, "shuffle": self.shuffle_gen})
        self.task.load_state_dict(state["task"])
        if self.replay is not None:
            self.replay.load_state_dict(state["replay"])
        for (_, _, reward), reward_state in zip(self.rewards, state["rewards"]):
            reward.load_state_dict(reward_state)

    def stop_requested(self) -> bool:
        """A SIGINT / SIGTERM asks for a stop; under torchrun, on any rank (all stop at the same step)."""
        asked = self.stop.signal_name is not None
        if self.dist.active:
            asked = bool(distributed.all_max(self.dist, int(asked)))
            if asked and self.stop.signal_name is None:
                self.stop.signal_name = "SIGTERM"
        return asked

    def _stop_here(self, where: str) -> None:
        """Save a checkpoint and end training (after a SIGINT / SIGTERM, at a step boundary)."""
        raise TrainingInterrupted(self.stop.signal_name, where, self.save())

    # ------------------------------------------------------------------ SFT warm start

    def sft(self) -> None:
        s = self.cfg.sft
        if self.sft_done or s.steps == 0:
            return
        # each rank its own batches; their gradients are averaged (data-parallel SFT)
        rng = np.random.default_rng(self.cfg.train.seed + 2 + RANK_SEED_STRIDE * self.dist.rank)
        opt = make_adamw(self.params, lr=s.lr)
        floor = self.cfg.train.min_lr_ratio if s.lr_schedule == "cosine" else 1.0  # a floor of 1: constant after warmup
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(s.warmup_steps, s.steps, floor))
        start, cpu_used = 0, 0.0
        if self.sft_progress is not None:  # resumed in the middle of SFT
            p = self.sft_progress
            start, cpu_used = p["step"], p["cpu_s"]
            opt.load_state_dict(p["optimizer"])
            schedule.load_state_dict(p["schedule"])
            rng.bit_generator.state = p["rng"]
        self.policy.model.train()
        bar = _progress(range(start, s.steps), "sft", self.cfg.train.progress, total=s.steps, initial=start)
        cpu_start, done = time.process_time() - cpu_used, start
        for i in bar:
            if s.max_cpu_s > 0 and distributed.all_max(self.dist, int(time.process_time() - cpu_start >= s.max_cpu_s)):
                break
            if self.stop_requested():
                self.sft_progress = {"step": i, "cpu_s": time.process_time() - cpu_start, "rng": rng.bit_generator.state,
                                     "optimizer": opt.state_dict(), "schedule": schedule.state_dict()}
                self._stop_here(f"at SFT step {i} of {s.steps}")
            with self.autocast:
                loss = self.policy.sft_loss(self.task.sft_batch(s.batch_size, rng))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            distributed.average_gradients(self.dist, self.params)
            clip_grad_norm(self.params, self.cfg.train.grad_clip)
            opt.step()
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss.item():.3f}")
            self.log.log({"sft/loss": loss.item(), "sft/lr": schedule.get_last_lr()[0]}, step=i, prefix_step="sft_step")
            schedule.step()
            done = i + 1
        # how much SFT ran: with sft.max_cpu_s, possibly fewer than sft.steps
        self.log.log({"sft/steps_done": done, "sft/cpu_s": time.process_time() - cpu_start}, step=done,
                     prefix_step="sft_step")
        self.sft_done, self.sft_progress = True, None

    # ------------------------------------------------------------------ rollouts and rewards

    def build_rewards(self) -> list[tuple[str, float, Reward]]:
        """(name, weight, Reward) for each configured reward, freshly built (no state yet)."""
        return [(r.name, r.weight, build_reward(r.name, r.params)) for r in self.cfg.rewards]

    def sample(self, contexts: list[Any], group_size: int, generator: torch.Generator, first_group: int = 0,
               temperature: float | None = None) -> Rollout:
        """The policy's G samples per context, with group ids stamped (here, and nowhere else). With
        `rollout.batch_size`, each sampler call takes at most that many rows (whole groups, one at
        least), so its KV cache and activations are bounded whatever the step's batch."""
        rows = self.cfg.rollout.batch_size
        per_call = max(1, rows // group_size) if rows > 0 else max(1, len(contexts))
        with self.autocast, self.whole_model():
            parts = [self.policy.sample(contexts[lo:lo + per_call], group_size, generator=generator,
                                        temperature=temperature) for lo in range(0, len(contexts), per_call) or [0]]
        return Rollout.concat(parts).stamp_groups(group_size, first_group)

    def score(self, rollout: Rollout, rewards: list[tuple[str, float, Reward]] | None = None,
              outputs: list | None = None) -> torch.Tensor:
        """Fill rollout.rewards with each reward component and their weighted "total"; `rewards`
        defaults to the training rewards (whose state moves with training), `outputs` to the
        rollout decoded."""
        if outputs is None:
            outputs = self.policy.decode(rollout)
        total = torch.zeros(len(rollout), device=self.device)
        for name, weight, reward in rewards or self.rewards:
            try:
                r = reward(rollout.contexts, outputs).to(self.device, torch.float32)
            except RewardFailure as fault:
                if not self.dist.active:
                    raise
                # Under torchrun the other ranks are headed for collectives: go on with zeros and
                # raise on every rank together (raise_faults).
                self.reward_fault = self.reward_fault or fault
                r = torch.zeros(len(rollout), device=self.device)
            rollout.rewards[name] = r
            total = total + weight * r
        rollout.rewards["total"] = total
        return total

    def raise_faults(self) -> None:
        """Raise the reward fault any rank met (the first rank's), on every rank; called where all ranks meet."""
        if not self.dist.active:
            return
        message = distributed.first_message(self.dist, None if self.reward_fault is None else str(self.reward_fault))
        self.reward_fault = None
        if message is not None:
            raise RewardFailure(message)

    def _keep_groups(self, rollout: Rollout, informative: torch.Tensor | None) -> torch.Tensor:
        """`informative`: `nonconstant_groups` of the rollout, computed when dynamic sampling is on."""
        a = self.cfg.algo
        keep = torch.ones(len(rollout), dtype=torch.bool, device=self.device)
        if a.dynamic_sampling:
            keep &= informative
        if a.success_filter is not None:
            first = rollout.rewards[self.rewards[0][0]]
            keep &= algos.success_rate_filter(first, rollout.group_ids, *a.success_filter)
        return keep

    def collect(self) -> tuple[Rollout, dict[str, float]]:
        """Sample one batch of groups; with dynamic sampling / success filtering, re-sample until
        enough groups survive or the try cap is hit (then say so in the metrics).

        With `algo.guide_below`, the contexts of groups where every sample failed (of every try)
        are left in `self.failed_contexts` for the update's guidance term."""
        cfg, P, G = self.cfg, self.cfg.train.prompts_per_step, self.cfg.sampling.group_size
        filtering = cfg.algo.dynamic_sampling or cfg.algo.success_filter is not None
        parts, kept_groups, tries, stats = [], 0, 0, defaultdict(float)
        self.failed_contexts = []
        for round_ in range(max(1, cfg.algo.max_sampling_tries)):
            # With several ranks every rank takes part in every round (the draw is collective); a
            # rank that has its groups samples nothing.
            need = P if round_ == 0 or (filtering and kept_groups < P) else 0
            if round_ > 0 and not filtering:
                break
            t0 = time.perf_counter()
            replayed = self.replay.draw(round(cfg.algo.prompt_replay * need)) if self.replay is not None and need else []
            drawn = self.draw_contexts(need - len(replayed), len(replayed), sampling=need > 0)
            if drawn is None:  # no rank needs more
                break
            if not need:
                continue
            fresh, first_group = drawn
            contexts = replayed + fresh
            rollout = self.sample(contexts, G, self.sample_gen, first_group=first_group)
            if self.dist.fsdp and self.filler is None:
                self.filler = rollout.select(torch.arange(1, device=self.device))
            stats["time/sample"] += time.perf_counter() - t0
            stats["gen_tokens"] += float(rollout.mask.sum())
            t0 = time.perf_counter()
            self.score(rollout)
            stats["time/reward"] += time.perf_counter() - t0
            if tries == 0:  # the raw batch's rewards (every rank's rows) are what the policy currently earns
                names = list(rollout.rewards)
                whole, _ = distributed.gather_rows(self.dist, [rollout.rewards[k] for k in names])
                stats.update(reward_stats(dict(zip(names, whole))))
                for name, _, reward in self.rewards:
                    stats.update({f"reward/{name}/{k}": v for k, v in reward.metrics().items()})
                    self.metric_weights.update({f"reward/{name}/{k}": w for k, w in reward.metric_weights().items()})
                    self.summed_metrics.update(f"reward/{name}/{k}" for k in reward.counted_metrics())
            total, gids = rollout.rewards["total"], rollout.group_ids
            informative = (algos.nonconstant_groups(total, gids)
                           if cfg.algo.dynamic_sampling or self.replay is not None else None)
            if self.replay is not None:
                unsettled = group_contexts(rollout, informative)
                self.replay.push(unsettled)
                stats["replay/pushed"] += len(unsettled)
                stats["replay/drawn"] += len(replayed)
                stats["replay/size"] = len(self.replay)
            if cfg.algo.guide_below is not None:
                self.failed_contexts += group_contexts(rollout, algos.failed_groups(total, gids, cfg.algo.guide_below))
            tries += 1
            if not filtering:
                parts.append(rollout)
                continue
            keep = self._keep_groups(rollout, informative)
            parts.append(rollout.select(keep))
            kept_groups += int(keep.sum()) // G
        batch = Rollout.concat(parts)
        if cfg.algo.guide_below is not None:
            stats["guide/failed_groups"] = len(self.failed_contexts)
        if filtering:
            stats["sampling/tries"] = tries
            stats["sampling/kept_groups"] = min(kept_groups, P)
            if kept_groups < P:
                stats["sampling/short_groups"] = P - kept_groups
                self.log.warn(f"step {self.step}: only {kept_groups} of {P} groups kept after {tries} tries",
                              kind="fewer groups than train.prompts_per_step kept after filtering")
            if kept_groups > P:  # trim to exactly P groups (the first ones, in sampling order)
                batch = batch.select(torch.arange(P * G, device=self.device))
        self.raise_faults()
        return batch, dict(stats)

    def draw_contexts(self, n_fresh: int, n_replayed: int, sampling: bool) -> tuple[list[Any], int] | None:
        """This rank's `n_fresh` new contexts and the group id of its first context (its replayed
        contexts come first), or None when no rank samples this round. Every rank draws the whole
        round's contexts from the same stream (the task is seeded alike on every rank) and keeps its
        own slice, so ranks see disjoint contexts, the data cursor is one for all ranks, and N ranks
        draw what one process drawing their total would."""
        counts = distributed.all_gather_ints(self.dist, [n_fresh, n_replayed, int(sampling)])
        if not any(c[2] for c in counts):
            return None
        fresh = [c[0] for c in counts]
        groups = [c[0] + c[1] for c in counts]
        contexts = self.task.next_batch(sum(fresh))
        start = sum(fresh[: self.dist.rank])
        first_group = self.group_offset + sum(groups[: self.dist.rank])
        self.group_offset += sum(groups)
        return contexts[start: start + n_fresh], first_group

    # ------------------------------------------------------------------ update

    def advantages(self, rollout: Rollout) -> torch.Tensor:
        a = self.cfg.algo
        rewards = rollout.rewards["total"]
        if a.overlong_cache_len > 0:
            rewards = rewards + algos.overlong_penalty(rollout.lengths, self.unit_budget(rollout), a.overlong_cache_len)
        if a.redit_scale > 0:
            rewards = algos.redit(rewards, a.redit_scale, kind=a.redit_kind, generator=self.sample_gen)
        if a.gfpo_keep > 0:  # GFPO: statistics and credit only for the kept members of each group
            keep = algos.gfpo_keep(rewards, rollout.group_ids, a.gfpo_keep, a.gfpo_metric, rollout.lengths)
            return algos.gfpo_advantages(rewards, rollout.group_ids, keep)
        params = dict(a.advantage_params)
        token_weighted = "mask" in algos.get_advantage_spec(self.advantage).params
        # Under torchrun the estimator sees every rank's rows (its batch-level statistics are global)
        # and each rank keeps its own; with one process, `mine` is every row.
        (rewards, group_ids, mask), mine = distributed.gather_rows(
            self.dist, [rewards, rollout.group_ids, rollout.mask])
        if token_weighted:
            params["mask"] = mask
        adv = algos.compute_advantages(self.advantage, rewards, group_ids, **params)
        if not self.dist.active:
            return adv
        return adv[mine, : rollout.mask.shape[1]] if adv.dim() == 2 else adv[mine]

    def row_sizes(self, rollout: Rollout) -> torch.Tensor | None:
        """Each row's prompt and reply tokens [N, 2] when micro-batches are packed by length."""
        return self.policy.row_tokens(rollout) if self.cfg.train.max_tokens_per_micro else None

    def _micro_batches(self, idx: torch.Tensor, sizes: torch.Tensor | None = None) -> list[torch.Tensor]:
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
        batches = self._micro_batches(torch.arange(len(rollout), device=self.device), self.row_sizes(rollout))
        parts = [score(rows) for rows in batches]
        order = torch.argsort(torch.cat(batches))
        T = rollout.mask.shape[1]

        def join(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([pad_units(x, T) for x in tensors])[order]

        if isinstance(parts[0], dict):
            return {k: join([p[k] for p in parts]) for k in parts[0]}
        return join(parts)

    def _optimizer_step(self) -> float:
        """Average the gradient over ranks, clip it, step the optimizer and the schedule; the pre-clip norm."""
        distributed.average_gradients(self.dist, self.params)
        grad_norm = clip_grad_norm(self.params, self.cfg.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm.item()

    def guidance_backward(self, contexts: list[Any]) -> float:
        """Backward of guide_coef x the supervised loss on the expert targets of `contexts`."""
        try:
            with self.autocast:
                loss = self.cfg.algo.guide_coef * self.policy.sft_loss(contexts)
        except KeyError as exc:
            raise ValueError(f"algo.guide_below needs the task's expert target in every context; "
                             f"{type(self.task).__name__}'s contexts lack {exc}") from None
        loss.backward()
        return loss.item()

    def sft_mix_backward(self) -> float:
        """Backward of algo.sft_coef x the supervised loss on a fresh expert batch of the task."""
        a = self.cfg.algo
        with self.autocast:
            loss = self.policy.sft_loss(self.task.sft_batch(a.sft_batch_size or self.cfg.sft.batch_size,
                                                            self.sft_mix_rng))
        (a.sft_coef * loss).backward()
        return loss.item()

    def pad_rows(self, rollout: Rollout, adv: torch.Tensor) -> tuple[Rollout, torch.Tensor]:
        """FSDP: pad this rank's rows to the most any rank has, with copies of a sampled row whose
        units are all masked out (they add nothing to any loss term, normaliser or metric), so every
        rank runs the same forwards and backwards."""
        n_max = distributed.all_max(self.dist, len(rollout))
        if len(rollout) == n_max:
            return rollout, adv
        source = rollout if len(rollout) else self.filler
        filler = source.select(torch.zeros(n_max - len(rollout), dtype=torch.long, device=self.device))
        filler.mask = torch.zeros_like(filler.mask)
        filler.rewards = {k: v for k, v in filler.rewards.items() if k in rollout.rewards}
        padded = Rollout.concat([rollout, filler]) if len(rollout) else filler
        pad_adv = adv.new_zeros((n_max - len(rollout), *adv.shape[1:]))
        return padded, torch.cat([adv, pad_adv])

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
                with_entropy = self.cfg.algo.papo_entropy[1] > 0
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

        inputs = loss_terms.TermInputs(scores, mask, ref_logp, self.trained_scores())
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
        mismatch correction's (see `correct_mismatch`). With several unit
        windows (`train.unit_chunk`), the loss is first taken on scores computed without graph,
        which gives its gradient with respect to every unit's scores; each window is then
        recomputed with graph and back-propagated against that gradient. The chain rule makes the
        parameter gradient the one-pass gradient for every loss and aggregation (sequence-level
        ratios included), while only one window's activations are alive at a time."""
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

    def certainty_weights(self, rollout: Rollout, masked: Rollout, mask: torch.Tensor,
                          adv: torch.Tensor) -> torch.Tensor:
        """VL-Calibration's token weights of the advantages [N, T] from the rollout's visual certainty."""
        scores = self.in_micro_batches(rollout, lambda rows: self.score_units(self.micro_part(rollout, rows),
                                                                             self.micro_part(masked, rows)))
        certainty = algos.visual_certainty(scores["logp"], scores["logp_masked"], scores["entropy"], mask,
                                           group_ids=rollout.group_ids)
        return algos.certainty_token_weights(certainty, mask, advantages=adv, alpha=self.cfg.algo.certainty_reweight)

    def update(self, rollout: Rollout, guide_contexts: list[Any] = ()) -> dict[str, float]:
        """One RL update on `rollout`; `guide_contexts` (see `collect`) add their supervised loss
        to the first optimizer step."""
        t, a = self.cfg.train, self.cfg.algo
        adv = self.advantages(rollout)
        n_real = len(rollout)
        if self.dist.fsdp:  # FSDP's collectives need the same number of forwards on every rank
            rollout, adv = self.pad_rows(rollout, adv)
        mask = algos.mask_truncated(rollout.mask, rollout.truncated) if a.mask_truncated else rollout.mask
        old_logp = rollout.logp_old
        N = len(rollout)  # 0: a rank that kept no rows while others did (replicate mode); no forward
        if t.recompute_old_logp and N:
            with self.autocast:
                old_logp = self.in_micro_batches(rollout, lambda rows: self.policy.logprobs(
                    self.micro_part(rollout, rows))[0])
        ref = None  # the reference's log-probs [N, T], or with the gaussian KL its step means [N, T, *unit_shape]
        if a.beta > 0 and N:
            reference = self.policy.reference_means if self.gaussian_kl else self.policy.reference_logprobs
            with self.autocast:
                ref = self.in_micro_batches(rollout, lambda rows: reference(self.micro_part(rollout, rows)))
        # One image mask per rollout, kept for every epoch of this update.
        masked = self.policy.mask_images(rollout, a.mask_prob, self.sample_gen) if a.masks_images and N else None
        if a.certainty_reweight > 0 and N:
            adv = adv[:, None] * self.certainty_weights(rollout, masked, mask, adv)
        correction, correction_metrics = None, {}
        if self.cfg.rollout.correction != "none" and N:
            correction, correction_metrics = self.correct_mismatch(rollout, old_logp, mask)
        budget, sizes = self.unit_budget(rollout), self.row_sizes(rollout)
        sums: dict[str, float] = defaultdict(float)
        row_means: set[str] = set()  # metrics that are means over this rank's rows
        n_updates = 0
        self.policy.model.train()
        for _ in range(t.ppo_epochs):
            order = torch.randperm(N, generator=self.shuffle_gen) if t.mini_batches > 1 else torch.arange(N)
            for mb in order.to(self.device).tensor_split(t.mini_batches):
                if len(mb) == 0 and not self.dist.active:  # with ranks, every rank steps the optimizer together
                    continue
                # The normaliser of the whole optimizer step (all its micro-batches, all ranks), so
                # neither micro-batching nor the number of ranks changes the gradient. Divided by the
                # world size because the ranks' gradients are averaged, not summed.
                denom = algos.agg_denominator(mask[mb[mb < n_real]], self.agg, budget)
                if self.dist.active:
                    denom = distributed.all_sum(self.dist, denom) / self.dist.world
                self.optimizer.zero_grad(set_to_none=True)
                if guide_contexts and n_updates == 0:
                    sums["guide_loss"] += self.guidance_backward(guide_contexts)
                for micro in self._micro_batches(mb, sizes):
                    part = self.micro_part(rollout, micro)
                    T = part.units.shape[1]  # trimmed under train.max_tokens_per_micro
                    loss, metrics = self.backward_micro(
                        part, None if masked is None else self.micro_part(masked, micro), mask[micro, :T],
                        old_logp[micro, :T], rows_of(adv, micro, T), None if ref is None else ref[micro, :T], denom,
                        None if correction is None else rows_of(correction, micro, T))
                    sums["loss"] += loss
                    for k, v in metrics.items():
                        if k in self.term_names:
                            sums[k] += v
                        elif k.endswith("_max"):
                            sums[k] = max(sums.get(k, v), v)
                        elif k.endswith("_min"):
                            sums[k] = min(sums.get(k, v), v)
                        else:  # row-weighted mean (padding rows weigh nothing)
                            sums[k] += v * int((micro < n_real).sum()) / (max(1, n_real) * t.ppo_epochs)
                            row_means.add(k)
                if a.sft_coef > 0:
                    sums["sft_loss"] += self.sft_mix_backward()
                sums["grad_norm"] += self._optimizer_step()
                n_updates += 1
        out = {f"train/{k}": v / max(1, n_updates) if k in ("loss", "grad_norm", "sft_loss", *self.term_names) else v
               for k, v in sums.items()}
        out["train/lr"] = self.scheduler.get_last_lr()[0]
        out.update(correction_metrics)
        row_weighted = [*(f"train/{k}" for k in row_means), *correction_metrics]
        self.metric_weights.update(dict.fromkeys(row_weighted, float(n_real)))
        if n_real < N:  # drop the padding rows
            rollout, adv = rollout.select(torch.arange(n_real, device=self.device)), adv[:n_real]
        # Statistics of the whole batch: every rank's rows (a rank that kept none takes part too).
        # Advantages of [N, T] travel right-padded with zeros to the longest T, as Rollout.concat pads.
        (adv, lengths, truncated), _ = distributed.gather_rows(self.dist, [adv, rollout.lengths, rollout.truncated])
        if len(adv):
            out.update(batch_stats(adv, lengths, truncated))
        return out

    def train_step(self) -> dict[str, float]:
        self.metric_weights = {}
        rollout, stats = self.collect()
        n_rows = len(rollout)
        if self.dist.active:  # skip or update together
            n_rows = int(distributed.all_sum(self.dist, torch.tensor(float(n_rows), device=self.device)))
        if n_rows == 0:
            n_failed = len(self.failed_contexts)
            if self.dist.active:
                n_failed = int(distributed.all_sum(self.dist, torch.tensor(float(n_failed), device=self.device)))
            if n_failed:  # nothing for RL to learn from, but the guidance still applies
                self.optimizer.zero_grad(set_to_none=True)
                if self.failed_contexts:
                    stats["train/guide_loss"] = self.guidance_backward(self.failed_contexts)
                stats["train/grad_norm"] = self._optimizer_step()
                return stats
            self.log.warn(f"step {self.step}: no group left after filtering; skipping the update",
                          kind="no group left after filtering (update skipped)")
            return stats
        t0 = time.perf_counter()
        metrics = self.update(rollout, self.failed_contexts)
        stats["time/update"] = time.perf_counter() - t0
        stats["tokens_per_s"] = stats.pop("gen_tokens") / max(stats["time/sample"], 1e-9)
        stats.update(metrics)
        return stats

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the task's fixed held-out set; a task may add its own metrics. Under
        torchrun the ranks split the held-out set for the rewards' evaluation and join the scores,
        so every rank gets one process's result; a task's own `evaluate(policy, n)` (simulators,
        judges of sampled captions) takes no split and still runs whole on every rank."""
        with self.whole_model():
            result = self._evaluate_rewards()
            with self.autocast:
                result.update({f"eval/{k}": v
                               for k, v in self.task.evaluate(self.policy, self.cfg.train.eval_size).items()})
        return result

    def _evaluate_rewards(self) -> dict[str, float]:
        """Mean rewards on the held-out set: greedy (`eval/<reward>`), and with
        `train.eval_samples` > 0 also over k samples at the training temperature
        (`eval/sampled_<reward>`), the reward the policy actually earns. Each rank scores its block
        of the held-out set (greedy scores equal one process's; the k samples come from each
        rank's own stream, so they are a sample of the same distribution, not the same draw)."""
        contexts = self.task.eval_batch(self.cfg.train.eval_size)
        mine = contexts[distributed.rank_block(len(contexts), self.dist)]
        gen = torch.Generator(device=self.device).manual_seed(12345)
        # Rewards built afresh: every evaluation draws the same (e.g. questions), and training's
        # rewards keep their state, so evaluating never changes what training sees.
        rewards = self.build_rewards()
        names = [name for name, _, _ in rewards] + ["total"]
        rollout, outputs = None, []
        if mine:
            rollout = self.sample(mine, 1, gen, temperature=0.0)
            outputs = self.policy.decode(rollout)
            self.score(rollout, rewards, outputs)
        scores, lengths = self._gather_scores(rollout, names)
        result = {f"eval/{k}": v.mean().item() for k, v in scores.items()}
        outputs = distributed.gather_objects(self.dist, outputs)
        result.update({f"eval/{k}": v for k, v in self.task.evaluate_outputs(contexts, outputs).items()})
        result["eval/len_mean"] = lengths.float().mean().item()
        k = self.cfg.train.eval_samples
        if k > 0:
            sampled = None
            if mine:
                sampled = self.sample(mine, k, gen)
                self.score(sampled, rewards)
            scores, _ = self._gather_scores(sampled, names)
            result.update({f"eval/sampled_{name}": v.mean().item() for name, v in scores.items()})
        self.raise_faults()
        result["step"] = self.step
        return result

    def _gather_scores(self, rollout: Rollout | None, names: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each reward `names`'s scores and the lengths of every rank's evaluation rows, in held-out
        order (`rollout` None: this rank's block is empty)."""
        if rollout is None:
            local = [torch.zeros(0, device=self.device) for _ in names]
            local.append(torch.zeros(0, dtype=torch.long, device=self.device))
        else:
            local = [rollout.rewards[name] for name in names] + [rollout.lengths]
        whole, _ = distributed.gather_rows(self.dist, local)
        return dict(zip(names, whole[:-1])), whole[-1]

    # ------------------------------------------------------------------ the loop

    def train(self, resume: bool = True) -> dict[str, Any]:
        """Run SFT (if configured) and RL to `train.steps`. With `resume`, continue this run's newest
        whole checkpoint, after checking that the folder holds a run of the same config; without it,
        discard whatever run the folder holds. SIGINT / SIGTERM end it with `TrainingInterrupted`
        after saving a checkpoint at the next step boundary; a reward's judge that is down
        (`RewardFailure`) ends it with `TrainingFailed` after saving one at the start of that step."""
        t = self.cfg.train
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        if resume:
            check_same_run(self.cfg)
        elif self.dist.is_main and discard_run(self.out_dir):
            say(f"starting afresh (no resume): discarded the previous run in {self.out_dir}")
        distributed.barrier(self.dist)  # no rank looks for a checkpoint while rank 0 discards
        resumed_from = self.resume() if resume else None
        if self.dist.is_main:
            write_run_config(self.cfg)
        if resumed_from is not None:
            at = (f"SFT step {self.sft_progress['step']} of {self.cfg.sft.steps}" if self.sft_progress
                  else f"step {self.step} of {t.steps}")
            say(f"resuming from {at} ({resumed_from})")
        else:
            self.log.reset()
            self.announce()
        with self.stop:
            try:
                return self._train_loop()
            except RewardFailure as fault:  # e.g. a judge that is down: stop with a checkpoint, not train on zeros
                raise TrainingFailed(str(fault), f"at step {self.step} of {t.steps}", self.save()) from None

    def announce(self) -> None:
        """Say, when a run starts, what it learns from: the data, and whether SFT or RL comes first
        from which weights (a mistake in either shows here, not after an hour of training)."""
        if not self.dist.is_main:
            return
        data = getattr(self.task, "data_summary", lambda: "")()  # hooks of TaskBase; a bare task may lack them
        if data:
            say(f"data: {data}")
        m = self.cfg.model
        start = f"model.path {m.path}" if m.source == "pretrained" else "a model built from scratch (model.source: tiny)"
        if self.cfg.sft.steps > 0:
            targets = getattr(self.task, "sft_targets", lambda: "the task's expert targets")()
            say(f"SFT: {self.cfg.sft.steps} steps on {targets}, starting from {start}; then {self.cfg.train.steps} RL steps")
        else:
            say(f"no SFT (sft.steps: 0): {self.cfg.train.steps} RL steps starting from {start}"
                + (": random weights rarely earn a reward to learn from" if m.source == "tiny" else ""))

    def _train_loop(self) -> dict[str, Any]:
        t = self.cfg.train
        if not self.sft_done:
            self.sft()
        if self.step == 0 and not self.eval_history:
            self.eval_history.append(self.evaluate())
            self.log.log(self.eval_history[-1], step=0)
        bar = _progress(range(self.step, t.steps), "grpo", t.progress, total=t.steps, initial=self.step)
        for _ in bar:
            start = self.step_start()
            try:
                stats = self.train_step()
            except RewardFailure:  # raised while collecting, before the update: the step did not happen
                self.restore_step_start(start)
                raise
            metrics = distributed.reduce_metrics(self.dist, stats, self.metric_weights, self.summed_metrics,
                                                 ("train/loss", *(f"train/{name}" for name in self.term_names)))
            self.step += 1
            if self.step % t.log_every == 0:
                self.log.log(metrics, step=self.step)
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:  # the last: after the save
                self.eval_history.append(self.evaluate())
                self.log.log(self.eval_history[-1], step=self.step)
            if hasattr(bar, "set_postfix"):
                post = {"reward": f"{metrics.get('reward/total', float('nan')):.3f}"}
                if self.eval_history:
                    post["eval"] = f"{self.eval_history[-1].get('eval/total', float('nan')):.3f}"
                bar.set_postfix(post)
            if t.save_every and self.step % t.save_every == 0 and self.step < t.steps:
                self.save()
            if self.stop_requested() and self.step < t.steps:
                self._stop_here(f"at step {self.step} of {t.steps}")
        # Training is done: checkpoint and weights go to disk before the final evaluation (long, and it
        # drives env workers), so a crash there loses no training and the same command then only
        # evaluates. results.json comes last, when everything it names is on disk.
        ckpt = self.save()
        with distributed.consolidated(self.dist, self.policy.model):  # the export one process would write
            if self.dist.is_main:
                self.policy.save(self.out_dir / "final")
        distributed.barrier(self.dist)
        if not self.eval_history or self.eval_history[-1]["step"] != self.step:
            self.eval_history.append(self.evaluate())
            if t.eval_every:
                self.log.log(self.eval_history[-1], step=self.step)
            # Saved again with the evaluation in its eval_history, as a longer train.steps resumes it.
            ckpt = self.save()
        # Facts the results should carry, e.g. env worker restarts (a task hook; this rank's task).
        health = getattr(self.task, "run_health", dict)()
        results = {
            "eval_before": self.eval_history[0],
            "eval_after": self.eval_history[-1],
            "eval_history": self.eval_history,
            "checkpoint": str(ckpt),
            "config": self.cfg.to_dict(),
            **({"run_health": health} if health else {}),
        }
        if self.dist.is_main:
            atomic_write_text(self.out_dir / "results.json", json.dumps(results, indent=2))
        self.log.close()
        if self.dist.is_main:
            for note in health.get("notes", []):
                say(f"note: {note}")
        return results


def reward_stats(rewards: dict[str, torch.Tensor]) -> dict[str, float]:
    """The mean of each reward component over a batch, and the spread of their weighted total."""
    out = {f"reward/{k}": v.mean().item() for k, v in rewards.items()}
    total = rewards["total"]
    out["reward/std"] = total.std().item() if len(total) > 1 else 0.0
    return out


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


def group_contexts(rollout: Rollout, rows: torch.Tensor) -> list[Any]:
    """The context of each group whose members `rows` (bool [N], one value per group) selects, once."""
    pick = (rows & algos.one_row_per_group(rollout.group_ids)).nonzero().squeeze(1).tolist()
    return [rollout.contexts[i] for i in pick]


def _progress(it, desc: str, enabled: bool, **kwargs):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, dynamic_ncols=True, **kwargs)
