"""Task `vqa`: image question answering with verifiable answers (the R1-V / EasyR1 workflow).

A record (see `mmrl.envs.vqa.records`) is one or several images, a `problem` with `<image>`
placeholders, an `answer`, and optionally `options`, `category`, `difficulty`, `key_steps`,
`bbox`. The task turns each into a context: the record plus `prompt` (the problem in a template
that asks for reasoning and a final answer in `<think>...</think><answer>...</answer>` or
`\\boxed{...}`) and `target` (the SFT reply: the record's `solution`, or its answer alone).

Sources: `synthetic` (the procedural set of `mmrl.envs.vqa.synthetic`: train and test disjoint,
and a harder level held out as `ood`), or `files` (`data_path` / `eval_path`: a parquet, JSON,
JSONL or CSV file, a folder of them in the hub or image-folder layout, or a hub dataset id, read
through `datasets`; `split` / `eval_split` pick a folder's splits, `column_map` names other
columns), with `benchmark` naming a known evaluation layout (MathVista, MathVerse, Geometry3K,
CLEVR-count). docs/your_data.md shows a dataset of one's own end to end. Records without a
`solution` get the answer alone as their SFT target (an empty <think> block, then the answer).
`sft_noise` gives that share of the SFT solutions a teacher's misreading (`misread_targets`), as
distilled reasoning traces have; the reward still checks each record's own answer.

`evaluate` adds what the mean reward does not say: accuracy per category and difficulty, format
rate, reply length, mean@k and pass@k at the sampling temperature, the held-out harder level, the
same questions with the image blanked (accuracy must fall toward chance: the model looks), and the
expected calibration error when replies state a confidence.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.envs import TaskBase, register_task
from mmrl.envs.base import check_source_params

SOURCES = ("synthetic", "files")
# Parameters only one source reads; given to the other, the config is refused at load.
SOURCE_PARAMS = {
    "synthetic": ("data_seed", "categories", "difficulties", "ood_difficulty", "n_train", "n_ood", "image_size",
                  "sft_miscount"),
    "files": ("data_path", "eval_path", "split", "eval_split", "column_map", "image_root", "benchmark"),
}
# The held-out split of a folder that holds several, when neither eval_path nor eval_split says.
EVAL_SPLITS = ("test", "validation", "valid", "val", "eval", "testmini")
ANSWER_STYLES = ("tag", "boxed")
# A `solution` holding this is a whole reply (a teacher's response), the SFT target as it is.
ANSWER_MARKS = {"tag": "<answer>", "boxed": "\\boxed{"}
PROMPTS = {
    "tag": "{problem}\nThink step by step inside <think> </think>, then give the final answer inside "
           "<answer> </answer>.",
    "boxed": "{problem}\nThink step by step inside <think> </think>, then put the final answer in \\boxed{{}}.",
}
_CONFIDENCE = re.compile(r"<confidence>\s*([0-9]*\.?[0-9]+)\s*(%?)\s*</confidence>", re.IGNORECASE)


def stated_confidence(reply: str) -> float | None:
    """The confidence a reply states in `<confidence>0.8</confidence>` (or `80%`), in [0, 1]; else None."""
    m = _CONFIDENCE.search(reply)
    if m is None:
        return None
    value = float(m.group(1)) / (100.0 if m.group(2) or float(m.group(1)) > 1 else 1.0)
    return min(max(value, 0.0), 1.0)


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = 10) -> float:
    """ECE: the |accuracy - confidence| gap of equal-width confidence bins, weighted by their size."""
    if len(confidence) == 0:
        return float("nan")
    which = np.minimum((confidence * bins).astype(int), bins - 1)
    gap = 0.0
    for b in np.unique(which):
        sel = which == b
        gap += sel.mean() * abs(correct[sel].mean() - confidence[sel].mean())
    return float(gap)


def blank_images(context: dict[str, Any]) -> dict[str, Any]:
    """The context with every image replaced by a mid-grey one of the same size."""
    def blank(img):
        arr = np.asarray(img if not isinstance(img, (str, Path)) else _open(img))
        return np.full_like(arr, 128)

    return {**context, "images": [blank(x) for x in context["images"]]}


def misread_targets(contexts: list[dict], share: float, rng: np.random.Generator) -> int:
    """Give about `share` of the SFT targets a teacher's misreading, in place: the target of another
    record with the same question and a different answer (a whole, self-consistent solution of the
    wrong image). Distilled reasoning traces carry such errors; the verifiable reward (the record's
    own `answer`) does not. Returns how many targets were replaced."""
    by_problem: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(contexts):
        if "target" in c:
            by_problem[c["problem"]].append(i)
    original = [c.get("target") for c in contexts]
    replaced = 0
    for i in np.flatnonzero(rng.random(len(contexts)) < share):
        c = contexts[i]
        if "target" not in c:
            continue
        others = [j for j in by_problem[c["problem"]] if str(contexts[j]["answer"]) != str(c["answer"])]
        if others:
            c["target"] = original[others[int(rng.integers(len(others)))]]
            replaced += 1
    return replaced


_LAST_COUNT = re.compile(r": (\d+)\. The answer is (\d+)\.</think>")


def miscount_targets(contexts: list[dict], share: float, rng: np.random.Generator) -> int:
    """Give about `share` of the counting SFT targets a teacher's systematic over-count, in place:
    the solution's final tally and its answer say one more than the image shows (as VLM teachers
    that count the reference object or a cell twice do). A share above 1/2 makes "one more" the
    SFT policy's most likely answer, an error that only the verifiable reward can correct. Returns
    how many targets were changed."""
    changed = 0
    for i in np.flatnonzero(rng.random(len(contexts)) < share):
        c = contexts[i]
        if c.get("category") != "counting" or "target" not in c:
            continue
        m = _LAST_COUNT.search(c["target"])
        if m is None or not m.group(1) == m.group(2) == str(c["answer"]):
            continue
        right, wrong = m.group(2), str(int(m.group(2)) + 1)
        tail = c["target"][m.end():].replace(f"<answer>{right}</answer>", f"<answer>{wrong}</answer>", 1)
        tail = tail.replace(f"\\boxed{{{right}}}", f"\\boxed{{{wrong}}}", 1)
        c["target"] = f"{c['target'][:m.start()]}: {wrong}. The answer is {wrong}.</think>{tail}"
        changed += 1
    return changed


def _open(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


@register_task("vqa")
class VQATask(TaskBase):
    REPORT = "vqa"

    def __init__(self, seed: int = 0, source: str = "synthetic", data_seed: int = 0,
                 categories: list[str] | tuple[str, ...] | None = None, difficulties: list[int] | tuple[int, ...] = (1, 2),
                 ood_difficulty: int | None = 3, n_train: int = 2000, n_test: int = 200, n_ood: int = 100,
                 image_size: int = 112, data_path: str | None = None, eval_path: str | None = None,
                 split: str | None = None, eval_split: str | None = None,
                 column_map: dict[str, str] | None = None, image_root: str | None = None,
                 benchmark: str | None = None, answer_style: str = "tag", prompt_template: str | None = None,
                 min_pixels: int | None = None, max_pixels: int | None = None, eval_k: int = 4,
                 blank_eval: bool = True, sft_noise: float = 0.0, sft_miscount: float = 0.0):
        if source not in SOURCES:
            raise ValueError(f"task.params.source: invalid value {source!r}; valid: {', '.join(SOURCES)}")
        if answer_style not in ANSWER_STYLES:
            raise ValueError(f"task.params.answer_style: invalid value {answer_style!r}; valid: {', '.join(ANSWER_STYLES)}")
        if not 0.0 <= sft_noise < 1.0:
            raise ValueError(f"task.params.sft_noise must be in [0, 1) (the share of misread SFT solutions), got {sft_noise}")
        if not 0.0 <= sft_miscount <= 1.0:
            raise ValueError(f"task.params.sft_miscount must be in [0, 1] (the share of over-counted SFT counting "
                             f"solutions), got {sft_miscount}")
        if eval_k < 0:
            raise ValueError(f"task.params.eval_k must be >= 0 (0 = no sampled evaluation), got {eval_k}")
        self.seed, self.answer_style, self.eval_k, self.blank_eval = int(seed), answer_style, int(eval_k), blank_eval
        self.prompt_template = prompt_template or PROMPTS[answer_style]
        if "{problem}" not in self.prompt_template:
            raise ValueError(f"task.params.prompt_template must contain {{problem}}, got {self.prompt_template!r}")
        self.pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        if source == "synthetic":
            from mmrl.envs.vqa.synthetic import CATEGORIES, make_splits

            splits = make_splits(data_seed, n_train, n_test, n_ood if ood_difficulty else 0,
                                 categories=tuple(categories or CATEGORIES), train_difficulties=tuple(difficulties),
                                 ood_difficulty=ood_difficulty or max(difficulties) + 1, image_size=image_size)
            train, test, ood = splits["train"], splits["test"], splits["ood"] if ood_difficulty else []
            self.data_note = (f"synthetic questions ({', '.join(categories or CATEGORIES)}): {len(train)} training, "
                              f"{len(test)} held out, {len(ood)} of the harder level {ood_difficulty} held out")
        else:
            train, test, ood, self.data_note = self._file_splits(data_path, eval_path, split, eval_split, column_map,
                                                                 image_root, benchmark, n_test)
        if not train and source == "synthetic":
            raise ValueError("task.params.n_train must be >= 1")
        self.train = [self.context(r) for r in train]
        solved = sum(bool(r.get("solution")) for r in train)
        # What SFT imitates, said when a run starts (Trainer asks `sft_targets`).
        self.sft_source = ("the records' solutions" if solved == len(train) else
                           "the answers alone (no 'solution' column: an empty <think> block, then the answer)"
                           if solved == 0 else f"the solutions of {solved} of {len(train)} records, the answer "
                           f"alone for the rest")
        if sft_noise > 0:
            misread_targets(self.train, sft_noise, np.random.default_rng([data_seed, 29]))
        if sft_miscount > 0:
            miscount_targets(self.train, sft_miscount, np.random.default_rng([data_seed, 31]))
        self.test = [self.context(r) for r in test]
        self.ood = [self.context(r) for r in ood]
        self.cursor = 0

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """Refuse a parameter the chosen source does not read (e.g. `column_map` with `synthetic`)."""
        check_source_params(params, SOURCE_PARAMS, "synthetic")

    @staticmethod
    def _file_splits(data_path, eval_path, split, eval_split, column_map, image_root, benchmark, n_test):
        from mmrl.envs.vqa.benchmarks import load_benchmark
        from mmrl.envs.vqa.records import folder_splits, load_records
        from mmrl.hub import resolve

        if data_path is None and eval_path is None:
            raise ValueError("task.params.source 'files' needs data_path (training records) and/or eval_path")
        if data_path is None and split is not None:
            raise ValueError("task.params.split picks the training split of data_path, which is not given")
        data = resolve(data_path, "dataset", "task.params.data_path") if data_path else None
        if data is not None and data.is_dir():  # a folder of splits (the hub's layout): train on "train"
            splits = folder_splits(data)
            if split is None and len(splits) > 1 and "train" in splits:
                split = "train"
            if eval_path is None:  # and hold out its test (or validation, ...) split
                if eval_split is None and len(splits) > 1:
                    eval_split = next((s for s in EVAL_SPLITS if s in splits and s != split), None)
                if eval_split is not None:
                    eval_path = data_path
        train = load_records(data, column_map=column_map, split=split, image_root=image_root) if data else []
        where = f"{data_path}" + (f" (split {split})" if split else "")
        if eval_path is None:  # hold out the last n_test training records
            if len(train) <= n_test:
                raise ValueError(f"task.params.data_path has {len(train)} records: too few to hold out n_test={n_test}; "
                                 "give eval_path or a smaller n_test")
            return (train[:-n_test], train[-n_test:], [],
                    f"{len(train) - n_test} training records from {where}, its last {n_test} held out (n_test)")
        evaluation = resolve(eval_path, "dataset", "task.params.eval_path")
        test = (load_benchmark(benchmark, evaluation, split=eval_split, image_root=image_root) if benchmark else
                load_records(evaluation, column_map=column_map, split=eval_split, image_root=image_root))
        held_out = (f"{eval_path}" + (f" (split {eval_split})" if eval_split else "")
                    + (f", {benchmark} layout" if benchmark else ""))
        note = (f"{len(train)} training records from {where}; " if data else "") + f"{len(test)} held out from {held_out}"
        return train, test, [], note

    # ------------------------------------------------------------------ contexts

    def _images(self, images: list) -> list:
        if not self.pixels:
            return list(images)
        from PIL import Image
        from qwen_vl_utils import fetch_image

        out = []
        for img in images:
            pil = Image.fromarray(img) if isinstance(img, np.ndarray) else str(img)
            out.append(np.asarray(fetch_image({"image": pil, **self.pixels}).convert("RGB")))
        return out

    def context(self, record: dict[str, Any]) -> dict[str, Any]:
        """A record as the policy and the rewards read it: `prompt`, `images`, and `target` (SFT)."""
        problem = record["problem"]
        options = record.get("options")
        if options and not re.search(r"(^|\n)\s*A[.)]", problem):  # options not yet listed in the problem
            problem += "".join(f"\n{chr(65 + i)}. {o}" for i, o in enumerate(options))
        ctx = {**record, "images": self._images(record["images"]), "prompt": self.prompt_template.format(problem=problem)}
        solution = record.get("solution") or ""
        if ANSWER_MARKS[self.answer_style] in solution:  # a whole reply in the answer format (a teacher's response)
            ctx["target"] = solution
        else:  # the reasoning, or nothing (the answer alone), then the record's answer
            final = (f"<answer>{record['answer']}</answer>" if self.answer_style == "tag"
                     else f"\\boxed{{{record['answer']}}}")
            ctx["target"] = f"<think>{solution}</think>{final}"
        return ctx

    def next_batch(self, n: int) -> list[dict]:
        """The training stream: a seeded permutation per epoch, so the cursor alone fixes it (exact resume)."""
        out = []
        for pos in range(self.cursor, self.cursor + n):
            epoch, k = divmod(pos, len(self.train))
            order = np.random.default_rng([self.seed, 23, epoch]).permutation(len(self.train))
            out.append(self.train[int(order[k])])
        self.cursor += n
        return out

    def eval_batch(self, n: int) -> list[dict]:
        return self.test[: min(n, len(self.test))]

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[dict]:
        if not self.train:
            raise ValueError("SFT needs training records; task.params.data_path gives none (sft.steps: 0 for RL only)")
        return [self.train[int(i)] for i in rng.integers(0, len(self.train), n)]

    def sft_targets(self) -> str:
        return self.sft_source

    def data_summary(self) -> str:
        return self.data_note

    def corpus(self) -> list[str]:
        contexts = self.train[:3000] + self.test + self.ood
        return [c["prompt"] + " " + c.get("target", c["answer"]) for c in contexts]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    # ------------------------------------------------------------------ evaluation

    def score(self, contexts: list[dict], replies: list[str]) -> dict[str, np.ndarray]:
        """Per reply: correct (0/1), format kept (0/1), length (characters), stated confidence (nan if none)."""
        from mmrl.rewards.vqa import AnswerAccuracy, Format

        answer_format = "tag" if self.answer_style == "tag" else "boxed"
        correct = AnswerAccuracy(answer_format=answer_format)(contexts, replies).numpy()
        style = "think_answer" if self.answer_style == "tag" else "boxed"
        kept = Format(style=style)(contexts, replies).numpy()
        conf = np.array([np.nan if (c := stated_confidence(r)) is None else c for r in replies])
        return {"correct": correct, "format": kept, "chars": np.array([len(r) for r in replies], float),
                "confidence": conf}

    def replies(self, policy, contexts: list[dict], k: int = 1, temperature: float | None = None,
                seed: int = 12345) -> list[str]:
        """k replies per context (rows context-major), greedy when temperature is 0."""
        if not contexts:
            return []
        gen = torch.Generator(device=policy.device).manual_seed(seed)
        out: list[str] = []
        for lo in range(0, len(contexts), 32):  # bounded batches: vision prefill memory grows with the batch
            rollout = policy.sample(contexts[lo:lo + 32], k, generator=gen, temperature=temperature)
            out += policy.decode(rollout)
        return out

    def evaluate(self, policy, n: int) -> dict[str, float]:
        contexts = self.eval_batch(n)
        greedy = self.score(contexts, self.replies(policy, contexts, temperature=0.0))
        out = {"accuracy": float(greedy["correct"].mean()), "format_rate": float(greedy["format"].mean()),
               "reply_chars": float(greedy["chars"].mean())}
        out.update(breakdown(contexts, greedy["correct"]))
        stated = ~np.isnan(greedy["confidence"])
        if stated.any():
            out["ece"] = expected_calibration_error(greedy["confidence"][stated], greedy["correct"][stated])
            out["confidence_rate"] = float(stated.mean())
        if self.blank_eval:
            blanked = [blank_images(c) for c in contexts]
            out["blank_accuracy"] = float(self.score(blanked, self.replies(policy, blanked, temperature=0.0))["correct"].mean())
            out["chance_accuracy"] = chance_accuracy(contexts, self.train)
        if self.ood:
            ood = self.ood[:n]
            out["ood_accuracy"] = float(self.score(ood, self.replies(policy, ood, temperature=0.0))["correct"].mean())
        if self.eval_k > 0:
            k = self.eval_k
            sampled = self.score([c for c in contexts for _ in range(k)],
                                 self.replies(policy, contexts, k=k))["correct"].reshape(len(contexts), k)
            out[f"mean@{k}"] = float(sampled.mean())
            out[f"pass@{k}"] = float(sampled.max(1).mean())
        return out

    def headline(self, before: dict[str, Any], after: dict[str, Any]) -> list:
        """Held-out greedy accuracy and the mean accuracy of k sampled replies (`evaluate`'s
        `accuracy` and `mean@k`), README's rows."""
        from mmrl.envs.base import headline_rows

        sampled = sorted(k for k in after if k.startswith("eval/mean@"))
        return headline_rows(before, after, [("greedy accuracy", "eval/accuracy", ".3f")]
                             + [(f"accuracy, mean of {k[len('eval/mean@'):]} sampled replies", k, ".3f")
                                for k in sampled])


def breakdown(contexts: list[dict], correct: np.ndarray) -> dict[str, float]:
    """Accuracy per category and per difficulty (keys `acc/<category>`, `acc/L<difficulty>`)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for c, ok in zip(contexts, correct):
        if c.get("category"):
            groups[f"acc/{c['category']}"].append(float(ok))
        if c.get("difficulty") is not None:
            groups[f"acc/L{c['difficulty']}"].append(float(ok))
    return {k: float(np.mean(v)) for k, v in sorted(groups.items())}


def chance_accuracy(contexts: list[dict], train: list[dict]) -> float:
    """What answering without the image earns at best from the question alone: the most frequent
    training answer of the same question text (1 / options for unseen multiple-choice questions)."""
    answers: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in train:
        answers[c["problem"]][str(c["answer"])] += 1
    hits = []
    for c in contexts:
        seen = answers.get(c["problem"])
        if seen:
            hits.append(float(max(seen, key=seen.get) == str(c["answer"])))
        else:
            hits.append(1.0 / len(c["options"]) if c.get("options") else 0.0)
    return float(np.mean(hits)) if hits else float("nan")
