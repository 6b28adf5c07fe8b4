"""The SFT warm start before RL: `sft.steps` supervised steps on the task's expert targets, with
their own optimizer and schedule, resumable from the middle (a SIGINT / SIGTERM saves its state)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mmrl import distributed
from mmrl.distributed import RANK_SEED_STRIDE, Dist
from mmrl.logger import progress
from mmrl.run_config import RunConfig
from mmrl.update import NonFiniteSteps, clip_grad_norm, make_adamw, warmup_cosine


class WarmStart:
    def __init__(self, cfg: RunConfig, policy, task, dist: Dist, params: list[torch.nn.Parameter], autocast, log,
                 state: dict[str, Any] | None = None):
        """`state`: the `state_dict` of a warm start stopped in the middle, to go on from."""
        s = cfg.sft
        self.cfg, self.policy, self.task, self.dist, self.params, self.autocast, self.log = (
            cfg, policy, task, dist, params, autocast, log)
        # each rank its own batches; their gradients are averaged (data-parallel SFT)
        self.rng = np.random.default_rng(cfg.train.seed + 2 + RANK_SEED_STRIDE * dist.rank)
        self.opt = make_adamw(params, lr=s.lr)
        floor = cfg.train.min_lr_ratio if s.lr_schedule == "cosine" else 1.0  # a floor of 1: constant after warmup
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup_cosine(s.warmup_steps, s.steps, floor))
        self.start, self.cpu_used = 0, 0.0
        self.nonfinite = NonFiniteSteps(cfg.train.max_nonfinite_steps, dist, log.warn)
        if state is not None:
            self.start, self.cpu_used = state["step"], state["cpu_s"]
            self.opt.load_state_dict(state["optimizer"])
            self.schedule.load_state_dict(state["schedule"])
            self.rng.bit_generator.state = state["rng"]

    def run(self, stop_requested: Callable[[], bool]) -> dict[str, Any] | None:
        """Train to `sft.steps` (or `sft.max_cpu_s`); None when done, else the state to resume from,
        when `stop_requested()` asked for a stop before a step."""
        s = self.cfg.sft
        self.policy.model.train()
        bar = progress(range(self.start, s.steps), "sft", self.cfg.train.progress, total=s.steps, initial=self.start)
        cpu_start, done = time.process_time() - self.cpu_used, self.start
        for i in bar:
            if s.max_cpu_s > 0 and distributed.all_max(self.dist, int(time.process_time() - cpu_start >= s.max_cpu_s)):
                break
            if stop_requested():
                return {"step": i, "cpu_s": time.process_time() - cpu_start, "rng": self.rng.bit_generator.state,
                        "optimizer": self.opt.state_dict(), "schedule": self.schedule.state_dict()}
            loss, applied = self.step(i)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss:.3f}")
            self.log.log({"sft/loss": loss, "sft/lr": self.schedule.get_last_lr()[0],
                          "sft/skipped_nonfinite": float(not applied)}, step=i, prefix_step="sft_step")
            if applied:
                self.schedule.step()
            done = i + 1
        # how much SFT ran: with sft.max_cpu_s, possibly fewer than sft.steps
        self.log.log({"sft/steps_done": done, "sft/cpu_s": time.process_time() - cpu_start}, step=done,
                     prefix_step="sft_step")
        return None

    def step(self, i: int) -> tuple[float, bool]:
        """SFT step `i`: its loss, and whether it was applied (not when its loss or gradient norm is
        not finite: `NonFiniteSteps`)."""
        with self.autocast:
            loss = self.policy.sft_loss(self.task.sft_batch(self.cfg.sft.batch_size, self.rng))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        distributed.average_gradients(self.dist, self.params)
        grad_norm = clip_grad_norm(self.params, self.cfg.train.grad_clip).item()
        loss_value = loss.item()
        applied = self.nonfinite.applies(grad_norm, loss_value, f"SFT step {i}")
        if applied:
            self.opt.step()
        else:
            self.opt.zero_grad(set_to_none=True)
        return loss_value, applied
