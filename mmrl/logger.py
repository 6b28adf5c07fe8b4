"""Metrics to `metrics.jsonl` (always), TensorBoard and Weights & Biases (optional, off by default)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from mmrl.checkpoint import atomic_write_text, named_write_error


def say(message: str) -> None:
    """One line to stderr, prefixed `mmrl: `; tqdm.write keeps an open progress bar intact below it."""
    from tqdm.auto import tqdm

    tqdm.write(f"mmrl: {message}", file=sys.stderr)


def progress(it, desc: str, enabled: bool, **kwargs):
    """`it` with a tqdm bar when `enabled`."""
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, dynamic_ncols=True, **kwargs)


class MetricsLogger:
    def __init__(self, out_dir: str | Path, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "mmrl", config: dict[str, Any] | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._tb = self._wandb = None
        self._repeats: dict[str, int] = {}  # warning kind -> times seen after the first
        # Rows written to metrics.jsonl, once known (a fresh log, or one cut to a checkpoint's rows):
        # a checkpoint records it, so that its resume keeps exactly the rows written before it.
        self.rows: int | None = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        if wandb:
            import wandb as wb

            self._wandb = wb.init(project=wandb_project, config=config or {}, dir=str(self.out_dir))

    def log(self, metrics: dict[str, Any], step: int, prefix_step: str = "step") -> None:
        row = {prefix_step: step, **{k: v for k, v in metrics.items() if k != "step"}}
        self._append(row)
        numeric = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and k != "step" and math.isfinite(float(v))}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def warn(self, message: str, kind: str | None = None) -> None:
        """Every warning goes to metrics.jsonl; on the console, a warning of a recurring `kind` is
        shown the first time only and counted, and `close` says how often it came back."""
        self._append({"warning": message})
        if kind is not None:
            self._repeats[kind] = self._repeats.get(kind, -1) + 1
            if self._repeats[kind] > 0:
                return
            message += " (shown once; metrics.jsonl has every occurrence)"
        say(f"warning: {message}")

    def _append(self, row: dict[str, Any]) -> None:
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as exc:
            raise named_write_error(exc, self.path) from None
        if self.rows is not None:
            self.rows += 1

    def reset(self) -> None:
        """A fresh run starts a fresh log."""
        self.path.unlink(missing_ok=True)
        self.rows = 0

    def truncate_to(self, rows: int) -> None:
        """On resume, keep the first `rows` rows (those written before the checkpoint), so the file reads
        as one uninterrupted run; an unchanged file is not written again."""
        lines = self.path.read_text().splitlines(keepends=True) if self.path.is_file() else []
        if len(lines) != rows or (lines and not lines[-1].endswith("\n")):
            atomic_write_text(self.path, "".join(lines[:rows]))
        self.rows = min(rows, len(lines))

    def truncate_after(self, step: int) -> None:
        """`truncate_to` for a checkpoint that does not record its rows: drop the rows of later steps."""
        if not self.path.is_file():
            self.rows = 0
            return
        kept = [line for line in self.path.read_text().splitlines() if json.loads(line).get("step", -1) <= step]
        atomic_write_text(self.path, "".join(x + "\n" for x in kept))
        self.rows = len(kept)

    def close(self) -> None:
        for kind, more in self._repeats.items():
            if more:
                say(f"warning: {kind}: {more} more time(s) (see metrics.jsonl)")
        self._repeats.clear()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class SilentLogger(MetricsLogger):
    """The logger of ranks other than 0 in a multi-process run: rank 0 logs for the run."""

    def __init__(self):
        self._repeats = {}
        self.rows = None

    def log(self, metrics: dict[str, Any], step: int, prefix_step: str = "step") -> None:
        pass

    def warn(self, message: str, kind: str | None = None) -> None:
        pass

    def reset(self) -> None:
        pass

    def truncate_to(self, rows: int) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
