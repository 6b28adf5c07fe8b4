"""The public benchmarks' own prompts and rule graders (evals/bench_official.py) and the benchmark
loaders' fixes (envs/vqa/benchmarks.py), on files written here in each benchmark's published layout:
MathVista's hub parquet (embedded image bytes, `query` column) and GitHub JSON (keyed by pid, image
paths), a MathVerse hub snapshot folder (testmini.parquet + .json + the text-only files), Geometry3K
(EasyR1's hub parquet) and R1-V's CLEVR counting parquet. The MathVista rows are real testmini rows
(data/testmini.json) with their official zero-shot queries (data/query.json); every expected verdict
was worked out by hand from the official scorers' code."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402

datasets = pytest.importorskip("datasets")
pytest.importorskip("math_verify")
from PIL import Image  # noqa: E402

from mmrl.envs.vqa.benchmarks import load_benchmark, mathverse_options  # noqa: E402
from mmrl.envs.vqa.task import VQATask  # noqa: E402
from mmrl.evals.bench_official import (BENCHMARKS, VERSIONS, breakdowns,  # noqa: E402
                                       build_prompt, edit_distance, extract, grade, mathvista_query)
from mmrl.rewards.vqa import MathJudge, compare_open  # noqa: E402

MATHVISTA_ROWS = [
    {'question': 'When a spring does work on an object, we cannot find the work by simply multiplying the spring '
                 "force by the object's displacement. The reason is that there is no one value for the force-it "
                 'changes. However, we can split the displacement up into an infinite number of tiny parts and then '
                 'approximate the force in each as being constant. Integration sums the work done in all those '
                 'parts. Here we use the generic result of the integration.\r\n'
                 '\r\n'
                 'In Figure, a cumin canister of mass $m=0.40 \\mathrm{~kg}$ slides across a horizontal frictionless '
                 'counter with speed $v=0.50 \\mathrm{~m} / \\mathrm{s}$. It then runs into and compresses a spring '
                 'of spring constant $k=750 \\mathrm{~N} / \\mathrm{m}$. When the canister is momentarily stopped by '
                 'the spring, by what distance $d$ is the spring compressed?',
     'image': 'images/1.jpg',
     'choices': None,
     'unit': None,
     'precision': 1,
     'answer': '1.2',
     'question_type': 'free_form',
     'answer_type': 'float',
     'pid': '1',
     'metadata': {'split': 'testmini',
                  'language': 'english',
                  'img_width': 1514,
                  'img_height': 720,
                  'source': 'SciBench',
                  'category': 'math-targeted-vqa',
                  'task': 'textbook question answering',
                  'context': 'scientific figure',
                  'grade': 'college',
                  'skills': ['scientific reasoning']},
     'query': 'Hint: Please answer the question requiring a floating-point number with one decimal place and provide '
              'the final value, e.g., 1.2, 1.3, 1.4, at the end.\n'
              'Question: When a spring does work on an object, we cannot find the work by simply multiplying the '
              "spring force by the object's displacement. The reason is that there is no one value for the force-it "
              'changes. However, we can split the displacement up into an infinite number of tiny parts and then '
              'approximate the force in each as being constant. Integration sums the work done in all those parts. '
              'Here we use the generic result of the integration.\r\n'
              '\r\n'
              'In Figure, a cumin canister of mass $m=0.40 \\mathrm{~kg}$ slides across a horizontal frictionless '
              'counter with speed $v=0.50 \\mathrm{~m} / \\mathrm{s}$. It then runs into and compresses a spring of '
              'spring constant $k=750 \\mathrm{~N} / \\mathrm{m}$. When the canister is momentarily stopped by the '
              'spring, by what distance $d$ is the spring compressed?'},
    {'question': 'what is the total volume of the measuring cup?',
     'image': 'images/2.jpg',
     'choices': None,
     'unit': 'g',
     'precision': None,
     'answer': '1000',
     'question_type': 'free_form',
     'answer_type': 'integer',
     'pid': '2',
     'metadata': {'split': 'testmini',
                  'language': 'english',
                  'img_width': 1024,
                  'img_height': 768,
                  'source': 'TextVQA',
                  'category': 'general-vqa',
                  'task': 'visual question answering',
                  'context': 'natural image',
                  'grade': 'not applicable',
                  'skills': ['numeric commonsense', 'arithmetic reasoning']},
     'query': 'Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, '
              '3, at the end.\n'
              'Question: what is the total volume of the measuring cup? (Unit: g)'},
    {'question': '△ABC的两内角平分线OB、OC相交于点O，若∠A＝110°，则∠BOC＝（）',
     'image': 'images/3.jpg',
     'choices': ['135°', '140°', '145°', '150°'],
     'unit': None,
     'precision': None,
     'answer': '145°',
     'question_type': 'multi_choice',
     'answer_type': 'text',
     'pid': '3',
     'metadata': {'split': 'testmini',
                  'language': 'chinese',
                  'img_width': 131,
                  'img_height': 60,
                  'source': 'GeoQA+',
                  'category': 'math-targeted-vqa',
                  'task': 'geometry problem solving',
                  'context': 'geometry diagram',
                  'grade': 'high school',
                  'skills': ['geometry reasoning', 'algebraic reasoning']},
     'query': 'Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the '
              'end.\n'
              'Question: △ABC的两内角平分线OB、OC相交于点O，若∠A＝110°，则∠BOC＝（）\n'
              'Choices:\n'
              '(A) 135°\n'
              '(B) 140°\n'
              '(C) 145°\n'
              '(D) 150°'},
    {'question': 'Find y',
     'image': 'images/271.jpg',
     'choices': ['3', '4.5', '5', '6'],
     'unit': None,
     'precision': None,
     'answer': '5',
     'question_type': 'multi_choice',
     'answer_type': 'text',
     'pid': '271',
     'metadata': {'split': 'testmini',
                  'language': 'english',
                  'img_width': 448,
                  'img_height': 287,
                  'source': 'Geometry3K',
                  'category': 'math-targeted-vqa',
                  'task': 'geometry problem solving',
                  'context': 'geometry diagram',
                  'grade': 'high school',
                  'skills': ['geometry reasoning', 'algebraic reasoning']},
     'query': 'Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the '
              'end.\n'
              'Question: Find y\n'
              'Choices:\n'
              '(A) 3\n'
              '(B) 4.5\n'
              '(C) 5\n'
              '(D) 6'},
    {'question': 'Find z',
     'image': 'images/310.jpg',
     'choices': ['10', '\\frac { 32 } { 3 }', '\\frac { 40 } { 3 }', '\\frac { 50 } { 3 }'],
     'unit': None,
     'precision': None,
     'answer': '\\frac { 40 } { 3 }',
     'question_type': 'multi_choice',
     'answer_type': 'text',
     'pid': '310',
     'metadata': {'split': 'testmini',
                  'language': 'english',
                  'img_width': 350,
                  'img_height': 218,
                  'source': 'Geometry3K',
                  'category': 'math-targeted-vqa',
                  'task': 'geometry problem solving',
                  'context': 'geometry diagram',
                  'grade': 'high school',
                  'skills': ['geometry reasoning', 'algebraic reasoning']},
     'query': 'Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the '
              'end.\n'
              'Question: Find z\n'
              'Choices:\n'
              '(A) 10\n'
              '(B) \\frac { 32 } { 3 }\n'
              '(C) \\frac { 40 } { 3 }\n'
              '(D) \\frac { 50 } { 3 }'},
    {'question': 'What is the sum of 2002, 2003 and 2004?',
     'image': 'images/981.jpg',
     'choices': None,
     'unit': None,
     'precision': 1,
     'answer': '70.4',
     'question_type': 'free_form',
     'answer_type': 'float',
     'pid': '981',
     'metadata': {'split': 'testmini',
                  'language': 'english',
                  'img_width': 800,
                  'img_height': 557,
                  'source': 'ChartQA',
                  'category': 'general-vqa',
                  'task': 'figure question answering',
                  'context': 'line plot',
                  'grade': 'not applicable',
                  'skills': ['statistical reasoning']},
     'query': 'Hint: Please answer the question requiring a floating-point number with one decimal place and provide '
              'the final value, e.g., 1.2, 1.3, 1.4, at the end.\n'
              'Question: What is the sum of 2002, 2003 and 2004?'},
    {'question': 'What is the sum of the two bars in  18 to 21?',
     'image': 'images/995.jpg',
     'choices': None,
     'unit': None,
     'precision': 2,
     'answer': '18.27',
     'question_type': 'free_form',
     'answer_type': 'float',
     'pid': '995',
     'metadata': {'split': 'testmini',
                  'language': 'english',
                  'img_width': 800,
                  'img_height': 557,
                  'source': 'ChartQA',
                  'category': 'general-vqa',
                  'task': 'figure question answering',
                  'context': 'bar chart',
                  'grade': 'not applicable',
                  'skills': ['statistical reasoning']},
     'query': 'Hint: Please answer the question requiring a floating-point number with two decimal places and '
              'provide the final value, e.g., 1.23, 1.34, 1.45, at the end.\n'
              'Question: What is the sum of the two bars in  18 to 21?'},
    {'question': 'Between which two years does the line  graph saw its maximum peak?',
     'image': 'images/506.jpg',
     'choices': None,
     'unit': None,
     'precision': None,
     'answer': '[2014, 2016]',
     'question_type': 'free_form',
     'answer_type': 'list',
     'pid': '506',
     'metadata': {'split': 'testmini',
                  'language': 'english',
                  'img_width': 850,
                  'img_height': 600,
                  'source': 'ChartQA',
                  'category': 'general-vqa',
                  'task': 'figure question answering',
                  'context': 'line plot',
                  'grade': 'not applicable',
                  'skills': ['statistical reasoning']},
     'query': 'Hint: Please answer the question requiring a Python list as an answer and provide the final list, '
              'e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end.\n'
              'Question: Between which two years does the line  graph saw its maximum peak?'},
    {'question': 'Given that the Hue-Saturation subspace shown in Fig. Q2 is a perfect circle and that colors A, B '
                 'and C can be represented as the 3 points shown in the subspace. Which color has the smallest '
                 'saturation coefficient?',
     'image': 'images/168.jpg',
     'choices': ['(c)', '(a)', '(e)', '(d)', '(b)'],
     'unit': None,
     'precision': None,
     'answer': '(b)',
     'question_type': 'multi_choice',
     'answer_type': 'text',
     'pid': '168',
     'metadata': {'split': 'testmini',
                  'language': 'english',
                  'img_width': 414,
                  'img_height': 454,
                  'source': 'TheoremQA',
                  'category': 'math-targeted-vqa',
                  'task': 'textbook question answering',
                  'context': 'scientific figure',
                  'grade': 'college',
                  'skills': ['scientific reasoning']},
     'query': 'Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the '
              'end.\n'
              'Question: Given that the Hue-Saturation subspace shown in Fig. Q2 is a perfect circle and that colors '
              'A, B and C can be represented as the 3 points shown in the subspace. Which color has the smallest '
              'saturation coefficient?\n'
              'Choices:\n'
              '(A) (c)\n'
              '(B) (a)\n'
              '(C) (e)\n'
              '(D) (d)\n'
              '(E) (b)'},
]


def png(color=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), color).save(buf, format="PNG")
    return buf.getvalue()


def write_parquet(path: Path, rows: list[dict], features: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows, features=datasets.Features(features)).to_parquet(str(path))
    return path


def by_id(records: list[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in records}


def asks(benchmark: str, record: dict, reply: str) -> bool:
    return grade(benchmark, record, extract(benchmark, record, reply))


# ---------------------------------------------------------------- MathVista

STR = datasets.Value("string")
MATHVISTA_FEATURES = {  # the hub card's dataset_info
    "pid": STR, "question": STR, "image": STR, "decoded_image": datasets.Image(),
    "choices": datasets.Sequence(STR), "unit": STR, "precision": datasets.Value("float64"), "answer": STR,
    "question_type": STR, "answer_type": STR,
    "metadata": {"category": STR, "context": STR, "grade": STR, "img_height": datasets.Value("int64"),
                 "img_width": datasets.Value("int64"), "language": STR, "skills": datasets.Sequence(STR),
                 "source": STR, "split": STR, "task": STR},
    "query": STR,
}


@pytest.fixture(scope="module")
def mathvista(tmp_path_factory) -> dict[str, dict[str, dict]]:
    """The same rows from the hub's parquet and from the GitHub JSON (no query column)."""
    root = tmp_path_factory.mktemp("mathvista")
    rows = [{**r, "decoded_image": {"bytes": png(), "path": None}} for r in MATHVISTA_ROWS]
    hub = root / "MathVista"
    write_parquet(hub / "data" / "testmini-00000-of-00001.parquet", rows, MATHVISTA_FEATURES)
    github = root / "github" / "data"
    (github / "images").mkdir(parents=True)
    keyed = {}
    for r in MATHVISTA_ROWS:
        (github / r["image"]).write_bytes(png())
        keyed[r["pid"]] = {k: v for k, v in r.items() if k != "query"}
    (github / "testmini.json").write_text(json.dumps(keyed, indent=4))
    return {"hub": by_id(load_benchmark("mathvista", hub)),
            "github": by_id(load_benchmark("mathvista", github / "testmini.json"))}


def test_mathvista_rows_load_with_their_fields(mathvista):
    for layout, recs in mathvista.items():
        assert list(recs) == [r["pid"] for r in MATHVISTA_ROWS], layout
        for row in MATHVISTA_ROWS:
            meta = recs[row["pid"]]["meta"]
            assert (meta["precision"], meta["unit"], meta["choices"], meta["answer"]) == (
                row["precision"], row["unit"], row["choices"], row["answer"]), (layout, row["pid"])
            assert (meta["question_type"], meta["answer_type"]) == (row["question_type"], row["answer_type"])
            for key in ("task", "skills", "category", "context", "grade", "source", "language"):
                assert meta[key] == row["metadata"][key], (layout, row["pid"], key)
            assert meta["query"] == (row["query"] if layout == "hub" else None)
    rec = mathvista["hub"]["271"]  # records keep the letter and the option texts (the training tasks' view)
    assert (rec["answer"], rec["options"]) == ("C", ["3", "4.5", "5", "6"])
    assert rec["problem"] == "<image>Find y\nA. 3\nB. 4.5\nC. 5\nD. 6"


def test_mathvista_github_json_of_a_thousand_problems_loads(tmp_path):
    """testmini.json is one 870 KB object keyed by pid: `datasets`' JSON reader gave up past ~370."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "x.jpg").write_bytes(png())
    keyed = {}
    for i in range(1000):
        row = {k: v for k, v in MATHVISTA_ROWS[i % len(MATHVISTA_ROWS)].items() if k != "query"}
        keyed[str(i + 1)] = {**row, "pid": str(i + 1), "image": "images/x.jpg"}
    f = tmp_path / "testmini.json"
    f.write_text(json.dumps(keyed, indent=4))
    recs = load_benchmark("mathvista", f)
    assert [r["id"] for r in recs] == [str(i + 1) for i in range(1000)]
    assert recs[999]["meta"]["answer"] == MATHVISTA_ROWS[999 % len(MATHVISTA_ROWS)]["answer"]


def test_mathvista_prompt_is_the_official_query(mathvista):
    for row in MATHVISTA_ROWS:
        hub, github = mathvista["hub"][row["pid"]], mathvista["github"][row["pid"]]
        assert build_prompt("mathvista", hub) == row["query"]  # the row's own query column
        assert mathvista_query(hub["meta"]) == row["query"]  # the rebuild agrees with it
        assert build_prompt("mathvista", github) == row["query"]  # no query column: the rebuild
    with pytest.raises(ValueError, match=r"mathvista: unknown prompt style 'cot'; accepted: \['zero-shot'\]"):
        build_prompt("mathvista", mathvista["hub"]["1"], "cot")
    meta = {**mathvista["github"]["981"]["meta"], "precision": 3}
    with pytest.raises(ValueError, match=r"pid '981': no MathVista hint for answer_type 'float' with precision 3"):
        mathvista_query(meta)


@pytest.mark.parametrize("pid, reply, right", [
    # integer (gold "1000"): calculate_score's str(int(float(x)))
    ("2", "1000", True), ("2", "<answer>1000.0</answer>", True), ("2", "\\boxed{999}", False),
    ("2", "<answer>1,000</answer>", False),  # float("1,000") fails: None, as the official scores it
    ("2", "The volume is 500 g, so the answer is 1000 g.", True),  # fallback: the last number said
    # float, precision 1 (gold "1.2") and 2 (gold "18.27"): round(float(x), precision)
    ("1", "<answer>1.23</answer>", True), ("1", "<answer>1.3</answer>", False), ("1", "1.2", True),
    ("995", "\\boxed{18.271}", True), ("995", "\\boxed{18.3}", False),
    ("981", 'The answer is "70.4".', True),  # extract_answer.py's quick rule
    # list (gold "[2014, 2016]"): compared as text
    ("506", "<answer>[2014, 2016]</answer>", True), ("506", "<answer>[2014,2016]</answer>", False),
    ("506", "So the peak is between [2014, 2016].", True),
    # multiple choice (gold "5" of 3 / 4.5 / 5 / 6): letter, "(C) text", the option text, nearest text
    ("271", "<answer>C</answer>", True), ("271", "\\boxed{(C) 5}", True), ("271", "5", True),
    ("271", "<answer>B</answer>", False), ("271", "<answer>4.6</answer>", False),  # nearest: "4.5"
    ("271", "y is 5 by similar triangles, so the answer is C.", True),
    ("3", "<answer>145°</answer>", True), ("3", "<answer>(B) 145°</answer>", False),  # "(B)" wins
    # fractions as option texts (gold "\frac { 40 } { 3 }"): the nearest by edit distance
    ("310", "\\boxed{\\frac{40}{3}}", True), ("310", "\\boxed{\\frac{32}{3}}", False), ("310", "(C)", True),
    # the official's quirk: "(b)" is read as letter B, i.e. the choice "(a)"
    ("168", "<answer>(b)</answer>", False), ("168", "<answer>E</answer>", True),
])
def test_mathvista_grades_as_calculate_score(mathvista, pid, reply, right):
    for layout in ("hub", "github"):
        assert asks("mathvista", mathvista[layout][pid], reply) is right, (layout, reply)


def test_mathvista_empty_extraction_picks_the_nearest_choice(mathvista):
    """calculate_score.py (ignore_empty_extractions off) maps an empty extraction to the nearest,
    i.e. shortest, choice: "3" of 3 / 4.5 / 5 / 6, the first of the one-character ones."""
    rec = mathvista["hub"]["271"]
    assert extract("mathvista", rec, "") is None and extract("mathvista", rec, "no idea") is None
    meta3 = {**rec, "meta": {**rec["meta"], "answer": "3"}}
    assert grade("mathvista", meta3, None) and not grade("mathvista", rec, None)
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("a", "a") == 0


def test_mathvista_breakdowns(mathvista):
    recs = [mathvista["hub"][r["pid"]] for r in MATHVISTA_ROWS]  # 1 2 3 271 310 981 995 506 168
    correct = [True, True, False, True, False, False, True, True, False]
    tables = breakdowns("mathvista", recs, correct)
    assert tables["task"] == {"FQA": {"accuracy": 2 / 3, "n": 3}, "GPS": {"accuracy": 1 / 3, "n": 3},
                              "TQA": {"accuracy": 0.5, "n": 2}, "VQA": {"accuracy": 1.0, "n": 1}}
    assert tables["skill"] == {"ALG": {"accuracy": 1 / 3, "n": 3}, "ARI": {"accuracy": 1.0, "n": 1},
                               "GEO": {"accuracy": 1 / 3, "n": 3}, "NUM": {"accuracy": 1.0, "n": 1},
                               "SCI": {"accuracy": 0.5, "n": 2}, "STA": {"accuracy": 2 / 3, "n": 3}}
    assert tables["question_type"] == {"free_form": {"accuracy": 0.8, "n": 5},
                                       "multi_choice": {"accuracy": 0.25, "n": 4}}
    assert tables["answer_type"]["float"] == {"accuracy": 2 / 3, "n": 3}
    with pytest.raises(ValueError, match=r"9 records but 2 verdicts"):
        breakdowns("mathvista", recs, [True, False])


# ---------------------------------------------------------------- MathVerse

MC_WO = "Please directly answer the question and provide the correct option letter, e.g., A, B, C, D."
MC_COT = ("Please first conduct reasoning, and then answer the question and provide the correct option letter, "
          "e.g., A, B, C, D, at the end.")
FF_WO = "Please directly answer the question and provide the final value, e.g., 1, 2.5, 300."
FF_COT = ("Please first conduct reasoning, and then answer the question and provide the final value, e.g., 1, 2.5, "
          "300, at the end.")
VISION_ONLY = "According to the question shown in the image, please "
Q1 = ("As shown in the figure, in triangle ABC, it is known that angle A = 80.0, angle B = 60.0, point D is on AB "
      "and point E is on AC, DE parallel BC, then the size of angle CED is ()\nChoices:\nA:40°\nB:60°\nC:120°\n"
      "D:140°")
Q440 = ("On the following unit circle, an angle $\\theta$ is formed by a radius and x-axis. Which two of the "
        "following expressions are OPPOSITE of $\\tan (\\theta)$ ?\nChoose 2 answers:\nChoices:\n"
        "A:$\\tan (\\pi+\\theta)$\nB:$\\tan \\left(\\frac{\\pi}{2}-\\theta\\right)$\nC:$\\tan (2 \\pi-\\theta)$\nD:$\\tan (\\pi-\\theta)$")
Q517 = ("Consider the graphs of the functions $y=4^{x}$ and $y=\\left(\\frac{1}{4}\\right)^{x}$. How would you "
        "describe the rate of increase of $y=4^{x}$ ?\nChoices:\nA.$y$ is increasing at a constant rate\nB.$y$ is "
        "increasing at a decreasing rate\nC.$y$ is increasing at an increasing rate")


def verse(index: str, problem: str, version: str, question: str, answer: str, mc: bool, subject: str,
          for_eval: str | None = None) -> dict:
    """A testmini row as the hub ships it (query_wo / query_cot built as the dataset's are)."""
    wo, cot = (MC_WO, MC_COT) if mc else (FF_WO, FF_COT)
    if question:
        query_wo, query_cot = f"{wo}\nQuestion: {question}", f"{cot}\nQuestion: {question}"
    else:  # Vision Only: the question is in the image
        query_wo, query_cot = VISION_ONLY + wo[len("Please "):], VISION_ONLY + cot[len("Please "):]
    return {"sample_index": index, "problem_index": problem, "problem_version": version, "question": question,
            "image": f"images_version_1-4/image_{problem}.png", "answer": answer,
            "question_type": "multi-choice" if mc else "free-form",
            "metadata": {"split": "testmini", "source": "GeoQA", "subject": subject, "subfield": "Angle"},
            "query_wo": query_wo, "query_cot": query_cot, "question_for_eval": for_eval or question}


VERSE_ROWS = [
    verse("1", "1", "Text Dominant", Q1, "D", True, "Plane Geometry"),
    verse("2", "1", "Text Lite", Q1.replace("it is known that angle A = 80.0, angle B = 60.0, ", ""), "D", True,
          "Plane Geometry"),
    verse("5", "1", "Vision Only", "", "D", True, "Plane Geometry", for_eval=Q1),
    verse("3421", "685", "Text Dominant", "A soft drink can has a height of 13 cm and a radius of 3 cm. Find L.",
          "14", False, "Solid Geometry"),
    verse("3424", "685", "Vision Dominant", "Find L.", "14", False, "Solid Geometry"),
    verse("3425", "685", "Vision Only", "", "14", False, "Solid Geometry"),
    verse("351", "351", "Vision Intensive", "Hence find BC in metres. Round your answer to one decimal place.",
          "4.4 m", False, "Plane Geometry"),
    verse("440", "440", "Text Lite", Q440, "C\nD", True, "Plane Geometry"),
    verse("517", "517", "Text Dominant", Q517, "(C)", True, "Functions"),
    verse("900", "900", "Text Lite", "The side is ()\nChoices:\nA. 5 cm\nB. 5 m", "5 cm", True, "Plane Geometry"),
    verse("901", "901", "Text Lite", "Which is x?\nChoices:\n(A) 5\n(B) 6\n(C) 7", "B", True, "Algebra"),
]
VERSE_FEATURES = {"sample_index": STR, "problem_index": STR, "problem_version": STR, "question": STR,
                  "image": datasets.Image(), "answer": STR, "question_type": STR,
                  "metadata": {k: STR for k in ("split", "source", "subject", "subfield")},
                  "query_wo": STR, "query_cot": STR, "question_for_eval": STR}


def write_mathverse_snapshot(folder: Path) -> Path:
    """The hub snapshot's files: testmini.parquet (images embedded), testmini.json (image paths) and
    the text-only version of both (no image)."""
    write_parquet(folder / "testmini.parquet", [{**r, "image": {"bytes": png(), "path": None}} for r in VERSE_ROWS],
                  VERSE_FEATURES)
    for r in VERSE_ROWS:
        (folder / r["image"]).parent.mkdir(parents=True, exist_ok=True)
        (folder / r["image"]).write_bytes(png((10, 200, 10)))
    (folder / "testmini.json").write_text(json.dumps(VERSE_ROWS, indent=4))
    text_only = [{**r, "problem_version": "Text Only", "image": ""} for r in VERSE_ROWS[:1]]
    (folder / "testmini_text_only.json").write_text(json.dumps(text_only, indent=4))
    write_parquet(folder / "testmini_text_only.parquet", [{**r, "image": None} for r in text_only], VERSE_FEATURES)
    return folder


@pytest.fixture(scope="module")
def mathverse(tmp_path_factory) -> dict[str, dict]:
    folder = write_mathverse_snapshot(tmp_path_factory.mktemp("MathVerse"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recs = load_benchmark("mathverse", folder)
    assert [str(w.message) for w in caught if "testmini_text_only" in str(w.message)], "text-only skip not said"
    return by_id(recs)


def test_mathverse_snapshot_loads_every_row_once(mathverse, tmp_path):
    assert list(mathverse) == [r["sample_index"] for r in VERSE_ROWS]  # parquet only: each row once
    assert all(isinstance(r["images"][0], type(mathverse["1"]["images"][0])) for r in mathverse.values())
    assert not isinstance(mathverse["1"]["images"][0], str)  # the parquet copy (embedded bytes), not the JSON's
    vision_only = mathverse["5"]
    assert vision_only["problem"] == "<image>" + VERSE_ROWS[2]["query_wo"] and vision_only["options"] is None
    assert vision_only["answer"] == "D" and vision_only["category"] == "Vision Only"
    meta = vision_only["meta"]
    assert (meta["problem_version"], meta["question_type"], meta["problem_index"], meta["subject"]) == (
        "Vision Only", "multi-choice", "1", "Plane Geometry")
    assert meta["choices"] == ["40°", "60°", "120°", "140°"]  # from question_for_eval, for grading texts
    assert meta["query_cot"] == VERSE_ROWS[2]["query_cot"] and meta["question_for_eval"] == Q1
    # the JSON copy alone (image paths) loads the same rows
    json_only = tmp_path / "json_only"
    write_mathverse_snapshot(json_only)
    (json_only / "testmini.parquet").unlink()
    with pytest.warns(UserWarning, match=r"skipped \['testmini_text_only.json', 'testmini_text_only.parquet'\]"):
        recs = load_benchmark("mathverse", json_only)
    assert [r["id"] for r in recs] == list(mathverse)
    assert recs[0]["images"] == [str(json_only / "images_version_1-4" / "image_1.png")]


def test_mathverse_text_only_is_refused_with_its_reason(tmp_path):
    folder = write_mathverse_snapshot(tmp_path)
    reason = r"Text Only version \(testmini_text_only\) has no images and records need one"
    with pytest.raises(ValueError, match=r"testmini_text_only.json: MathVerse's " + reason):
        load_benchmark("mathverse", folder / "testmini_text_only.json")
    with pytest.raises(ValueError, match=r"split='testmini_text_only': MathVerse's " + reason):
        load_benchmark("mathverse", folder, split="testmini_text_only")
    renamed = tmp_path / "renamed.json"
    (folder / "testmini_text_only.json").rename(renamed)
    with pytest.raises(ValueError, match=r"renamed.json record 0 \(id '1'\): problem_version 'Text Only' with "
                                         r"image '': MathVerse's " + reason):
        load_benchmark("mathverse", renamed)


def test_mathverse_choices_are_recognised_and_listed_once(mathverse):
    assert mathverse_options("Q\nChoices:\nA. 5 cm\nB. 5 m") == ["5 cm", "5 m"]
    expected = {"1": ["40°", "60°", "120°", "140°"], "900": ["5 cm", "5 m"], "901": ["5", "6", "7"]}
    task = VQATask.__new__(VQATask)  # the VQA task's own prompt, without building a data set
    task.pixels, task.prompt_template, task.answer_style = {}, "{problem}", "tag"
    for sid, options in expected.items():
        rec = mathverse[sid]
        assert rec["options"] == options and rec["meta"]["choices"] == options
        prompt = task.context(rec)["prompt"]
        for k, text in enumerate(options):
            assert prompt.count(f"\n{'ABCD'[k]}. {text}") == 1, (sid, prompt)
        assert "A:" not in prompt and "(A)" not in prompt
    assert (mathverse["900"]["answer"], mathverse["517"]["answer"]) == ("A", "C")  # option text / "(C)"
    assert (mathverse["440"]["answer"], mathverse["440"]["options"]) == ("C\nD", None)  # two answers


def test_mathverse_prompt_is_the_query_column(mathverse):
    for row in VERSE_ROWS:
        rec = mathverse[row["sample_index"]]
        assert build_prompt("mathverse", rec) == row["query_cot"]
        assert build_prompt("mathverse", rec, "cot") == row["query_cot"]
        assert build_prompt("mathverse", rec, "direct") == row["query_wo"]
    with pytest.raises(ValueError, match=r"mathverse: unknown prompt style 'w/o'; accepted: \['cot', 'direct'\]"):
        build_prompt("mathverse", mathverse["1"], "w/o")


@pytest.mark.parametrize("sid, reply, right", [
    # multiple choice (gold D = 140°): the letter in its spellings, or the option's text
    ("1", "<answer>D</answer>", True), ("1", "\\boxed{(D)}", True), ("1", "<answer>D:140°</answer>", True),
    ("1", "<answer>140°</answer>", True), ("1", "<answer>C</answer>", False), ("1", "<answer>120°</answer>", False),
    ("2", "Angle CED is 140°, so the answer is D.", True), ("2", "... so the answer is (C) 120°", False),
    # Vision Only rows: the options are in the image
    ("5", "<answer>D</answer>", True), ("5", "<answer>B</answer>", False), ("5", "<answer>140°</answer>", True),
    # free form (gold "14"; "4.4 m" with its unit)
    ("3421", "<answer>14</answer>", True), ("3421", "\\boxed{14.0}", True), ("3421", "<answer>14 cm</answer>", True),
    ("3421", "<answer>15</answer>", False), ("3425", "L = sqrt(205), rounded down the answer is 14.", True),
    ("351", "<answer>4.4</answer>", True), ("351", "<answer>4.4 m</answer>", True),
    ("351", "<answer>4.5</answer>", False), ("351", "<answer>4.4 cm</answer>", False),
    # two answers, "(C)" written as the gold, an option text as the gold
    ("440", "<answer>C, D</answer>", True), ("440", "<answer>C</answer>", False),
    ("517", "<answer>C</answer>", True), ("517", "<answer>A</answer>", False),
    ("900", "<answer>A</answer>", True), ("900", "<answer>5 cm</answer>", True), ("900", "<answer>B</answer>", False),
    ("901", "<answer>(B)</answer>", True), ("901", "<answer>6</answer>", True), ("901", "<answer>5</answer>", False),
])
def test_mathverse_rule_grades(mathverse, sid, reply, right):
    assert asks("mathverse", mathverse[sid], reply) is right


def test_mathverse_breakdown_by_version(mathverse):
    recs = list(mathverse.values())
    correct = [True, False, True, True, True, False, True, False, True, True, False]
    tables = breakdowns("mathverse", recs, correct)
    assert list(tables["problem_version"]) == ["Text Dominant", "Text Lite", "Vision Intensive", "Vision Dominant",
                                               "Vision Only", "All"]
    assert tables["problem_version"] == {
        "Text Dominant": {"accuracy": 1.0, "n": 3}, "Text Lite": {"accuracy": 0.25, "n": 4},
        "Vision Intensive": {"accuracy": 1.0, "n": 1}, "Vision Dominant": {"accuracy": 1.0, "n": 1},
        "Vision Only": {"accuracy": 0.5, "n": 2}, "All": {"accuracy": 7 / 11, "n": 11}}
    assert tables["subject"]["Solid Geometry"] == {"accuracy": 2 / 3, "n": 3}


# ---------------------------------------------------------------- Geometry3K and CLEVR counting

@pytest.fixture(scope="module")
def geometry3k(tmp_path_factory) -> dict[str, dict]:
    hub = tmp_path_factory.mktemp("geometry3k")
    rows = [{"images": [{"bytes": png(), "path": None}], "problem": p, "answer": a} for p, a in (
        ("<image>Find x. Round to the nearest tenth if necessary.", "0.5"),
        ("<image>Find the measure of \\angle 2.", "\\frac{40}{3}"),
        ("<image>Find the perimeter of the figure.", "12 cm"))]
    write_parquet(hub / "data" / "test-00000-of-00001.parquet", rows,
                  {"images": datasets.Sequence(datasets.Image()), "problem": STR, "answer": STR})
    return by_id(load_benchmark("geometry3k", hub))


def test_geometry3k_prompt_is_easyr1_math_template(geometry3k):
    assert build_prompt("geometry3k", geometry3k["0"]) == (
        "Find x. Round to the nearest tenth if necessary. You FIRST think about the reasoning process as an internal "
        "monologue and then provide the final answer. The reasoning process MUST BE enclosed within <think> </think> "
        "tags. The final answer MUST BE put in \\boxed{}.")
    assert geometry3k["1"]["meta"] == {"problem": "<image>Find the measure of \\angle 2.", "answer": "\\frac{40}{3}"}


@pytest.mark.parametrize("rid, reply, right", [
    ("0", "<think>x = 1/2</think> \\boxed{\\frac{1}{2}}", True), ("0", "\\boxed{0.5}", True),
    ("0", "\\boxed{0.6}", False), ("0", "<answer>0.5</answer>", False),  # EasyR1 reads \boxed{} only
    ("1", "\\boxed{40/3}", True), ("1", "\\boxed{13\\frac{1}{3}}", True),  # a mixed number, as math-verify reads it
    ("1", "\\boxed{13.33}", False), ("1", "\\boxed{13\\frac{1}{4}}", False),
    ("1", "\\boxed{\\frac{40}{3}}", True),
    ("2", "\\boxed{12}", True), ("2", "\\boxed{12 cm}", True), ("2", "\\boxed{13}", False),
])
def test_geometry3k_grades_by_math_equality(geometry3k, rid, reply, right):
    assert asks("geometry3k", geometry3k[rid], reply) is right


def test_clevr_count_prompt_and_integer_grading(tmp_path):
    f = write_parquet(tmp_path / "clevr_cogen_a_train" / "data" / "train-00000-of-00001.parquet",
                      [{"image": {"bytes": png(), "path": None}, "problem": "How many items are there in the image?",
                        "solution": "<answer> 3 </answer>"}],
                      {"image": datasets.Image(), "problem": STR, "solution": STR})
    [rec] = load_benchmark("clevr_count", f.parent.parent)
    assert build_prompt("clevr_count", rec) == ("How many items are there in the image?  Output the thinking process "
                                                "in <think> </think> and final answer (number) in <answer> </answer> "
                                                "tags.")
    assert rec["meta"] == {"question": "How many items are there in the image?", "answer": "3"}
    for reply, right in (("<think>1, 2, 3</think><answer>3</answer>", True), ("<answer> 3 </answer>", True),
                         ("<answer>4</answer>", False), ("<answer>three</answer>", False), ("3", False),
                         ("\\boxed{3}", False), ("<answer>3.0</answer>", False)):
        assert asks("clevr_count", rec, reply) is right, reply
    assert breakdowns("clevr_count", [rec], [True]) == {}


# ---------------------------------------------------------------- units and the registry

@pytest.mark.parametrize("gold, pred, verdict", [
    ("12 cm", "12", "correct"), ("12 cm", "12 cm", "correct"), ("12 cm", "12 centimeters", "correct"),
    ("12 cm", "13", "wrong"), ("12 cm", "12 m", "wrong"), ("3 \\text{cm}^2", "3", "correct"),
    ("5 square units", "5", "correct"), ("90 degrees", "90^\\circ", "correct"), ("60°", "60", "correct"),
    ("25%", "0.25", "correct"), ("Area $=9 \\pi \\mathrm{cm}^{2}$", "9\\pi", "correct"),
    ("12 m", "12", "correct"), ("12 m", "12 s", "wrong"),
    ("red", "Red", "correct"), ("red", "blue", "wrong"), ("\\frac{1}{2}", "0.5", "correct"),
])
def test_compare_open_reads_golds_with_units(gold, pred, verdict):
    assert compare_open(pred, gold, MathJudge()) == verdict


def test_registry_names_every_benchmark(mathvista):
    from mmrl.envs.vqa import benchmarks

    assert BENCHMARKS == (*benchmarks.BENCHMARKS, "synthetic", "synthetic_ood")  # every loader, the generated sets
    assert set(VERSIONS) == set(BENCHMARKS)
    assert all("@v" in v for pair in VERSIONS.values() for v in pair)
    with pytest.raises(ValueError, match=r"unknown benchmark 'mmmu'"):
        grade("mmmu", {}, "A")
    with pytest.raises(ValueError, match=r"mathvista record 'x' has no 'meta' dict \(got NoneType\)"):
        build_prompt("mathvista", {"id": "x", "problem": "<image>Q", "answer": "1"})


# ---------------------------------------------------------------- every benchmark from the command line

def test_a_tiny_saved_qwen_vl_evaluates_on_each_benchmark_from_the_command_line(local_inputs, tmp_path, capsys):
    """`mmrl eval --benchmark NAME --model DIR --data PATH`, no config: every row answered, asked
    with the benchmark's own prompt, graded by its grader, with its breakdown tables."""
    from mmrl.cli import main
    from mmrl.envs.vqa.records import IMAGE_TOKEN

    data = {
        "mathvista": write_parquet(tmp_path / "MathVista" / "data" / "testmini-00000-of-00001.parquet",
                                   [{**r, "decoded_image": {"bytes": png(), "path": None}} for r in MATHVISTA_ROWS],
                                   MATHVISTA_FEATURES).parent.parent,
        "mathverse": write_mathverse_snapshot(tmp_path / "MathVerse"),
        "geometry3k": local_inputs.geometry3k_folder(),
        "clevr_count": write_parquet(tmp_path / "clevr" / "train.parquet",
                                     [{"image": {"bytes": png(), "path": None}, "problem": f"How many items? ({i})",
                                       "solution": f"<answer> {i} </answer>"} for i in range(3)],
                                     {"image": datasets.Image(), "problem": STR, "solution": STR}),
    }
    tables = {"mathvista": "task", "mathverse": "problem_version", "geometry3k": None, "clevr_count": None}
    for name, path in data.items():
        out = tmp_path / f"out_{name}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MathVerse's text-only files are skipped with a warning
            assert main(["eval", "--benchmark", name, "--model", local_inputs.tiny_qwen_vl(), "--data", str(path),
                         "--max-new-tokens", "6", "--dtype", "float32", "--device", "cpu", "--output", str(out)]) == 0
        rec = json.loads((out / f"{name}.json").read_text())
        records = load_benchmark(name, path)
        assert rec["n"] == len(records) == len(rec["items"]) and rec["n"] >= 3, name
        sent = [json.loads(line) for line in (out / "replies.jsonl").read_text().splitlines()]
        for r, s in zip(records, sent):
            assert s["prompt"].replace(IMAGE_TOKEN, "") == build_prompt(name, r).replace(IMAGE_TOKEN, "")
            assert s["prompt"].count(IMAGE_TOKEN) == len(r["images"])
        verdicts = [grade(name, r, extract(name, r, s["reply"])) for r, s in zip(records, sent)]
        assert [it["correct"] for it in rec["items"]] == verdicts, name
        assert rec["provenance"]["grader"] == VERSIONS[name][1] and rec["provenance"]["data_sha256"]
        if tables[name]:
            assert sum(c["n"] for c in rec["scores"]["rule"]["breakdowns"][tables[name]].values()) >= len(records)
    assert "mathverse: " in capsys.readouterr().out
