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
    """(task, policy) of a config (mmrl.assemble.build)."""
    from mmrl.assemble import build as _build

    return _build(cfg)


def train(cfg, resume: bool = True) -> dict[str, Any]:
    """Build and train `cfg` (SFT if configured, then RL); returns the run's results (also written
    to `train.output_dir`/results.json)."""
    from mmrl.cli import run_training

    return run_training(cfg, resume=resume)[1]


__all__ = ["build", "load_config", "train"]
