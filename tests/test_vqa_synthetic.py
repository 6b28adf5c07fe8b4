"""The procedural VQA set: determinism, splits, record validity, and answers that agree with the pixels.

The scene checks re-derive each answer from the image alone (connected components of the palette
colours, bar heights over the gridlines, the rectangle's outline), so a drawing that drifts from the
question's answer fails here.
"""

import re
import time
from collections import Counter

import numpy as np
import pytest

from mmrl.envs.vqa import synthetic as syn
from mmrl.envs.vqa.synthetic import CATEGORIES, COLOURS, generate, make_splits, record_key

NUMBER = re.compile(r"^-?\d+(\.\d+)?$|^\d+/\d+$")
KEYS = {"id", "images", "problem", "answer", "options", "category", "difficulty", "key_steps", "solution", "bbox"}


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x["id"] == y["id"] and record_key(x) == record_key(y) and x["answer"] == y["answer"]
        and x["key_steps"] == y["key_steps"] and x["solution"] == y["solution"] and x["options"] == y["options"]
        for x, y in zip(a, b))


# ----------------------------------------------------------------------------- pixel parsing


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean mask, as (N, 2) arrays of (row, col)."""
    seen = np.zeros_like(mask, dtype=bool)
    out = []
    h, w = mask.shape
    for r0, c0 in zip(*np.nonzero(mask)):
        if seen[r0, c0]:
            continue
        stack, pix = [(r0, c0)], []
        seen[r0, c0] = True
        while stack:
            r, c = stack.pop()
            pix.append((r, c))
            for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= rr < h and 0 <= cc < w and mask[rr, cc] and not seen[rr, cc]:
                    seen[rr, cc] = True
                    stack.append((rr, cc))
        out.append(np.array(pix))
    return out


def _parse_objects(image: np.ndarray) -> list[dict]:
    """Every palette-coloured blob: its colour, shape (from how much of its box it fills) and box centre."""
    objs = []
    for name, rgb in COLOURS.items():
        for pix in _components((image == np.array(rgb, dtype=np.uint8)).all(-1)):
            r0, c0 = pix.min(0)
            r1, c1 = pix.max(0)
            fill = len(pix) / ((r1 - r0 + 1) * (c1 - c0 + 1))
            shape = "square" if fill > 0.92 else "circle" if fill > 0.65 else "triangle"
            objs.append({"colour": name, "shape": shape, "x": (c0 + c1) / 2, "y": (r0 + r1) / 2})
    return objs


TOL = 3  # px: objects of one grid column (row) share a centre; different ones are >= 14 px apart


def _holds(a: dict, rel: str, b: dict) -> bool:
    return {"left of": b["x"] - a["x"], "right of": a["x"] - b["x"], "above": b["y"] - a["y"],
            "below": a["y"] - b["y"]}[rel] > TOL


def _find(objs: list[dict], colour: str, shape: str) -> dict:
    hits = [o for o in objs if o["colour"] == colour and o["shape"] == shape]
    assert len(hits) == 1, (colour, shape, hits)
    return hits[0]


def _target(words: str):
    """ "circles" / "red objects" / "red circles" -> a predicate on parsed objects."""
    parts = words.split()
    if len(parts) == 1:
        return lambda o: o["shape"] + "s" == parts[0]
    if parts[1] == "objects":
        return lambda o: o["colour"] == parts[0]
    return lambda o: o["colour"] == parts[0] and o["shape"] + "s" == parts[1]


def _count_from_image(problem: str, image: np.ndarray) -> int:
    objs = _parse_objects(image)
    q = problem.removeprefix("<image>")
    m = re.fullmatch(r"How many (.+?) are there\?", q)
    if m:
        return sum(map(_target(m.group(1)), objs))
    m = re.fullmatch(r"How many (.+?) are (left of|right of|above|below) the (\w+) (\w+)\?", q)
    assert m, q
    ref = _find(objs, m.group(3), m.group(4))
    match = _target(m.group(1))
    return sum(match(o) and o is not ref and _holds(o, m.group(2), ref) for o in objs)


def _spatial_from_image(problem: str, options: list[str], image: np.ndarray) -> str:
    objs = _parse_objects(image)
    q = problem.removeprefix("<image>").split("\n")[0]
    extremes = {"left-most": ("x", min), "right-most": ("x", max), "top-most": ("y", min), "bottom-most": ("y", max)}

    def extreme(which: str) -> dict:
        key, fn = extremes[which]
        best = fn(o[key] for o in objs)
        winners = [o for o in objs if abs(o[key] - best) <= TOL]
        assert len(winners) == 1, (which, winners)
        return winners[0]

    def yes_no(a: dict, rel: str, b: dict) -> str:
        key = "x" if rel in ("left of", "right of") else "y"
        assert abs(a[key] - b[key]) > TOL, "relation asked between objects on one line"
        return "A" if _holds(a, rel, b) else "B"

    m = re.fullmatch(r"Is the (\w+) (\w+) (left of|right of|above|below) the (\w+) (\w+)\?", q)
    if m:
        return yes_no(_find(objs, m.group(1), m.group(2)), m.group(3), _find(objs, m.group(4), m.group(5)))
    m = re.fullmatch(r"Is the (\S+) object (left of|right of|above|below) the (\w+) (\w+)\?", q)
    if m:
        return yes_no(extreme(m.group(1)), m.group(2), _find(objs, m.group(3), m.group(4)))
    m = re.fullmatch(r"Which object is the (\S+)\?", q)
    assert m, q
    w = extreme(m.group(1))
    return "ABCD"[options.index(f"{w['colour']} {w['shape']}")]


def _bars_from_image(image: np.ndarray) -> tuple[list[tuple[str, int]], int]:
    """(colour name, value) of each bar left to right, and the unit in px, read off axes and gridlines."""
    ink = (image == np.array(syn.INK, dtype=np.uint8)).all(-1)
    base = int(np.argmax(ink.sum(1)))  # the x axis: the longest ink row
    axis = int(np.argmax(ink.sum(0)))  # the y axis
    grid_col = image[:base, axis + 1]
    is_grid = ((grid_col == syn.GRID_GREY).all(-1) | (grid_col == syn.GRID_DARK).all(-1))
    rows = np.nonzero(is_grid)[0]
    unit = base - int(rows.max())
    assert np.all(np.diff(rows[::-1]) == -unit), "gridlines are not evenly spaced"
    row = image[base - 1]
    names = {tuple(v): k for k, v in COLOURS.items()}
    bars, x = [], 0
    while x < row.shape[0]:
        c = tuple(int(v) for v in row[x])
        if c in names:
            x1 = x
            while x1 + 1 < row.shape[0] and tuple(int(v) for v in row[x1 + 1]) == c:
                x1 += 1
            col = image[:base, (x + x1) // 2]
            top = int(np.nonzero((col == np.array(c, dtype=np.uint8)).all(-1))[0].min())
            assert (base - top) % unit == 0, "bar height is not a whole number of units"
            bars.append((names[c], (base - top) // unit))
            x = x1 + 1
        else:
            x += 1
    return bars, unit


def _chart_from_image(rec: dict) -> str:
    bars, _ = _bars_from_image(rec["images"][0])
    letters = len({name for name, _ in bars}) == 1  # one colour: bars are named by the letters under them
    values = {(chr(ord("A") + i) if letters else name): v for i, (name, v) in enumerate(bars)}
    assert len(values) == len(bars)
    q = rec["problem"].removeprefix("<image>").split("\n")[0]
    nm = r"(?:the )?(?:bar )?(\w+)(?: bar)?"
    if m := re.fullmatch(rf"What is the value of {nm}\?", q):
        return str(values[m.group(1)])
    if m := re.fullmatch(r"What is the sum of (?:bars (\w) and (\w)|the (\w+) and (\w+) bars)\?", q):
        a, b = [g for g in m.groups() if g]
        return str(values[a] + values[b])
    if m := re.fullmatch(rf"How much taller is {nm} than {nm}\?", q):
        return str(values[m.group(1)] - values[m.group(2)])
    if q == "What is the difference between the tallest and the shortest bar?":
        return str(max(values.values()) - min(values.values()))
    if q == "What is the total of all the bars?":
        return str(sum(values.values()))
    m = re.fullmatch(r"Which bar is the (tallest|shortest)\?", q)
    assert m, q
    pick = (max if m.group(1) == "tallest" else min)(values, key=values.get)
    return "ABCD"[rec["options"].index(f"bar {pick}" if letters else pick)]


# ----------------------------------------------------------------------------- determinism and sets


def test_same_seed_same_records_other_seed_other_records():
    a, b = generate(24, seed=3), generate(24, seed=3)
    assert _same(a, b)
    c = generate(24, seed=4)
    assert sum(record_key(x) == record_key(y) for x, y in zip(a, c)) < 3


def test_records_do_not_depend_on_n():
    assert _same(generate(8, seed=5, image_size=56), generate(20, seed=5, image_size=56)[:8])


def test_generate_balances_categories_and_difficulties_with_unique_ids():
    recs = generate(48, seed=0, difficulties=(1, 2, 3))
    counts = Counter((r["category"], r["difficulty"]) for r in recs)
    assert set(counts) == {(c, d) for c in CATEGORIES for d in (1, 2, 3)}
    assert set(counts.values()) == {4}
    assert len({r["id"] for r in recs}) == len(recs)
    assert generate(0, seed=0) == []


def test_splits_disjoint_and_ood_held_out():
    sp = make_splits(seed=1, n_train=64, n_test=32, n_ood=16, categories=CATEGORIES, image_size=56)
    assert [len(sp[k]) for k in ("train", "test", "ood")] == [64, 32, 16]
    train_keys = {record_key(r) for r in sp["train"]}
    assert not any(record_key(r) in train_keys for r in sp["test"])
    assert {r["difficulty"] for r in sp["train"]} == {r["difficulty"] for r in sp["test"]} == {1, 2}
    assert {r["difficulty"] for r in sp["ood"]} == {3}
    ids = [r["id"] for split in sp.values() for r in split]
    assert len(set(ids)) == len(ids)
    assert _same(sp["train"], generate(64, seed=1, image_size=56))


def test_test_split_avoids_train_even_when_the_level_is_small():
    # Two objects on a 2x2 grid: a few hundred distinct questions, so independent draws collide.
    kw = dict(categories=("spatial",), image_size=32)
    train = generate(400, seed=2, difficulties=(1,), **kw)
    train_keys = {record_key(r) for r in train}
    naive = generate(100, seed=99, difficulties=(1,), **kw)
    assert any(record_key(r) in train_keys for r in naive)  # the situation the split must handle
    sp = make_splits(seed=2, n_train=400, n_test=100, n_ood=0, train_difficulties=(1,), **kw)
    assert _same(sp["train"], train)
    assert not any(record_key(r) in train_keys for r in sp["test"])


# ----------------------------------------------------------------------------- record validity


@pytest.mark.parametrize("category", CATEGORIES)
def test_every_category_makes_valid_records(category):
    for size in (56, 112):
        for r in generate(40, seed=7, categories=(category,), difficulties=(1, 2, 3, 4, 5), image_size=size):
            assert set(r) == KEYS
            assert r["category"] == category and r["bbox"] is None
            assert r["images"] and all(im.dtype == np.uint8 and im.shape == (size, size, 3) for im in r["images"])
            assert r["problem"].startswith("<image>") and r["problem"].count("<image>") == len(r["images"])
            assert isinstance(r["answer"], str) and r["answer"]
            if r["options"] is not None:
                letters = "ABCD"[: len(r["options"])]
                assert 2 <= len(r["options"]) <= 4 and r["answer"] in letters
                assert len(set(r["options"])) == len(r["options"])
                for letter, opt in zip(letters, r["options"]):
                    assert f"\n{letter}. {opt}" in r["problem"]
            else:
                assert NUMBER.match(r["answer"]), r["answer"]
            assert r["key_steps"] and all(isinstance(s, str) and s for s in r["key_steps"])
            assert r["solution"].endswith(f"The answer is {r['answer']}.")


def test_key_steps_appear_in_the_solution_in_order():
    for r in generate(200, seed=11, difficulties=(1, 2, 3, 4), image_size=56):
        pos = 0
        for step in r["key_steps"]:
            at = r["solution"].find(step, pos)
            assert at >= 0, (r["id"], step, r["solution"])
            pos = at + len(step)


def test_geometry_answers_follow_from_the_marked_values():
    for r in generate(120, seed=13, categories=("geometry",), difficulties=(1, 2, 3, 4), image_size=56):
        q, v = r["problem"], [float(s) for s in r["key_steps"]]
        ans = float(r["answer"])
        if "area of the rectangle" in q:
            assert ans == v[0] * v[1]
        elif "perimeter of the rectangle" in q:
            assert ans == 2 * (v[0] + v[1])
        elif "right triangle" in q:
            assert ans == v[0] * v[1] / 2
        elif "perimeter of the triangle" in q:
            assert ans == v[0] + v[1] + v[2]
        else:
            total = 180 if "triangle" in q else 360
            n_known = 2 if total == 180 else 3
            assert ans == total - sum(v[:n_known]) and ans > 0


def test_counting_answers_are_not_one_value():
    # A set where one count dominates teaches a small model the prior instead of counting.
    recs = generate(400, seed=17, categories=("counting",), difficulties=(1, 2), image_size=56)
    shares = Counter(r["answer"] for r in recs)
    assert max(shares.values()) < 0.4 * len(recs) and len(shares) >= 4


# ----------------------------------------------------------------------------- answers agree with the pixels


def test_counting_scenes_with_fixed_rng_are_drawn_as_answered():
    # Hand-checked: rng 1 asks "How many yellow objects are there?" over a 2x2 grid holding two.
    rec = syn.make_counting(np.random.default_rng(1), 1, 112)
    assert rec["problem"] == "<image>How many yellow objects are there?" and rec["answer"] == "2"
    img = rec["images"][0]
    blobs = _components((img == np.array(COLOURS["yellow"], dtype=np.uint8)).all(-1))
    assert len(blobs) == 2 and all(len(b) > 200 for b in blobs)  # two whole shapes, not specks
    # rng 0 asks for triangles: two blobs fill about half their bounding box.
    rec = syn.make_counting(np.random.default_rng(0), 1, 112)
    assert rec["problem"] == "<image>How many triangles are there?" and rec["answer"] == "2"
    assert sum(o["shape"] == "triangle" for o in _parse_objects(rec["images"][0])) == 2


def test_colour_counts_equal_the_number_of_blobs():
    checked = 0
    for r in generate(80, seed=3, categories=("counting",), difficulties=(1, 2), image_size=56):
        m = re.fullmatch(r"<image>How many (\w+) objects are there\?", r["problem"])
        if m:
            mask = (r["images"][0] == np.array(COLOURS[m.group(1)], dtype=np.uint8)).all(-1)
            assert len(_components(mask)) == int(r["answer"]), r["id"]
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_counting_answers_match_the_image(difficulty):
    for r in generate(24, seed=19, categories=("counting",), difficulties=(difficulty,), image_size=112):
        assert _count_from_image(r["problem"], r["images"][0]) == int(r["answer"]), r["id"]


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_spatial_answers_match_the_image(difficulty):
    for r in generate(24, seed=23, categories=("spatial",), difficulties=(difficulty,), image_size=112):
        assert _spatial_from_image(r["problem"], r["options"], r["images"][0]) == r["answer"], r["id"]


@pytest.mark.parametrize("size", [56, 112])
def test_chart_answers_match_the_bar_heights(size):
    for r in generate(40, seed=29, categories=("chart",), difficulties=(1, 2, 3, 4), image_size=size):
        assert _chart_from_image(r) == r["answer"], (r["id"], r["problem"])


def test_rectangles_are_drawn_with_the_marked_proportions():
    checked = 0
    for r in generate(60, seed=31, categories=("geometry",), difficulties=(1,), image_size=112):
        w, h = int(r["key_steps"][0]), int(r["key_steps"][1])
        if max(w, h) / min(w, h) > 3:  # drawn clamped to 1:3 so labels fit; not to scale
            continue
        ink = (r["images"][0] == np.array(syn.INK, dtype=np.uint8)).all(-1)
        rows, cols = ink.sum(1), ink.sum(0)
        edge_rows = np.nonzero(rows >= 0.8 * rows.max())[0]  # top and bottom edges, not label glyphs
        edge_cols = np.nonzero(cols >= 0.8 * cols.max())[0]
        ratio = (edge_cols.max() - edge_cols.min()) / (edge_rows.max() - edge_rows.min())
        assert ratio == pytest.approx(w / h, rel=0.12), (r["id"], w, h)
        checked += 1
    assert checked >= 20


def test_geometry_labels_stay_inside_the_image():
    for r in generate(200, seed=37, categories=("geometry",), difficulties=(1, 2, 3, 4), image_size=56):
        im = r["images"][0]
        frame = np.concatenate([im[0], im[-1], im[:, 0], im[:, -1]])
        assert (frame == np.array(syn.BACKGROUND, dtype=np.uint8)).all(), r["id"]


# ----------------------------------------------------------------------------- arguments and speed


@pytest.mark.parametrize("call, fragment", [
    (lambda: generate(4, 0, categories=("counting", "colours")), "'colours'"),
    (lambda: generate(4, 0, difficulties=(0,)), "difficulty"),
    (lambda: generate(4, 0, image_size=31), "image_size"),
    (lambda: generate(-1, 0), "n must be"),
    (lambda: generate(4, -2), "seed"),
    (lambda: make_splits(0, 4, 4, 4, CATEGORIES, train_difficulties=(1, 2), ood_difficulty=2), "held out"),
    (lambda: make_splits(0, 4, -1, 4, CATEGORIES), "n_test"),
    (lambda: syn.make_chart(np.random.default_rng(0), 0, 112), "difficulty"),
    (lambda: syn.make_spatial(np.random.default_rng(0), 1, 16), "image_size"),
])
def test_bad_arguments_raise_value_error_naming_them(call, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        call()


def test_unknown_category_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        generate(4, 0, categories=("maps",))
    assert all(c in str(err.value) for c in CATEGORIES)


def test_a_thousand_records_are_fast():
    t = time.perf_counter()
    generate(1000, seed=41, difficulties=(1, 2), image_size=112)
    assert time.perf_counter() - t < 10
