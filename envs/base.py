"""What every task shares: the hooks the trainer and the CLI call, with their defaults.

A task is a prompt source (`next_batch`, `eval_batch`, `sft_batch`, `state_dict`) registered by
name with `register_task`. Subclass `TaskBase` and override only the hooks a domain has: a domain
metric (`evaluate`), the metric a run's headline reports (`headline`), and the domain whose
reports `mmrl train` and `mmrl eval --checkpoint` write (`REPORT`, a name of
mmrl.evals.reports.REPORTS).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np


class Headline(NamedTuple):
    """One metric of a run's headline, `label: before -> after`: the value of `key` in the first
    and the last held-out evaluation (None where that evaluation did not log it). `fmt` is a format
    spec: ".3f", or ".1%" to show a share as a percentage."""

    label: str
    before: float | None
    after: float | None
    fmt: str
    key: str  # where each evaluation logs it (the report plots it over the run's evaluations)

    def show(self, value: float | None) -> str:
        return "n/a" if value is None or math.isnan(value) else format(value, self.fmt)


# (label, eval key, format): what a run reports when its task names no metric of its own
HELD_OUT_REWARD = ("held-out reward", "eval/total", ".3f")


def headline_rows(before: dict[str, Any], after: dict[str, Any],
                  metrics: Iterable[tuple[str, str, str]]) -> list[Headline]:
    """The `metrics` (label, eval key, format) that either evaluation logged, as headline rows; the
    held-out reward when none was (a policy that cannot produce the task's metric, a renamed reward),
    so a headline is never empty."""
    rows = [Headline(label, before.get(key), after.get(key), fmt, key)
            for label, key, fmt in metrics if key in before or key in after]
    if rows:
        return rows
    label, key, fmt = HELD_OUT_REWARD
    return [Headline(label, before.get(key), after.get(key), fmt, key)]


def check_source_params(params: dict[str, Any], source_params: dict[str, tuple[str, ...]], default: str) -> None:
    """Refuse, in one line, a `task.params` entry that only another data source of the task reads
    (`source_params`: source -> the parameters only it reads; `default`: the source when none is set)."""
    source = params.get("source", default)
    if source not in source_params:
        return  # the task's own check names a bad source
    for other, names in source_params.items():
        unused = [k for k in params if k in names and other != source]
        if unused:
            raise ValueError(f"task.params.{unused[0]}: not read by source {source!r} (it is a parameter of "
                             f"source {other!r}); remove it, or set task.params.source: {other}")


class TaskBase:
    # The domain whose reports `mmrl train` and `mmrl eval --checkpoint` write (mmrl.evals.reports.REPORTS).
    REPORT = "held_out"

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

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """Refuse, with a ValueError naming the key, `task.params` that are valid names but do not fit
        together (checked when the config loads, after the names against `__init__`); none by default."""

    def data_summary(self) -> str:
        """One line on where the training and held-out data come from, said when a run starts; "" for none."""
        return ""

    def sft_targets(self) -> str:
        """What SFT imitates (said when a run with SFT starts)."""
        return "the task's expert targets"

    def run_health(self) -> dict[str, Any]:
        """Facts results.json should carry about how the run went (e.g. env worker restarts), with
        "notes": lines `mmrl train` prints at the end; {} by default."""
        return {}

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

    def headline(self, before: dict[str, Any], after: dict[str, Any]) -> list[Headline]:
        """The metric(s) README's results table reports for this domain, from the first and the last
        held-out evaluation (results.json's eval_before / eval_after): `mmrl train` prints them first
        and report.md opens with them. Default: the mean held-out reward."""
        return headline_rows(before, after, [HELD_OUT_REWARD])

    def load_for_eval(self, policy, checkpoint: str | Path, splits: list[str] | None = None) -> tuple[Path, int]:
        """Load the weights of `checkpoint` (a run folder or a checkpoint in one) into `policy` for
        `mmrl eval`: (the checkpoint's run folder, its step); its trainer state is not read. `splits`
        is refused: this task has one held-out set."""
        from mmrl.checkpoint import checkpoint_step, load_weights, resolve_checkpoint

        if splits:
            raise ValueError(f"--splits: {type(self).__name__} has one held-out set; --splits is for planning tasks")
        run_dir, ckpt = resolve_checkpoint(checkpoint)
        load_weights(ckpt, policy.model)
        return Path(run_dir), checkpoint_step(ckpt)
