"""Image question-answering records from local files, in the one format the VQA task, policy and rewards share.

A record (one question)::

    {"id": str, "images": [uint8 HxWx3 array | absolute path str, ...], "problem": str with one "<image>"
     placeholder per image, "answer": str, "options": [str, ...] | None (then "answer" is the option
     letter), "solution": str | None (the reasoning an SFT target imitates, or a whole reply), "category": str,
     "difficulty": int | str | None, "key_steps": [str | [str, ...], ...] | None (a step may list
     equivalent strings), "bbox": [x1, y1, x2, y2] | None}

`load_records` reads one parquet / JSON / JSONL / CSV file (JSON: a list of objects, ``{"data":
[...]}``, or an object keyed by id, as MathVista's ``testmini.json``) or a folder of them, through
`datasets` and from local files only. A folder's files are assigned to splits by `datasets`' own
naming rules, as on the Hugging Face hub: ``train.jsonl`` / ``test.jsonl``,
``data/train-00000-of-00001.parquet``, ``data/train.jsonl``, or image folders ``train/`` holding
the images and a ``metadata.jsonl`` (or .csv / .parquet) whose ``file_name`` column names them;
`split` picks one. A folder with no split names is one split.

Image cells may be a path (relative to `image_root`, else to the data file's folder), a list of
paths, a PIL image, a ``{"bytes", "path"}`` dict (how parquet stores an `Image` feature) or raw bytes.
Bytes are decoded to arrays now, so the data file is all that is kept; paths stay paths (absolute,
checked to exist and to open with PIL), so a large image set is read lazily by the policy.

Every error names the file, the record's index in it (and id), the bad value and what is accepted.
The problem text is kept as the source wrote it (only placeholders are added): a source whose
options live in their own column gets them in "options", not appended to "problem".
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

DATA_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
RECORD_KEYS = ("id", "images", "problem", "answer", "options", "solution", "category", "difficulty", "key_steps",
               "bbox")
REQUIRED_KEYS = ("images", "problem", "answer")
# Source columns tried for a record key when `column_map` does not name one ("file_name": the
# image-folder layout's metadata column).
DEFAULT_COLUMNS: dict[str, tuple[str, ...]] = {k: (k,) for k in RECORD_KEYS} | {"images": ("images", "image", "file_name")}
IMAGE_TOKEN = "<image>"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
ACCEPTED_PATHS = "a .parquet / .json / .jsonl / .csv file, or a folder of them (hub or image-folder layout)"
ACCEPTED_IMAGES = ("a file path str, a list of them, a PIL image, a {'bytes', 'path'} dict (parquet image "
                   "column) or raw image bytes")


# ---------------------------------------------------------------- files and rows

def data_files(path: str | Path, split: str | None = None, default_split: str | None = None) -> list[Path]:
    """The data files behind `path`: the file itself, or the files of one split of a folder (see
    `folder_splits`); `default_split` settles a folder holding several splits when `split` is None."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix not in DATA_FORMATS:
            raise ValueError(f"{p}: unknown data file type {p.suffix!r}; accepted: {ACCEPTED_PATHS}")
        if split is not None:
            raise ValueError(f"{p}: split={split!r} picks files in a folder, but this is one file; "
                             f"pass the folder, or no split")
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such file or folder; accepted: {ACCEPTED_PATHS}")
    splits = folder_splits(p)
    if split is None:
        if len(splits) == 1:
            return next(iter(splits.values()))
        if default_split in splits:
            return splits[default_split]
        raise ValueError(f"{p}: folder holds several splits {sorted(splits)}; pick one with split "
                         f"(task.params.split / eval_split)")
    if split not in splits:
        raise ValueError(f"{p}: no split {split!r}; the folder's splits are {sorted(splits)}")
    return splits[split]


def folder_splits(folder: Path) -> dict[str, list[Path]]:
    """Split name -> data files of a folder, by `datasets`' own rules (the ones `load_dataset(folder)`
    applies: ``train.jsonl``, ``data/test-00000-of-00001.parquet``, ``train/metadata.jsonl``, ...;
    a folder with no split names is all "train"). Image files are not data files; they are read
    through the data's image column."""
    from datasets.data_files import EmptyDatasetError, get_data_patterns, resolve_pattern

    try:
        patterns = {str(k): v for k, v in get_data_patterns(str(folder)).items()}
    except EmptyDatasetError:
        patterns = {}
    splits: dict[str, list[Path]] = {}
    for name, pats in patterns.items():
        files: set[Path] = set()
        for pat in pats:  # datasets tries several spellings of a split; it raises on one that matches nothing
            try:
                files.update(Path(f) for f in resolve_pattern(pat, base_path=str(folder)))
            except FileNotFoundError:
                continue
        files = {f for f in files if f.suffix in DATA_FORMATS}
        if files:
            splits[name] = sorted(files)
    if not splits:
        raise ValueError(f"{folder}: folder holds no .parquet / .json / .jsonl / .csv files; accepted: {ACCEPTED_PATHS}")
    return splits


def load_table(file: Path, field: str | None = None):
    """One data file as a `datasets.Dataset`. A JSON object is unwrapped: its `field` (a list of
    rows), ``{"data": [...]}`` by reading its "data" field, an object of objects (keyed by id, as
    MathVista's testmini.json) as one row per value, with the key as "id" where the value has none."""
    import datasets

    kind = DATA_FORMATS[file.suffix]
    if file.suffix == ".json" and _is_json_object(file):
        return _json_object_table(file, field)
    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()  # a local file reads in a blink: no "Generating split" bars
    try:
        return datasets.load_dataset(kind, data_files=str(file), split="train", **({"field": field} if field else {}))
    except Exception as e:  # pyarrow / json errors: say which file, keep the cause
        raise ValueError(f"{file}: cannot read as {kind} ({type(e).__name__}: {e})") from e
    finally:
        if bars:
            datasets.utils.logging.enable_progress_bar()


def _json_object_table(file: Path, field: str | None):
    """A JSON file holding one object, parsed with the json module: `datasets`' JSON reader gives up
    on one large object keyed by id (MathVista's 870 KB testmini.json fails past ~370 problems)."""
    import datasets

    try:
        data = json.loads(file.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot read as json ({type(e).__name__}: {e})") from e
    if field is not None:
        if not isinstance(data.get(field), list):
            raise ValueError(f"{file}: no list under the JSON field {field!r} (fields: {sorted(data)[:10]})")
        rows = data[field]
    elif isinstance(data.get("data"), list):
        rows = data["data"]
    elif data and all(isinstance(v, dict) for v in data.values()):
        rows = [{"id": k, **v} for k, v in data.items()]
    else:
        rows = [data]  # one record
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{file}: the JSON rows are not all objects; accepted: a list of objects, "
                         f"{{\"data\": [...]}}, or an object of objects keyed by id")
    try:
        return datasets.Dataset.from_list(rows)
    except Exception as e:  # pyarrow type clashes between rows: say which file, keep the cause
        raise ValueError(f"{file}: rows do not form one table ({type(e).__name__}: {e})") from e


def _is_json_object(file: Path) -> bool:
    with open(file, encoding="utf-8") as fh:
        return fh.read(4096).lstrip("\ufeff \t\r\n").startswith("{")


def _undecoded_images(feature: Any) -> Any:
    """The feature tree with every `Image` left undecoded (`datasets` decodes the rest, e.g. `Json`)."""
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False)
    if isinstance(feature, dict):
        return type(feature)({k: _undecoded_images(f) for k, f in feature.items()})
    if isinstance(feature, list):
        return [_undecoded_images(f) for f in feature]
    if dataclasses.is_dataclass(feature) and hasattr(feature, "feature"):  # List / LargeList / Sequence
        return dataclasses.replace(feature, feature=_undecoded_images(feature.feature))
    return feature


def iter_rows(table, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Rows as plain Python values with image cells left as ``{"bytes", "path"}`` dicts, so decoding
    (and its errors, with the record named) happens in `load_images`."""
    import datasets

    features = datasets.Features(_undecoded_images(dict(table.features)))
    t = table.data.table if limit is None else table.data.table.slice(0, limit)
    for batch in t.to_batches(max_chunksize=256):
        cols = features.decode_batch(batch.to_pydict())
        for i in range(batch.num_rows):
            yield {k: v[i] for k, v in cols.items()}


def where(file: Path | str, index: int, rid: Any = None) -> str:
    """The one place an error points to: the file, the record's index in it and its id."""
    return f"{file} record {index}" + (f" (id {rid!r})" if rid not in (None, "") else "")


# ---------------------------------------------------------------- fields

def load_images(value: Any, base: Path, at: str) -> list[np.ndarray | str]:
    """An image cell as a list of uint8 HxWx3 arrays (decoded bytes / PIL images) and absolute path
    strings (existing files PIL can open)."""
    from PIL import Image

    if value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0):
        raise ValueError(f"{at}: no image (got {value!r}); accepted: {ACCEPTED_IMAGES}")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    out: list[np.ndarray | str] = []
    for j, v in enumerate(values):
        what = f"{at}: image {j}"
        if isinstance(v, dict):  # an undecoded `datasets` Image: bytes win, its path is the source's
            if v.get("bytes"):
                v = v["bytes"]
            elif v.get("path"):
                v = v["path"]
            else:
                raise ValueError(f"{what} is a dict with neither 'bytes' nor 'path' (keys {sorted(v)}); "
                                 f"accepted: {ACCEPTED_IMAGES}")
        if isinstance(v, (bytes, bytearray, memoryview)):
            try:
                img = Image.open(io.BytesIO(bytes(v)))
                img.load()
            except Exception as e:
                raise ValueError(f"{what}: {len(v)} bytes that PIL cannot read as an image "
                                 f"({type(e).__name__}: {e}); accepted: encoded image bytes (PNG, JPEG, ...)") from e
            out.append(np.asarray(img.convert("RGB"), dtype=np.uint8))
        elif isinstance(v, Image.Image):
            out.append(np.asarray(v.convert("RGB"), dtype=np.uint8))
        elif isinstance(v, np.ndarray):
            if v.dtype != np.uint8 or v.ndim != 3 or v.shape[2] != 3:
                raise ValueError(f"{what} is an array of {v.dtype} {v.shape}; accepted arrays: uint8 HxWx3")
            out.append(v)
        elif isinstance(v, (str, Path)):
            p = Path(v).expanduser()
            p = (p if p.is_absolute() else base / p).resolve()
            if not p.is_file():
                raise FileNotFoundError(f"{what}: image file {str(v)!r} not found (looked for {p}; relative "
                                        f"paths are read from image_root, else the data file's folder)")
            try:
                with Image.open(p):
                    pass
            except Exception as e:
                raise ValueError(f"{what}: {p} is not an image PIL can open ({type(e).__name__}: {e}); "
                                 f"accepted: image files (PNG, JPEG, ...)") from e
            out.append(str(p))
        else:
            raise ValueError(f"{what} is a {type(v).__name__} ({_short(v)}); accepted: {ACCEPTED_IMAGES}")
    return out


def place_images(problem: str, n_images: int, at: str) -> str:
    """The problem with one "<image>" per image: kept where the source put them (EasyR1 / Geometry3K),
    else prepended, so the policy knows where each image goes."""
    found = problem.count(IMAGE_TOKEN)
    if found == 0:
        return IMAGE_TOKEN * n_images + problem
    if found != n_images:
        raise ValueError(f"{at}: problem has {found} {IMAGE_TOKEN} placeholders but the record has "
                         f"{n_images} images ({_short(problem)}); accepted: one placeholder per image, or none")
    return problem


def parse_list(value: Any, name: str, at: str) -> list | None:
    """A list cell, or a JSON string holding one (how CSV-born JSON often stores lists); None when empty."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{at}: {name} {_short(value)} is a string but not JSON; accepted: a list, "
                             f"or a JSON string holding a list") from None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{at}: {name} {_short(value)} is a {type(value).__name__}; accepted: a list, "
                         f"or a JSON string holding a list")
    return list(value) if len(value) else None


def option_letter(answer: str, options: list[str], at: str) -> str:
    """The letter of a multiple-choice answer given as a letter ("b", "B") or as an option's text."""
    a, texts = answer.strip(), [o.strip() for o in options]
    if len(a) == 1 and a.upper() in LETTERS[: len(options)]:
        return a.upper()
    if a in texts:
        return LETTERS[texts.index(a)]
    raise ValueError(f"{at}: answer {answer!r} is neither an option letter (A-{LETTERS[len(options) - 1]}) "
                     f"nor an option text {options}")


def make_record(fields: dict[str, Any], *, file: Path | str, index: int, base: Path,
                default_id: str, default_category: str) -> dict[str, Any]:
    """A checked record from raw source values keyed by record key (missing keys take defaults)."""
    rid = fields.get("id")
    rid = default_id if rid is None or str(rid) == "" else str(rid)
    at = where(file, index, rid)
    answer = fields.get("answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError(f"{at}: no answer (got {answer!r}); every record needs a non-empty answer")
    if isinstance(answer, (list, dict)):
        raise ValueError(f"{at}: answer {_short(answer)} is a {type(answer).__name__}; accepted: a string or number")
    answer = str(answer).strip()
    problem = fields.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{at}: problem {_short(problem)} is not a non-empty string; accepted: the question text")
    images = load_images(fields.get("images"), base, at)
    options = parse_list(fields.get("options"), "options", at)
    if options is not None:
        if len(options) > len(LETTERS):
            raise ValueError(f"{at}: {len(options)} options; accepted: at most {len(LETTERS)}")
        options = [str(o) for o in options]
        answer = option_letter(answer, options, at)
    key_steps = parse_list(fields.get("key_steps"), "key_steps", at)
    bbox = parse_list(fields.get("bbox"), "bbox", at)
    if bbox is not None:
        try:
            bbox = [float(x) for x in bbox]
        except (TypeError, ValueError):
            bbox = None
        if bbox is None or len(bbox) != 4:
            raise ValueError(f"{at}: bbox {_short(fields.get('bbox'))}; accepted: 4 numbers [x1, y1, x2, y2]")
    difficulty = fields.get("difficulty")
    if isinstance(difficulty, float) and difficulty.is_integer():
        difficulty = int(difficulty)
    category = fields.get("category")
    solution = fields.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise ValueError(f"{at}: solution {_short(solution)} is a {type(solution).__name__}; accepted: the "
                         f"reasoning text (a string), or empty")
    return {"id": rid, "images": images, "problem": place_images(problem, len(images), at), "answer": answer,
            "options": options, "solution": (solution or "").strip() or None,
            "category": default_category if category in (None, "") else str(category),
            "difficulty": difficulty, "key_steps": None if key_steps is None else [_step(s) for s in key_steps],
            "bbox": bbox}


def _step(step: Any) -> str | list[str]:
    """A key step: a string, or a list of equivalent strings (R1-VL's augmented key steps)."""
    return [str(x) for x in step] if isinstance(step, (list, tuple)) else str(step)


def _short(value: Any, n: int = 80) -> str:
    s = repr(value)
    return s if len(s) <= n else s[: n - 3] + "..."


# ---------------------------------------------------------------- the loader

def _columns(column_map: dict[str, str] | None, available: list[str], file: Path) -> dict[str, str]:
    """Record key -> source column for one file (explicit map first, then the default names)."""
    column_map = dict(column_map or {})
    unknown_keys = sorted(set(column_map) - set(RECORD_KEYS))
    if unknown_keys:
        raise ValueError(f"{file}: column_map keys {unknown_keys} are not record keys; "
                         f"accepted keys: {list(RECORD_KEYS)}")
    missing = {k: c for k, c in column_map.items() if c not in available}
    if missing:
        raise ValueError(f"{file}: column_map names columns that are not there: {missing}; "
                         f"available columns: {available}")
    cols = dict(column_map)
    for key, names in DEFAULT_COLUMNS.items():
        if key not in cols:
            found = [c for c in names if c in available]
            if found:
                cols[key] = found[0]
    absent = [k for k in REQUIRED_KEYS if k not in cols]
    if absent:
        raise ValueError(f"{file}: no column for {absent}; map them with column_map "
                         f"(e.g. {{'{absent[0]}': '<column>'}}); available columns: {available}")
    return cols


def load_records(path: str | Path, column_map: dict[str, str] | None = None, split: str | None = None,
                 image_root: str | Path | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Records (see the module doc) from local data files.

    `column_map` maps record keys to the source's column names, e.g. ``{"problem": "question",
    "solution": "rationale"}``; unmapped keys use a column of their own name ("images" also "image"
    and "file_name").
    A missing "id" becomes the record's running index; a missing "category" the data's name
    (file stem or folder name). `limit` caps the number of records read."""
    files = data_files(path, split)
    root = Path(image_root).expanduser() if image_root is not None else None
    name = Path(path).stem if Path(path).is_file() else Path(path).resolve().name
    records: list[dict[str, Any]] = []
    for file in files:
        if limit is not None and len(records) >= limit:
            break
        table = load_table(file)
        cols = _columns(column_map, table.column_names, file)
        base = root if root is not None else file.parent
        left = None if limit is None else limit - len(records)
        for i, row in enumerate(iter_rows(table, left)):
            fields = {key: row.get(col) for key, col in cols.items()}
            records.append(make_record(fields, file=file, index=i, base=base,
                                       default_id=str(len(records)), default_category=name))
    return records
