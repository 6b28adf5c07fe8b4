"""Write VQA records to files in the layouts a user's own data comes in, with a user's own column names.

The "your own data" demo (scripts/make_vqa_files.py, docs/your_data.md) writes the procedural set
of `mmrl.envs.vqa.synthetic` this way and trains from the files, as a user trains from theirs. The
columns are deliberately not mmrl's record keys, so the config has to name them (`column_map`):

    question   the question text, without "<image>" and without its options
    image      the image: a path relative to the data file (jsonl, json, csv, imagefolder's file_name)
               or the encoded PNG inside the file (parquet)
    choices    the option texts of a multiple-choice question, else null
    label      the answer: a number, or the text of the right choice
    response   a teacher's whole reply, "<think>reasoning</think><answer>its answer</answer>", which
               SFT imitates (optional in a user's data; the teacher's answer may be wrong, the label is not)
    type       the question's category

Layouts (`fmt`): "jsonl" (train.jsonl, test.jsonl, images/), "json" (train.json, test.json as lists),
"csv" (train.csv, test.csv; choices as a JSON string), "parquet" (the hub's data/train-00000-of-00001.parquet
with the images inside), "imagefolder" (train/ and test/, each with its images and a metadata.jsonl
whose file_name names them).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

FORMATS = ("jsonl", "json", "csv", "parquet", "imagefolder")
COLUMN_MAP = {"problem": "question", "answer": "label", "options": "choices", "solution": "response",
              "category": "type"}
_OPTION_LINES = re.compile(r"(\n[A-Z]\. [^\n]*)+$")
_COUNT = re.compile(r"^(.*): (\d+)\. The answer is (\d+)\.$")


def teacher_reply(record: dict[str, Any], overcount: bool) -> str:
    """A teacher's reply to a synthetic record; with `overcount`, a counting reply whose tally and
    answer say one more ("blue: 2. The answer is 2." -> "blue: 3. ... 3"), a distilling teacher's
    systematic error (other questions are answered right)."""
    reasoning, answer = record["solution"], record["answer"]
    m = _COUNT.match(reasoning)
    if overcount and m is not None and m.group(2) == m.group(3) == answer:
        answer = str(int(answer) + 1)
        reasoning = f"{m.group(1)}: {answer}. The answer is {answer}."
    return f"<think>{reasoning}</think><answer>{answer}</answer>"


def user_row(record: dict[str, Any], image: str | bytes, response: str | None) -> dict[str, Any]:
    """A synthetic record as a user's row (see the module doc for the columns)."""
    question = _OPTION_LINES.sub("", record["problem"].replace("<image>", "")).strip()
    options = record.get("options")
    label = options["ABCDEFGHIJKLMNOPQRSTUVWXYZ".index(record["answer"])] if options else record["answer"]
    return {"question": question, "image": image, "choices": options, "label": label, "response": response,
            "type": record["category"]}


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def write_split(records: list[dict[str, Any]], out: Path, split: str, fmt: str) -> Path:
    """Write one split of `records` (single-image, arrays) under `out` in layout `fmt`; returns the data file."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; accepted: {', '.join(FORMATS)}")
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import datasets

        rows = [user_row(r, {"bytes": _png(r["images"][0]), "path": None}, r.get("response")) for r in records]
        features = datasets.Features({"question": datasets.Value("string"), "image": datasets.Image(),
                                      "choices": datasets.List(datasets.Value("string")),
                                      "label": datasets.Value("string"), "response": datasets.Value("string"),
                                      "type": datasets.Value("string")})
        file = out / "data" / f"{split}-00000-of-00001.parquet"
        file.parent.mkdir(exist_ok=True)
        datasets.utils.logging.disable_progress_bar()  # one small file: no "Creating parquet" bar
        datasets.Dataset.from_list(rows, features=features).to_parquet(str(file))
        return file
    image_dir = out / split if fmt == "imagefolder" else out / "images"
    image_dir.mkdir(exist_ok=True)
    rows = []
    for i, r in enumerate(records):
        name = f"{split}_{i:05d}.png"
        (image_dir / name).write_bytes(_png(r["images"][0]))
        rows.append(user_row(r, name if fmt == "imagefolder" else f"images/{name}", r.get("response")))
    if fmt == "imagefolder":  # the image column is the layout's file_name, next to the images
        file = image_dir / "metadata.jsonl"
        rows = [{"file_name": row.pop("image"), **row} for row in rows]
    else:
        file = out / f"{split}.{fmt}"
    if fmt == "json":
        file.write_text(json.dumps(rows))
    elif fmt == "csv":
        import csv

        with open(file, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({**row, "choices": json.dumps(row["choices"]) if row["choices"] else ""} for row in rows)
    else:
        file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return file


def write_synthetic(out: str | Path, fmt: str = "jsonl", n_train: int = 2000, n_test: int = 200, seed: int = 0,
                    categories: tuple[str, ...] = ("counting", "spatial"), difficulty: int = 1, image_size: int = 56,
                    teacher_overcount: float = 0.6) -> dict[str, Path]:
    """The procedural set as a user's dataset under `out`: train and test splits, the training
    responses from a teacher that over-counts on `teacher_overcount` of the counting questions (the
    labels stay right). Returns split -> data file."""
    from mmrl.envs.vqa.synthetic import make_splits

    if not 0.0 <= teacher_overcount <= 1.0:
        raise ValueError(f"teacher_overcount must be in [0, 1], got {teacher_overcount}")
    splits = make_splits(seed, n_train, n_test, 0, categories=categories, train_difficulties=(difficulty,),
                         ood_difficulty=difficulty + 1, image_size=image_size)
    rng = np.random.default_rng([seed, 31])
    train = [{**r, "response": teacher_reply(r, draw < teacher_overcount)}
             for r, draw in zip(splits["train"], rng.random(len(splits["train"])))]
    test = splits["test"]  # held-out data needs no reply to imitate
    out = Path(out)
    return {"train": write_split(train, out, "train", fmt), "test": write_split(test, out, "test", fmt)}
