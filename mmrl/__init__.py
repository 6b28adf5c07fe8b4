"""mmrl: RL post-training (GRPO family) for multimodal models.

    import mmrl
    cfg = mmrl.load_config("configs/digit_sort_grpo.yaml", ["train.steps=20"])
    task, policy = mmrl.build(cfg)          # the components, e.g. to evaluate or probe them
    results = mmrl.train(cfg)               # or the whole run, as `mmrl train` does

Everything heavy (torch, the task's simulator) is imported on first use, so `import mmrl` is cheap.
"""

from __future__ import annotations

from typing import Any


def load_config(path: str, overrides: list[str] | None = None):
    """A validated `RunConfig` from a YAML file plus dotted `key=value` overrides."""
    from mmrl.config import load_config as _load

    return _load(path, overrides or [])


def build(cfg) -> tuple[Any, Any]:
    """(task, policy) of a config: the task registered under `task.name` (its module imported on
    first use) and the policy adapter of `model.policy` on `train.device`, seeded by `train.seed`.
    A `model.path` hub id is fetched into the Hugging Face cache first (mmrl.hub)."""
    import dataclasses

    import torch

    from mmrl.envs import make_task
    from mmrl.hub import resolve
    from mmrl.policies import build_policy
    from mmrl.trainer import resolve_device

    if cfg.model.source == "pretrained":  # a hub id builds from its local snapshot; the run's config keeps the id
        local = str(resolve(cfg.model.path, "model", "model.path"))
        if local != cfg.model.path:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=local))
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    task = make_task(cfg.task.name, seed=cfg.train.seed, **cfg.task.params)
    policy = build_policy(cfg, task, resolve_device(cfg.train.device))
    policy.logprob_chunk = cfg.train.logprob_chunk
    if cfg.train.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    return task, policy


def train(cfg, resume: bool = True) -> dict[str, Any]:
    """Build and train `cfg` (SFT if configured, then RL); returns the run's results (also written
    to `train.output_dir`/results.json)."""
    from mmrl.cli import run_training

    return run_training(cfg, resume=resume)[1]


__all__ = ["build", "load_config", "train"]
