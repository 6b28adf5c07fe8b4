"""Prism-style caption evaluation: a text-only judge answers held-out questions from captions.

For each held-out image the captioner writes `k` sampled captions (k = 4 as in CapRL) and one
greedy caption; the judge answers every question of the image from each caption (options
shuffled, cannot-answer appended, as in training). Reported: mean and best-of-k accuracy of the
sampled captions, greedy accuracy, caption length statistics (words), the judge's accuracy with
an empty caption (the floor), the accuracy of greedy captions written for a *different* image
(the grounding check: a captioner that ignores its image scores the same there) and, on synthetic
scenes, of the templated ground-truth caption (the ceiling).

    python -m mmrl.evals.caption_eval CONFIG --checkpoint RUN_DIR [--before RUN_DIR] [--n 100]

writes caption_eval.json, caption_eval.md and gallery.html (images with captions before and
after training) to RUN_DIR/eval. `mmrl eval CONFIG --checkpoint RUN_DIR` reports the same metrics
through the task's `evaluate` hook.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.checkpoint import atomic_write_text
from mmrl.envs.captioning.evaluation import evaluate_captioner


# ----------------------------------------------------------------------------- report


def _png_b64(image: np.ndarray, scale: int = 2) -> str:
    from PIL import Image

    img = Image.fromarray(np.asarray(image, dtype=np.uint8))
    img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def markdown_table(rows: dict[str, dict[str, float]], k: int) -> str:
    keys = [("caption_acc_no_caption", "no caption (floor)"), ("caption_acc_mean", "mean"),
            (f"caption_acc_best_of_{k}", f"best of {k}"), ("caption_acc_greedy", "greedy"),
            ("caption_acc_shuffled_images", "greedy, wrong image"), ("caption_acc_reference", "reference caption"),
            ("caption_len_mean", "length (words), mean"), ("caption_len_max", "length, max"),
            ("judge_unjudged_share", "judge replies unusable (share)")]
    names = list(rows)
    lines = ["| metric | " + " | ".join(names) + " |", "| --- | " + " | ".join("---:" for _ in names) + " |"]
    for key, label in keys:
        if any(key in rows[m] for m in names):
            cells = [f"{rows[m][key]:.3f}" if key in rows[m] else "—" for m in names]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_gallery(path: Path, contexts: Sequence[dict], captions: dict[str, list[str]], n: int = 24) -> Path:
    """An HTML page: each image with its reference caption and each model's greedy caption."""
    rows = []
    for i, c in enumerate(contexts[:n]):
        cells = "".join(f"<p><b>{html.escape(name)}:</b> {html.escape(caps[i])}</p>" for name, caps in captions.items())
        ref = f"<p><i>reference:</i> {html.escape(c['target'])}</p>" if c.get("target") else ""
        rows.append(f"<div class='row'><img src='data:image/png;base64,{_png_b64(c['image'])}'>"
                    f"<div>{ref}{cells}</div></div>")
    page = ("<html><head><meta charset='utf-8'><title>captions</title><style>.row{display:flex;gap:12px;"
            "margin:8px;font-family:sans-serif}img{image-rendering:pixelated}</style></head><body>"
            + "".join(rows) + "</body></html>")
    atomic_write_text(path, page)
    return path


def write_caption_report(out_dir: str | Path, contexts: Sequence[dict], results: dict[str, tuple[dict, dict]],
                         k: int) -> dict[str, Any]:
    """caption_eval.json, caption_eval.md and gallery.html for one or more models (name -> (metrics, raw))."""
    out = Path(out_dir)
    record = {name: {"metrics": m, "greedy_captions": raw["greedy"][:50]} for name, (m, raw) in results.items()}
    atomic_write_text(out / "caption_eval.json", json.dumps(record, indent=2))
    table = markdown_table({name: m for name, (m, _) in results.items()}, k)
    atomic_write_text(out / "caption_eval.md", f"# Caption eval ({len(contexts)} held-out images, k={k})\n\n"
                      f"{table}\n\nGallery: gallery.html\n")
    write_gallery(out / "gallery.html", contexts, {name: raw["greedy"] for name, (_, raw) in results.items()})
    return {"table": table, **record}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="caption_eval", description="Prism-style caption evaluation of checkpoints")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", required=True, help="the trained run directory (or a step_NNNNNN directory)")
    p.add_argument("--before", help="a run directory to compare with, e.g. an SFT-only run (train.steps=0)")
    p.add_argument("--n", type=int, default=100, help="held-out images")
    p.add_argument("--k", type=int, default=None, help="captions per image (default: task.params.eval_k)")
    p.add_argument("--out", help="output folder (default: CHECKPOINT/eval)")
    a = p.parse_args(argv)

    from mmrl.checkpoint import load_weights, resolve_checkpoint
    from mmrl.assemble import build
    from mmrl.config import load_config

    cfg = load_config(a.config, a.overrides)
    task, policy = build(cfg)
    contexts = task.eval_batch(a.n)
    k = a.k or task.eval_k
    results: dict[str, tuple[dict, dict]] = {}
    for name, ckpt in (("before", a.before), ("after", a.checkpoint)):
        if ckpt:
            load_weights(resolve_checkpoint(ckpt)[1], policy.model)
            results[name] = evaluate_captioner(policy, contexts, task.judge, k=k)
    out = Path(a.out or Path(a.checkpoint) / "eval")
    report = write_caption_report(out, contexts, results, k)
    print(report["table"])
    print(f"written: {out}/caption_eval.json, caption_eval.md, gallery.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
