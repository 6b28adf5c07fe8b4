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
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    train = [(r["step"], r["reward/total"]) for r in rows if "reward/total" in r]
    evals = [(r["step"], r["eval/total"]) for r in rows if "eval/total" in r]
    sampled = [(r["step"], r["eval/sampled_total"]) for r in rows if "eval/sampled_total" in r]
    if train:
        axes[0].plot(*zip(*train), lw=1, alpha=0.7, label="train reward (batch mean)")
    if evals:
        axes[0].plot(*zip(*evals), "o-", label="held-out reward (greedy)")
    if sampled:
        axes[0].plot(*zip(*sampled), "s--", label="held-out reward (sampled)")
    axes[0].set_title("reward")
    panels = [(axes[1], "policy", (("train/entropy", "entropy"), ("train/clip_frac", "clip fraction"),
                                   ("train/approx_kl", "KL to sampler"), ("train/kl_ref", "KL to reference"))),
              (axes[2], "responses", (("len/mean", "mean length"), ("len/truncated_frac", "truncated share")))]
    for ax, title, keys in panels:
        for key, label in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), lw=1, label=label)
        ax.set_title(title)
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
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
