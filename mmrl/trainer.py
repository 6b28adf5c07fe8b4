"""The domain-agnostic RL trainer: a short loop over the step's stages.

    collect (mmrl.collect: sample G replies per context, score them, rollout stages filter)
    -> advantages (an estimator of mmrl.algos, reward shapers, advantage transforms)
    -> update (mmrl.update: the policy loss, loss terms, auxiliary losses)

It knows a policy only through `sample`, `logprobs`, `decode`, `sft_loss`, `reference_logprobs`
and `model`, and a task only through `next_batch`, `eval_batch`, `sft_batch`, `evaluate` and its
`state_dict`; what a paper adds is a stage (mmrl.stages), never a branch here. The trainer holds the
run's state (step, streams, checkpoints, evaluations) and the loop.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from mmrl import algos, distributed, stages
from mmrl.checkpoint import (WRITE_FAILURES, atomic_write_text, check_same_run, discard_run, find_latest,
                             load_whole_checkpoint, remove_leftovers, replace_dir, resolve_checkpoint, rng_state,
                             save_checkpoint, save_sharded_checkpoint, set_rng_state, size_text, tensor_bytes,
                             write_failure, write_run_config)
from mmrl.collect import Collector
from mmrl.distributed import RANK_SEED_STRIDE, Dist
from mmrl.logger import MetricsLogger, SilentLogger, progress, say
from mmrl.rewards import RewardFailure
from mmrl.rollout import Diverged, Rollout
from mmrl.run_config import RunConfig
from mmrl.run_control import StopRequest, TrainingDiverged, TrainingFailed, TrainingInterrupted
from mmrl.sft import WarmStart
from mmrl.update import Updater


class Trainer:
    def __init__(self, cfg: RunConfig, policy, task, log: MetricsLogger | None = None, dist: Dist | None = None):
        self.cfg, self.policy, self.task = cfg, policy, task
        self.device = policy.device
        self.out_dir = Path(cfg.train.output_dir)
        t = cfg.train
        # One process unless launched by torchrun (then this rank's share; see mmrl.distributed)
        self.dist = dist or distributed.current(t.fsdp)
        self.stages = stages.from_algo(cfg.algo, cfg.sft.batch_size)
        if cfg.algo.beta > 0:
            self.policy.enable_reference()
        self.distribute_model()
        rank_seed = t.seed + RANK_SEED_STRIDE * self.dist.rank
        self.sample_gen = torch.Generator(device=self.device).manual_seed(rank_seed)
        self.shuffle_gen = torch.Generator().manual_seed(rank_seed + 1)
        for stage in self.stages.items:
            stage.setup(rank_seed)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=t.bf16 and self.device.type == "cuda")
        if log is None:  # rank 0 logs for the run
            log = (MetricsLogger(self.out_dir, tensorboard=t.tensorboard, wandb=t.wandb, wandb_project=t.wandb_project,
                                 config=cfg.to_dict()) if self.dist.is_main else SilentLogger())
        self.log = log
        self.collector = Collector(cfg, policy, task, self.dist, self.stages.rollout, self.sample_gen, self.autocast,
                                   self.whole_model, log.warn)
        self.updater = Updater(cfg, policy, task, self.dist, self.stages, self.autocast, self.shuffle_gen,
                               self.sample_gen, log.warn)
        self.step, self.sft_done = 0, cfg.sft.steps == 0
        # The step of the checkpoint on disk that holds exactly this state (written or resumed), or None.
        self.checkpointed: tuple[int, Path] | None = None
        self.already_finished = False  # set by `train` when the folder's run had finished before it
        self.sft_progress: dict[str, Any] | None = None  # the SFT loop's own state while it runs
        self.stop = StopRequest()
        self.eval_history: list[dict[str, Any]] = []
        # How many items each rank's value of a metric is a mean over (see distributed.reduce_metrics).
        self.metric_weights: dict[str, float] = {}
        if self.updater.masks_images and not policy.can_mask_images:  # say so before SFT, not at the first update
            raise ValueError(f"algo.papo_gamma, algo.papo_entropy and algo.certainty_reweight need a policy whose "
                             f"rollouts carry images to mask (qwen_vl); {type(policy).__name__} cannot")

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

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.updater.optimizer

    def streams(self) -> dict[str, torch.Generator]:
        return {"sample": self.sample_gen, "shuffle": self.shuffle_gen}

    def state_dict(self, with_optimizer: bool = True) -> dict[str, Any]:
        """Everything but the weights; in a multi-process run, this rank's (the optimizer is saved
        sharded beside it)."""
        collected = self.collector.state_dict()
        state = {
            "step": self.step, "group_offset": collected["group_offset"], "sft_done": self.sft_done,
            "sft_progress": self.sft_progress, "scheduler": self.updater.scheduler.state_dict(),
            "rng": rng_state(self.streams()), "task": self.task.state_dict(), "eval_history": self.eval_history,
            "stages": self.stages.state_dict(), "rewards": collected["rewards"],
            "log_rows": self.log.rows,  # metrics.jsonl's rows up to this state: a resume keeps exactly these
        }
        if with_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def save(self) -> Path:
        if self.dist.active:
            path = save_sharded_checkpoint(self.out_dir, self.step, self.policy.model, self.optimizer,
                                           self.state_dict(with_optimizer=False), self.dist)
        else:
            path = save_checkpoint(self.out_dir, self.step, self.policy.model, self.state_dict())
        self.checkpointed = (self.step, path)
        return path

    def export_final(self) -> None:
        """The weights as `final/` (the policy's `save`, which `from_pretrained` loads), written to a
        temporary folder and renamed into place: a kill leaves the previous final/ or the new one."""
        with distributed.consolidated(self.dist, self.policy.model):  # the export one process would write
            if self.dist.is_main:
                tmp = self.out_dir / ".tmp_final"
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    self.policy.save(tmp)
                    replace_dir(tmp, self.out_dir / "final")
                except WRITE_FAILURES as exc:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise write_failure(exc, "the final weights (final/)", self.out_dir,
                                        tensor_bytes(self.policy.model.state_dict())) from None
        distributed.barrier(self.dist)

    def remove_leftovers(self) -> None:
        """Delete what a killed run left in this run's folder (temporary files and folders), saying so."""
        removed = remove_leftovers(self.out_dir)
        if removed:
            total = sum(size for _, size in removed)
            say(f"removed what an interrupted write left in {self.out_dir} ({size_text(total)}): "
                + ", ".join(f"{name} ({size_text(size)})" for name, size in removed))

    def finished_before(self) -> dict[str, Any] | None:
        """The results of this folder's run when the resumed checkpoint is that of a finished run (its
        last step, with the final evaluation) and everything after it is on disk; else None."""
        results = self.out_dir / "results.json"
        if not (self.sft_done and self.step >= self.cfg.train.steps and self.eval_history
                and self.eval_history[-1]["step"] == self.step and results.is_file()
                and (self.out_dir / "final").is_dir()):
            return None
        try:
            saved = json.loads(results.read_text())
        except (OSError, ValueError):
            return None  # written again below
        return saved if saved.get("eval_after", {}).get("step") == self.step else None

    def resume(self, path: str | Path | None = None) -> Path | None:
        """Load the checkpoint at `path` (default: the newest whole one of this run); returns its path.
        A checkpoint written by another number of ranks loads too: weights and optimizer are
        re-sharded, the data cursor is global; a rank without its own saved RNG state starts new
        sampling streams (so the continuation is not bit-exact, see README.md, Scaling)."""
        path = resolve_checkpoint(path)[1] if path else find_latest(self.out_dir)
        if path is None:
            return None
        state = load_whole_checkpoint(path, self.policy.model, optimizer=self.optimizer, rank=self.dist.rank)
        self.step, self.sft_done, self.sft_progress = state["step"], state["sft_done"], state.get("sft_progress")
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.updater.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], self.streams())
        if state.get("rank") not in (None, self.dist.rank):  # another rank's streams: do not share them
            rank_seed = self.cfg.train.seed + RANK_SEED_STRIDE * self.dist.rank + self.step
            self.sample_gen.manual_seed(rank_seed)
            self.shuffle_gen.manual_seed(rank_seed + 1)
        self.task.load_state_dict(state["task"])
        self.eval_history = state["eval_history"]
        self.stages.load_state_dict(state.get("stages") or legacy_stage_state(state))
        self.collector.load_state_dict(state)
        if state.get("log_rows") is not None:
            self.log.truncate_to(state["log_rows"])
        else:  # a checkpoint written before the row count: the rows up to its step
            self.log.truncate_after(self.step)
        self.checkpointed = (self.step, Path(path))
        return Path(path)

    def step_start(self) -> dict[str, Any]:
        """What collecting a batch moves (data cursor, group ids, sampling streams, stages' state,
        reward draws), to put back when a fault ends the step: its checkpoint then resumes the step."""
        # Stages' states are fresh containers already (the replay buffer's list); its contexts are not copied.
        return {"rng": rng_state(self.streams()), "task": copy.deepcopy(self.task.state_dict()),
                "stages": self.stages.state_dict(), **copy.deepcopy(self.collector.state_dict())}

    def restore_step_start(self, state: dict[str, Any]) -> None:
        set_rng_state(state["rng"], self.streams())
        self.task.load_state_dict(state["task"])
        self.stages.load_state_dict(state["stages"])
        self.collector.load_state_dict(state)

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

    # ------------------------------------------------------------------ the step

    def sft(self) -> None:
        """The SFT warm start (mmrl.sft), resumed where a stop left it."""
        if self.sft_done or self.cfg.sft.steps == 0:
            return
        warm = WarmStart(self.cfg, self.policy, self.task, self.dist, self.updater.params, self.autocast, self.log,
                         state=self.sft_progress)
        self.sft_progress = warm.run(self.stop_requested)
        if self.sft_progress is not None:
            self._stop_here(f"at SFT step {self.sft_progress['step']} of {self.cfg.sft.steps}")
        self.sft_done = True

    def collect(self) -> tuple[Rollout, dict[str, float]]:
        return self.collector.collect(self.step)

    def advantages(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """The advantages of `rollout` and the shaped rewards [N] they come from: the total reward
        through the reward shapers, the estimator (under torchrun over every rank's rows: its
        batch-level statistics are global; each rank keeps its own), then the transforms that
        read only rewards."""
        rewards = rollout.rewards["total"]
        budget = self.updater.unit_budget(rollout)
        for shaper in self.stages.reward_shapers:
            rewards = shaper.shape(rewards, rollout, budget, self.sample_gen)
        name = self.cfg.algo.resolved_advantage()
        params = dict(self.cfg.algo.advantage_params)
        (all_rewards, group_ids, mask), mine = distributed.gather_rows(
            self.dist, [rewards, rollout.group_ids, rollout.mask])
        if "mask" in algos.get_advantage_spec(name).params:  # token-weighted estimators
            params["mask"] = mask
        adv = algos.compute_advantages(name, all_rewards, group_ids, **params)
        if self.dist.active:
            adv = adv[mine, : rollout.mask.shape[1]] if adv.dim() == 2 else adv[mine]
        x = stages.AdvantageInputs(rollout, rewards)
        for transform in self.stages.advantage_transforms:
            if not transform.needs_policy_scores:
                adv = transform.transform(adv, x)
        return adv, rewards

    def update(self, rollout: Rollout) -> dict[str, float]:
        """One RL update on `rollout` (advantages, then mmrl.update)."""
        adv, rewards = self.advantages(rollout)
        return self.updater.update(rollout, adv, rewards, self.collector.filler, step=self.step)

    def train_step(self) -> dict[str, float]:
        rollout, stats = self.collect()
        self.metric_weights = dict(self.collector.metric_weights)
        n_rows = len(rollout)
        if self.dist.active:  # skip or update together
            n_rows = int(distributed.all_sum(self.dist, torch.tensor(float(n_rows), device=self.device)))
        if n_rows == 0:
            return self.step_without_rows(stats)
        t0 = time.perf_counter()
        metrics = self.update(rollout)
        self.metric_weights.update(self.updater.metric_weights)
        stats["time/update"] = time.perf_counter() - t0
        stats["tokens_per_s"] = stats.pop("gen_tokens") / max(stats["time/sample"], 1e-9)
        stats.update(metrics)
        return stats

    def step_without_rows(self, stats: dict[str, float]) -> dict[str, float]:
        """No group left after filtering: nothing for RL to learn from, but the auxiliary losses of
        the first step that have items (guidance on the failed groups) still take a step."""
        pending = sum(s.pending() for s in self.stages.auxiliary_losses if s.first_step_only)
        if self.dist.active:
            pending = int(distributed.all_sum(self.dist, torch.tensor(float(pending), device=self.device)))
        if not pending:
            self.log.warn(f"step {self.step}: no group left after filtering; skipping the update",
                          kind="no group left after filtering (update skipped)")
            return stats
        self.updater.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        self.updater.auxiliary_backward(sums, first_step_only=True)
        self.updater.optimizer_step(sums, self.step)  # adds grad_norm and skipped_nonfinite
        stats.update({f"train/{k}": v for k, v in sums.items()})
        return stats

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the task's fixed held-out set (mmrl.collect's `evaluate_rewards`); a
        task may add its own metrics. A task's own `evaluate(policy, n)` (simulators, judges of
        sampled captions) takes no split of ranks and runs whole on every rank."""
        with self.whole_model():
            result = self.collector.evaluate_rewards(self.task.eval_batch(self.cfg.train.eval_size),
                                                     self.cfg.train.eval_samples)
            result["step"] = self.step
            with self.autocast:
                result.update({f"eval/{k}": v
                               for k, v in self.task.evaluate(self.policy, self.cfg.train.eval_size).items()})
        return result

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
        if self.dist.is_main:
            self.remove_leftovers()
        distributed.barrier(self.dist)  # no rank looks for a checkpoint while rank 0 discards
        resumed_from = self.resume() if resume else None
        done = self.finished_before() if resumed_from is not None else None
        if done is not None:  # the command of a finished run: nothing changes on disk
            self.already_finished = True
            say(f"the run in {self.out_dir} is finished (step {self.step} of {t.steps}); nothing to train. "
                f"Evaluate again with `mmrl eval --checkpoint {self.out_dir}`, or train on with a larger train.steps")
            return done
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
            except Diverged as fault:  # no checkpoint of diverged weights: name the newest one from before
                newest = self.checkpointed[1] if self.checkpointed else None  # written or resumed: whole, no rehash
                raise TrainingDiverged(str(fault), f"at step {self.step} of {t.steps}", newest) from None

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
        bar = progress(range(self.step, t.steps), "grpo", t.progress, total=t.steps, initial=self.step)
        for _ in bar:
            start = self.step_start()
            try:
                stats = self.train_step()
            except RewardFailure:  # raised while collecting, before the update: the step did not happen
                self.restore_step_start(start)
                raise
            metrics = distributed.reduce_metrics(self.dist, stats, self.metric_weights, self.collector.summed_metrics,
                                                 ("train/loss", *(f"train/{name}" for name in self.updater.term_names)))
            self.step += 1
            self.after_step(metrics, bar)
        return self.finish()

    def after_step(self, metrics: dict[str, float], bar) -> None:
        """Log the step, evaluate, save and stop as the config and signals ask."""
        t = self.cfg.train
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

    def finish(self) -> dict[str, Any]:
        """Training is done: checkpoint and weights go to disk before the final evaluation (long, and
        it drives env workers), so a crash there loses no training and the same command then only
        evaluates. results.json comes last, when everything it names is on disk."""
        t = self.cfg.train
        # Resumed from this step's first save (a kill came after it): that checkpoint is this state.
        ckpt = self.checkpointed[1] if self.checkpointed and self.checkpointed[0] == self.step else self.save()
        self.export_final()
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


def legacy_stage_state(state: dict[str, Any]) -> dict[str, Any]:
    """The stages' state in a checkpoint written before the stages (its prompt replay buffer and
    SFT-mix stream had keys of their own)."""
    legacy = {}
    if state.get("replay"):
        legacy["prompt_replay"] = state["replay"]
    if state.get("sft_mix_rng") is not None:
        legacy["sft_mix"] = {"rng": state["sft_mix_rng"]}
    return legacy
