"""A run's components from its config: the task and the policy adapter, for training, evaluating or
probing them. Above the tasks and policies it joins, below the evaluations that use it."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import torch

from mmrl.distributed import resolve_device
from mmrl.envs import make_task
from mmrl.hub import resolve
from mmrl.policies import build_policy


def build(cfg) -> tuple[Any, Any]:
    """(task, policy) of a config: the task registered under `task.name` (its module imported on
    first use) and the policy adapter of `model.policy` on `train.device`, seeded by `train.seed`.
    A `model.path` hub id is fetched into the Hugging Face cache first (mmrl.hub)."""
    if cfg.model.source == "pretrained":  # a hub id builds from its local snapshot; the run's config keeps the id
        local = str(resolve(cfg.model.path, "model", "model.path"))
        if local != cfg.model.path:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=local))
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    # Python's and numpy's global generators too: a library may draw from them, and a checkpoint
    # saves their states, which then match between a run and its resumed twin.
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    task = make_task(cfg.task.name, seed=cfg.train.seed, **cfg.task.params)
    policy = build_policy(cfg, task, resolve_device(cfg.train.device))
    policy.logprob_chunk = cfg.train.logprob_chunk
    if cfg.train.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    return task, policy
