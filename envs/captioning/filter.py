"""CapRL's QA filter: keep a question only if a VLM answers it well *with* the image and badly
*without* it, so that no question can be answered from priors alone (leaky QA cost CapRL a point).

Each question is asked `trials` times with freshly shuffled options, with and without its image;
it is kept when accuracy with the image > `with_image_min` (0.75) and without < `without_image_max`
(0.25). The answerer is any object with
``answer(images: list[array | None], questions: list[str], options: list[list[str]]) -> list[letter | None]``;
`VLMAnswerer` wraps a Qwen-VL checkpoint directory.

    python -m mmrl.envs.captioning.filter IN OUT --model DIR [--trials 4] [--with-image-min 0.75]
        [--without-image-max 0.25] [--temperature 1.0]
    mmrl caption-filter ...        (the same)
    python -m mmrl.envs.captioning.filter --synthetic 500 OUT    (write a synthetic set to filter)

IN and OUT are CapRL-QA-shaped data (`mmrl.envs.captioning.data`); OUT gets `filter_stats.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mmrl.checkpoint import atomic_write_text
from mmrl.rewards.captioning.judges import LETTERS, parse_letter

from .data import load_qa_dataset, write_qa_dataset


class Answerer(Protocol):
    def answer(self, images: list[Any], questions: list[str], options: list[list[str]]) -> list[str | None]: ...


def answer_prompt(question: str, options: Sequence[str]) -> str:
    lines = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
    return f"{question}\n{lines}\nAnswer with the letter of one option."


class VLMAnswerer:
    """A vision-language checkpoint (any Hugging Face VLM) answering by one sampled reply (first valid letter), `batch_size` at a time."""

    def __init__(self, path: str | Path, temperature: float = 1.0, max_new_tokens: int = 8, batch_size: int = 32,
                 device: str = "cpu", seed: int = 0):
        import torch

        from mmrl.policies.vlm import VLMPolicy

        self.policy = VLMPolicy.from_pretrained(path, device=device, max_new_tokens=max_new_tokens,
                                                image_key="image", prompt_key="prompt")
        self.temperature, self.batch_size = temperature, batch_size
        self.generator = torch.Generator(device=self.policy.device).manual_seed(seed)

    def answer(self, images: list[Any], questions: list[str], options: list[list[str]]) -> list[str | None]:
        contexts = [{"image": im, "prompt": answer_prompt(q, o)} for im, q, o in zip(images, questions, options)]
        out: list[str | None] = []
        for lo in range(0, len(contexts), self.batch_size):
            part = contexts[lo:lo + self.batch_size]
            texts = self.policy.decode(self.policy.sample(part, 1, generator=self.generator,
                                                          temperature=self.temperature))
            out += [parse_letter(t, len(o)) for t, o in zip(texts, options[lo:lo + self.batch_size])]
        return out


def qa_accuracy(answerer: Answerer, records: list[dict[str, Any]], trials: int, with_image: bool,
                rng: np.random.Generator) -> list[np.ndarray]:
    """Per record, the answerer's accuracy on each question over `trials` shuffles (one batched call)."""
    images, questions, options, correct, owner = [], [], [], [], []
    for r_i, rec in enumerate(records):
        for q_i, qa in enumerate(rec["qa"]):
            for _ in range(trials):
                opts = [qa["choices"][j] for j in rng.permutation(len(qa["choices"]))]
                images.append(rec["image"] if with_image else None)
                questions.append(qa["question"])
                options.append(opts)
                correct.append(LETTERS[opts.index(qa["answer"])])
                owner.append((r_i, q_i))
    letters = answerer.answer(images, questions, options) if images else []
    if len(letters) != len(images):
        raise RuntimeError(f"the answerer returned {len(letters)} answers for {len(images)} questions")
    hits = np.array([a == c for a, c in zip(letters, correct)], dtype=np.float64)
    acc = [np.zeros(len(rec["qa"])) for rec in records]
    for (r_i, q_i), h in zip(owner, hits):
        acc[r_i][q_i] += h / trials
    return acc


def filter_qa(records: list[dict[str, Any]], answerer: Answerer, trials: int = 4, with_image_min: float = 0.75,
              without_image_max: float = 0.25, seed: int = 0, drop_empty: bool = True
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records with only the questions that pass both thresholds (strictly), and the counts."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if not (0 <= without_image_max <= 1 and 0 <= with_image_min <= 1):
        raise ValueError(f"thresholds must be in [0, 1], got with_image_min={with_image_min}, "
                         f"without_image_max={without_image_max}")
    rng = np.random.default_rng(seed)
    with_acc = qa_accuracy(answerer, records, trials, True, rng)
    without_acc = qa_accuracy(answerer, records, trials, False, rng)
    kept, stats = [], {"questions": 0, "kept": 0, "failed_with_image": 0, "leaky_without_image": 0}
    for rec, wa, na in zip(records, with_acc, without_acc):
        qa = []
        for q, a_with, a_without in zip(rec["qa"], wa, na):
            stats["questions"] += 1
            stats["failed_with_image"] += int(a_with <= with_image_min)
            stats["leaky_without_image"] += int(a_without >= without_image_max)
            if a_with > with_image_min and a_without < without_image_max:
                qa.append(q)
        stats["kept"] += len(qa)
        if qa or not drop_empty:
            kept.append({**rec, "qa": qa})
    stats.update(records_in=len(records), records_out=len(kept), trials=trials, with_image_min=with_image_min,
                 without_image_max=without_image_max)
    return kept, stats


def synthetic_records(n: int, seed: int = 0, **scene_params) -> list[dict[str, Any]]:
    """`n` synthetic scenes as CapRL-QA records (image, qa, templated caption)."""
    from .scenes import caption_of, make_questions, make_scene, render

    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, 3, i])
        scene = make_scene(rng, **scene_params)
        out.append({"id": f"synthetic/{i}", "image": render(scene), "qa": make_questions(scene, rng),
                    "caption": caption_of(scene)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="caption-filter", description="CapRL's with/without-image QA filter")
    p.add_argument("input", nargs="?", help="a CapRL-QA folder or file")
    p.add_argument("output", help="where to write the filtered set (an imagefolder)")
    p.add_argument("--model", help="a Qwen-VL checkpoint directory (the answerer)")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--with-image-min", type=float, default=0.75)
    p.add_argument("--without-image-max", type=float, default=0.25)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--synthetic", type=int, default=0, help="instead: write N synthetic scenes to OUTPUT, unfiltered")
    a = p.parse_args(argv)
    if a.synthetic:
        out = write_qa_dataset(synthetic_records(a.synthetic, a.seed), a.output)
        print(f"written: {a.synthetic} synthetic records to {out}")
        return 0
    if not a.input or not a.model:
        p.error("filtering needs INPUT and --model DIR (or --synthetic N to write a synthetic set)")
    records = load_qa_dataset(a.input)
    kept, stats = filter_qa(records, VLMAnswerer(a.model, a.temperature, device=a.device, seed=a.seed), a.trials,
                            a.with_image_min, a.without_image_max, a.seed)
    out = write_qa_dataset(kept, a.output)
    atomic_write_text(out / "filter_stats.json", json.dumps(stats, indent=2))
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
