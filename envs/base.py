"""What every task shares: the hooks the trainer and the CLI call, with their defaults.

A task is a prompt source (`next_batch`, `eval_batch`, `sft_batch`, `state_dict`) registered by
name with `register_task`. Subclass `TaskBase` and override only the hooks a domain has: a domain
metric (`evaluate`), a before/after table (`summarize`), its own checkpoint report (`evaluate_checkpoint`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


class TaskBase:
    def next_batch(self, n: int) -> list[Any]:  # training contexts; advances the cursor
        raise NotImplementedError

    def eval_batch(self, n: int) -> list[Any]:  # a fixed held-out list
        raise NotImplementedError

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[Any]:  # contexts with targets
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def corpus(self) -> list[str]:
        """Text to train a tiny local tokenizer on; [] lets the policy build one from SFT contexts."""
        return []

    def evaluate(self, policy, n: int) -> dict[str, float]:
        """A domain metric beyond the mean held-out reward (logged as eval/<key>); none by default."""
        return {}

    def evaluate_outputs(self, contexts: list, outputs: list) -> dict[str, float]:
        """Metrics of the greedy held-out outputs the trainer's evaluation has just generated and
        scored (logged as eval/<key>), for tasks whose generation is too costly to repeat; none by
        default."""
        return {}

    def summarize(self, results: dict[str, Any], out_dir: str, cpu_s: float | None = None) -> str:
        """Text `mmrl train` prints after the run (e.g. a before/after table); none by default."""
        return ""

    def load_for_eval(self, policy, checkpoint: str | Path, splits: list[str] | None = None) -> tuple[Path, dict]:
        """Load `checkpoint` (a run folder or a checkpoint in one) into `policy` for `mmrl eval`:
        (the checkpoint's run folder, its saved state). `splits` is refused: this task has one held-out set."""
        from mmrl.checkpoint import load_whole_checkpoint, resolve_checkpoint

        if splits:
            raise ValueError(f"--splits: {type(self).__name__} has one held-out set; --splits is for planning tasks")
        run_dir, ckpt = resolve_checkpoint(checkpoint)
        return Path(run_dir), load_whole_checkpoint(ckpt, policy.model)

    def evaluate_checkpoint(self, cfg, policy, checkpoint: str | Path, output: str | None = None,
                            splits: list[str] | None = None) -> Path:
        """`mmrl eval`: the trainer's held-out evaluation of `checkpoint`, printed and written as
        JSON (default: eval.json in the checkpoint's run folder); returns the file written."""
        from mmrl.trainer import Trainer

        run_dir, state = self.load_for_eval(policy, checkpoint, splits)
        cfg.train.output_dir = str(run_dir)  # the evaluation belongs to the checkpoint's run
        trainer = Trainer(cfg, policy, self)
        trainer.step = state["step"]  # the results are labelled with the checkpoint's step
        result = trainer.evaluate()
        out = Path(output or Path(run_dir) / "eval.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"checkpoint": str(checkpoint), **result}, indent=2))
        for k, v in result.items():
            print(f"{k:>24}: {v:.4f}" if isinstance(v, float) else f"{k:>24}: {v}")
        return out
