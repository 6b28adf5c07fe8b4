"""Public VQA benchmarks from the local copies users already have, as records (see `records`).

Column names and layouts were checked against the datasets' own cards and code (search tool):

* ``mathvista``: AI4Math/MathVista dataset card (README.md ``dataset_info``): pid, question, image
  (a path such as "images/1.jpg"), decoded_image (Image), choices, unit, precision, answer,
  question_type ("multi_choice" / "free_form"), answer_type, metadata{category, grade, skills, ...},
  query; splits testmini (answers) and test (none). Multiple-choice answers are option *texts*
  (code that converts them: ``choices.index(answer)``). The original GitHub layout, testmini.json /
  annot_testmini.json with images/, is one object keyed by pid (read by ``data.items()``).
* ``mathverse``: AI4Math/MathVerse dataset card: sample_index, problem_index, problem_version,
  question, image (Image; a path such as "images_version_5/image_2.png" in testmini.json), answer,
  question_type ("multi-choice" / "free-form"), metadata{split, source, subject, subfield},
  query_wo, query_cot, question_for_eval. Multiple-choice answers are letters, the options sit in
  the question after "Choices:" ("A:40°"); Vision-Only questions carry them in the image.
* ``geometry3k``: hiyouga/geometry3k (EasyR1) card: images (list of Image), problem (with
  "<image>"), answer; splits train / validation / test.
* ``clevr_count``: R1-V's leonardPKU/clevr_cogen_a_train, read by R1-V's grpo.py and by conversion
  scripts as columns image, problem, solution ("<answer> 3 </answer>"); and the original CLEVR
  questions file (CLEVR README "QUESTION FILE FORMAT": {"info", "questions": [{split, image_index,
  image_filename, question, answer, program, question_family_index}]}) with images/<split>/.

`path` is the file or the folder (a hub snapshot folder picks its files by split name; a MathVerse
snapshot holds testmini.parquet, testmini.json and the text-only files in one folder: one copy of
the split is read, see `mathverse_files`).

Every record gets a "meta" dict beside the shared record keys (`records.make_record`): the
benchmark's own fields its prompt construction, grader and breakdowns read (`mmrl.evals.bench_official`):

* mathvista: pid, question, answer (the gold as the source writes it: an option *text* for multiple
  choice), question_type, answer_type, precision, unit, choices, query (None in the GitHub JSON,
  which keeps it in query.json), and the metadata fields (task, skills, category, context, grade,
  source, language, split, img_width, img_height).
* mathverse: sample_index, problem_index, problem_version, question, answer (as written: a letter,
  "(C)", "C\nD", or an option text), question_type, query_wo, query_cot, question_for_eval,
  choices (option texts from the question, else from question_for_eval; None when neither lists
  them), and the metadata fields (subject, subfield, source, split).
* geometry3k: problem, answer.
* clevr_count: question and answer (R1-V: problem and the solution's count; CLEVR: also
  question_family_index, image_index, split).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .records import DATA_FORMATS, LETTERS, data_files, folder_splits, iter_rows, load_table, make_record, where

BENCHMARKS = ("mathvista", "mathverse", "geometry3k", "clevr_count")
# The split a hub snapshot folder is read from when it holds several and none is asked for.
DEFAULT_SPLITS = {"mathvista": "testmini", "mathverse": "testmini", "geometry3k": "test", "clevr_count": "train"}
REQUIRED_COLUMNS = {
    "mathvista": ("pid", "question", "answer", "question_type", "choices"),
    "mathverse": ("sample_index", "question", "answer", "question_type", "image", "problem_version"),
    "geometry3k": ("images", "problem", "answer"),
    "clevr_r1v": ("image", "problem", "solution"),
    "clevr": ("image_filename", "question"),
}

Convert = Callable[[dict[str, Any], Path, int], "dict[str, Any] | None"]


def load_benchmark(name: str, path: str | Path, limit: int | None = None, *, split: str | None = None,
                   image_root: str | Path | None = None) -> list[dict[str, Any]]:
    """Records of benchmark `name` read from `path`; at most `limit` of them. `split` picks the files
    of a folder (default: testmini / testmini / test / train); relative image paths are read from
    `image_root`, else from the data file's folder (CLEVR: its images/<split>/ folder)."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {list(BENCHMARKS)}")
    root = None if image_root is None else Path(image_root).expanduser()
    files = mathverse_files(path, split) if name == "mathverse" else data_files(path, split, DEFAULT_SPLITS[name])
    if name == "clevr_count":
        return _clevr(files, root, limit)
    convert = {"mathvista": _mathvista, "mathverse": _mathverse, "geometry3k": _geometry3k}[name]
    return _collect(name, files, root, limit, convert, lambda file: load_table(file))


def _collect(layout: str, files: list[Path], root: Path | None, limit: int | None, convert: Convert,
             open_table: Callable, bases: dict[Path, Path] | None = None, category: str = "") -> list[dict]:
    records: list[dict[str, Any]] = []
    for file in files:
        table = open_table(file)
        missing = [c for c in REQUIRED_COLUMNS[layout] if c not in table.column_names]
        if missing:
            raise ValueError(f"{file}: not the {layout} layout: no column {missing}; "
                             f"available columns: {table.column_names}")
        base = root if root is not None else (bases or {}).get(file, file.parent)
        for i, row in enumerate(iter_rows(table)):
            if limit is not None and len(records) >= limit:
                return records
            fields = convert(row, file, i)
            if fields is not None:
                record = make_record(fields, file=file, index=i, base=base, default_id=str(len(records)),
                                     default_category=category or layout)
                records.append({**record, "meta": fields["meta"]})
    return records


# ---------------------------------------------------------------- MathVista

def _integral(value: Any) -> Any:
    """1.0 -> 1 (parquet stores MathVista's precision as float64, its JSON as an int)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _mathvista(row: dict[str, Any], file: Path, i: int) -> dict[str, Any]:
    at = where(file, i, row["pid"])
    metadata = row.get("metadata") or {}
    answer, options, problem = row["answer"], None, row["question"]
    if answer is None or str(answer).strip() == "":
        raise ValueError(f"{at}: no answer (got {answer!r}); MathVista's test split has none, use testmini")
    choices = None if row["choices"] is None else [str(c) for c in row["choices"]]
    if row["question_type"] == "multi_choice":
        options = choices or []
        texts = [o.strip() for o in options]
        if str(answer).strip() not in texts:
            raise ValueError(f"{at}: multiple-choice answer {answer!r} is not one of the choices {options}")
        answer = LETTERS[texts.index(str(answer).strip())]
        problem = str(problem) + "".join(f"\n{LETTERS[k]}. {o}" for k, o in enumerate(options))
    image = row.get("decoded_image") or row.get("image")  # the hub's parquet embeds bytes; the JSON a path
    meta = {**{k: _integral(v) for k, v in metadata.items()},
            "pid": str(row["pid"]), "question": row["question"], "answer": str(row["answer"]),
            "question_type": row["question_type"], "answer_type": row.get("answer_type"),
            "precision": _integral(row.get("precision")), "unit": row.get("unit"), "choices": choices,
            "query": row.get("query")}
    meta["skills"] = list(meta.get("skills") or [])
    return {"id": row["pid"], "images": image, "problem": problem, "answer": answer, "options": options,
            "category": metadata.get("category"), "difficulty": metadata.get("grade"), "meta": meta}


# ---------------------------------------------------------------- MathVerse

_CHOICES = re.compile(r"\bChoices?\s*:\s*\n", re.IGNORECASE)
_CHOICE_LINE = re.compile(r"^\s*(?:\(([A-Z])\)|([A-Z])\s*[:.])\s*(.*?)\s*$")
_TEXT_ONLY = re.compile(r"text[_-]only", re.IGNORECASE)
TEXT_ONLY_REASON = ("MathVerse's Text Only version (testmini_text_only) has no images and records need one; "
                    "its problems are the testmini problems' text, so load testmini (the five visual versions)")


def _choice_block(question: str) -> tuple[int, int, list[str]] | None:
    """(start, end, option texts) of the option lines after the last "Choices:" / "Choice:" line, or
    None when there are not at least two lines lettered A, B, ... in order."""
    found = list(_CHOICES.finditer(question))
    if not found:
        return None
    options: list[str] = []
    start = end = found[-1].end()
    for line in question[start:].split("\n"):
        m = _CHOICE_LINE.match(line)
        if m is None or (m.group(1) or m.group(2)) != LETTERS[len(options)]:
            break
        options.append(m.group(3))
        end += len(line) + 1
    return (start, min(end, len(question)), options) if len(options) >= 2 else None


def mathverse_options(question: str) -> list[str] | None:
    """The option texts listed after "Choices:" ("A:40°", "A.5 cm", "A. 5 cm", "(A) 5"), or None when
    the question does not list them (Vision-Only questions show them in the image)."""
    block = _choice_block(question)
    return None if block is None else block[2]


def _listed_as_letters(question: str) -> str:
    """The question with its option lines written "A. text", the way the VQA task recognises listed
    options (it appends "options" to a problem that does not list them): "A:40°" / "(A) 5" would
    otherwise be shown twice."""
    block = _choice_block(question)
    if block is None:
        return question
    start, end, options = block
    lines = "\n".join(f"{LETTERS[k]}. {o}" for k, o in enumerate(options))
    rest = question[end:]
    return question[:start] + lines + ("\n" + rest if rest else "")


def _gold_letter(answer: str, options: list[str]) -> str | None:
    """The option letter a MathVerse answer names: "D", "(C)", or an option's text; None otherwise
    (e.g. "C\nD", a two-answer question)."""
    a = answer.strip()
    m = re.fullmatch(r"\(?([A-Z])\)?", a)
    if m and LETTERS.index(m.group(1)) < len(options):
        return m.group(1)
    texts = [o.strip() for o in options]
    return LETTERS[texts.index(a)] if a in texts else None


def mathverse_files(path: str | Path, split: str | None = None) -> list[Path]:
    """The files of one copy of a MathVerse split. A snapshot folder holds the testmini split twice
    (testmini.parquet and testmini.json; lmms-eval's copy adds one file per version) and the text-only
    split beside it: the files named after `split` (default testmini: testmini.parquet or
    data/testmini-00000-of-00001.parquet) are read, parquet before JSON; the text-only files are
    skipped with a warning (`TEXT_ONLY_REASON`)."""
    want = split or DEFAULT_SPLITS["mathverse"]
    if _TEXT_ONLY.search(want):
        raise ValueError(f"split={split!r}: {TEXT_ONLY_REASON}")
    p = Path(path).expanduser()
    if not p.is_dir():
        files = data_files(p, split)
        if _TEXT_ONLY.search(p.name):
            raise ValueError(f"{p}: {TEXT_ONLY_REASON}")
        return files
    found = sorted({f for fs in folder_splits(p).values() for f in fs})
    skipped = [f.name for f in found if _TEXT_ONLY.search(f.name)]
    named = [f for f in found if (f.stem == want or f.stem.startswith(want + "-")) and f not in skipped]
    if not named:
        raise ValueError(f"{p}: no {want} file (looked for {want}.parquet / .json / .jsonl, or {want}-*.parquet); "
                         f"data files there: {[str(f.relative_to(p)) for f in found]}")
    if skipped:
        warnings.warn(f"{p}: skipped {skipped}: {TEXT_ONLY_REASON}", stacklevel=3)
    for suffix in DATA_FORMATS:  # one copy: parquet (images embedded), else JSON (image paths), ...
        chosen = [f for f in named if f.suffix == suffix]
        if chosen:
            return chosen
    return named


def _mathverse(row: dict[str, Any], file: Path, i: int) -> dict[str, Any]:
    at = where(file, i, row["sample_index"])
    question = str(row["question"] or "")
    if row["problem_version"] == "Text Only":
        raise ValueError(f"{at}: problem_version {row['problem_version']!r} with image {row['image']!r}: "
                         f"{TEXT_ONLY_REASON}")
    metadata = row.get("metadata") or {}
    answer = str(row["answer"] if row["answer"] is not None else "").strip()
    listed = mathverse_options(question)
    choices = listed or mathverse_options(str(row.get("question_for_eval") or ""))
    options, problem = None, _listed_as_letters(question)
    if row["question_type"] == "multi-choice" and listed is not None:
        letter = _gold_letter(answer, listed)
        options, answer = (listed, letter) if letter is not None else (None, answer)
    if not question.strip():  # Vision Only: the question is in the image, the instruction in query_wo
        problem = str(row.get("query_wo") or row.get("query_cot") or "")
    meta = {**metadata, "sample_index": str(row["sample_index"]), "problem_index": str(row.get("problem_index")),
            "problem_version": row["problem_version"], "question": question, "answer": str(row["answer"]),
            "question_type": row["question_type"], "query_wo": row.get("query_wo"),
            "query_cot": row.get("query_cot"), "question_for_eval": row.get("question_for_eval"),
            "choices": choices}
    return {"id": row["sample_index"], "images": row["image"], "problem": problem, "answer": answer,
            "options": options, "category": row["problem_version"], "meta": meta}


# ---------------------------------------------------------------- Geometry3K

def _geometry3k(row: dict[str, Any], file: Path, i: int) -> dict[str, Any]:
    return {"images": row["images"], "problem": row["problem"], "answer": row["answer"], "category": "geometry",
            "meta": {"problem": row["problem"], "answer": None if row["answer"] is None else str(row["answer"])}}


# ---------------------------------------------------------------- CLEVR counting

_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_COUNT_QUESTION = re.compile(r"^\s*(how many|what number of)\b", re.IGNORECASE)


def _integer(value: Any) -> str | None:
    try:
        return str(int(str(value).strip()))
    except ValueError:
        return None


def _clevr_r1v(row: dict[str, Any], file: Path, i: int) -> dict[str, Any]:
    solution = str(row["solution"] or "")
    m = _ANSWER_TAG.search(solution)
    answer = _integer(m.group(1) if m else solution)
    if answer is None:
        raise ValueError(f"{where(file, i)}: solution {solution!r} holds no integer count; "
                         f"accepted: '<answer> 3 </answer>' or '3'")
    return {"images": row["image"], "problem": row["problem"], "answer": answer, "category": "counting",
            "meta": {"question": row["problem"], "answer": answer}}


def _clevr_original(row: dict[str, Any], file: Path, i: int) -> dict[str, Any] | None:
    """Count questions only: "How many ..." / "What number of ..." (CLEVR's count templates)."""
    if not _COUNT_QUESTION.match(row["question"]):
        return None
    answer = row.get("answer")
    if answer is not None and _integer(answer) is None:
        raise ValueError(f"{where(file, i)}: count question {row['question']!r} has answer {answer!r}; "
                         f"accepted: an integer")
    rid = row.get("question_index")
    rid = f"{row.get('split') or file.stem}-{rid if rid is not None else i}"
    answer = None if answer is None else _integer(answer)
    meta = {"question": row["question"], "answer": answer, "split": row.get("split"),
            "image_index": row.get("image_index"), "question_family_index": row.get("question_family_index")}
    return {"id": rid, "images": row["image_filename"], "problem": row["question"], "answer": answer,
            "category": "counting", "meta": meta}


def _clevr_images(file: Path, table) -> Path:
    """Where a CLEVR questions file's images are: CLEVR_v1.0/questions/X.json -> CLEVR_v1.0/images/<split>/."""
    rows = iter_rows(table, 1)
    first = next(rows, None)
    if first is None:
        return file.parent
    split = first.get("split") or ""
    tried = [file.parent.parent / "images" / split, file.parent / "images" / split, file.parent / "images",
             file.parent]
    for d in tried:
        if (d / first["image_filename"]).is_file():
            return d
    raise FileNotFoundError(f"{where(file, 0)}: image {first['image_filename']!r} is in none of "
                            f"{[str(d) for d in tried]}; pass image_root= the folder holding the images")


def _clevr(files: list[Path], root: Path | None, limit: int | None) -> list[dict[str, Any]]:
    """The original questions JSON (read through its "questions" field), else R1-V's layout."""
    if all(f.suffix == ".json" for f in files):
        tables = {}
        for f in files:
            try:
                tables[f] = load_table(f, field="questions")
            except ValueError:
                break
        else:
            bases = {} if root is not None else {f: _clevr_images(f, t) for f, t in tables.items()}
            return _collect("clevr", files, root, limit, _clevr_original, tables.__getitem__, bases, "counting")
    return _collect("clevr_r1v", files, root, limit, _clevr_r1v, lambda file: load_table(file),
                    category="counting")
