"""The captioning task (CapRL): contexts are images with their multiple-choice questions.

Context dict (what the Qwen-VL policy and the `caption_qa` reward read)::

    image   uint8 [H, W, 3]   the picture
    prompt  str               "Describe the image."
    qa      list[dict]        {"question", "choices", "answer"} (answer: the text of one choice)
    target  str               SFT caption (synthetic: the templated caption; folder data: its caption)
    grid    int               the synthetic scene's grid (the lexical judge reads positions with it)
    uid     str               "<split>/<index>"

`source: synthetic` draws scenes from seeds: the held-out scenes come from seed stream 1 and the
training stream (seed stream 0, a pure function of the cursor) skips any scene identical to a
held-out one. `source: folder` reads CapRL-QA-shaped data (`mmrl.envs.captioning.data`) from
`data_path`, with `eval_path` or the last `test_fraction` of it held out.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from mmrl.envs import TaskBase, register_task
from mmrl.envs.base import Headline, check_source_params, headline_rows

from .data import load_qa_dataset
from .scenes import (
    CAPTION_STYLES,
    COLOURS,
    GLYPHS,
    LETTER,
    PROMPT,
    QUESTION_FORMS,
    RELATIONS,
    SHAPES,
    SIZES,
    Scene,
    caption_of,
    make_questions,
    make_scene,
    position_words,
    render,
)

SOURCES = ("synthetic", "folder")
# Parameters only one source reads; given to the other, the config is refused at load.
SOURCE_PARAMS = {
    "synthetic": ("n_test", "cell_px", "min_objects", "max_objects", "glyph_prob", "caption_style", "sft_terse_prob"),
    "folder": ("data_path", "eval_path", "test_fraction"),
}


@register_task("caption")
class CaptionTask(TaskBase):
    def __init__(self, seed: int = 0, source: Literal["synthetic", "folder"] = "synthetic", n_test: int = 200,
                 grid: int = 2, cell_px: int = 28, min_objects: int = 1, max_objects: int = 3,
                 glyph_prob: float = 0.15, n_choices: int = 4, data_path: str | None = None,
                 eval_path: str | None = None, test_fraction: float = 0.1, prompt: str = PROMPT,
                 judge: str | dict[str, Any] = "lexical", eval_k: int = 4, eval_questions: int = 0,
                 caption_style: str = "cells", sft_terse_prob: float = 0.0):
        if source not in SOURCES:
            raise ValueError(f"task.params.source: invalid value {source!r}; valid: {', '.join(SOURCES)}")
        if eval_k < 1:
            raise ValueError(f"task.params.eval_k must be >= 1, got {eval_k}")
        self.seed, self.source, self.prompt = int(seed), source, prompt
        self.judge, self.eval_k, self.eval_questions = judge, int(eval_k), int(eval_questions)
        self.scene_params = {"grid": grid, "cell_px": cell_px, "min_objects": min_objects,
                             "max_objects": max_objects, "glyph_prob": glyph_prob}
        if caption_style not in CAPTION_STYLES:
            raise ValueError(f"task.params.caption_style: invalid value {caption_style!r}; valid: "
                             f"{', '.join(CAPTION_STYLES)}")
        self.caption_style = caption_style
        if not 0.0 <= sft_terse_prob <= 1.0:
            raise ValueError(f"task.params.sft_terse_prob must be in [0, 1], got {sft_terse_prob}")
        self.sft_terse_prob = float(sft_terse_prob)
        self.n_choices = int(n_choices)
        self.grid = int(grid)
        self.cursor = 0
        if source == "synthetic":
            make_scene(np.random.default_rng(0), **self.scene_params)  # validates the scene parameters
            self.test = [self._scene_context(np.random.default_rng([self.seed, 1, i]), f"test/{i}")
                         for i in range(n_test)]
            self._test_keys = {c["target"] for c in self.test}  # a templated caption identifies its scene
            self.train_records: list[dict] = []
        else:
            if not data_path:
                raise ValueError("task.params.data_path is required when source is 'folder'")
            records = load_qa_dataset(data_path)
            if eval_path:
                test = load_qa_dataset(eval_path)
            else:
                if not 0 < test_fraction < 1:
                    raise ValueError(f"task.params.test_fraction must be in (0, 1), got {test_fraction}")
                n = max(1, int(len(records) * test_fraction))
                records, test = records[:-n], records[-n:]
            if not records:
                raise ValueError(f"task.params.data_path {data_path}: no training records left after the split")
            self.train_records = records
            self.test = [self._record_context(r, f"test/{i}") for i, r in enumerate(test)]

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """Refuse a parameter the chosen source does not read (e.g. `data_path` with `synthetic`)."""
        check_source_params(params, SOURCE_PARAMS, "synthetic")

    # ------------------------------------------------------------------ contexts

    def _scene_context(self, rng: np.random.Generator, uid: str) -> dict[str, Any]:
        scene = make_scene(rng, **self.scene_params)
        return self.context_of_scene(scene, rng, uid)

    def context_of_scene(self, scene: Scene, rng: np.random.Generator, uid: str) -> dict[str, Any]:
        return {"image": render(scene), "prompt": self.prompt, "qa": make_questions(scene, rng, self.n_choices),
                "target": caption_of(scene, self.caption_style), "grid": scene.grid, "scene": scene.to_dict(), "uid": uid}

    def _record_context(self, rec: dict[str, Any], uid: str) -> dict[str, Any]:
        return {"image": rec["image"], "prompt": self.prompt, "qa": rec["qa"], "target": rec.get("caption"),
                "grid": self.grid, "uid": uid}

    def _train_scene(self, i: int) -> tuple[Scene, np.random.Generator]:
        """Training scene `i` (a pure function of the seed and i) and its rng, never a held-out scene."""
        for attempt in range(1000):
            rng = np.random.default_rng([self.seed, 0, i, attempt])
            scene = make_scene(rng, **self.scene_params)
            if caption_of(scene, self.caption_style) not in self._test_keys:
                return scene, rng
        raise RuntimeError("could not draw a training scene distinct from the held-out ones; lower n_test "
                           "or allow more objects")

    def _train_context(self, i: int) -> dict[str, Any]:
        if self.source == "folder":
            return self._record_context(self.train_records[i % len(self.train_records)], f"train/{i}")
        scene, rng = self._train_scene(i)
        return self.context_of_scene(scene, rng, f"train/{i}")

    # ------------------------------------------------------------------ Task protocol

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        out = [self._train_context(self.cursor + j) for j in range(n)]
        self.cursor += n
        return out

    def eval_batch(self, n: int) -> list[dict[str, Any]]:
        return self.test[: min(n, len(self.test))]

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
        """Random training contexts whose `target` is a caption: for synthetic scenes the templated
        one, in which each object is terse (no size, no colour) with probability `sft_terse_prob`,
        like the short captions of typical SFT data; the judge's questions reward the details."""
        if self.source == "folder":
            have = [r for r in self.train_records if r.get("caption")]
            if not have:
                raise ValueError("SFT needs captions: the folder data has no 'caption' column (set sft.steps: 0)")
            return [self._record_context(have[int(j)], "sft") for j in rng.integers(len(have), size=n)]
        out = []
        for j in rng.integers(1 << 40, size=n):
            scene, scene_rng = self._train_scene(int(j))
            ctx = self.context_of_scene(scene, scene_rng, f"sft/{j}")
            ctx["target"] = caption_of(scene, self.caption_style, rng.random(len(scene.objects)) < self.sft_terse_prob)
            out.append(ctx)
        return out

    def corpus(self) -> list[str]:
        """Captions, prompt and the whole scene vocabulary, for a tiny local tokenizer."""
        words = [*COLOURS, *SHAPES, *SIZES, LETTER, *GLYPHS, *position_words(self.grid), *RELATIONS, "empty",
                 *(f for f, _ in QUESTION_FORMS.values())]
        if self.source == "folder":
            captions = [r["caption"] for r in self.train_records if r.get("caption")]
        else:
            captions = [caption_of(self._train_scene(i)[0], self.caption_style) for i in range(1000)]
        return [self.prompt, " ".join(words), *captions]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, policy, n: int) -> dict[str, float]:
        """Prism-style judge accuracy on `n` held-out images (see mmrl.envs.captioning.evaluation)."""
        from mmrl.envs.captioning.evaluation import evaluate_captioner

        metrics, _ = evaluate_captioner(policy, self.eval_batch(n), self.judge, k=self.eval_k,
                                        max_questions=self.eval_questions or None)
        return metrics

    def headline(self, before: dict[str, Any], after: dict[str, Any]) -> list[Headline]:
        """The judge's held-out accuracy from the captions: the mean over k sampled captions and the
        greedy caption's (README's rows)."""
        return headline_rows(before, after, [
            (f"judge accuracy, mean of {self.eval_k} sampled captions", "eval/caption_acc_mean", ".3f"),
            ("judge accuracy, greedy caption", "eval/caption_acc_greedy", ".3f")])
