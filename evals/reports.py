"""A task's reports: the summary `mmrl train` prints after the headline (and report.md holds), and
`mmrl eval --checkpoint RUN`, the checkpoint evaluated on the task's held-out data in the report of
its domain. A task names its domain's reports (`TaskBase.REPORT`); the reports live here, so the
tasks never import the evaluations."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def held_out(cfg, task, policy, checkpoint, output=None, splits=None) -> Path:
    """The trainer's held-out evaluation of `checkpoint`, printed and written as JSON (default:
    eval.json in the checkpoint's run folder); returns the file written."""
    from mmrl.trainer import Trainer

    run_dir, step = task.load_for_eval(policy, checkpoint, splits)
    cfg.train.output_dir = str(run_dir)  # the evaluation belongs to the checkpoint's run
    trainer = Trainer(cfg, policy, task)
    trainer.step = step  # the results are labelled with the checkpoint's step
    result = trainer.evaluate()
    out = Path(output or Path(run_dir) / "eval.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"checkpoint": str(checkpoint), **result}, indent=2))
    for k, v in result.items():
        print(f"{k:>24}: {v:.4f}" if isinstance(v, float) else f"{k:>24}: {v}")
    return out


def planning(cfg, task, policy, checkpoint, output=None, splits=None) -> Path:
    """The paper's Table-1 report of a planner (EM / PR per split and level, the em_pr plot, plan
    GIFs); splits default to test, ood and (when `paper_split` is set) paper. The one-shot text
    planner has no closed-loop plans: the held-out evaluation."""
    from mmrl.evals.planning_eval import report_checkpoint

    if not hasattr(policy, "plan"):
        return held_out(cfg, task, policy, checkpoint, output, splits)
    splits = splits or ["test", "ood", *(["paper"] if task.paper_split_path else [])]
    return report_checkpoint(cfg, task, policy, checkpoint, out=output, splits=splits)


def vqa(cfg, task, policy, checkpoint, output=None, splits=None) -> Path:
    """The accuracy report (JSON + Markdown, the accuracy-by-step plot, an HTML page of replies)."""
    from mmrl.evals.vqa_eval import report_checkpoint

    return report_checkpoint(cfg, task, policy, checkpoint, out=output, splits=splits)


def video(cfg, task, policy, checkpoint, output=None, splits=None) -> Path:
    """The held-out evaluation (eval.json) and the videos it generated (videos.gif / .png)."""
    from mmrl.evals.video_eval import write_grid

    written = held_out(cfg, task, policy, checkpoint, output, splits)
    videos = task.eval_videos[-1]  # the evaluation above generated them (`VideoTask.evaluate_outputs`)
    paths = write_grid(Path(written).parent / "videos", {"checkpoint": videos}, task.shown_prompts)
    print(f"videos: {paths[0]}")
    return written


def vla(cfg, task, policy, checkpoint, output=None, splits=None) -> Path:
    """Every held-out state (LIBERO: each task's official initial states, the published protocol)
    in the task's eval mode(s), as `mmrl.evals.vla_eval` reports it (vla_eval.json / .md: success
    per suite and task, with images shuffled too, the SFT loss gap, rollout videos) into `output`
    (default: <run>/eval). Returns the JSON written."""
    import torch

    from mmrl.evals.vla_eval import table, write_vla_report

    run_dir, _ = task.load_for_eval(policy, checkpoint, splits)
    out_dir = Path(output) if output else run_dir / "eval"
    with torch.no_grad():
        record = write_vla_report(policy, [(getattr(task, "suite", None), task)], out_dir, Path(run_dir).name,
                                  task.eval_modes(), run_dir=run_dir)
    for mode in record["modes"]:
        print(f"{mode} success (%):")
        print(table([record], mode), end="")
    return out_dir / "vla_eval.json"


# ----------------------------------------------------------------------------- after training


def planning_summary(task, results: dict[str, Any], out_dir: str, cpu_s: float | None = None) -> str:
    """The held-out table before RL (after SFT) and after it, written to out_dir/before_after.md
    (and .json) and returned for printing. `cpu_s`: process time of the whole training call; the
    time spent in `evaluate` is taken out of it."""
    from mmrl.evals.planning_eval import ENV_TITLES, write_before_after

    train_cpu = None if cpu_s is None else task.training_cpu_s(cpu_s)
    return write_before_after(results, out_dir, train_cpu, title=f"{ENV_TITLES[task.env]}, held-out "
                              f"{'/'.join(f'{s}x{s}' for s in task.sizes)}")


def video_summary(task, results: dict[str, Any], out_dir: str, cpu_s: float | None = None) -> str:
    """The held-out metrics the headline leaves out (temporal consistency, sampled rewards),
    before -> after, and the before / after video grid."""
    from mmrl.evals.video_eval import write_grid

    before, after = results.get("eval_before") or {}, results.get("eval_after") or {}
    shown = {row.key for row in task.headline(before, after)} | {"eval/len_mean"}
    keys = sorted(k for k in after if k.startswith("eval/") and k in before and k not in shown
                  and isinstance(after[k], float))
    lines = []
    if keys:
        lines = ["| other held-out metric | before | after |", "| --- | ---: | ---: |"]
        lines += [f"| {k[5:]} | {before[k]:.3f} | {after[k]:.3f} |" for k in keys]
    if task.eval_videos:  # the same prompts and initial noise at the first and the last evaluation
        rows = ({"before": task.eval_videos[0], "after": task.eval_videos[-1]} if len(task.eval_videos) > 1
                else {"after": task.eval_videos[-1]})
        gif, _ = write_grid(Path(out_dir) / "videos_before_after", rows, task.shown_prompts)
        lines += [""] * bool(lines) + [f"Videos before / after (same prompts and noise): {gif}"]
    return "".join(line + "\n" for line in lines)


# A domain's name (TaskBase.REPORT) -> its checkpoint report and its summary after training (none: no summary).
REPORTS: dict[str, tuple[Callable[..., Path], Callable[..., str] | None]] = {
    "held_out": (held_out, None),
    "planning": (planning, planning_summary),
    "vqa": (vqa, None),
    "video": (video, video_summary),
    "vla": (vla, None),
}


def reports_of(task) -> tuple[Callable[..., Path], Callable[..., str] | None]:
    name = getattr(task, "REPORT", "held_out")
    if name not in REPORTS:
        raise ValueError(f"{type(task).__name__}.REPORT: unknown report {name!r}; valid: {', '.join(REPORTS)}")
    return REPORTS[name]


def evaluate_checkpoint(cfg, task, policy, checkpoint, output=None, splits=None) -> Path:
    """`checkpoint` evaluated in the report of the task's domain; returns the main file written."""
    return reports_of(task)[0](cfg, task, policy, checkpoint, output, splits)


def summarize(task, results: dict[str, Any], out_dir: str, cpu_s: float | None = None) -> str:
    """Markdown `mmrl train` prints after the headline and report.md includes (e.g. planning's
    before/after table by size); "" for a domain without one."""
    summary = reports_of(task)[1]
    return summary(task, results, out_dir, cpu_s) if summary else ""
