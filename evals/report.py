"""Human-facing outputs of a run: a PNG of training curves and a Markdown summary table."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """Training reward and held-out reward against step, one PNG."""
    rows = [r for r in read_metrics(run_dir) if "step" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out or Path(run_dir) / "curves.png")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    train = [(r["step"], r["reward/total"]) for r in rows if "reward/total" in r]
    evals = [(r["step"], r["eval/total"]) for r in rows if "eval/total" in r]
    if train:
        axes[0].plot(*zip(*train), lw=1, label="train reward (batch mean)")
    if evals:
        axes[0].plot(*zip(*evals), "o-", label="held-out reward (greedy)")
    axes[0].set_xlabel("RL step")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    for key, label in (("train/clip_frac", "clip fraction"), ("train/entropy", "entropy"), ("len/mean", "response length")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            axes[1].plot(*zip(*pts), lw=1, label=label)
    axes[1].set_xlabel("RL step")
    axes[1].legend()
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    lines = ["| step | held-out reward | mean length |", "| ---: | ---: | ---: |"]
    for r in results["eval_history"]:
        lines.append(f"| {r['step']} | {r.get('eval/total', float('nan')):.3f} | {r.get('eval/len_mean', 0):.1f} |")
    png = plot_curves(run_dir)
    if png is not None:
        lines += ["", f"![curves]({png.name})"]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out
