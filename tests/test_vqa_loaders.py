"""VQA record loaders (envs/vqa/records.py, envs/vqa/benchmarks.py): small files written here in each
layout (tiny PNGs made with PIL), checked record by record, and every error's one-line message."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
from PIL import Image  # noqa: E402

from mmrl.envs.vqa.benchmarks import BENCHMARKS, load_benchmark, mathverse_options  # noqa: E402
from mmrl.envs.vqa.records import load_records  # noqa: E402

RED, GREEN, BLUE = (200, 10, 10), (10, 200, 10), (10, 10, 200)


def png(color, size=(3, 2)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def save_png(path: Path, color, size=(3, 2)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png(color, size))
    return path


def pixels(color, size=(3, 2)) -> np.ndarray:
    return np.full((size[1], size[0], 3), color, dtype=np.uint8)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, columns: dict, features: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_dict(columns, features=None if features is None else datasets.Features(features))
    ds.to_parquet(str(path))
    return path


def same_image(got, color, size=(3, 2)):
    assert isinstance(got, np.ndarray) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, pixels(color, size))


# ---------------------------------------------------------------- load_records

def test_jsonl_with_column_map_paths_and_options(tmp_path):
    save_png(tmp_path / "imgs" / "a.png", RED)
    save_png(tmp_path / "imgs" / "b.png", GREEN)
    f = write_jsonl(tmp_path / "qa.jsonl", [
        {"qid": "q1", "question": "How many?", "image": "imgs/a.png", "label": 3, "level": 2,
         "steps": ["count", "add"], "box": "[0, 1, 2, 3]", "why": " three red ones "},
        {"qid": "q2", "question": "Which colour?", "image": str(tmp_path / "imgs" / "b.png"), "label": "green",
         "choices": '["red", "green"]', "topic": "colour"},
    ])
    recs = load_records(f, column_map={"id": "qid", "problem": "question", "images": "image", "answer": "label",
                                       "options": "choices", "difficulty": "level", "key_steps": "steps",
                                       "bbox": "box", "category": "topic", "solution": "why"})
    assert recs == [
        {"id": "q1", "images": [str(tmp_path / "imgs" / "a.png")], "problem": "<image>How many?", "answer": "3",
         "options": None, "solution": "three red ones", "category": "qa", "difficulty": 2, "key_steps": ["count", "add"],
         "bbox": [0.0, 1.0, 2.0, 3.0]},
        {"id": "q2", "images": [str(tmp_path / "imgs" / "b.png")], "problem": "<image>Which colour?",
         "answer": "B", "options": ["red", "green"], "solution": None, "category": "colour", "difficulty": None,
         "key_steps": None,
         "bbox": None},
    ]


def test_json_list_several_images_image_root_and_limit(tmp_path):
    root = tmp_path / "pics"
    for name, c in (("x.png", RED), ("y.png", BLUE), ("z.png", GREEN)):
        save_png(root / name, c)
    f = tmp_path / "data" / "set.json"
    f.parent.mkdir()
    f.write_text(json.dumps([
        {"images": ["x.png", "y.png"], "problem": "Compare <image> with <image>.", "answer": "A",
         "options": ["same", "different"]},
        {"images": "z.png", "problem": "Colour?", "answer": "green"},
        {"images": "x.png", "problem": "Colour?", "answer": "red"},
    ]))
    recs = load_records(f, image_root=root, limit=2)
    assert [r["id"] for r in recs] == ["0", "1"]
    assert recs[0]["images"] == [str(root / "x.png"), str(root / "y.png")]
    assert recs[0]["problem"] == "Compare <image> with <image>." and recs[0]["answer"] == "A"
    assert recs[1]["images"] == [str(root / "z.png")] and recs[1]["problem"] == "<image>Colour?"
    assert recs[1]["options"] is None and recs[1]["category"] == "set"


def test_json_data_field_and_id_keyed_object(tmp_path):
    save_png(tmp_path / "a.png", RED)
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [{"id": 7, "image": "a.png", "problem": "Q?", "answer": "1"}]}, indent=2))
    keyed = tmp_path / "keyed.json"
    keyed.write_text(json.dumps({"k1": {"image": "a.png", "problem": "Q1?", "answer": "1"},
                                 "k2": {"image": "a.png", "problem": "Q2?", "answer": "2"}}, indent=2))
    assert [(r["id"], r["problem"]) for r in load_records(wrapped)] == [("7", "<image>Q?")]
    assert [(r["id"], r["answer"]) for r in load_records(keyed)] == [("k1", "1"), ("k2", "2")]


def test_parquet_image_bytes_decoded(tmp_path):
    f = write_parquet(tmp_path / "g.parquet", {
        "images": [[{"bytes": png(RED), "path": None}], [{"bytes": png(GREEN, (4, 4)), "path": "gone.png"},
                                                          {"bytes": png(BLUE), "path": None}]],
        "problem": ["<image>Find x.", "<image> and <image>: find y."],
        "answer": ["12", "2\\sqrt{3}"]})
    recs = load_records(f)
    same_image(recs[0]["images"][0], RED)
    same_image(recs[1]["images"][0], GREEN, (4, 4))
    same_image(recs[1]["images"][1], BLUE)
    assert [r["problem"] for r in recs] == ["<image>Find x.", "<image> and <image>: find y."]
    assert [r["answer"] for r in recs] == ["12", "2\\sqrt{3}"]


def test_parquet_image_feature_and_raw_bytes(tmp_path):
    f = write_parquet(tmp_path / "feat.parquet",
                      {"image": [Image.open(io.BytesIO(png(BLUE)))], "problem": ["Q"], "answer": ["1"]},
                      {"image": datasets.Image(), "problem": datasets.Value("string"),
                       "answer": datasets.Value("string")})
    same_image(load_records(f)[0]["images"][0], BLUE)
    raw = write_parquet(tmp_path / "raw.parquet", {"pic": [png(GREEN)], "problem": ["Q"], "answer": ["1"]})
    same_image(load_records(raw, column_map={"images": "pic"})[0]["images"][0], GREEN)


def test_folder_splits_and_running_ids(tmp_path):
    def rows(tag):
        return {"images": [[{"bytes": png(RED), "path": None}]] * 2, "problem": [f"{tag} a", f"{tag} b"],
                "answer": ["1", "2"]}

    write_parquet(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet", rows("train"))
    write_parquet(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet", rows("test"))
    recs = load_records(tmp_path / "hub", split="test")
    assert [(r["id"], r["problem"]) for r in recs] == [("0", "<image>test a"), ("1", "<image>test b")]
    with pytest.raises(ValueError, match=r"several splits \['test', 'train'\]; pick one with split"):
        load_records(tmp_path / "hub")
    with pytest.raises(ValueError, match=r"no split 'dev'; the folder's splits are \['test', 'train'\]"):
        load_records(tmp_path / "hub", split="dev")

    save_png(tmp_path / "flat" / "i.png", RED)
    write_jsonl(tmp_path / "flat" / "a.jsonl", [{"image": "i.png", "problem": "p1", "answer": "1"}])
    write_jsonl(tmp_path / "flat" / "b.jsonl", [{"image": "i.png", "problem": "p2", "answer": "2"},
                                                {"image": "i.png", "problem": "p3", "answer": "3"}])
    recs = load_records(tmp_path / "flat")
    assert [(r["id"], r["problem"], r["category"]) for r in recs] == [
        ("0", "<image>p1", "flat"), ("1", "<image>p2", "flat"), ("2", "<image>p3", "flat")]
    assert len(load_records(tmp_path / "flat", limit=2)) == 2


# ---------------------------------------------------------------- load_records errors

def test_record_errors(tmp_path):
    save_png(tmp_path / "a.png", RED)
    (tmp_path / "bad.png").write_bytes(b"not an image")

    def one(row, name="e.jsonl", **kw):
        return load_records(write_jsonl(tmp_path / name, [{"id": "ok", "image": "a.png", "problem": "Q",
                                                           "answer": "1"}, row]), **kw)

    f = re.escape(str(tmp_path / "e.jsonl"))
    with pytest.raises(ValueError, match=rf"^{f} record 1 \(id 'b'\): no answer \(got None\)"):
        one({"id": "b", "image": "a.png", "problem": "Q", "answer": None})
    with pytest.raises(FileNotFoundError, match=rf"^{f} record 1 \(id 'c'\): image 0: image file 'nope.png' not found"):
        one({"id": "c", "image": "nope.png", "problem": "Q", "answer": "1"})
    with pytest.raises(ValueError, match=rf"^{f} record 1 \(id 'd'\): image 0: .*bad.png is not an image PIL can open"):
        one({"id": "d", "image": "bad.png", "problem": "Q", "answer": "1"})
    with pytest.raises(ValueError, match=r"image 0 is a int \(5\); accepted: a file path str"):
        one({"id": "e", "image": 5, "problem": "Q", "answer": "1"}, name="e2.jsonl")
    with pytest.raises(ValueError, match=r"record 1 \(id 'f'\): answer 'C' is neither an option letter \(A-B\) "
                                         r"nor an option text \['x', 'y'\]"):
        one({"id": "f", "image": "a.png", "problem": "Q", "answer": "C", "options": ["x", "y"]})
    with pytest.raises(ValueError, match=r"options 'x, y' is a string but not JSON; accepted: a list"):
        one({"id": "g", "image": "a.png", "problem": "Q", "answer": "A", "options": "x, y"})
    with pytest.raises(ValueError, match=r"problem has 2 <image> placeholders but the record has 1 images"):
        one({"id": "h", "image": "a.png", "problem": "<image><image>Q", "answer": "1"})
    with pytest.raises(ValueError, match=r"bbox \[1, 2\]; accepted: 4 numbers"):
        one({"id": "i", "image": "a.png", "problem": "Q", "answer": "1", "bbox": [1, 2]})
    with pytest.raises(ValueError, match=r"column_map names columns that are not there: \{'problem': 'question'\}; "
                                         r"available columns: \['id', 'image', 'problem', 'answer'\]"):
        one({"id": "j", "image": "a.png", "problem": "Q", "answer": "1"}, column_map={"problem": "question"})
    with pytest.raises(ValueError, match=r"column_map keys \['question'\] are not record keys"):
        one({"id": "k", "image": "a.png", "problem": "Q", "answer": "1"}, column_map={"question": "problem"})
    with pytest.raises(ValueError, match=r"no column for \['answer'\]; map them with column_map"):
        load_records(write_jsonl(tmp_path / "noans.jsonl", [{"image": "a.png", "problem": "Q", "label": "1"}]))


def test_bytes_and_path_errors(tmp_path):
    f = write_parquet(tmp_path / "b.parquet", {"images": [[{"bytes": b"garbage", "path": None}]],
                                                "problem": ["Q"], "answer": ["1"]})
    with pytest.raises(ValueError, match=re.escape(str(f)) + r" record 0 \(id '0'\): image 0: 7 bytes that PIL "
                                                             r"cannot read as an image"):
        load_records(f)
    (tmp_path / "t.tsv").write_text("a\tb\n")
    with pytest.raises(ValueError, match=r"t.tsv: unknown data file type '.tsv'; accepted: a .parquet / .json"):
        load_records(tmp_path / "t.tsv")
    with pytest.raises(FileNotFoundError, match=r"missing: no such file or folder; accepted: a .parquet"):
        load_records(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"empty: folder holds no .parquet / .json / .jsonl / .csv files"):
        load_records(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"split='train' picks files in a folder, but this is one file"):
        load_records(f, split="train")


# ---------------------------------------------------------------- benchmarks

MATHVISTA_FEATURES = {
    "pid": datasets.Value("string"), "question": datasets.Value("string"), "image": datasets.Value("string"),
    "decoded_image": datasets.Image(), "choices": datasets.Sequence(datasets.Value("string")),
    "unit": datasets.Value("string"), "precision": datasets.Value("float64"), "answer": datasets.Value("string"),
    "question_type": datasets.Value("string"), "answer_type": datasets.Value("string"),
    "metadata": {"category": datasets.Value("string"), "grade": datasets.Value("string"),
                 "skills": datasets.Sequence(datasets.Value("string"))},
    "query": datasets.Value("string"),
}


def mathvista_rows(answers=("equal to", "1.5")):
    return {
        "pid": ["1", "2"], "question": ["The derivative at x=2 is ____ that at x=5", "What is the length?"],
        "image": ["images/1.jpg", "images/2.jpg"],
        "decoded_image": [Image.open(io.BytesIO(png(RED))), Image.open(io.BytesIO(png(GREEN)))],
        "choices": [["larger than", "equal to", "smaller than"], None], "unit": [None, "cm"],
        "precision": [None, 1.0], "answer": list(answers), "question_type": ["multi_choice", "free_form"],
        "answer_type": ["text", "float"],
        "metadata": [{"category": "math-targeted-vqa", "grade": "college", "skills": ["algebraic reasoning"]},
                     {"category": "general-vqa", "grade": "high school", "skills": []}],
        "query": ["Hint: ...", "Hint: ..."],
    }


def test_mathvista_hub_parquet(tmp_path):
    hub = tmp_path / "MathVista"
    write_parquet(hub / "data" / "testmini-00000-of-00001-abc.parquet", mathvista_rows(), MATHVISTA_FEATURES)
    write_parquet(hub / "data" / "test-00000-of-00001-def.parquet", mathvista_rows((None, None)), MATHVISTA_FEATURES)
    (hub / "annot_testmini.json").write_text("{}")
    recs = load_benchmark("mathvista", hub)  # testmini by default
    assert [r["id"] for r in recs] == ["1", "2"]
    assert recs[0]["problem"] == ("<image>The derivative at x=2 is ____ that at x=5\nA. larger than\nB. equal to"
                                  "\nC. smaller than")
    assert recs[0]["options"] == ["larger than", "equal to", "smaller than"] and recs[0]["answer"] == "B"
    assert recs[1]["problem"] == "<image>What is the length?" and recs[1]["answer"] == "1.5"
    assert recs[1]["options"] is None
    assert [(r["category"], r["difficulty"]) for r in recs] == [("math-targeted-vqa", "college"),
                                                                 ("general-vqa", "high school")]
    same_image(recs[0]["images"][0], RED)
    same_image(recs[1]["images"][0], GREEN)
    assert len(load_benchmark("mathvista", hub, limit=1)) == 1
    with pytest.raises(ValueError, match=r"test-00000-of-00001-def.parquet record 0 \(id '1'\): no answer "
                                         r"\(got None\); MathVista's test split has none, use testmini"):
        load_benchmark("mathvista", hub, split="test")


def test_mathvista_github_json_keyed_by_pid(tmp_path):
    save_png(tmp_path / "data" / "images" / "1.jpg", BLUE)
    f = tmp_path / "data" / "testmini.json"
    f.write_text(json.dumps({"1": {"pid": "1", "question": "Which is larger?", "image": "images/1.jpg",
                                   "choices": ["(A) x", "(B) y"], "answer": "(B) y", "question_type": "multi_choice",
                                   "answer_type": "text", "unit": None, "precision": None,
                                   "metadata": {"category": "general-vqa", "grade": "daily life"}}}, indent=4))
    [rec] = load_benchmark("mathvista", f)
    assert rec["images"] == [str(tmp_path / "data" / "images" / "1.jpg")]
    assert rec["problem"] == "<image>Which is larger?\nA. (A) x\nB. (B) y"
    assert (rec["answer"], rec["options"], rec["category"]) == ("B", ["(A) x", "(B) y"], "general-vqa")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"3": {"pid": "3", "question": "Q", "image": "data/images/1.jpg", "choices": ["a", "b"],
                                     "answer": "c", "question_type": "multi_choice"}}))
    with pytest.raises(ValueError, match=r"record 0 \(id '3'\): multiple-choice answer 'c' is not one of the "
                                         r"choices \['a', 'b'\]"):
        load_benchmark("mathvista", bad)


def test_mathverse(tmp_path):
    q_mc = ("As shown in the figure, angle A = 80.0, then the size of angle CED is ()\n"
            "Choices:\nA:40°\nB:60°\nC:120°\nD:140°")
    q_vo = ("According to the question shown in the image, please directly answer the question and provide the "
            "correct option letter, e.g., A, B, C, D, at the end.")
    f = write_parquet(tmp_path / "testmini.parquet", {
        "sample_index": ["1", "5", "6"], "problem_index": ["1", "1", "2"],
        "problem_version": ["Text Dominant", "Vision Only", "Text Lite"], "question": [q_mc, q_vo, "Find x."],
        "image": [Image.open(io.BytesIO(png(c))) for c in (RED, GREEN, BLUE)], "answer": ["D", "D", "2\\sqrt{3}"],
        "question_type": ["multi-choice", "multi-choice", "free-form"],
        "metadata": [{"split": "testmini", "source": "GeoQA", "subject": "Plane Geometry", "subfield": "Angle"}] * 3,
        "query_wo": ["..."] * 3, "query_cot": ["..."] * 3, "question_for_eval": ["..."] * 3,
    }, {"sample_index": datasets.Value("string"), "problem_index": datasets.Value("string"),
        "problem_version": datasets.Value("string"), "question": datasets.Value("string"), "image": datasets.Image(),
        "answer": datasets.Value("string"), "question_type": datasets.Value("string"),
        "metadata": {k: datasets.Value("string") for k in ("split", "source", "subject", "subfield")},
        "query_wo": datasets.Value("string"), "query_cot": datasets.Value("string"),
        "question_for_eval": datasets.Value("string")})
    recs = load_benchmark("mathverse", f)
    assert [(r["id"], r["category"], r["answer"]) for r in recs] == [
        ("1", "Text Dominant", "D"), ("5", "Vision Only", "D"), ("6", "Text Lite", "2\\sqrt{3}")]
    # the option lines are written "A. 40°", as the VQA task recognises listed options (not shown twice)
    assert recs[0]["problem"] == "<image>" + q_mc.replace("A:", "A. ").replace("B:", "B. ").replace(
        "C:", "C. ").replace("D:", "D. ") and recs[0]["options"] == ["40°", "60°", "120°", "140°"]
    assert recs[1]["options"] is None and recs[2]["options"] is None
    for r, c in zip(recs, (RED, GREEN, BLUE)):
        same_image(r["images"][0], c)

    save_png(tmp_path / "j" / "images_version_5" / "image_2.png", RED)
    j = tmp_path / "j" / "testmini.json"
    j.write_text(json.dumps([{"sample_index": "9", "problem_index": "2", "problem_version": "Vision Dominant",
                              "question": "Angle 2 is ()\nChoices:\nA:50°\nB:60°",
                              "image": "images_version_5/image_2.png", "answer": "B",
                              "question_type": "multi-choice", "metadata": {"split": "testmini"}}]))
    [rec] = load_benchmark("mathverse", j)
    assert rec["images"] == [str(tmp_path / "j" / "images_version_5" / "image_2.png")]
    assert (rec["options"], rec["answer"], rec["category"]) == (["50°", "60°"], "B", "Vision Dominant")


def test_mathverse_options_parser():
    assert mathverse_options("Q\nChoice:\nA.5 cm\nB.5 m") == ["5 cm", "5 m"]
    assert mathverse_options("Q\nChoices:\n(A) 1\n(B) 2\n(C) 3\nExplain.") == ["1", "2", "3"]
    assert mathverse_options("Q\nChoices:\nB:1\nC:2") is None
    assert mathverse_options("Q without choices") is None


def test_geometry3k_hub_folder(tmp_path):
    hub = tmp_path / "geometry3k"
    for split, color in (("train", RED), ("validation", GREEN), ("test", BLUE)):
        write_parquet(hub / "data" / f"{split}-00000-of-00001.parquet",
                      {"images": [[Image.open(io.BytesIO(png(color)))]], "problem": [f"<image>Find x ({split})."],
                       "answer": ["3"]},
                      {"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
                       "answer": datasets.Value("string")})
    [rec] = load_benchmark("geometry3k", hub)
    assert (rec["id"], rec["problem"], rec["answer"], rec["category"]) == ("0", "<image>Find x (test).", "3",
                                                                           "geometry")
    same_image(rec["images"][0], BLUE)
    [rec] = load_benchmark("geometry3k", hub, split="train")
    assert rec["problem"] == "<image>Find x (train)."
    same_image(rec["images"][0], RED)


def test_clevr_count_r1v_parquet(tmp_path):
    f = write_parquet(tmp_path / "clevr_cogen_a_train" / "data" / "train-00000-of-00001.parquet", {
        "image": [{"bytes": png(RED), "path": None}, {"bytes": png(GREEN), "path": None}],
        "problem": ["How many items are there in the image?"] * 2,
        "solution": ["<answer> 3 </answer>", "<answer>10</answer>"]})
    recs = load_benchmark("clevr_count", f.parent.parent)
    assert [(r["id"], r["problem"], r["answer"], r["category"]) for r in recs] == [
        ("0", "<image>How many items are there in the image?", "3", "counting"),
        ("1", "<image>How many items are there in the image?", "10", "counting")]
    same_image(recs[1]["images"][0], GREEN)
    bad = write_parquet(tmp_path / "bad.parquet", {"image": [{"bytes": png(RED), "path": None}], "problem": ["Q"],
                                                   "solution": ["<answer> three </answer>"]})
    with pytest.raises(ValueError, match=r"bad.parquet record 0: solution '<answer> three </answer>' holds no "
                                         r"integer count"):
        load_benchmark("clevr_count", bad)


def test_clevr_count_original_layout(tmp_path):
    clevr = tmp_path / "CLEVR_v1.0"
    save_png(clevr / "images" / "val" / "CLEVR_val_000000.png", RED)
    save_png(clevr / "images" / "val" / "CLEVR_val_000001.png", BLUE)

    def q(i, img, text, ans):
        return {"split": "val", "image_index": img, "image_filename": f"CLEVR_val_00000{img}.png",
                "question_index": i, "question": text, "answer": ans, "question_family_index": 1,
                "program": [{"inputs": [], "function": "scene", "value_inputs": []}]}

    f = clevr / "questions" / "CLEVR_val_questions.json"
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps({"info": {"split": "val", "version": "1.0"}, "questions": [
        q(0, 0, "How many cubes are there?", "3"),
        q(1, 0, "Is the sphere red?", "yes"),
        q(2, 1, "What number of cylinders are left of the cube?", "0"),
        q(3, 1, "Are there more cubes than spheres?", "no"),
        q(4, 1, "How many red things are there?", "2")]}))
    recs = load_benchmark("clevr_count", f)
    assert [(r["id"], r["problem"], r["answer"], r["category"]) for r in recs] == [
        ("val-0", "<image>How many cubes are there?", "3", "counting"),
        ("val-2", "<image>What number of cylinders are left of the cube?", "0", "counting"),
        ("val-4", "<image>How many red things are there?", "2", "counting")]
    assert recs[0]["images"] == [str(clevr / "images" / "val" / "CLEVR_val_000000.png")]
    assert recs[1]["images"] == [str(clevr / "images" / "val" / "CLEVR_val_000001.png")]
    assert [r["id"] for r in load_benchmark("clevr_count", f, limit=2)] == ["val-0", "val-2"]
    moved = tmp_path / "elsewhere"
    (clevr / "images" / "val").rename(moved)
    assert load_benchmark("clevr_count", f, image_root=moved, limit=1)[0]["images"] == [
        str(moved / "CLEVR_val_000000.png")]
    with pytest.raises(FileNotFoundError, match=r"record 0: image 'CLEVR_val_000000.png' is in none of .*; "
                                                r"pass image_root="):
        load_benchmark("clevr_count", f)


def test_benchmark_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown benchmark 'mmmu'; known: \['mathvista', 'mathverse', "
                                         r"'geometry3k', 'clevr_count'\]"):
        load_benchmark("mmmu", tmp_path)
    assert BENCHMARKS == ("mathvista", "mathverse", "geometry3k", "clevr_count")
    f = write_jsonl(tmp_path / "x.jsonl", [{"image": "a.png", "problem": "Q", "answer": "1"}])
    with pytest.raises(ValueError, match=r"x.jsonl: not the mathvista layout: no column \['pid', 'question', "
                                         r"'question_type', 'choices'\]; available columns: \['image', 'problem', "
                                         r"'answer'\]"):
        load_benchmark("mathvista", f)
