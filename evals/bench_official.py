"""The public VQA benchmarks' own prompt construction and rule graders, as pure functions over the
records `mmrl.envs.vqa.benchmarks.load_benchmark` returns (each with its "meta" dict).

Where each behaviour comes from (read in the official repositories):

* mathvista (github lupantech/MathVista): the prompt is evaluation/build_query.py's zero-shot query
  (`create_one_query` with shot_num 0 and shot_type "solution", as data/query.json and the hub's
  `query` column hold it: the hint line by question / answer type and precision, "Question: ..."
  with " (Unit: u)", then "Choices:" and "(A) ..." lines, stripped). The row's `query` is used when
  the source has it, the rebuild only when not. Extraction follows evaluation/extract_answer.py's
  rules (see `extract`); grading is evaluation/calculate_score.py's `normalize_extracted_answer`
  then `safe_equal` to the gold answer; the breakdowns are its per-key accuracies, with the task
  and skill names shortened as the paper's tables print them.
* mathverse (github ZrrSkywalker/MathVerse): the prompt is the row's `query_cot` (style "cot") or
  `query_wo` (style "direct", the leaderboard's "w/o" input; README "Data Usage"). The official
  extraction and scoring ask GPT (evaluation/extract_answer_s1.py, score_answer_s2.py); the rule
  grader here marks multiple choice by the option letter (or an option's text, as the judge's
  examples in evaluation/prompts.py accept) and free-form answers with math-verify
  (`mmrl.rewards.vqa.compare_open`). Breakdown by problem version and subject, as
  score_answer_s2.py prints them.
* geometry3k (github hiyouga/EasyR1): examples/format_prompt/math.jinja rendered over the problem
  (verl/utils/dataset.py: the template stripped, `content | trim`); examples/reward_function/math.py
  reads the last \\boxed{} (after its whitespace clean-up around <, >, /) and mathruler's
  `grade_answer` judges it, here `compare_open`.
* synthetic / synthetic_ood (this project): the VQA task's own held-out set and its harder level
  (`mmrl.envs.vqa.synthetic.make_splits` with the task's defaults), asked with the task's "tag"
  prompt and graded by the `answer_accuracy` reward; broken down by category and difficulty.
* clevr_count (github Deep-Agent/R1-V): src/r1-v/src/open_r1/grpo.py's QUESTION_TEMPLATE (two
  spaces after the question, as there); src/eval/test_qwen2vl_counting_superclevr.py's grading:
  the <answer> holds digits only and equals the count as an integer.

Prompts come without the "<image>" placeholder: the caller places the images.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from typing import Any

from mmrl.envs.vqa.records import IMAGE_TOKEN, LETTERS
from mmrl.rewards.vqa import MathJudge, compare_open, extract_answer, judge_answer, normalize_text

BENCHMARKS = ("mathvista", "mathverse", "geometry3k", "clevr_count", "synthetic", "synthetic_ood")
SYNTHETIC = ("synthetic", "synthetic_ood")  # generated, not read: records carry no "meta"
# The styles each benchmark can be asked in; the first is the default.
STYLES = {"mathvista": ("zero-shot",), "mathverse": ("cot", "direct"), "geometry3k": ("math",),
          "clevr_count": ("r1v",), "synthetic": ("tag",), "synthetic_ood": ("tag",)}
# Each benchmark's (prompt template, grader) as provenance records them: where each comes from, and
# a version bumped whenever its text or rule changes (--compare refuses results that differ).
VERSIONS: dict[str, tuple[str, str]] = {
    "mathvista": ("mathvista.build_query/zero-shot@v1",
                  "mathvista.calculate_score.normalize_extracted_answer+safe_equal@v1"),
    "mathverse": ("mathverse.query_cot|query_wo@v1", "mathverse.rules(letter|compare_open+math-verify)@v1"),
    "geometry3k": ("easyr1.format_prompt/math.jinja@v1", "easyr1.math.last_boxed+compare_open@v1"),
    "clevr_count": ("r1v.grpo.QUESTION_TEMPLATE@v1", "r1v.counting.integer_equal@v1"),
    "synthetic": ("mmrl.vqa.PROMPTS[tag]@v1", "mmrl.rewards.vqa.answer_accuracy@v1"),
    "synthetic_ood": ("mmrl.vqa.PROMPTS[tag]@v1", "mmrl.rewards.vqa.answer_accuracy@v1"),
}

# MathVista's hints (build_query.py), by answer type and, for floats, precision.
MATHVISTA_HINTS = {
    "text": "Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.",
    "integer": "Hint: Please answer the question requiring an integer answer and provide the final value, "
               "e.g., 1, 2, 3, at the end.",
    ("float", 1): "Hint: Please answer the question requiring a floating-point number with one decimal place and "
                  "provide the final value, e.g., 1.2, 1.3, 1.4, at the end.",
    ("float", 2): "Hint: Please answer the question requiring a floating-point number with two decimal places and "
                  "provide the final value, e.g., 1.23, 1.34, 1.45, at the end.",
    "list": "Hint: Please answer the question requiring a Python list as an answer and provide the final list, "
            "e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end.",
}
EASYR1_MATH = (" You FIRST think about the reasoning process as an internal monologue and then provide the final "
               "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
               "BE put in \\boxed{}.")
R1V_COUNTING = ("{question}  Output the thinking process in <think> </think> and final answer (number) in "
                "<answer> </answer> tags.")

# The paper's table headers for MathVista's task and skill metadata.
MATHVISTA_TASKS = {"figure question answering": "FQA", "geometry problem solving": "GPS",
                   "math word problem": "MWP", "textbook question answering": "TQA",
                   "visual question answering": "VQA"}
MATHVISTA_SKILLS = {"algebraic reasoning": "ALG", "arithmetic reasoning": "ARI", "geometry reasoning": "GEO",
                    "logical reasoning": "LOG", "numeric commonsense": "NUM", "scientific reasoning": "SCI",
                    "statistical reasoning": "STA"}
MATHVERSE_VERSIONS = ("Text Dominant", "Text Lite", "Vision Intensive", "Vision Dominant", "Vision Only")


def _check(benchmark: str) -> None:
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; known: {list(BENCHMARKS)}")


def _meta(benchmark: str, record: dict[str, Any]) -> dict[str, Any]:
    if benchmark in SYNTHETIC:
        return record
    meta = record.get("meta")
    if not isinstance(meta, dict):
        raise ValueError(f"{benchmark} record {record.get('id')!r} has no 'meta' dict (got {type(meta).__name__}); "
                         f"accepted: records from mmrl.envs.vqa.benchmarks.load_benchmark")
    return meta


@functools.cache
def _judge() -> MathJudge:
    return MathJudge()


# ---------------------------------------------------------------- prompts

def mathvista_query(meta: dict[str, Any]) -> str:
    """MathVista's zero-shot query rebuilt from the row (build_query.py `create_one_query`, shot_num 0,
    shot_type "solution", no caption / OCR), in the order data/query.json holds it: hint, question
    with its unit, choices."""
    at = f"mathvista pid {meta.get('pid')!r}"
    answer_type, precision = meta.get("answer_type"), meta.get("precision")
    if meta.get("question_type") == "multi_choice" and answer_type != "text":
        raise ValueError(f"{at}: multi_choice with answer_type {answer_type!r}; accepted: 'text'")
    key = ("float", int(precision)) if answer_type == "float" and precision is not None else answer_type
    if key not in MATHVISTA_HINTS:
        raise ValueError(f"{at}: no MathVista hint for answer_type {answer_type!r} with precision {precision!r}; "
                         f"accepted: text, integer, float (precision 1 or 2), list")
    question = f"Question: {meta['question']}" + (f" (Unit: {meta['unit']})" if meta.get("unit") else "")
    parts = [MATHVISTA_HINTS[key], question]
    if meta.get("choices"):
        parts.append("\n".join(["Choices:"] + [f"({LETTERS[i]}) {c}" for i, c in enumerate(meta["choices"])]))
    return "\n".join(parts).strip()


def _style(benchmark: str, style: str | None) -> str:
    if style is None:
        return STYLES[benchmark][0]
    if style not in STYLES[benchmark]:
        raise ValueError(f"{benchmark}: unknown prompt style {style!r}; accepted: {list(STYLES[benchmark])}")
    return style


def build_prompt(benchmark: str, record: dict[str, Any], style: str | None = None) -> str:
    """The text the benchmark asks with (no "<image>" placeholder). `style`: mathverse "cot" (default,
    `query_cot`) or "direct" (`query_wo`); the others have one style each (`STYLES`)."""
    _check(benchmark)
    meta, style = _meta(benchmark, record), _style(benchmark, style)
    if benchmark == "mathvista":
        return meta["query"] if meta.get("query") else mathvista_query(meta)
    if benchmark == "mathverse":
        column = "query_cot" if style == "cot" else "query_wo"
        if not meta.get(column):
            raise ValueError(f"mathverse record {record.get('id')!r}: no {column} (got {meta.get(column)!r}); "
                             f"accepted: rows of the hub's testmini (they carry query_wo and query_cot)")
        return meta[column]
    if benchmark == "geometry3k":
        return meta["problem"].replace(IMAGE_TOKEN, "").strip() + EASYR1_MATH
    if benchmark in SYNTHETIC:
        from mmrl.envs.vqa.task import PROMPTS

        return PROMPTS["tag"].format(problem=record["problem"])
    return R1V_COUNTING.format(question=meta["question"].replace(IMAGE_TOKEN, ""))


# ---------------------------------------------------------------- extraction

_QUOTED = re.compile(r'The answer is "(.*)"\.')  # extract_answer.py's quick rule
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_LIST = re.compile(r"\[[^\[\]]*\]")
_ANSWER_IS = re.compile(r"answer\s*(?:is\s*:?|:)\s*(.+)", re.IGNORECASE)  # "The answer is B", "Answer: 14"
_EASYR1_SPACES = re.compile(r"\s*(<|>|/)\s*")  # examples/reward_function/math.py's clean-up


def _last_letter(reply: str, n: int) -> str | None:
    """The last option letter standing alone in the reply ("(B)", "B.", "B"), among the first n."""
    found = re.findall(rf"(?<![A-Za-z])\(?([A-{LETTERS[max(n, 1) - 1]}])\)?(?![A-Za-z])", reply)
    return found[-1] if found else None


def _last_number(reply: str) -> str | None:
    found = _NUMBER.findall(reply)
    return found[-1].replace(",", "") if found else None


def _said(reply: str) -> str | None:
    """What follows the reply's last "answer is" / "Answer:" on its line (a final full stop dropped)."""
    said = _ANSWER_IS.findall(reply)
    return (said[-1].strip().rstrip(".").strip() or None) if said else None


def _fallback(reply: str, multi_choice: bool, n_options: int, answer_type: str | None) -> str | None:
    """Where the official asks GPT: what follows the last "answer is" (for numbers and lists, the
    last one in it), else the reply's last option letter, [...] list or number."""
    said = _said(reply)
    if multi_choice:
        return said or _last_letter(reply, n_options)
    if answer_type == "list":
        found = _LIST.findall(said or "") or _LIST.findall(reply)
        return found[-1] if found else None
    if answer_type in ("integer", "float"):
        return _last_number(said or "") or _last_number(reply)
    return said or _last_number(reply)


def _mathvista_extract(meta: dict[str, Any], reply: str) -> str | None:
    """extract_answer.py's rules on the whole reply (a choice text, an integer / float reply, 'The
    answer is "..."'), then `_fallback`."""
    if reply == "":
        return None
    choices = meta.get("choices") or []
    multi_choice = meta.get("question_type") == "multi_choice"
    if multi_choice and reply in choices:
        return reply
    for kind, cast in (("integer", int), ("float", float)):
        if meta.get("answer_type") == kind:
            try:
                return str(cast(reply))
            except ValueError:
                pass
    quoted = _QUOTED.search(reply)
    if quoted:
        return quoted.group(1)
    return _fallback(reply, multi_choice, len(choices), meta.get("answer_type"))


def extract(benchmark: str, record: dict[str, Any], reply: str) -> str | None:
    """The reply's final answer by rule, or None when it has none.

    mathvista / mathverse: the last <answer>...</answer>, else the last \\boxed{} (`extract_answer`);
    else mathvista's own rules from extract_answer.py (the reply is a choice text; an int / float
    reply for integer / float answers; 'The answer is "..."'), and as a last resort, where the
    official asks GPT, `_fallback`: what follows the last "answer is" / "Answer:", else the
    reply's last option letter ("(B)", "B"), [...] list or number.
    geometry3k: the last \\boxed{} only (EasyR1's math reward), after its whitespace clean-up.
    clevr_count: the last <answer> tag (R1-V reads tags only)."""
    _check(benchmark)
    meta = _meta(benchmark, record)
    if not isinstance(reply, str):
        return None
    if benchmark == "geometry3k":
        return extract_answer(_EASYR1_SPACES.sub(r"\1", reply), "boxed")
    if benchmark == "clevr_count":
        return extract_answer(reply, "tag")
    found = extract_answer(reply, "either")
    if benchmark in SYNTHETIC:
        return found
    if found is not None:
        return found
    if benchmark == "mathvista":
        return _mathvista_extract(meta, reply)
    multi_choice = meta.get("question_type") == "multi-choice"
    return _fallback(reply, multi_choice, len(meta.get("choices") or LETTERS[:8]), None)


# ---------------------------------------------------------------- grading

def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute: 1 each), as python-Levenshtein's `distance`
    that MathVista's calculate_score.py calls."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def mathvista_normalize(extraction: str | None, meta: dict[str, Any]) -> str | None:
    """calculate_score.py's `normalize_extracted_answer` (ignore_empty_extractions off, its default).

    multi_choice: the first "(x)" names the letter; a letter A.. picks its choice, anything else
    (also an empty extraction) the choice nearest by edit distance (the first of equals). integer:
    str(int(float(x))); float: str(round(float(x), precision)); list: the text as is; None when the
    conversion fails."""
    text = "" if extraction is None else str(extraction)
    if meta["question_type"] == "multi_choice":
        choices = meta.get("choices")
        if not choices:
            raise ValueError(f"mathvista pid {meta.get('pid')!r}: multi_choice without choices (got {choices!r})")
        text = text.strip()
        letter = re.findall(r"\(([a-zA-Z])\)", text)
        if letter:
            text = letter[0].upper()
        if len(text) == 1 and text in LETTERS[: len(choices)]:
            return choices[LETTERS.index(text)]
        distances = [edit_distance(text, c) for c in choices]
        return choices[distances.index(min(distances))]
    answer_type = meta.get("answer_type")
    if answer_type not in ("integer", "float", "list"):
        raise ValueError(f"mathvista pid {meta.get('pid')!r}: free_form answer_type {answer_type!r}; "
                         f"accepted: integer, float, list")
    if extraction is None:
        return None
    try:
        if answer_type == "integer":
            return str(int(float(text)))
        if answer_type == "float":
            return str(round(float(text), int(meta["precision"])))
    except (TypeError, ValueError, OverflowError):
        return None
    return text


def _letters(text: str, n: int) -> frozenset[str] | None:
    """The option letters an answer names: "B", "(B)", "B.", "B:2√{3}", "Option B", "C, D", "C\\nD",
    "CD"; None when it names none (among the first n)."""
    t = text.strip()
    t = re.sub(r"^(?:the\s+)?(?:correct\s+)?(?:answer|option|choice)s?\s*(?:is|are)?\s*:?\s*", "", t,
               flags=re.IGNORECASE)
    one = re.fullmatch(r"\(([A-Za-z])\)(?:\s*.*)?|([A-Za-z])(?:\s*[.:)]\s*.*)?", t, re.DOTALL)
    letter = None if one is None else one.group(1) or one.group(2)
    if letter and (len(t) == 1 or letter.isupper()):
        letters = frozenset(letter.upper())
    else:
        many = re.fullmatch(r"\(?[A-Z]\)?(?:\s*(?:,|and|&|\n|\s)?\s*\(?[A-Z]\)?)+", t)
        letters = frozenset(re.findall(r"[A-Z]", t)) if many else None
    if letters is None or any(LETTERS.index(x) >= n for x in letters):
        return None
    return letters


def _option_of(text: str, choices: list[str]) -> frozenset[str] | None:
    """The letter of the option whose text the answer is: equal normalised text, else the one option
    math-verify finds equal (`compare_open`)."""
    norm = [normalize_text(c) for c in choices]
    if normalize_text(text) in norm:
        return frozenset(LETTERS[norm.index(normalize_text(text))])
    hits = [i for i, c in enumerate(choices) if compare_open(text, c, _judge()) == "correct"]
    return frozenset(LETTERS[hits[0]]) if len(hits) == 1 else None


def _mathverse_grade(meta: dict[str, Any], extracted: str) -> bool:
    gold = meta["answer"].strip()
    if meta["question_type"] != "multi-choice":
        return compare_open(extracted, gold, _judge()) == "correct"
    choices = meta.get("choices") or []
    n = len(choices) or len(LETTERS)
    want = _letters(gold, n) or (_option_of(gold, choices) if choices else None)
    if want is None:  # the gold is an option text and the options are not listed (Vision Only)
        return compare_open(extracted, gold, _judge()) == "correct"
    norm = [normalize_text(c) for c in choices]
    if normalize_text(extracted) in norm:  # an option's own text (checked first: an option may be a letter)
        return frozenset(LETTERS[norm.index(normalize_text(extracted))]) == want
    got = _letters(extracted, n) or (_option_of(extracted, choices) if choices else None)
    return got == want


def grade(benchmark: str, record: dict[str, Any], extracted: str | None) -> bool:
    """Whether the extracted answer is right, by the benchmark's rule (see the module doc).

    mathvista: `mathvista_normalize` then equality with the gold text (`safe_equal`); note that, as
    in the official scorer, an empty extraction of a multiple-choice question still picks the
    nearest (shortest) choice. mathverse: multiple choice by the option letter(s) named, or an
    option's text; free form with `compare_open`. geometry3k: `compare_open`. clevr_count: digits
    equal to the count as integers."""
    _check(benchmark)
    meta = _meta(benchmark, record)
    if benchmark == "mathvista":
        return mathvista_normalize(extracted, meta) == meta["answer"]
    if extracted is None:
        return False
    if benchmark == "mathverse":
        return _mathverse_grade(meta, extracted)
    if benchmark == "geometry3k":
        return compare_open(extracted, str(record["answer"]), _judge()) == "correct"
    if benchmark in SYNTHETIC:
        return judge_answer(record, extracted, _judge()) == "correct"
    return re.fullmatch(r"\d+", extracted.strip()) is not None and int(extracted) == int(record["answer"])


# ---------------------------------------------------------------- breakdowns

def _table(cells: dict[str, list[bool]], order: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    keys = [k for k in order if k in cells] + sorted(k for k in cells if k not in order)
    return {k: {"accuracy": sum(cells[k]) / len(cells[k]), "n": len(cells[k])} for k in keys}


Tables = dict[str, dict[str, dict[str, float]]]  # table -> cell -> {"accuracy", "n"}


def breakdowns(benchmark: str, records: list[dict[str, Any]], correct: list[bool]) -> Tables:
    """The accuracy tables the benchmark's paper prints: table -> cell -> {"accuracy", "n"}.

    mathvista: "task" (FQA, GPS, MWP, TQA, VQA), "skill" (ALG, ARI, GEO, LOG, NUM, SCI, STA; a
    problem counts under every skill it lists), "question_type", "answer_type". mathverse:
    "problem_version" (the five versions, then "All") and "subject". synthetic: "category" and
    "difficulty". geometry3k, clevr_count: none."""
    _check(benchmark)
    if len(records) != len(correct):
        raise ValueError(f"{benchmark}: {len(records)} records but {len(correct)} verdicts; accepted: one each")
    tables: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for record, ok in zip(records, correct):
        meta = _meta(benchmark, record)
        if benchmark == "mathvista":
            task = meta.get("task")
            tables["task"][MATHVISTA_TASKS.get(task, str(task))].append(bool(ok))
            for skill in meta.get("skills") or []:
                tables["skill"][MATHVISTA_SKILLS.get(skill, str(skill))].append(bool(ok))
            tables["question_type"][str(meta.get("question_type"))].append(bool(ok))
            tables["answer_type"][str(meta.get("answer_type"))].append(bool(ok))
        elif benchmark == "mathverse":
            tables["problem_version"][str(meta.get("problem_version"))].append(bool(ok))
            tables["problem_version"]["All"].append(bool(ok))
            tables["subject"][str(meta.get("subject"))].append(bool(ok))
        elif benchmark in SYNTHETIC:
            tables["category"][str(record["category"])].append(bool(ok))
            tables["difficulty"][f"L{record['difficulty']}"].append(bool(ok))
    orders = {"task": tuple(MATHVISTA_TASKS.values()), "skill": tuple(MATHVISTA_SKILLS.values()),
              "problem_version": (*MATHVERSE_VERSIONS, "All")}
    return {name: _table(cells, orders.get(name, ())) for name, cells in tables.items()}
