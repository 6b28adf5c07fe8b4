"""Caption QA data in CapRL-QA's shape: an image and a list of multiple-choice questions.

On disk, through `datasets`:

* a folder in the `imagefolder` layout: image files plus a `metadata.jsonl` whose rows name their
  image in `file_name` and carry `qa` (and optionally `caption`, `id`);
* or one `.jsonl` / `.json` / `.parquet` file whose `image` column is a path (relative to the file)
  or image bytes.

Each `qa` entry is ``{"question": str, "choices": [str, ...], "answer": ...}``; the answer may be the
choice text, its letter ("B") or its index. Records come back normalised: the image as uint8
HxWx3 and every answer as the text of one of its choices.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.checkpoint import atomic_write_text

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def normalise_qa(qa: dict[str, Any], where: str) -> dict[str, Any]:
    """One QA entry with its answer resolved to a choice's text (letters and indices accepted)."""
    missing = [k for k in ("question", "choices", "answer") if k not in qa]
    if missing:
        raise ValueError(f"{where}: QA entry lacks {missing}; each needs question, choices, answer")
    choices = [str(c) for c in qa["choices"]]
    if len(choices) < 2:
        raise ValueError(f"{where}: a question needs at least 2 choices, got {choices}")
    ans = qa["answer"]
    if isinstance(ans, str) and ans in choices:
        text = ans
    elif isinstance(ans, str) and len(ans.strip()) == 1 and 0 <= ord(ans.strip().upper()) - 65 < len(choices):
        text = choices[ord(ans.strip().upper()) - 65]
    elif isinstance(ans, int) and not isinstance(ans, bool) and 0 <= ans < len(choices):
        text = choices[ans]
    else:
        raise ValueError(f"{where}: answer {ans!r} is none of the choices {choices} (nor their letter or index)")
    out = {"question": str(qa["question"]), "choices": choices, "answer": text}
    if qa.get("kind"):
        out["kind"] = qa["kind"]
    return out


def _image(value: Any, base: Path, where: str) -> np.ndarray:
    from PIL import Image

    if isinstance(value, dict):  # datasets' Image feature undecoded: {"bytes", "path"}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        value = Image.open(io.BytesIO(value))
    elif isinstance(value, str):
        path = Path(value) if Path(value).is_absolute() else base / value
        if not path.is_file():
            raise FileNotFoundError(f"{where}: image file not found: {path}")
        value = Image.open(path)
    if not isinstance(value, Image.Image):
        raise TypeError(f"{where}: cannot read an image from {type(value).__name__}")
    return np.asarray(value.convert("RGB"), dtype=np.uint8)


def load_qa_dataset(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Records {"id", "image", "qa", "caption"?} from a folder or a file (see the module doc)."""
    import datasets

    path = Path(path)
    if path.is_dir():
        if not (path / "metadata.jsonl").is_file():
            raise FileNotFoundError(f"{path}: a caption QA folder needs metadata.jsonl (imagefolder layout)")
        ds = datasets.load_dataset("imagefolder", data_dir=str(path), split="train")
        base = path
    elif path.is_file():
        kind = FILE_FORMATS.get(path.suffix)
        if kind is None:
            raise ValueError(f"{path}: unknown data file type {path.suffix!r}; valid: folder, "
                             f"{', '.join(FILE_FORMATS)}")
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        base = path.parent
    else:
        raise FileNotFoundError(f"caption QA data not found: {path}")
    if "image" not in ds.column_names or "qa" not in ds.column_names:
        raise ValueError(f"{path}: needs columns 'image' and 'qa'; it has {ds.column_names}")
    records = []
    for i, row in enumerate(ds):
        if limit is not None and i >= limit:
            break
        where = f"{path} row {i}"
        rec = {"id": str(row.get("id") or i), "image": _image(row["image"], base, where),
               "qa": [normalise_qa(q, f"{where} qa[{j}]") for j, q in enumerate(row["qa"] or [])]}
        if row.get("caption"):
            rec["caption"] = str(row["caption"])
        records.append(rec)
    return records


def write_qa_dataset(records: list[dict[str, Any]], out_dir: str | Path) -> Path:
    """Write records as an imagefolder (PNG images + metadata.jsonl) that `load_qa_dataset` reads."""
    from PIL import Image

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, rec in enumerate(records):
        name = f"images/{i:06d}.png"
        Image.fromarray(np.asarray(rec["image"], dtype=np.uint8)).save(out / name)
        row = {"file_name": name, "id": str(rec.get("id", i)),
               "qa": [{k: q[k] for k in ("question", "choices", "answer")} for q in rec["qa"]]}
        if rec.get("caption"):
            row["caption"] = rec["caption"]
        lines.append(json.dumps(row))
    atomic_write_text(out / "metadata.jsonl", "\n".join(lines) + "\n")
    return out
