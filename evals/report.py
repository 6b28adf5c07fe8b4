"""Human-facing outputs of a run: the headline (the task's README metric before -> after RL), a
PNG of training curves and report.md.

`mmrl train` prints `headline_text` first, then the task's `summarize` Markdown, and
`write_report` puts both into report.md with the held-out evaluations over the run and
`curves.png` (reward, the headline metric, entropy, KL, clip fraction, response length and
truncated share, each on its own labelled axis).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmrl.checkpoint import atomic_write_text
from mmrl.envs.base import HELD_OUT_REWARD, Headline, headline_rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- the headline


def headline_text(rows: Sequence[Headline], before_step: int, after_step: int) -> str:
    """`label: before -> after` a line per metric, labels aligned; the first line names the steps."""
    width = max(len(r.label) for r in rows) + 1
    lines = [f"{r.label + ':':<{width}} {r.show(r.before)} -> {r.show(r.after)}" for r in rows]
    lines[0] += f"  (held-out, step {before_step} -> {after_step})"
    return "".join(line + "\n" for line in lines)


def headline_markdown(rows: Sequence[Headline], before_step: int, after_step: int,
                      before_label: str = "before RL") -> str:
    """The headline as a Markdown table: a row per metric, a column per evaluation."""
    if before_step == after_step:  # no RL step was taken: one evaluation
        lines = [f"| metric | step {after_step} |", "| --- | ---: |"]
        lines += [f"| {r.label} | {r.show(r.after)} |" for r in rows]
    else:
        lines = [f"| metric | step {before_step}: {before_label} | step {after_step}: after RL |",
                 "| --- | ---: | ---: |"]
        lines += [f"| {r.label} | {r.show(r.before)} | {r.show(r.after)} |" for r in rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- curves


def _points(rows: list[dict], key: str, scale: float = 1.0) -> list[tuple[float, float]]:
    return [(r["step"], scale * r[key]) for r in rows
            if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]


def curves_figure(rows: list[dict[str, Any]], headline: Sequence[Headline] = (),
                  evals: list[dict[str, Any]] | None = None):
    """The curves of `rows` (metrics.jsonl) as a matplotlib figure: one panel per quantity, each
    with its own y-label, so a small share (clip fraction, truncation) never hides under a larger
    quantity's scale. Held-out (eval/) curves come from `evals` when given (results.json's
    eval_history, which also holds the final evaluation a run without `eval_every` does not log).
    Panels without data are left out."""
    import matplotlib.pyplot as plt

    source = lambda key: evals if evals is not None and key.startswith("eval/") else rows  # noqa: E731

    # (title, y-label, [(key, line label, style)], y-limits or None, scale)
    panels: list[tuple[str, str, list[tuple[str, str, str]], tuple[float, float] | None, float]] = []
    shown = [r for r in headline if r.key != "eval/total"]  # the reward panel has the held-out reward
    if shown:
        percent = all(r.fmt.endswith("%") for r in shown)
        ylabel = shown[0].label if len(shown) == 1 else "held-out metric"
        styles = ("o-", "s--", "^:", "d-.")  # metrics that coincide (EM and PR often do) stay visible
        panels.append(("headline metric (held-out)", ylabel + (" (%)" if percent else ""),
                       [(r.key, r.label, styles[i % len(styles)]) for i, r in enumerate(shown)],
                       (-2.0, 102.0) if percent else None, 100.0 if percent else 1.0))
    panels += [
        ("reward", "reward", [("reward/total", "train (batch mean)", "-"),
                              ("eval/total", "held-out, greedy", "o-"),
                              ("eval/sampled_total", "held-out, sampled", "s--")], None, 1.0),
        ("entropy", "entropy (nats per token)", [("train/entropy", "entropy", "-")], None, 1.0),
        ("KL", "KL divergence", [("train/approx_kl", "KL to sampler", "-"),
                                 ("train/kl_ref", "KL to reference", "--")], None, 1.0),
        ("clip fraction", "share of tokens clipped", [("train/clip_frac", "clip fraction", "-")], None, 1.0),
        ("response length", "mean length (tokens)", [("len/mean", "mean length", "-")], None, 1.0),
        ("truncated responses", "share truncated", [("len/truncated_frac", "truncated share", "-")],
         (-0.02, 1.02), 1.0),
    ]
    panels = [p for p in panels if any(_points(source(key), key) for key, _, _ in p[2])]
    cols = min(len(panels), 4)
    n_rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3.2 * n_rows), squeeze=False)
    for ax, (title, ylabel, lines, ylim, scale) in zip(axes.flat, panels):
        for key, label, style in lines:
            pts = _points(source(key), key, scale)
            if pts:
                ax.plot(*zip(*pts), style, lw=1.2, ms=5, mfc="none", label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        fig.delaxes(ax)
    fig.tight_layout()
    return fig


def plot_curves(run_dir: str | Path, out: str | Path | None = None, headline: Sequence[Headline] = ()) -> Path | None:
    """`curves_figure` of the run's metrics.jsonl and results.json saved as a PNG (default:
    curves.png in the run)."""
    rows = [r for r in read_metrics(run_dir) if "step" in r]
    if not rows:
        return None
    results = Path(run_dir) / "results.json"
    evals = json.loads(results.read_text())["eval_history"] if results.is_file() else None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out or Path(run_dir) / "curves.png")
    fig = curves_figure(rows, headline, evals)
    tmp = out.with_name(f".tmp_{out.name}")  # renamed into place: a kill never leaves half a picture
    fig.savefig(tmp, dpi=110, format=out.suffix.lstrip(".") or "png")
    plt.close(fig)
    os.replace(tmp, out)
    return out


# ----------------------------------------------------------------------------- report.md


def write_report(run_dir: str | Path, headline: Sequence[Headline] | None = None, summary: str = "") -> Path:
    """report.md of a finished run: the headline table (default: the held-out reward), the task's
    `summary` Markdown (e.g. planning's EM / PR table by size), every held-out evaluation of the run
    and curves.png."""
    run_dir = Path(run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    before, after = results["eval_before"], results["eval_after"]
    rows = list(headline) if headline is not None else headline_rows(before, after, [HELD_OUT_REWARD])
    had_sft = (results.get("config", {}).get("sft", {}).get("steps") or 0) > 0
    md = [f"# Run report: {run_dir.name}", "",
          headline_markdown(rows, before["step"], after["step"], "before RL (after SFT)" if had_sft else "before RL")]
    if summary.strip():
        md += [summary.strip(), ""]
    md += ["## Held-out evaluations", "", *history_markdown(results["eval_history"], rows)]
    png = plot_curves(run_dir, headline=rows)
    if png is not None:
        md += ["", f"![training curves]({png.name})"]
    out = run_dir / "report.md"
    atomic_write_text(out, "\n".join(md) + "\n")
    return out


def history_markdown(history: list[dict[str, Any]], headline: Sequence[Headline]) -> list[str]:
    """A row per held-out evaluation: the headline metrics, the held-out reward and the mean length."""
    columns = [(r.label, r.key, r) for r in headline]
    if all(r.key != "eval/total" for r in headline):
        columns.append(("held-out reward", "eval/total", None))
    head = ["step", *(label for label, _, _ in columns), "mean length"]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for ev in history:
        cells = [str(ev["step"])]
        for _, key, row in columns:
            value = ev.get(key)
            cells.append(row.show(value) if row else ("n/a" if value is None else f"{value:.3f}"))
        cells.append(f"{ev.get('eval/len_mean', float('nan')):.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines
