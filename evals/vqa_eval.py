"""`mmrl eval` on a `vqa` config: an accuracy report a person would rather look at than read.

Writes, in `<run>/eval` (or `--output`): `vqa_eval.json` (every metric of `VQATask.evaluate` on the
whole held-out set: accuracy, per category and difficulty, format rate, mean@k / pass@k, the
blank-image accuracy beside the question-only chance, the harder held-out level, ECE when replies
state a confidence), `vqa_eval.md` (the same as tables), `accuracy_by_step.png` (held-out,
blank-image and harder-level accuracy over the run's evaluations) and `samples.html` (questions
with their images, the reply and whether it was right).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

SAMPLES = 24  # replies shown on the HTML page


def report_checkpoint(cfg, task, policy, checkpoint, out=None, splits=None) -> Path:
    """Load `checkpoint`, evaluate it on the whole held-out set, write the report; returns the Markdown file."""
    import torch

    from mmrl.checkpoint import checkpoint_step, load_weights, resolve_checkpoint

    if splits:
        raise ValueError("--splits: a vqa task reports its held-out set, the blank-image set and the harder level "
                         "together; --splits is for planning tasks")
    run_dir, ckpt = resolve_checkpoint(checkpoint)
    load_weights(ckpt, policy.model)
    step = checkpoint_step(ckpt)
    out = Path(out or run_dir / "eval")
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        metrics = task.evaluate(policy, len(task.test))
        shown = task.test[:SAMPLES]
        replies = task.replies(policy, shown, temperature=0.0)
    scored = task.score(shown, replies)
    record = {"checkpoint": str(checkpoint), "step": step, "n_test": len(task.test), "metrics": metrics}
    (out / "vqa_eval.json").write_text(json.dumps(record, indent=2))
    (out / "vqa_eval.md").write_text(markdown(record))
    plot = accuracy_by_step(run_dir, out / "accuracy_by_step.png")
    (out / "samples.html").write_text(samples_page(shown, replies, scored["correct"], step))
    print(markdown(record), end="")
    if plot is None:
        print("(no evaluations logged in the run yet: accuracy_by_step.png not written)")
    return out / "vqa_eval.md"


def markdown(record: dict[str, Any]) -> str:
    m = record["metrics"]
    head = [("accuracy (greedy)", "accuracy"), ("format kept", "format_rate"), ("reply characters", "reply_chars")]
    head += [(k, k) for k in m if k.startswith(("mean@", "pass@"))]
    head += [("blank-image accuracy", "blank_accuracy"), ("question-only chance", "chance_accuracy"),
             ("harder level (held out)", "ood_accuracy"), ("ECE (stated confidence)", "ece")]
    lines = [f"### VQA held-out evaluation, step {record['step']} ({record['n_test']} questions)", "",
             "| metric | value |", "| --- | ---: |"]
    lines += [f"| {name} | {m[key]:.3f} |" for name, key in head if key in m]
    groups = [(k[4:], v) for k, v in m.items() if k.startswith("acc/")]
    if groups:
        lines += ["", "| category / difficulty | accuracy |", "| --- | ---: |"]
        lines += [f"| {name} | {v:.3f} |" for name, v in groups]
    return "\n".join(lines) + "\n"


def accuracy_by_step(run_dir: Path, path: Path) -> Path | None:
    """Held-out, blank-image and harder-level accuracy against step, from the run's metrics.jsonl."""
    from mmrl.evals.report import read_metrics

    rows = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for key, label in (("eval/accuracy", "held-out"), ("eval/blank_accuracy", "image blanked"),
                       ("eval/ood_accuracy", "harder level (held out)")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    chance = [r["eval/chance_accuracy"] for r in rows if "eval/chance_accuracy" in r]
    if chance:
        ax.axhline(chance[-1], color="grey", ls="--", lw=1, label="question-only chance")
    ax.set_xlabel("RL step (0 = after SFT)")
    ax.set_ylabel("greedy accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _png_data_uri(image) -> str:
    from PIL import Image

    img = Image.open(image) if isinstance(image, (str, Path)) else Image.fromarray(np.asarray(image, np.uint8))
    if max(img.size) < 160:  # small synthetic images: enlarge without blurring, for the eye
        scale = 160 // max(img.size)
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def samples_page(contexts: list[dict], replies: list[str], correct: np.ndarray, step: int) -> str:
    """One card per question: its images, the question, the expected answer, the reply, right or wrong."""
    cards = []
    for c, reply, ok in zip(contexts, replies, correct):
        imgs = "".join(f'<img src="{_png_data_uri(x)}">' for x in c["images"])
        mark = '<b class="ok">right</b>' if ok else '<b class="bad">wrong</b>'
        meta = " · ".join(str(c[k]) for k in ("category", "difficulty") if c.get(k) is not None)
        cards.append(f'<div class="card">{imgs}<p class="meta">{html.escape(meta)}</p>'
                     f'<p>{html.escape(c["problem"]).replace(chr(10), "<br>")}</p>'
                     f'<p>expected <code>{html.escape(str(c["answer"]))}</code> · {mark}</p>'
                     f'<pre>{html.escape(reply)}</pre></div>')
    style = ("body{font-family:sans-serif;margin:1.5em}.card{display:inline-block;vertical-align:top;width:330px;"
             "margin:6px;padding:8px;border:1px solid #ccc;border-radius:6px}img{margin-right:4px}"
             "pre{white-space:pre-wrap;background:#f6f6f6;padding:4px}.ok{color:#178a2e}.bad{color:#c0262d}"
             ".meta{color:#777;font-size:85%}")
    return (f"<!doctype html><meta charset='utf-8'><title>VQA replies, step {step}</title><style>{style}</style>"
            f"<h2>Greedy replies at step {step}: {int(np.sum(correct))} of {len(correct)} right</h2>"
            + "".join(cards))
