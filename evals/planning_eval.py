"""VPRL evaluation: closed-loop plans on held-out layouts, laid out like the paper's Table 1.

For one policy on one environment, `evaluate_planner` returns, per split (our held-out `test`
layouts, out-of-distribution sizes `ood`, the paper's own test split `paper`), EM / PR / success /
invalid share of failed plans overall and per grid size. `write_planner_report` writes that as
JSON + Markdown, a PNG of EM/PR against the training step (from the run's metrics.jsonl) and GIFs
of sample plans (generated frame | its parsed state | the optimal plan's state). `table1` merges
the JSON files of several runs (methods x environments) into the paper's table:

    python -m mmrl.evals.planning_eval CONFIG --checkpoint RUN_DIR [--method NAME] [--splits test ood paper]
    python -m mmrl.evals.planning_eval table runs/*/planning_eval.json > table1.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mmrl.envs.planning.metrics import evaluate_plans, evaluate_plans_by_level

ENV_TITLES = {"frozenlake": "FrozenLake", "maze": "Maze", "minibehavior": "MiniBehavior"}
METRIC_KEYS = ("exact_match", "progress_rate", "success_rate", "invalid_share_of_failures")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


# ----------------------------------------------------------------------------- evaluation


def evaluate_planner(policy, task, splits: Sequence[str] = ("test",), n: int | None = None,
                     ) -> tuple[dict[str, Any], dict[str, tuple[list, list]]]:
    """Metrics per split (overall and `by_level`), and the (contexts, plans) behind them.

    A split that cannot be built (no `paper_split` path, no `ood_sizes`) is skipped with a note.
    """
    results: dict[str, Any] = {}
    raw: dict[str, tuple[list, list]] = {}
    for split in splits:
        try:
            if split == "ood" and not task.ood_layouts():
                results[split] = {"skipped": "task.params.ood_sizes is empty"}
                continue
            contexts, plans = task.rollout_plans(policy, n, split)
        except (ValueError, FileNotFoundError) as exc:
            results[split] = {"skipped": str(exc)}
            continue
        layouts = [c["layout"] for c in contexts]
        states = [p["states"] for p in plans]
        entry = {k: float(v) for k, v in evaluate_plans(states, layouts).items()}
        entry["by_level"] = {str(lv): {k: float(v) for k, v in m.items()}
                             for lv, m in evaluate_plans_by_level(states, layouts).items()}
        stops: dict[str, int] = {}
        for p in plans:
            stops[p.get("stop", "?")] = stops.get(p.get("stop", "?"), 0) + 1
        entry["stop_reasons"] = stops
        if split == "paper":  # our training split is drawn without looking at the paper's layouts
            entry["in_training"] = task.paper_overlap()
        results[split] = entry
        raw[split] = (contexts, plans)
    return results, raw


# ----------------------------------------------------------------------------- tables


def split_markdown(results: dict[str, Any], title: str = "", train_sizes: Sequence[int] = ()) -> str:
    """One table per run: a row per (split, size) with EM / PR / success / invalid share. With the
    training grid sizes, an `ood` split that scores 0 is footnoted with why (`ood_note`)."""
    note = ood_note(results.get("ood", {}), train_sizes)
    lines = [f"### {title}" if title else "", "",
             "| split | size | n | EM | PR | success | invalid share of failures |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for split, entry in results.items():
        if "skipped" in entry:
            lines.append(f"| {split} | — | 0 | — | — | — | skipped: {entry['skipped']} |")
            continue
        rows = [("all", entry)] + [(lv, m) for lv, m in entry["by_level"].items()]
        name = f"{split} (1)" if split == "ood" and note else split
        for size, m in rows:
            lines.append(f"| {name} | {size} | {int(m['n'])} | {_pct(m['exact_match'])} | "
                         f"{_pct(m['progress_rate'])} | {_pct(m['success_rate'])} | "
                         f"{_pct(m['invalid_share_of_failures'])} |")
    overlap = results.get("paper", {}).get("in_training")
    if overlap is not None:
        lines += ["", f"{overlap} of the paper's {int(results['paper']['n'])} test layouts are also in the "
                  "training split (it is drawn without looking at them)."]
    if note:
        lines += ["", f"(1) {note}"]
    return "\n".join(lines).lstrip() + "\n"


def ood_note(entry: dict[str, Any], train_sizes: Sequence[int]) -> str:
    """Why an out-of-distribution split scores 0 EM (docs/vprl_experiments.md): the planner lays
    every frame on a code canvas as large as its largest training grid, so a larger grid is a frame
    it has never drawn. "" when the split was not run, scored above 0 or the training sizes are unknown."""
    if not train_sizes or "exact_match" not in entry or entry["exact_match"] > 0:
        return ""
    biggest = max(train_sizes)
    sizes = " / ".join(f"{lv}x{lv}" for lv in entry.get("by_level", {}))
    return (f"{sizes or 'The out-of-distribution sizes'} score 0 by construction: the planner draws each frame "
            f"on a code canvas sized to its largest training size, {biggest}x{biggest}, which cannot hold a "
            "larger grid (docs/vprl_experiments.md).")


def table1(records: Sequence[dict[str, Any]], split: str = "test") -> str:
    """The paper's Table 1 layout: a row per method; FrozenLake / Maze / MiniBehavior EM and PR
    (percent) on `split`. `records`: the JSON written by `write_planner_report`."""
    methods: dict[str, dict[str, dict]] = {}
    for rec in records:
        entry = rec["splits"].get(split, {})
        if "skipped" not in entry and entry:
            methods.setdefault(rec["method"], {})[rec["env"]] = entry
    envs = list(ENV_TITLES)
    head = "| method | " + " | ".join(f"{ENV_TITLES[e]} EM | {ENV_TITLES[e]} PR" for e in envs) + " |"
    lines = [head, "| --- |" + " ---: |" * (2 * len(envs))]
    for method, by_env in methods.items():
        cells = []
        for e in envs:
            m = by_env.get(e)
            cells += [_pct(m["exact_match"]) if m else "—", _pct(m["progress_rate"]) if m else "—"]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def before_after_markdown(before: dict[str, Any], after: dict[str, Any], train_cpu_s: float | None = None,
                          title: str = "") -> str:
    """The trainer's first and last held-out evaluation (`eval/exact_match`, `eval/progress_rate`,
    ... and per size `eval/exact_match_L<n>`) as one table, a row per (stage, size)."""
    def rows(label: str, ev: dict[str, Any]) -> list[str]:
        get = ev.get
        out = [f"| {label} | {get('step', 0)} | all | {_pct(get('eval/exact_match'))} | "
               f"{_pct(get('eval/progress_rate'))} | {_pct(get('eval/success_rate'))} | "
               f"{_pct(get('eval/invalid_share_of_failures'))} |"]
        levels = sorted(int(k.rsplit("_L", 1)[1]) for k in ev if k.startswith("eval/exact_match_L"))
        out += [f"| {label} | {get('step', 0)} | {lv}x{lv} | {_pct(get(f'eval/exact_match_L{lv}'))} | "
                f"{_pct(get(f'eval/progress_rate_L{lv}'))} | — | — |" for lv in levels]
        return out

    n = int(after.get("eval/n", 0))
    lines = [f"### {title}" if title else "", "",
             f"Held-out layouts: {n}, greedy closed-loop plans, percent."
             + (f" Training CPU-seconds (SFT + RL, evaluations excluded): {train_cpu_s:.0f}." if train_cpu_s else ""),
             "", "| stage | step | size | EM | PR | success | invalid share of failures |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += rows("before RL (after SFT)", before)
    if after.get("step", 0) != before.get("step", 0):
        lines += rows("after RL", after)
    return "\n".join(lines).lstrip() + "\n"


def write_before_after(results: dict[str, Any], out_dir: str | Path, train_cpu_s: float | None = None,
                       title: str = "") -> str:
    """Write before_after.md / .json from a trainer's results (eval_before, eval_after); return the Markdown."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    before, after = results["eval_before"], results["eval_after"]
    md = before_after_markdown(before, after, train_cpu_s, title)
    (out_dir / "before_after.md").write_text(md)
    (out_dir / "before_after.json").write_text(json.dumps(
        {"before": before, "after": after, "train_cpu_s": train_cpu_s}, indent=2))
    return md


# ----------------------------------------------------------------------------- media


def plot_em_pr(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """EM and PR (held-out, closed loop) against the training step, from metrics.jsonl eval rows."""
    from mmrl.evals.report import read_metrics

    rows = [r for r in read_metrics(run_dir) if "eval/exact_match" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out or Path(run_dir) / "em_pr.png")
    fig = em_pr_figure(rows)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def em_pr_figure(rows: list[dict[str, Any]]):
    """The EM / PR / success curves of `rows` (metrics.jsonl eval rows) as a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    steps = [r["step"] for r in rows]
    # Success often equals EM: distinct markers and line styles keep a line visible under another.
    for key, label, style in (("eval/exact_match", "exact match (EM)", dict(marker="o", ls="-", lw=2.2)),
                              ("eval/progress_rate", "progress rate (PR)", dict(marker="s", ls="--", lw=1.6)),
                              ("eval/success_rate", "success", dict(marker="^", ls=":", lw=1.4, ms=8, mfc="none"))):
        ax.plot(steps, [r.get(key, np.nan) for r in rows], label=label, **style)
    levels = sorted({k.rsplit("_L", 1)[1] for r in rows for k in r if k.startswith("eval/exact_match_L")})
    for lv in levels:
        ax.plot(steps, [r.get(f"eval/exact_match_L{lv}", np.nan) for r in rows], "-.", lw=1, alpha=0.7,
                label=f"EM {lv}x{lv}")
    ax.set_xlabel("RL step (0 = after SFT)")
    ax.set_ylabel("share of held-out layouts")
    ax.set_title("Held-out closed-loop plans", fontsize=10)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plan_gif(context: dict[str, Any], plan: dict[str, Any], path: str | Path, cell_size: int = 16,
             fps: float = 2.0, scale: int = 2) -> Path:
    """A GIF of one plan: generated frame | the state parsed from it | the optimal plan's state,
    each step's panels named above and the colours named below (`legend_strip`)."""
    import imageio.v2 as imageio
    from mmrl.envs.planning import render_state, shortest_path

    lay = context["layout"]
    optimal = shortest_path(lay, context["state"])
    first = context["frame"]
    blank = np.full_like(first, 128)
    tiles = []
    gap = np.full((first.shape[0], 4, 3), 255, np.uint8)
    gen_frames = [first] + list(plan.get("frames", []))
    for t, state in enumerate(plan["states"]):
        gen = gen_frames[t] if t < len(gen_frames) else blank
        parsed = render_state(lay, state, cell_size) if state[0] >= 0 else blank
        ref = render_state(lay, optimal[min(t, len(optimal) - 1)], cell_size)
        if gen.shape != first.shape:
            gen = blank
        tiles.append(np.concatenate([gen, gap, parsed, gap, ref], 1))
    legend = legend_strip(lay, tiles[0].shape[1] * scale)
    tiles = [np.concatenate([_label_tile(np.repeat(np.repeat(tile, scale, 0), scale, 1), t, first.shape[1] * scale,
                                         4 * scale), legend], 0)
             for t, tile in enumerate(tiles)]
    tiles += [tiles[-1]] * 2  # linger on the last step
    path = Path(path)
    imageio.mimsave(path, tiles, duration=1.0 / fps, loop=0)
    return path


def legend_entries(layout) -> list[tuple[str, tuple[int, int, int]]]:
    """(name, RGB) of every colour a frame of `layout` can show (the renderer's palette), and the
    grey of a panel whose frame could not be parsed."""
    from mmrl.envs.planning.grid import Cell
    from mmrl.envs.planning.render import PALETTE, Colour

    has = lambda cell: bool((layout.grid == cell).any())  # noqa: E731
    names = [(Colour.FLOOR, "ice" if layout.task == "frozenlake" else "floor"),
             (Colour.GOAL, "goal") if has(Cell.GOAL) else None,
             (Colour.HOLE, "hole") if has(Cell.HOLE) else None,
             (Colour.WALL, "wall") if has(Cell.WALL) or layout.walls is not None else None,
             (Colour.TABLE, "table") if has(Cell.TABLE) else None,
             (Colour.AGENT, "agent (red disc)"),
             (Colour.PRINTER, "printer (dot in the agent = carried)") if layout.printer else None]
    out = [(name, tuple(int(v) for v in PALETTE[colour])) for colour, name in filter(None, names)]
    return out + [("not parseable / no frame", (128, 128, 128))]


def legend_strip(layout, width: int) -> np.ndarray:
    """A white strip `width` px wide: a swatch and a name per `legend_entries`, wrapped to new lines."""
    from PIL import Image, ImageDraw

    swatch, line_h, pad = 9, 13, 10
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    placed, x, y = [], 2, 2
    for name, rgb in legend_entries(layout):
        item_w = swatch + 3 + int(measure.textlength(name)) + pad
        if x > 2 and x + item_w > width:
            x, y = 2, y + line_h
        placed.append((x, y, name, rgb))
        x += item_w
    strip = Image.new("RGB", (width, y + line_h + 2), "white")
    draw = ImageDraw.Draw(strip)
    for x, y, name, rgb in placed:
        draw.rectangle([x, y + 1, x + swatch, y + 1 + swatch], fill=rgb, outline=(0, 0, 0))
        draw.text((x + swatch + 3, y), name, fill=(0, 0, 0))
    return np.asarray(strip)


def _label_tile(tile: np.ndarray, step: int, panel_w: int, gap_w: int) -> np.ndarray:
    """`tile` with a white strip above it naming each panel and the plan step."""
    from PIL import Image, ImageDraw

    strip = Image.new("RGB", (tile.shape[1], 14), "white")
    draw = ImageDraw.Draw(strip)
    names = (f"drawn (step {step})", "parsed", "optimal")
    for i, name in enumerate(names):
        draw.text((i * (panel_w + gap_w) + 2, 1), name, fill=(0, 0, 0))
    return np.concatenate([np.asarray(strip), tile], 0)


# ----------------------------------------------------------------------------- one run's report


def write_planner_report(policy, task, out_dir: str | Path, method: str = "policy",
                         splits: Sequence[str] = ("test", "ood", "paper"), n: int | None = None,
                         run_dir: str | Path | None = None, n_gifs: int = 4) -> dict[str, Any]:
    """Evaluate, then write planning_eval.json, planning_eval.md, em_pr.png and plan GIFs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, raw = evaluate_planner(policy, task, splits, n)
    record = {"method": method, "env": task.env, "sizes": task.sizes, "splits": results}
    (out_dir / "planning_eval.json").write_text(json.dumps(record, indent=2))
    md = [f"# {ENV_TITLES[task.env]}: {method}", "", table1([record]), split_markdown(results, train_sizes=task.sizes)]
    png = plot_em_pr(run_dir, out_dir / "em_pr.png") if run_dir is not None else None
    if png is not None:
        md += ["![EM/PR vs training step](em_pr.png)"]
    if "test" in raw and n_gifs:
        contexts, plans = raw["test"]
        gif_dir = out_dir / "plans"
        gif_dir.mkdir(exist_ok=True)
        # successes and failures both, so the GIFs show what goes wrong too
        order = sorted(range(len(plans)), key=lambda i: plans[i].get("stop") != "goal")
        pick = order[: n_gifs // 2] + order[::-1][: n_gifs - n_gifs // 2]
        for i in dict.fromkeys(pick):
            plan_gif(contexts[i], plans[i], gif_dir / f"{contexts[i]['layout_id'].replace('/', '_')}.gif",
                     cell_size=task.cell_size)
        md += ["", "GIFs in `plans/`: generated frame | parsed state | optimal plan, with a colour legend."]
    (out_dir / "planning_eval.md").write_text("\n".join(md) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "table":
        p = argparse.ArgumentParser(prog="planning_eval table")
        p.add_argument("files", nargs="+")
        p.add_argument("--split", default="test")
        a = p.parse_args(argv[1:])
        print(table1([json.loads(Path(f).read_text()) for f in a.files], a.split), end="")
        return 0
    p = argparse.ArgumentParser(prog="planning_eval", description="VPRL closed-loop evaluation of a checkpoint")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", help="a run directory or step_NNNNNN checkpoint (default: untrained)")
    p.add_argument("--method", default=None, help="row name in the table (default: the run directory's name)")
    p.add_argument("--splits", nargs="+", default=["test", "ood", "paper"])
    p.add_argument("--n", type=int, default=None, help="layouts per split (default: all)")
    p.add_argument("--out", default=None, help="output folder (default: <output_dir>/eval)")
    a = p.parse_args(argv)

    from mmrl.assemble import build
    from mmrl.config import load_config

    cfg = load_config(a.config, a.overrides)
    task, policy = build(cfg)
    written = report_checkpoint(cfg, task, policy, a.checkpoint, out=a.out, method=a.method, splits=a.splits, n=a.n)
    print(f"written: {written}")
    return 0


def report_checkpoint(cfg, task, policy, checkpoint: str | Path | None, out: str | Path | None = None,
                      method: str | None = None, splits: Sequence[str] = ("test", "ood", "paper"),
                      n: int | None = None) -> Path:
    """Load `checkpoint` (a run directory or a step_NNNNNN one; None: evaluate `policy` as it is),
    write the planner report (default folder: <run>/eval) and print its table; returns the
    report's Markdown file."""
    import torch

    from mmrl.checkpoint import load_weights, resolve_checkpoint

    run_dir = Path(cfg.train.output_dir)
    if checkpoint:
        run_dir, ckpt = resolve_checkpoint(checkpoint)
        load_weights(ckpt, policy.model)
    out = Path(out or run_dir / "eval")
    with torch.no_grad():
        record = write_planner_report(policy, task, out, method or run_dir.name, splits, n, run_dir=run_dir)
    print(table1([record]), end="")
    for split, entry in record["splits"].items():
        print(f"{split}: " + (entry["skipped"] if "skipped" in entry else
                              "  ".join(f"{k}={entry[k]:.3f}" for k in METRIC_KEYS)))
    note = ood_note(record["splits"].get("ood", {}), task.sizes)
    if note:
        print(f"ood: {note}")
    return out / "planning_eval.md"


if __name__ == "__main__":
    sys.exit(main())
