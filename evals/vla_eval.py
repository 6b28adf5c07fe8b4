"""Robot-policy evaluation: closed-loop success on held-out initial states, laid out like SRPO's tables.

    python -m mmrl.evals.vla_eval CONFIG --checkpoint RUN_OR_DIR [--suite spatial object] [--trials 50]
    python -m mmrl.evals.vla_eval table runs/*/eval/vla_eval.json runs/*/results.json > table.md

For one policy, `evaluate_vla` runs every held-out state of each suite (LIBERO: `eval_trials`
official states per task; tabletop: the task's `n_eval` states per task) greedily and/or sampled
at the training temperature, and records success overall, per suite and per task, plus the mean
episode length. `write_vla_report` writes that as `vla_eval.json` + `vla_eval.md` (a row per
method, a column per suite or task, then the average, as in SRPO's Table 1), GIF (and MP4 where
FFmpeg is there) videos of a few rollouts, successes and failures both, and a PNG success-rate
curve from the run's metrics.jsonl. `table` merges records into one table; a run's `results.json`
counts as two rows, "<run> (start)" (after SFT, before RL) and "<run>" (after RL).

`mmrl eval CONFIG --checkpoint DIR` reaches the same numbers through the task's `evaluate` hook.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mmrl.envs.robot_task import episode_metrics, grounding_loss

# Column titles of SRPO / SimpleVLA-RL tables.
TITLES = {"libero_spatial": "Spatial", "libero_object": "Object", "libero_goal": "Goal", "libero_10": "Long",
          "reach": "Reach", "push": "Push", "pick_place": "Pick&Place"}
MODES = ("greedy", "sampled")


def _pct(x: float | None) -> str:
    return "—" if x is None or math.isnan(x) else f"{100 * x:.1f}"


# ----------------------------------------------------------------------------- evaluation


def suite_tasks(cfg, suites: Sequence[str] | None, trials: int | None) -> list[tuple[str | None, Any]]:
    """(column, task) pairs. LIBERO: one task per suite, its column the suite. Tabletop: one task
    over all its tasks (so the held-out states are exactly the training run's), column None: each
    tabletop task becomes its own column."""
    from mmrl.envs import make_task

    params = dict(cfg.task.params)
    if cfg.task.name == "libero":
        if trials is not None:
            params["eval_trials"] = trials
        out = []
        for s in suites or [params.get("suite", "spatial")]:
            task = make_task("libero", seed=cfg.train.seed, **{**params, "suite": s})
            out.append((task.suite, task))
        return out
    if cfg.task.name == "tabletop":
        if trials is not None:
            params["n_eval"] = trials
        if suites:
            params["tasks"] = list(suites)
        return [(None, make_task("tabletop", seed=cfg.train.seed, **params))]
    raise ValueError(f"vla_eval handles the robot tasks (tabletop, libero), not {cfg.task.name!r}")


def evaluate_vla(policy, suites: Sequence[tuple[str | None, Any]], modes: Sequence[str] = ("greedy",),
                 grounding: bool = False) -> tuple[dict[str, Any], dict[str, tuple[list, list]]]:
    """Per mode: success per column (suite or tabletop task), the average over columns, per task,
    mean episode length; and per mode the (contexts, trajectories) of the first suite, for videos.
    With `grounding`, each mode's entry also holds `shuffled`: the average success with images
    shuffled across episodes (`VectorEnvFactory.images_shuffled`)."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown eval mode {bad[0]!r}; valid: {', '.join(MODES)}")
    results: dict[str, Any] = {}
    raw: dict[str, tuple[list, list]] = {}
    for mode in modes:
        entry: dict[str, Any] = {"columns": {}, "per_task": {}, "episode_len": {}, "episodes": 0}
        for name, task in suites:
            rows, outputs = task.rollouts(policy, task.eval_batch(len(task.test)), mode)
            m = episode_metrics(rows, outputs, task.group_key)
            per_task = {k[len("success/"):]: v for k, v in m.items() if k.startswith("success/")}
            if name is None:  # tabletop: a column per task
                entry["columns"].update(per_task)
                entry["per_task"].update(per_task)
                lens = {t: float(np.mean([o["length"] for r, o in zip(rows, outputs) if r["task"] == t]))
                        for t in per_task}
                entry["episode_len"].update(lens)
            else:
                entry["columns"][name] = m["success"]
                entry["per_task"].update({f"{name}/{k}": v for k, v in per_task.items()})
                entry["episode_len"][name] = m["episode_len"]
            entry["episodes"] += int(m["episodes"])
            raw.setdefault(mode, (rows, outputs))
            if grounding:
                with task.env_factory.images_shuffled():
                    rows_s, outputs_s = task.rollouts(policy, task.eval_batch(len(task.test)), mode)
                shuffled = episode_metrics(rows_s, outputs_s, task.group_key)
                entry.setdefault("shuffled_columns", {}).update(
                    {k[len("success/"):]: v for k, v in shuffled.items() if k.startswith("success/")}
                    if name is None else {name: shuffled["success"]})
        entry["average"] = float(np.mean(list(entry["columns"].values())))
        if grounding:
            entry["shuffled"] = float(np.mean(list(entry["shuffled_columns"].values())))
        results[mode] = entry
    return results, raw


# ----------------------------------------------------------------------------- tables


def records_from_results(path: str | Path) -> list[dict[str, Any]]:
    """A trainer's results.json as two table records: before RL (after SFT) and after RL. Sampled
    success comes from the task's evaluate hook (`eval/sampled/success`), greedy from the trainer's
    pass (`eval/success`)."""
    path = Path(path)
    res = json.loads(path.read_text())
    name = path.parent.name
    out = []
    for label, ev in ((f"{name} (start)", res["eval_before"]), (name, res["eval_after"])):
        modes = {}
        for mode, key in (("greedy", "eval/success"), ("sampled", "eval/sampled/success")):
            alt = "eval/greedy/success" if mode == "greedy" else "eval/sampled_success"
            v = ev.get(key, ev.get(alt))
            if v is None:
                continue
            cols = {k.split("/")[-1]: ev[k] for k in ev if k.startswith(f"eval/{mode}/success/")}
            if not cols:
                cols = {"all": v}
            modes[mode] = {"columns": cols, "average": v, "episode_len": {"all": ev.get(f"eval/{mode}/episode_len")}}
        # A single-task run without per-task greedy keys: name its column after the sampled one.
        names = {c for m in modes.values() for c in m["columns"] if c != "all"}
        if len(names) == 1:
            for m in modes.values():
                if list(m["columns"]) == ["all"]:
                    m["columns"] = {next(iter(names)): m["columns"]["all"]}
        out.append({"method": label, "step": ev.get("step"), "modes": modes})
    return out


def table(records: Sequence[dict[str, Any]], mode: str = "greedy") -> str:
    """SRPO's layout: a row per method, a column per suite/task (success %), the average, and the
    mean episode length. Records of one method on different suites merge into one row."""
    rows: dict[str, dict[str, Any]] = {}
    columns: list[str] = []
    for rec in records:
        entry = rec.get("modes", {}).get(mode)
        if not entry:
            continue
        row = rows.setdefault(rec["method"], {"cols": {}, "len": []})
        for c, v in entry["columns"].items():
            row["cols"][c] = v
            if c not in columns:
                columns.append(c)
        row["len"] += [v for v in entry.get("episode_len", {}).values() if v is not None]
        if "shuffled" in entry:
            row["shuffled"] = entry["shuffled"]
    # The grounding check (evaluate_vla(grounding=True)): success with images shuffled across episodes.
    with_shuffled = any("shuffled" in row for row in rows.values())
    extra = " Shuffled imgs |" if with_shuffled else ""
    head = "| Method | " + " | ".join(TITLES.get(c, c) for c in columns) + " | Avg |" + extra + " Ep. len |"
    lines = [head, "| --- |" + " ---: |" * (len(columns) + 2 + with_shuffled)]
    for method, row in rows.items():
        vals = [row["cols"].get(c) for c in columns]
        present = [v for v in vals if v is not None]
        avg = float(np.mean(present)) if present else None
        ep = f"{np.mean(row['len']):.1f}" if row["len"] else "—"
        shuffled = f" {_pct(row.get('shuffled'))} |" if with_shuffled else ""
        lines.append(f"| {method} | " + " | ".join(_pct(v) for v in vals) + f" | {_pct(avg)} |{shuffled} {ep} |")
    return "\n".join(lines) + "\n"


def per_task_markdown(record: dict[str, Any]) -> str:
    lines = ["| mode | task | success % |", "| --- | --- | ---: |"]
    for mode, entry in record["modes"].items():
        for k, v in entry.get("per_task", {}).items():
            lines.append(f"| {mode} | {k} | {_pct(v)} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- media


def plot_success(run_dir: str | Path, out: str | Path) -> Path | None:
    """Success rate against the RL step from metrics.jsonl: the training batch, held-out greedy and
    held-out sampled."""
    from mmrl.evals.report import read_metrics

    rows = [r for r in read_metrics(run_dir) if "step" in r]
    series = [("reward/success", "train batch (sampled)", "-"), ("eval/success", "held-out, greedy", "o-"),
              ("eval/greedy/success", "held-out, greedy", "o-"), ("eval/sampled/success", "held-out, sampled", "s--")]
    series = [(k, label, style) for k, label, style in series if any(k in r for r in rows)]
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    seen = set()
    for key, label, style in series:
        if label in seen:
            continue
        seen.add(label)
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*pts), style, lw=1 if style == "-" else 1.5, alpha=0.6 if style == "-" else 1.0, label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _video_frames(traj: dict[str, Any], scale: int = 3, caption: str = "") -> list[np.ndarray]:
    """Upscaled frames with a border (green for a success, red for a failure) under a white band
    showing `caption` (the instruction); the last frame is held."""
    frames = np.asarray(traj["frames"])
    color = np.array([40, 200, 60] if traj["success"] else [220, 40, 40], np.uint8)
    band = caption_band(caption, frames.shape[2] * scale) if caption else None
    out = []
    for f in frames:
        big = f.repeat(scale, 0).repeat(scale, 1)
        big[:4], big[-4:], big[:, :4], big[:, -4:] = color, color, color, color
        out.append(big if band is None else np.concatenate([band, big], 0))
    return out + [out[-1]] * 3


def caption_band(text: str, width: int) -> np.ndarray:
    """A white band `width` px wide with `text` in black, wrapped to as many lines as it needs."""
    from PIL import Image, ImageDraw

    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    lines: list[str] = []
    for word in text.split():  # greedy wrap on the rendered width (long LIBERO instructions)
        if lines and measure.textlength(f"{lines[-1]} {word}") <= width - 6:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    line_h = 12
    band = Image.new("RGB", (width, line_h * len(lines) + 4), "white")
    draw = ImageDraw.Draw(band)
    for i, line in enumerate(lines):
        draw.text((3, 2 + line_h * i), line, fill=(0, 0, 0))
    return np.asarray(band)


def write_videos(contexts: list[dict], outputs: list[dict], out_dir: str | Path, n: int = 4, fps: float = 4.0
                 ) -> list[Path]:
    """GIFs (and MP4s where imageio can find FFmpeg) of up to n rollouts, successes first then
    failures, the instruction shown above the frames. Frames are the decision steps (one per action
    chunk)."""
    import imageio.v2 as imageio

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    succ = [i for i, o in enumerate(outputs) if o["success"]]
    fail = [i for i, o in enumerate(outputs) if not o["success"]]
    pick = (succ[: (n + 1) // 2] + fail)[:n] if succ else fail[:n]
    paths = []
    for j, i in enumerate(pick):
        c, o = contexts[i], outputs[i]
        stem = f"{j:02d}_{c.get('task', c.get('task_id', ''))}_{c.get('init_state_id', i)}_" \
               f"{'success' if o['success'] else 'failure'}"
        frames = _video_frames(o, caption=o.get("instruction") or c.get("instruction") or str(c.get("task", "")))
        gif = out_dir / f"{stem}.gif"
        imageio.mimsave(gif, frames, duration=1.0 / fps, loop=0)
        paths.append(gif)
        try:
            mp4 = out_dir / f"{stem}.mp4"
            imageio.mimsave(mp4, frames, fps=fps, macro_block_size=1)
            paths.append(mp4)
        except (ImportError, OSError, RuntimeError, ValueError):  # no FFmpeg backend: the GIF is enough
            pass
    return paths


# ----------------------------------------------------------------------------- one run's report


def write_vla_report(policy, suites: Sequence[tuple[str, Any]], out_dir: str | Path, method: str = "policy",
                     modes: Sequence[str] = ("greedy",), run_dir: str | Path | None = None,
                     n_videos: int = 4, grounding: bool = True) -> dict[str, Any]:
    """Evaluate, then write vla_eval.json, vla_eval.md, success.png and rollout videos. With
    `grounding`, the table gains success with shuffled images and the record the SFT loss on demo
    frames with own vs shuffled images (`grounding_loss`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, raw = evaluate_vla(policy, suites, modes, grounding=grounding)
    record = {"method": method, "modes": results,
              "held_out_states": {name or "tabletop": len(task.test) for name, task in suites}}
    demo_tasks = [task for _, task in suites if task.has_demos()] if grounding else []
    if demo_tasks:
        record["grounding_loss"] = grounding_loss(policy, demo_tasks[0].demo_frames())
    (out_dir / "vla_eval.json").write_text(json.dumps(record, indent=2))
    md = [f"# {method}", ""]
    for mode in results:
        md += [f"## {mode} success (%)", "", table([record], mode)]
    if "grounding_loss" in record:
        g = record["grounding_loss"]
        md += ["## grounding", "", f"The policy's SFT loss on demo frames (per action token, or the denoising "
               f"loss): {g['sft_loss_own']:.4f} with their own images, {g['sft_loss_shuffled']:.4f} with shuffled "
               f"ones (gap {g['sft_loss_gap']:+.4f}; "
               "about 0 for a policy that ignores its images).", ""]
    md += ["## per task", "", per_task_markdown(record)]
    png = plot_success(run_dir, out_dir / "success.png") if run_dir is not None else None
    if png is not None:
        md += ["![success rate vs RL step](success.png)", ""]
    if n_videos and raw:
        mode = next(iter(raw))
        write_videos(*raw[mode], out_dir / "videos", n=n_videos)
        md += [f"Videos of {mode} rollouts in `videos/` (instruction above; green border: success, red: failure)."]
    (out_dir / "vla_eval.md").write_text("\n".join(md) + "\n")
    return record


def saved_policy_kind(path: str | Path) -> str | None:
    """The `model.policy` of a folder written by a VLA policy's `save` (the run's final/), told by
    the settings file that adapter writes beside its weights; None for anything else (a run or
    step_NNNNNN checkpoint). The Diffusion Policy's folder holds lerobot's model.safetensors like a
    checkpoint does, so only its settings file tells them apart."""
    from mmrl.policies.vla.configuration import ACTION_VLA_CONFIG_NAME, DIFFUSION_CONFIG_NAME, SMOLVLA_CONFIG_NAME

    kinds = {ACTION_VLA_CONFIG_NAME: "action_vla", SMOLVLA_CONFIG_NAME: "smolvla", DIFFUSION_CONFIG_NAME: "diffusion"}
    return next((kind for name, kind in kinds.items() if (Path(path) / name).is_file()), None)


def load_saved_policy(cfg, checkpoint: str | None):
    """The config's policy with the checkpoint's weights: a run dir (latest step), a step_NNNNNN
    dir, or a directory written by `policy.save` (the run's final/)."""
    from mmrl.checkpoint import load_weights, resolve_checkpoint
    from mmrl.assemble import build

    run_dir = Path(cfg.train.output_dir)
    if checkpoint is None:
        return *build(cfg), run_dir
    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"--checkpoint {ckpt} is not a directory")
    kind = saved_policy_kind(ckpt)
    if kind is not None:
        if kind != cfg.model.policy:
            raise ValueError(f"--checkpoint {ckpt} holds a saved {kind!r} policy, but the config builds "
                             f"{cfg.model.policy!r}; give the config it was trained with")
        cfg.model.source, cfg.model.path = "pretrained", str(ckpt)
        task, policy = build(cfg)
        return task, policy, ckpt.parent
    run_dir, ckpt = resolve_checkpoint(ckpt)
    task, policy = build(cfg)
    load_weights(ckpt, policy.model)
    return task, policy, run_dir


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "table":
        p = argparse.ArgumentParser(prog="vla_eval table", description="merge vla_eval.json / results.json files")
        p.add_argument("files", nargs="+")
        p.add_argument("--mode", default="greedy", choices=MODES)
        a = p.parse_args(argv[1:])
        records: list[dict[str, Any]] = []
        for f in a.files:
            records += records_from_results(f) if Path(f).name == "results.json" else [json.loads(Path(f).read_text())]
        print(table(records, a.mode), end="")
        return 0
    p = argparse.ArgumentParser(prog="vla_eval", description="closed-loop success of a robot policy checkpoint")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", help="a run dir, step_NNNNNN dir or policy.save dir (default: the untrained policy)")
    p.add_argument("--method", help="row name (default: the run directory's name)")
    p.add_argument("--suite", nargs="+", help="LIBERO suites (spatial object goal long) or tabletop tasks")
    p.add_argument("--trials", type=int, help="episodes per task (LIBERO: official states; default 50)")
    p.add_argument("--mode", nargs="+", default=["greedy"], choices=MODES,
                   help="greedy, and/or sampled at the training temperature")
    p.add_argument("--videos", type=int, default=4, help="rollout videos to write")
    p.add_argument("--no-grounding", action="store_true",
                   help="skip the grounding check (episodes with shuffled images, SFT loss own vs shuffled)")
    p.add_argument("--out", help="output folder (default: <run dir>/eval)")
    a = p.parse_args(argv)

    import torch

    from mmrl.config import load_config

    cfg = load_config(a.config, a.overrides)
    _, policy, run_dir = load_saved_policy(cfg, a.checkpoint)
    suites = suite_tasks(cfg, a.suite, a.trials)
    with torch.no_grad():
        record = write_vla_report(policy, suites, a.out or run_dir / "eval", a.method or run_dir.name, a.mode,
                                  run_dir=run_dir, n_videos=a.videos, grounding=not a.no_grounding)
    for mode in record["modes"]:
        print(f"{mode}:")
        print(table([record], mode), end="")
    print(f"written: {Path(a.out or run_dir / 'eval') / 'vla_eval.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
