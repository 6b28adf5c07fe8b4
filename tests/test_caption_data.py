"""Captioning data: the scene generator (determinism, disjoint splits, answerable questions), the
CapRL-QA loader on a tiny dataset written to disk, and the with/without-image QA filter."""

import json

import numpy as np
import pytest
from mmrl.envs import make_task
from mmrl.envs.captioning.data import load_qa_dataset, normalise_qa, write_qa_dataset
from mmrl.envs.captioning.filter import filter_qa, synthetic_records
from mmrl.envs.captioning.filter import main as filter_main
from mmrl.envs.captioning.scenes import (
    Scene,
    answer_query,
    caption_of,
    make_questions,
    make_scene,
    parse_caption,
    parse_question,
    render,
)

from mmrl.rewards.captioning.judges import LETTERS


def test_generator_is_deterministic_and_renders_what_it_says():
    a = make_scene(np.random.default_rng(7), max_objects=4, glyph_prob=0.5)
    b = make_scene(np.random.default_rng(7), max_objects=4, glyph_prob=0.5)
    assert a == b and np.array_equal(render(a), render(b))
    img = render(a)
    assert img.shape == (56, 56, 3) and img.dtype == np.uint8
    # Every object's cell holds its colour; every empty cell is plain background.
    occupied = {(o.row, o.col) for o in a.objects}
    for r in range(2):
        for c in range(2):
            cell = img[r * 28:(r + 1) * 28, c * 28:(c + 1) * 28].reshape(-1, 3)
            assert (len(np.unique(cell, axis=0)) > 1) == ((r, c) in occupied)
    big = make_scene(np.random.default_rng(0), grid=3, cell_px=20, max_objects=9)
    assert render(big).shape == (60, 60, 3)
    with pytest.raises(ValueError, match="grid must be one of"):
        make_scene(np.random.default_rng(0), grid=5)


def test_questions_are_answerable_from_the_true_caption_only():
    rng = np.random.default_rng(1)
    for _ in range(50):
        scene = make_scene(rng, max_objects=4, glyph_prob=0.3)
        for style in ("cells", "objects"):
            objs = parse_caption(caption_of(scene, style), scene.grid)
            for qa in make_questions(scene, rng):
                assert qa["answer"] in qa["choices"] and len(set(qa["choices"])) == len(qa["choices"])
                kind, args = parse_question(qa["question"])
                assert kind == qa["kind"]
                assert answer_query(kind, args, objs, scene.grid) == qa["answer"], (qa, caption_of(scene, style))
                assert answer_query(kind, args, [], scene.grid) is None


def test_task_splits_are_disjoint_and_the_stream_resumes():
    task = make_task("caption", seed=3, n_test=100, max_objects=2)
    test_captions = {c["target"] for c in task.eval_batch(100)}
    train = task.next_batch(300)
    assert not test_captions & {c["target"] for c in train}
    assert task.eval_batch(5)[0]["uid"] == "test/0" and all(c["qa"] for c in train)
    state = task.state_dict()
    nxt = task.next_batch(3)
    again = make_task("caption", seed=3, n_test=100, max_objects=2)
    again.load_state_dict(state)
    assert [c["target"] for c in again.next_batch(3)] == [c["target"] for c in nxt]
    other = make_task("caption", seed=4, n_test=100, max_objects=2)
    assert [c["target"] for c in other.eval_batch(20)] != [c["target"] for c in task.eval_batch(20)]
    with pytest.raises(ValueError, match="caption_style.*valid: cells, objects"):
        make_task("caption", seed=0, caption_style="poem")
    with pytest.raises(ValueError, match="source.*valid: synthetic, folder"):
        make_task("caption", seed=0, source="web")


def test_terse_sft_captions_drop_size_and_colour():
    scene = make_scene(np.random.default_rng(5), min_objects=2, max_objects=2)
    full, terse = caption_of(scene), caption_of(scene, terse=[True, False])
    a, b = scene.objects
    assert f"{a.size} {a.colour} {a.noun}" in full and f"{a.size} {a.colour}" not in terse and a.noun in terse
    assert f"{b.size} {b.colour} {b.noun}" in terse
    task = make_task("caption", seed=0, n_test=10, sft_terse_prob=1.0)
    for c in task.sft_batch(20, np.random.default_rng(0)):
        assert not any(w in c["target"].split() for w in ("red", "green", "blue", "yellow", "small", "large"))
    task = make_task("caption", seed=0, n_test=10, sft_terse_prob=0.0)
    assert all(c["target"] == caption_of(Scene.from_dict(c["scene"])) for c in task.sft_batch(5, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="sft_terse_prob must be in"):
        make_task("caption", seed=0, sft_terse_prob=2)


def test_loader_reads_a_caprl_qa_folder_and_a_jsonl_file(tmp_path):
    records = synthetic_records(5, seed=0)
    folder = write_qa_dataset(records, tmp_path / "set")
    back = load_qa_dataset(folder)
    assert len(back) == 5
    by_id = {r["id"]: r for r in back}
    for rec in records:
        got = by_id[rec["id"]]
        assert np.array_equal(got["image"], rec["image"])
        assert [q["answer"] for q in got["qa"]] == [q["answer"] for q in rec["qa"]]
        assert got["caption"] == rec["caption"]
    # A single JSONL file with image paths and answers given as letters and indices.
    rows = [{"image": "set/images/000000.png", "qa": [
        {"question": "What colour?", "choices": ["red", "blue"], "answer": "B"},
        {"question": "How many?", "choices": ["1", "2", "3"], "answer": 0}]}]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (rec,) = load_qa_dataset(tmp_path / "data.jsonl")
    assert [q["answer"] for q in rec["qa"]] == ["blue", "1"] and rec["image"].shape == (56, 56, 3)
    # The task reads it too (folder source, last share held out).
    task = make_task("caption", seed=0, source="folder", data_path=str(folder), test_fraction=0.4)
    assert len(task.eval_batch(10)) == 2 and len(task.next_batch(4)) == 4
    assert task.sft_batch(2, np.random.default_rng(0))[0]["target"]


def test_loader_errors_name_the_bad_value(tmp_path):
    with pytest.raises(ValueError, match=r"answer 'Z' is none of the choices \['a', 'b'\]"):
        normalise_qa({"question": "q", "choices": ["a", "b"], "answer": "Z"}, "row 0")
    with pytest.raises(ValueError, match="lacks \\['choices'\\]"):
        normalise_qa({"question": "q", "answer": "a"}, "row 0")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown data file type '.csv'"):
        load_qa_dataset(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_qa_dataset(tmp_path / "missing")


class FakeAnswerer:
    """Deterministic: question i is answered correctly in `with_hits[i]` of 4 trials with its image
    and `without_hits[i]` of 4 without (trials are counted per question and mode)."""

    def __init__(self, with_hits, without_hits):
        self.hits = {True: with_hits, False: without_hits}
        self.seen: dict = {}

    def answer(self, images, questions, options):
        out = []
        for im, q, opts in zip(images, questions, options):
            key = (q, im is not None)
            n = self.seen[key] = self.seen.get(key, 0) + 1
            i = int(q.split()[-1])
            right = n <= self.hits[im is not None][i]
            ans = "yes" if right else "no"
            out.append(LETTERS[opts.index(ans)])
        return out


def test_qa_filter_thresholds_are_strict():
    image = np.zeros((8, 8, 3), np.uint8)
    qa = [{"question": f"q {i}", "choices": ["yes", "no", "maybe"], "answer": "yes"} for i in range(5)]
    records = [{"id": "0", "image": image, "qa": qa}]
    # with-image hits of 4, without-image hits of 4: keep iff with > 0.75 and without < 0.25.
    ans = FakeAnswerer(with_hits=[4, 3, 4, 4, 4], without_hits=[0, 0, 1, 0, 4])
    kept, stats = filter_qa(records, ans, trials=4)
    assert [q["question"] for q in kept[0]["qa"]] == ["q 0", "q 3"]
    assert stats["failed_with_image"] == 1 and stats["leaky_without_image"] == 2 and stats["kept"] == 2
    # Looser thresholds keep more.
    kept, _ = filter_qa(records, FakeAnswerer([4, 3, 4, 4, 4], [0, 0, 1, 0, 4]), trials=4, with_image_min=0.5,
                        without_image_max=0.5)
    assert [q["question"] for q in kept[0]["qa"]] == ["q 0", "q 1", "q 2", "q 3"]
    # A record left with no question is dropped.
    kept, stats = filter_qa(records, FakeAnswerer([0] * 5, [0] * 5), trials=4)
    assert kept == [] and stats["records_out"] == 0
    with pytest.raises(ValueError, match="thresholds must be in"):
        filter_qa(records, ans, with_image_min=1.5)


def test_filter_command_writes_a_synthetic_set(tmp_path):
    assert filter_main(["--synthetic", "3", str(tmp_path / "syn")]) == 0
    assert len(load_qa_dataset(tmp_path / "syn")) == 3


def test_a_parameter_the_source_does_not_read_is_refused_at_load():
    from mmrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"task.params.data_path: not read by source 'synthetic'"):
        load_config("configs/caption_grpo.yaml", ["task.params.data_path=captions.jsonl"])
    with pytest.raises(ConfigError, match=r"task.params.cell_px: not read by source 'folder'"):
        load_config("configs/caption_grpo.yaml", ["task.params.source=folder", "task.params.data_path=c.jsonl",
                                                  "task.params.cell_px=20"])
