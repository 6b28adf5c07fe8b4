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
import torch

from mmrl.checkpoint import atomic_write_text
from mmrl.rewards.captioning.qa import cached_judge, judge_captions


def _accuracy(judge, captions: Sequence[str], contexts: Sequence[dict], rng: np.random.Generator,
              max_questions: int | None, tally: dict[str, Any]) -> np.ndarray:
    """Each caption's judged accuracy; `tally` adds up the judged and failed replies over calls
    (and holds the reasons already warned about, said once per evaluation)."""
    qa = [c["qa"][:max_questions] for c in contexts]
    stats: dict[str, Any] = {}
    per = judge_captions(judge, captions, qa, [int(c.get("grid", 2)) for c in contexts], rng, stats=stats,
                         warned=tally.setdefault("warned", set()))
    tally["judged"] = tally.get("judged", 0) + stats.get("judged", 0)
    tally["failed"] = tally.get("failed", 0) + stats.get("failed", 0)
    return np.array([a.mean() if a.size else 0.0 for a in per])


@torch.no_grad()
def captions_of(policy, contexts: Sequence[dict], k: int, temperature: float | None = None, seed: int = 0,
                batch_size: int = 32) -> list[list[str]]:
    """k captions per context (greedy when temperature == 0), batch by batch."""
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    out: list[list[str]] = []
    for lo in range(0, len(contexts), batch_size):
        part = list(contexts[lo:lo + batch_size])
        texts = policy.decode(policy.sample(part, k, generator=gen, temperature=temperature))
        out += [texts[i * k:(i + 1) * k] for i in range(len(part))]
    return out


def evaluate_captioner(policy, contexts: Sequence[dict], judge_spec: str | dict[str, Any] = "lexical", k: int = 4,
                       max_questions: int | None = None, seed: int = 0) -> tuple[dict[str, float], dict[str, Any]]:
    """(metrics, raw captions) on `contexts` (see the module doc for the metrics)."""
    if not contexts:
        raise ValueError("caption eval: no held-out contexts")
    judge = cached_judge(judge_spec)
    rng = np.random.default_rng(seed)
    n = len(contexts)
    sampled = captions_of(policy, contexts, k, seed=seed)
    greedy = [c[0] for c in captions_of(policy, contexts, 1, temperature=0.0, seed=seed)]
    tally: dict[str, Any] = {}
    acc = _accuracy(judge, [c for caps in sampled for c in caps], [x for x in contexts for _ in range(k)], rng,
                    max_questions, tally).reshape(n, k)
    greedy_acc = _accuracy(judge, greedy, contexts, rng, max_questions, tally)
    # Grounding check: image i's questions judged from the greedy caption of image i+1.
    shuffled = _accuracy(judge, greedy[1:] + greedy[:1], contexts, rng, max_questions, tally) if n > 1 else greedy_acc
    floor = _accuracy(judge, [""] * n, contexts, rng, max_questions, tally)
    lengths = np.array([len(c.split()) for caps in sampled for c in caps])
    metrics = {
        "caption_acc_mean": float(acc.mean()), f"caption_acc_best_of_{k}": float(acc.max(1).mean()),
        "caption_acc_greedy": float(greedy_acc.mean()), "caption_acc_shuffled_images": float(shuffled.mean()),
        "caption_acc_no_caption": float(floor.mean()),
        "caption_len_mean": float(lengths.mean()), "caption_len_median": float(np.median(lengths)),
        "caption_len_max": float(lengths.max()), "caption_len_std": float(lengths.std()),
        "n_images": float(n), "n_questions": float(sum(len(c["qa"][:max_questions]) for c in contexts)),
    }
    if all(c.get("target") for c in contexts):
        metrics["caption_acc_reference"] = float(_accuracy(judge, [c["target"] for c in contexts], contexts, rng,
                                                           max_questions, tally).mean())
    # The replies the judge could not give (scored 0 above): a judge that is down shows here, not as a bad captioner.
    metrics["judge_unjudged_share"] = tally["failed"] / tally["judged"] if tally["judged"] else 0.0
    raw = {"sampled": sampled, "greedy": greedy, "acc": acc.tolist(), "greedy_acc": greedy_acc.tolist()}
    return metrics, raw


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

    from mmrl.checkpoint import load_checkpoint
    from mmrl import build
    from mmrl.config import load_config

    cfg = load_config(a.config, a.overrides)
    task, policy = build(cfg)
    contexts = task.eval_batch(a.n)
    k = a.k or task.eval_k
    results: dict[str, tuple[dict, dict]] = {}
    for name, ckpt in (("before", a.before), ("after", a.checkpoint)):
        if ckpt:
            load_checkpoint(ckpt, policy.model)
            results[name] = evaluate_captioner(policy, contexts, task.judge, k=k)
    out = Path(a.out or Path(a.checkpoint) / "eval")
    report = write_caption_report(out, contexts, results, k)
    print(report["table"])
    print(f"written: {out}/caption_eval.json, caption_eval.md, gallery.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
