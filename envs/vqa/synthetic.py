"""A procedural, seeded visual-reasoning set for small-model VQA post-training (SFT, then GRPO).

Built offline with PIL, it is meant for a CPU demo that trains a tiny, randomly initialised
Qwen2.5-VL-architecture model, and for tests. Every answer is exactly recoverable from the image:
any value a solution needs (counts, positions, bar heights, marked lengths and angles) can be read
off it, and objects a question names as references are drawn exactly once (a counted colour or
shape may be absent: the answer is then 0).

Categories (each a ``make_<category>(rng, difficulty, image_size)`` returning a record without an id):

* ``counting``: coloured circles / squares / triangles on a plain background, one per grid cell.
  "How many red objects are there?", "How many red circles ...", "How many circles are left of
  the blue square?". Objects sit at cell centres, so "left of" (a smaller column) is decidable.
* ``chart``: a bar chart with whole-unit gridlines. Bars are named by colour (levels 1-2) or by
  a letter under the bar (level 3 and up). Questions: read a value, sum, difference, range,
  total, or the tallest / shortest bar (multiple choice).
* ``geometry``: a rectangle, right triangle, triangle or quadrilateral with marked lengths or
  angles (digits in PIL's default font). Ask for an area, a perimeter, or the angle marked "?".
* ``spatial``: a few distinct objects. "Is the red circle left of the green square?" (A. yes /
  B. no), "Which object is the top-most?" (options), and at level 3 and up two-hop questions
  ("Is the left-most object above the blue square?").

How difficulty scales (1 = easiest; any integer >= 1 works, levels above 4 reuse level 4's
settings): a finer grid with more objects and colours (counting, spatial), attribute
conjunctions and then spatial relations (counting), more bars, larger values and letter labels
(chart), two-digit numbers, angle sums, three-term perimeters and quadrilaterals (geometry),
more options and two-hop questions (spatial). Level 1 is kept small for a ~1M-parameter model:
a 2x2 grid (one cell per 28 px token at 56 px) with one to four objects of two
colours and two shapes; three coloured bars of value 1-4; single-digit rectangles; two objects in
different columns. Counting answers are drawn first (0 about 10% of the time, the rest uniform) and
scenes redrawn to match, so no count dominates. Sizes 56-112 px are the intended range; at 32-47 px
everything still renders, but geometry labels may touch the image edge.

Record format (the contract with the task and the rewards)::

    {"id", "images": [uint8 HxWx3], "problem": "<image>question[\\nA. ...]", "answer": "3" | "12.5" | "A",
     "options": [...] | None, "category", "difficulty", "key_steps": [...], "solution": "...", "bbox": None}

``solution`` states the ``key_steps`` in order and always ends with "The answer is <answer>."

Speed (one slow core, image_size 112): 1000 records take about 0.45 s at levels 1-2 and 1.1-1.4 s at
levels 3-4 (PIL drawing; the rest is rejection sampling of counting scenes).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

CATEGORIES = ("counting", "chart", "geometry", "spatial")
# Few, saturated colours: a tiny vision tower separates these from one 14 px patch.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 90, 230), "yellow": (235, 200, 40),
}
_COLOUR_NAMES = tuple(COLOURS)
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (245, 245, 240)
INK = (30, 30, 30)          # outlines, axes, text
GRID_GREY = (205, 205, 205)  # chart gridline, one per unit
GRID_DARK = (150, 150, 150)  # every fifth gridline, so large values can be counted in fives
MIN_IMAGE_SIZE = 32
OPTION_LETTERS = "ABCD"
_MAX_ATTEMPTS = 500  # redraws per slot when a split must avoid another split's records

Record = dict[str, Any]


# ----------------------------------------------------------------------------- validation


def _check_difficulty(difficulty: Any) -> int:
    if isinstance(difficulty, bool) or not isinstance(difficulty, (int, np.integer)) or difficulty < 1:
        raise ValueError(f"difficulty must be an integer >= 1 (1 = easiest), got {difficulty!r}")
    return int(difficulty)


def _check_image_size(image_size: Any) -> int:
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be an integer >= {MIN_IMAGE_SIZE}, got {image_size!r}")
    return int(image_size)


def _check_categories(categories: str | Iterable[str]) -> tuple[str, ...]:
    cats = (categories,) if isinstance(categories, str) else tuple(categories)
    for c in cats:
        if c not in CATEGORIES:
            raise ValueError(f"unknown category {c!r}; valid: {', '.join(CATEGORIES)}")
    if not cats:
        raise ValueError(f"categories is empty; choose from: {', '.join(CATEGORIES)}")
    return tuple(dict.fromkeys(cats))


def _check_difficulties(difficulties: int | Iterable[int], name: str = "difficulties") -> tuple[int, ...]:
    ds = (difficulties,) if isinstance(difficulties, (int, np.integer)) else tuple(difficulties)
    if not ds:
        raise ValueError(f"{name} is empty; give integers >= 1")
    return tuple(dict.fromkeys(_check_difficulty(d) for d in ds))


def _check_count(n: Any, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {n!r}")
    return int(n)


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return int(seed)


def _level(difficulty: int, table: dict[int, Any]) -> Any:
    """The setting for `difficulty`, the highest defined level's for anything above it."""
    return table[min(difficulty, max(table))]


# ----------------------------------------------------------------------------- drawing helpers

_FONTS: dict[int, Any] = {}


def _font(px: int):
    """PIL's default font at `px` (FreeType builds); the fixed-size bitmap font otherwise."""
    if px not in _FONTS:
        try:
            _FONTS[px] = ImageFont.load_default(size=px)
        except (TypeError, ValueError, ImportError, OSError):
            _FONTS[px] = ImageFont.load_default()
    return _FONTS[px]


def _font_px(image_size: int) -> int:
    return max(8, round(image_size / 8))


def _text(draw: ImageDraw.ImageDraw, centre: tuple[float, float], text: str, font, fill=INK) -> None:
    """Text centred on `centre` (works for bitmap fonts, which have no anchors)."""
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    draw.text((round(centre[0] - (x0 + x1) / 2), round(centre[1] - (y0 + y1) / 2)), text, fill=fill, font=font)


def _canvas(image_size: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    img = Image.new("RGB", (image_size, image_size), BACKGROUND)
    return img, ImageDraw.Draw(img)


def _pixels(img: Image.Image) -> np.ndarray:
    return np.array(img, dtype=np.uint8)  # a writable copy, HxWx3


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: int, cy: int, r: int, fill) -> None:
    """A filled shape whose bounding box is centred on (cx, cy); no anti-aliasing, so pixels are
    exactly the palette colour."""
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        s = max(2, round(r * 0.85))  # a bit smaller: equal-looking area to the circle
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:  # pragma: no cover - internal
        raise ValueError(f"unknown shape {shape!r}")


def _grid_geometry(image_size: int, g: int) -> tuple[int, int]:
    """Cell size and offset of a centred g x g grid."""
    cell = image_size // g
    return cell, (image_size - cell * g) // 2


def _max_grid(image_size: int) -> int:
    return max(2, image_size // 14)  # cells of at least 14 px keep shapes recognisable


def _fmt(x: float) -> str:
    """Numbers as answers are written: "12", "12.5"."""
    if float(x).is_integer():
        return str(int(x))
    return f"{x:g}"


def _finish(image: np.ndarray, question: str, answer: str, options: list[str] | None, category: str,
            difficulty: int, key_steps: list[str], reasoning: str) -> Record:
    problem = "<image>" + question
    if options is not None:
        problem += "".join(f"\n{OPTION_LETTERS[i]}. {o}" for i, o in enumerate(options))
    solution = f"{reasoning} The answer is {answer}."
    return {"images": [image], "problem": problem, "answer": answer, "options": options, "category": category,
            "difficulty": difficulty, "key_steps": key_steps, "solution": solution, "bbox": None}


def _shuffled_options(rng: np.random.Generator, correct: str, others: Sequence[str]) -> tuple[list[str], str]:
    """`correct` and up to three of `others`, in random order, and the correct letter."""
    others = list(others)
    pick = [others[i] for i in rng.permutation(len(others))[: len(OPTION_LETTERS) - 1]]
    opts = [correct, *pick]
    opts = [opts[i] for i in rng.permutation(len(opts))]
    return opts, OPTION_LETTERS[opts.index(correct)]


# ----------------------------------------------------------------------------- scenes of objects


def _place_objects(rng: np.random.Generator, g: int, n: int, colours: Sequence[str], distinct: bool,
                   shapes: Sequence[str] = SHAPES) -> list[dict]:
    """`n` objects in distinct cells of a g x g grid; `distinct`: no two share colour and shape."""
    cells = rng.permutation(g * g)[:n].tolist()
    if distinct:
        kinds = [(c, s) for c in colours for s in shapes]
        cs = [kinds[k] for k in rng.permutation(len(kinds))[:n].tolist()]
    else:
        ci, si = rng.integers(len(colours), size=n).tolist(), rng.integers(len(shapes), size=n).tolist()
        cs = [(colours[c], shapes[s]) for c, s in zip(ci, si)]
    objs = [{"colour": c, "shape": s, "row": k // g, "col": k % g} for (c, s), k in zip(cs, cells)]
    return sorted(objs, key=lambda o: (o["row"], o["col"]))


def _render_objects(objs: list[dict], g: int, image_size: int, rng: np.random.Generator,
                    size_jitter: bool) -> np.ndarray:
    img, draw = _canvas(image_size)
    cell, off = _grid_geometry(image_size, g)
    for o in objs:
        # Centres are exact cell centres: objects in one column share x, so "left of" is never a close call.
        cx, cy = off + o["col"] * cell + cell // 2, off + o["row"] * cell + cell // 2
        frac = rng.uniform(0.28, 0.40) if size_jitter else 0.36
        _draw_shape(draw, o["shape"], cx, cy, max(3, round(frac * cell)), COLOURS[o["colour"]])
    return _pixels(img)


def _name(o: dict) -> str:
    return f"{o['colour']} {o['shape']}"


_PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}
# relation -> (axis key, sign): a is <rel> b  iff  sign * (a[key] - b[key]) > 0
_RELATIONS = {"left of": ("col", -1), "right of": ("col", 1), "above": ("row", -1), "below": ("row", 1)}
_EXTREMES = {"left-most": ("col", min), "right-most": ("col", max), "top-most": ("row", min),
             "bottom-most": ("row", max)}


def _holds(a: dict, rel: str, b: dict) -> bool:
    key, sign = _RELATIONS[rel]
    return sign * (a[key] - b[key]) > 0


def _pos(o: dict, key: str) -> str:
    return f"{_name(o)}: {'column' if key == 'col' else 'row'} {o[key] + 1}"


# ----------------------------------------------------------------------------- counting

# difficulty -> (grid, (min, max) objects, colours per scene, question kinds, size jitter)
# difficulty -> (grid, (min, max) objects, colours and shapes per scene, question kinds, size jitter,
#                largest answer aimed for)
_COUNTING = {
    1: (2, (1, 4), (2, 2), ("colour", "shape"), False, 3),
    2: (3, (2, 6), (3, 3), ("colour", "shape", "colour_shape"), False, 4),
    3: (4, (4, 9), (4, 3), ("colour_shape", "relation"), True, 4),
    4: (5, (6, 12), (4, 3), ("relation", "relation_colour", "relation_colour_shape"), True, 5),
}
_ZERO_RATE = 0.1  # share of counting questions aimed at answer 0


def make_counting(rng: np.random.Generator, difficulty: int, image_size: int = 112) -> Record:
    """Count objects matching attributes, and at level 3+ a spatial relation to a unique reference."""
    difficulty, image_size = _check_difficulty(difficulty), _check_image_size(image_size)
    g, (lo, hi), (n_colours, n_shapes), kinds, jitter, top = _level(difficulty, _COUNTING)
    g = min(g, _max_grid(image_size))
    hi = min(hi, g * g)
    lo = min(lo, hi)
    kind = kinds[int(rng.integers(len(kinds)))]
    # Aim at an answer drawn first and redraw scenes until it comes up: otherwise "1" dominates and a
    # small model learns the prior instead of counting. Scenes are cheap until rendered.
    want = 0 if rng.random() < _ZERO_RATE else int(rng.integers(1, top + 1))
    built = None
    for attempt in range(300):
        palette = [_COLOUR_NAMES[i] for i in rng.permutation(len(COLOURS))[:n_colours].tolist()]
        shapes = [SHAPES[i] for i in rng.permutation(len(SHAPES))[:n_shapes].tolist()]
        cand_objs = _place_objects(rng, g, int(rng.integers(lo, hi + 1)), palette, distinct=False, shapes=shapes)
        cand = _counting_question(rng, kind, cand_objs, palette, shapes)
        if cand is not None:
            objs, built = cand_objs, cand
            if cand[2] == want:
                break
    if built is None:  # pragma: no cover - a relation scene needs one uniquely named object
        raise RuntimeError("could not build a counting question")
    question, steps, answer = built
    image = _render_objects(objs, g, image_size, rng, jitter)
    return _finish(image, question, str(answer), None, "counting", difficulty, steps, ". ".join(steps) + ".")


def _counting_question(rng, kind, objs, palette, shapes):
    def pick_target_object(pool):
        return pool[int(rng.integers(len(pool)))]

    # Mostly ask about something present; sometimes about an absent colour/shape, so 0 is a possible answer.
    present = rng.random() < 0.85
    if kind in ("colour", "shape", "colour_shape"):
        t = pick_target_object(objs)
        colour = t["colour"] if present else list(COLOURS)[int(rng.integers(len(COLOURS)))]
        shape = t["shape"] if present else SHAPES[int(rng.integers(len(SHAPES)))]
        n_colour = sum(o["colour"] == colour for o in objs)
        n_shape = sum(o["shape"] == shape for o in objs)
        n_both = sum(o["colour"] == colour and o["shape"] == shape for o in objs)
        if kind == "colour":
            return f"How many {colour} objects are there?", [f"{colour}: {n_colour}"], n_colour
        if kind == "shape":
            return f"How many {_PLURAL[shape]} are there?", [f"{_PLURAL[shape]}: {n_shape}"], n_shape
        return (f"How many {colour} {_PLURAL[shape]} are there?",
                [f"{colour}: {n_colour}", f"{colour} {_PLURAL[shape]}: {n_both}"], n_both)
    # Relations: the reference must be the only object of its colour and shape.
    names = Counter((o["colour"], o["shape"]) for o in objs)
    unique = [o for o in objs if names[o["colour"], o["shape"]] == 1]
    if not unique or len(objs) < 2:
        return None
    ref = unique[int(rng.integers(len(unique)))]
    rel = list(_RELATIONS)[int(rng.integers(len(_RELATIONS)))]
    rest = [o for o in objs if o is not ref]
    t = pick_target_object(rest)
    colour = t["colour"] if present else palette[int(rng.integers(len(palette)))]
    shape = t["shape"] if present else shapes[int(rng.integers(len(shapes)))]
    if kind == "relation":
        target, match = _PLURAL[shape], (lambda o: o["shape"] == shape)
    elif kind == "relation_colour":
        target, match = f"{colour} objects", (lambda o: o["colour"] == colour)
    else:
        target, match = f"{colour} {_PLURAL[shape]}", (lambda o: o["colour"] == colour and o["shape"] == shape)
    pool = [o for o in rest if match(o)]
    n = sum(_holds(o, rel, ref) for o in pool)
    key = _RELATIONS[rel][0]
    counted = f"other {target}" if match(ref) else target  # the reference itself is never counted
    steps = [_pos(ref, key), f"{counted}: {len(pool)}", f"{target} {rel} the {_name(ref)}: {n}"]
    return f"How many {target} are {rel} the {_name(ref)}?", steps, n


# ----------------------------------------------------------------------------- chart

# difficulty -> (bars, max value, name bars by letter, question kinds)
_CHART = {
    1: (3, 4, False, ("value", "sum2", "argmax")),
    2: (4, 6, False, ("sum2", "diff", "argmax", "argmin")),
    3: (5, 9, True, ("diff", "range", "total", "argmax", "argmin")),
    4: (6, 12, True, ("diff", "range", "total", "sum2", "argmin")),
}


def make_chart(rng: np.random.Generator, difficulty: int, image_size: int = 112) -> Record:
    """A bar chart with a gridline per unit; arithmetic over the bar values."""
    difficulty, image_size = _check_difficulty(difficulty), _check_image_size(image_size)
    k, vmax, letters, kinds = _level(difficulty, _CHART)
    fs = _font_px(image_size)
    margin = max(3, image_size // 16)
    bottom = fs + 4 if letters else margin
    plot_h = image_size - margin - bottom
    vmax = min(vmax, plot_h // 2)  # at least 2 px per unit, so gridlines stay countable
    unit = plot_h // vmax
    if letters:
        names = [chr(ord("A") + i) for i in range(k)]
        fills = [COLOURS["blue"]] * k  # one colour: the letter is the only way to tell bars apart
    else:
        names = [list(COLOURS)[int(i)] for i in rng.choice(len(COLOURS), k, replace=False)]
        fills = [COLOURS[c] for c in names]
    kind = kinds[int(rng.integers(len(kinds)))]
    while True:  # extremes must be unique, and not all bars equal (a difference needs a taller bar)
        values = [int(v) for v in rng.integers(1, vmax + 1, size=k)]
        if values.count(max(values)) == 1 and values.count(min(values)) == 1:
            break

    # Draw: baseline at the bottom of the plot, one gridline per unit above it.
    img, draw = _canvas(image_size)
    base = image_size - bottom - 1
    left, right = margin, image_size - margin - 1
    for v in range(1, vmax + 1):
        draw.line((left, base - v * unit, right, base - v * unit), fill=GRID_DARK if v % 5 == 0 else GRID_GREY)
    slot = (right - left) // k
    bar_w = max(3, int(slot * 0.6))
    font = _font(fs)
    for i, (v, fill) in enumerate(zip(values, fills)):
        x0 = left + 1 + i * slot + (slot - bar_w) // 2
        draw.rectangle((x0, base - v * unit, x0 + bar_w - 1, base - 1), fill=fill)
        if letters:
            _text(draw, (x0 + bar_w / 2, base + 2 + fs / 2), names[i], font)
    draw.line((left, base, right, base), fill=INK)
    draw.line((left, base - vmax * unit, left, base), fill=INK)
    image = _pixels(img)

    def bar(i: int) -> str:
        return f"bar {names[i]}" if letters else f"the {names[i]} bar"

    def read(i: int) -> str:
        return f"{names[i]}: {values[i]}"

    options, answer = None, None
    if kind == "value":
        i = int(rng.integers(k))
        question = f"What is the value of {bar(i)}?"
        steps, answer = [read(i)], str(values[i])
        reasoning = f"{read(i)}."
    elif kind == "sum2":
        i, j = (int(x) for x in rng.choice(k, 2, replace=False))
        s = values[i] + values[j]
        question = (f"What is the sum of bars {names[i]} and {names[j]}?" if letters else
                    f"What is the sum of the {names[i]} and {names[j]} bars?")
        steps, answer = [read(i), read(j), str(s)], str(s)
        reasoning = f"{read(i)}, {read(j)}. {values[i]} + {values[j]} = {s}."
    elif kind == "diff":
        pairs = [(i, j) for i in range(k) for j in range(k) if values[i] > values[j]]
        i, j = pairs[int(rng.integers(len(pairs)))]
        d = values[i] - values[j]
        question = f"How much taller is {bar(i)} than {bar(j)}?"
        steps, answer = [read(i), read(j), str(d)], str(d)
        reasoning = f"{read(i)}, {read(j)}. {values[i]} - {values[j]} = {d}."
    elif kind == "range":
        hi_i, lo_i = values.index(max(values)), values.index(min(values))
        d = values[hi_i] - values[lo_i]
        question = "What is the difference between the tallest and the shortest bar?"
        steps = [f"tallest: {read(hi_i)}", f"shortest: {read(lo_i)}", str(d)]
        answer = str(d)
        reasoning = f"{steps[0]}, {steps[1]}. {values[hi_i]} - {values[lo_i]} = {d}."
    elif kind == "total":
        total = sum(values)
        question = "What is the total of all the bars?"
        steps = [read(i) for i in range(k)] + [str(total)]
        answer = str(total)
        reasoning = ", ".join(steps[:-1]) + f". {' + '.join(map(str, values))} = {total}."
    else:  # argmax / argmin: multiple choice over bar names
        i = values.index(max(values) if kind == "argmax" else min(values))
        word = "tallest" if kind == "argmax" else "shortest"
        question = f"Which bar is the {word}?"
        # Letter bars are offered as "bar C", so an option text never looks like an option letter.
        label = [f"bar {nm}" if letters else nm for nm in names]
        options, answer = _shuffled_options(rng, label[i], [t for j, t in enumerate(label) if j != i])
        steps = [read(label.index(o)) for o in options] + [f"{word}: {names[i]}"]
        reasoning = ", ".join(steps[:-1]) + f". {steps[-1]}, option {answer}."
    return _finish(image, question, answer, options, "chart", difficulty, steps, reasoning)


# ----------------------------------------------------------------------------- geometry

# difficulty -> (question kinds, (min, max) lengths, angle step)
_GEOMETRY = {
    1: (("rect_area", "rect_perimeter"), (2, 9), 10),
    2: (("rect_area", "rect_perimeter", "right_area", "triangle_angle"), (2, 12), 10),
    3: (("rect_area", "right_area", "triangle_angle", "triangle_perimeter", "quad_angle"), (5, 20), 10),
    4: (("rect_perimeter", "right_area", "triangle_angle", "triangle_perimeter", "quad_angle"), (8, 30), 5),
}


def _unit(v: tuple[float, float]) -> tuple[float, float]:
    n = math.hypot(*v) or 1.0
    return v[0] / n, v[1] / n


def _label_direction(q: Sequence[tuple[float, float]], where: str, i: int) -> tuple[float, float]:
    """Unit vector pointing away from the figure: from vertex i along its outer angle bisector, or
    from the midpoint of edge i -> i+1 along its outer normal. Scale-free, so computed once."""
    n = len(q)
    cx, cy = sum(p[0] for p in q) / n, sum(p[1] for p in q) / n
    if where == "vertex":
        p, a, b = q[i], q[i - 1], q[(i + 1) % n]
        u, v = _unit((a[0] - p[0], a[1] - p[1])), _unit((b[0] - p[0], b[1] - p[1]))
        bis = _unit((u[0] + v[0], u[1] + v[1]))
        return -bis[0], -bis[1]
    a, b = q[i], q[(i + 1) % n]
    nx, ny = _unit((-(b[1] - a[1]), b[0] - a[0]))
    mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
    return (nx, ny) if nx * (mx - cx) + ny * (my - cy) >= 0 else (-nx, -ny)


def _draw_figure(draw: ImageDraw.ImageDraw, points: Sequence[tuple[float, float]],
                 labels: Sequence[tuple[str, int, str]], image_size: int, rng: np.random.Generator, font,
                 width: int) -> list[tuple[float, float]]:
    """Draw the polygon `points` (y up) with `labels` (("vertex" | "edge", index, text)) just
    outside it, as large as fits with every label inside the image, at a random scale and position
    (so figures with equal labels still differ). Returns the vertices in image coordinates."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    q = [(x - min(xs), max(ys) - y) for x, y in points]  # y down, origin at the top-left corner
    pad = 2 + width  # px between a label's box and the line it marks
    placed = []  # (anchor as a function of the vertices, offset, half width, half height, text)
    for where, i, text in labels:
        dx, dy = _label_direction(q, where, i)
        x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
        hw, hh = (x1 - x0) / 2, (y1 - y0) / 2
        dist = abs(dx) * hw + abs(dy) * hh + pad  # the box's edge, not its centre, clears the line
        placed.append((where, i, dx * dist, dy * dist, hw, hh, text))

    def anchor(pts, where, i):
        if where == "vertex":
            return pts[i]
        a, b = pts[i], pts[(i + 1) % len(pts)]
        return (a[0] + b[0]) / 2, (a[1] + b[1]) / 2

    def extent(s):
        pts = [(x * s, y * s) for x, y in q]
        boxes = [(x, y, x, y) for x, y in pts]
        for where, i, ox, oy, hw, hh, _ in placed:
            ax, ay = anchor(pts, where, i)
            boxes.append((ax + ox - hw, ay + oy - hh, ax + ox + hw, ay + oy + hh))
        return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes),
                max(b[3] for b in boxes))

    room = image_size - 4  # keep a 2 px frame clear
    s = room / max(max(p[0] for p in q), max(p[1] for p in q))
    while True:
        x0, y0, x1, y1 = extent(s)
        if (x1 - x0 <= room and y1 - y0 <= room) or s < 1:
            break
        s *= 0.97
    s *= rng.uniform(0.85, 1.0)
    x0, y0, x1, y1 = extent(s)
    tx = 2 - x0 + rng.uniform(0, max(0.0, room - (x1 - x0)))
    ty = 2 - y0 + rng.uniform(0, max(0.0, room - (y1 - y0)))
    pts = [(x * s + tx, y * s + ty) for x, y in q]
    draw.polygon(pts, outline=INK, width=width)
    for where, i, ox, oy, _, _, text in placed:
        ax, ay = anchor(pts, where, i)
        _text(draw, (ax + ox, ay + oy), text, font)
    return pts


def _polygon_with_angles(rng: np.random.Generator, angles: Sequence[float]) -> list[tuple[float, float]] | None:
    """A convex polygon (y up, counter-clockwise) with these interior angles (degrees): two sides are
    random, the last two close the shape. None when they would not be positive."""
    n = len(angles)
    dirs, heading = [], 0.0
    for k in range(n):
        dirs.append((math.cos(math.radians(heading)), math.sin(math.radians(heading))))
        heading += 180 - angles[(k + 1) % n]  # turn at the end of side k, i.e. at vertex k+1
    lengths = [rng.uniform(0.7, 1.3) for _ in range(n - 2)]
    rx = -sum(L * d[0] for L, d in zip(lengths, dirs))
    ry = -sum(L * d[1] for L, d in zip(lengths, dirs))
    (a, c), (b, d) = dirs[n - 2], dirs[n - 1]  # solve a*L1 + b*L2 = rx, c*L1 + d*L2 = ry
    det = a * d - b * c
    if abs(det) < 1e-9:
        return None
    l1, l2 = (rx * d - b * ry) / det, (a * ry - c * rx) / det
    if min(l1, l2) < 0.35:
        return None
    lengths += [l1, l2]
    pts, x, y = [], 0.0, 0.0
    for L, dvec in zip(lengths, dirs):
        pts.append((x, y))
        x, y = x + L * dvec[0], y + L * dvec[1]
    return pts


def _clamp_aspect(w: float, h: float, limit: float = 3.0) -> tuple[float, float]:
    """Draw proportionally, but no thinner than 1:limit, so labels and edges stay apart."""
    if w / h > limit:
        return w, w / limit
    if h / w > limit:
        return h / limit, h
    return w, h


def make_geometry(rng: np.random.Generator, difficulty: int, image_size: int = 112) -> Record:
    """A figure with marked lengths or angles; ask for an area, a perimeter or the angle marked "?"."""
    difficulty, image_size = _check_difficulty(difficulty), _check_image_size(image_size)
    kinds, (lo, hi), step = _level(difficulty, _GEOMETRY)
    kind = kinds[int(rng.integers(len(kinds)))]
    font = _font(_font_px(image_size))
    img, draw = _canvas(image_size)
    lw = 2 if image_size >= 64 else 1

    def length() -> int:
        return int(rng.integers(lo, hi + 1))

    if kind in ("rect_area", "rect_perimeter"):
        w, h = length(), length()
        dw, dh = _clamp_aspect(w, h)
        # vertices (y up): 0 bottom-left, 1 bottom-right, 2 top-right, 3 top-left; width below, height right
        _draw_figure(draw, [(0, 0), (dw, 0), (dw, dh), (0, dh)], [("edge", 0, str(w)), ("edge", 1, str(h))],
                     image_size, rng, font, lw)
        if kind == "rect_area":
            question = "What is the area of the rectangle?"
            a = w * h
            steps = [str(w), str(h), str(a)]
            reasoning = f"width {w}, height {h}. area = {w} x {h} = {a}."
        else:
            question = "What is the perimeter of the rectangle?"
            s, a = w + h, 2 * (w + h)
            steps = [str(w), str(h), str(s), str(a)]
            reasoning = f"width {w}, height {h}. {w} + {h} = {s}. perimeter = 2 x {s} = {a}."
        answer = _fmt(a)
    elif kind == "right_area":
        w, h = length(), length()
        dw, dh = _clamp_aspect(w, h)
        pts = _draw_figure(draw, [(0, 0), (dw, 0), (0, dh)], [("edge", 0, str(w)), ("edge", 2, str(h))],
                           image_size, rng, font, lw)
        m = max(3.0, 0.12 * min(pts[1][0] - pts[0][0], pts[0][1] - pts[2][1]))  # right-angle marker
        x0, y0 = pts[0]
        draw.line([(x0 + m, y0), (x0 + m, y0 - m), (x0, y0 - m)], fill=INK, width=1)
        p = w * h
        a = p / 2
        question = "What is the area of the right triangle?"
        steps = [str(w), str(h), str(p), _fmt(a)]
        reasoning = f"The legs are {w} and {h}. {w} x {h} = {p}. {p} / 2 = {_fmt(a)}."
        answer = _fmt(a)
    elif kind == "triangle_perimeter":
        while True:  # clearly non-degenerate: the longest side well short of the other two together
            sides = sorted(length() for _ in range(3))
            if sides[0] + sides[1] >= sides[2] + 2:
                break
        a_, b_, c_ = (sides[int(i)] for i in rng.permutation(3))
        # Base c_ on the x axis, apex from the law of cosines: drawn to scale, each side labelled.
        x = (c_ ** 2 + b_ ** 2 - a_ ** 2) / (2 * c_)
        y = math.sqrt(max(b_ ** 2 - x ** 2, 1e-6))
        _draw_figure(draw, [(0, 0), (c_, 0), (x, y)],
                     [("edge", 0, str(c_)), ("edge", 1, str(a_)), ("edge", 2, str(b_))], image_size, rng, font, lw)
        s, total = c_ + a_, c_ + a_ + b_
        question = "What is the perimeter of the triangle?"
        steps = [str(c_), str(a_), str(b_), str(s), str(total)]
        reasoning = f"The sides are {c_}, {a_} and {b_}. {c_} + {a_} = {s}. {s} + {b_} = {total}."
        answer = str(total)
    else:  # triangle_angle / quad_angle: the vertex marked "?" closes the angle sum
        n, total = (3, 180) if kind == "triangle_angle" else (4, 360)
        lo_a, hi_a = (30, 100) if n == 3 else (60, 130)
        while True:
            known = [int(v) * step for v in rng.integers(lo_a // step, hi_a // step + 1, size=n - 1)]
            missing = total - sum(known)
            if lo_a <= missing <= hi_a + (20 if n == 3 else 0):
                angles = [*known, missing]
                pts = _polygon_with_angles(rng, angles)
                if pts is not None:
                    break
        # The figure is drawn with its true angles; angle i sits at vertex i (a y flip keeps angles).
        labels = [("vertex", i, "?" if i == n - 1 else str(v)) for i, v in enumerate(angles)]
        _draw_figure(draw, pts, labels, image_size, rng, font, lw)
        s = sum(known)
        shape = "triangle" if n == 3 else "quadrilateral"
        question = f"In the {shape}, what is the angle marked ? in degrees?"
        steps = [str(v) for v in known] + [str(s), str(missing)]
        listed = " and ".join([", ".join(map(str, known[:-1])), str(known[-1])])
        reasoning = (f"The marked angles are {listed}. {' + '.join(map(str, known))} = {s}. "
                     f"{total} - {s} = {missing}.")
        answer = str(missing)
    return _finish(_pixels(img), question, answer, None, "geometry", difficulty, steps, reasoning)


# ----------------------------------------------------------------------------- spatial

# difficulty -> (grid, (min, max) objects, question kinds)
_SPATIAL = {
    1: (2, (2, 2), ("horizontal",)),
    2: (3, (3, 3), ("horizontal", "vertical", "extreme")),
    3: (4, (4, 5), ("relation", "extreme", "two_hop")),
    4: (5, (5, 7), ("extreme", "two_hop")),
}


def _unique_extreme(objs: list[dict], which: str) -> dict | None:
    key, fn = _EXTREMES[which]
    best = fn(o[key] for o in objs)
    winners = [o for o in objs if o[key] == best]
    return winners[0] if len(winners) == 1 else None


def make_spatial(rng: np.random.Generator, difficulty: int, image_size: int = 112) -> Record:
    """Relations between distinct objects: yes/no relations, extremes, and two-hop questions."""
    difficulty, image_size = _check_difficulty(difficulty), _check_image_size(image_size)
    g, (lo, hi), kinds = _level(difficulty, _SPATIAL)
    g = min(g, _max_grid(image_size))
    hi = min(hi, g * g - 1)  # a free cell leaves some row / column with a single object: unique extremes exist
    lo = min(lo, hi)
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "relation":
        kind = ("horizontal", "vertical")[int(rng.integers(2))]
    for _ in range(200):
        objs = _place_objects(rng, g, int(rng.integers(lo, hi + 1)), list(COLOURS), distinct=True)
        built = _spatial_question(rng, kind, objs)
        if built is not None:
            break
    else:  # pragma: no cover
        raise RuntimeError("could not build a spatial question")
    question, options, answer, steps, reasoning = built
    image = _render_objects(objs, g, image_size, rng, size_jitter=difficulty >= 3)
    return _finish(image, question, answer, options, "spatial", difficulty, steps, reasoning)


def _yes_no(a: dict, rel: str, b: dict) -> tuple[str, list[str], str]:
    """Option letter, key steps and reasoning for "Is a <rel> b?" (A. yes, B. no)."""
    key = _RELATIONS[rel][0]
    yes = _holds(a, rel, b)
    verdict = f"{_name(a)} {rel} {_name(b)}: {'yes' if yes else 'no'}"
    steps = [_pos(a, key), _pos(b, key), verdict]
    return ("A" if yes else "B"), steps, ". ".join(steps) + "."


def _spatial_question(rng, kind, objs):
    if kind in ("horizontal", "vertical"):
        rels = ("left of", "right of") if kind == "horizontal" else ("above", "below")
        rel = rels[int(rng.integers(2))]
        key = _RELATIONS[rel][0]
        i, j = (int(x) for x in rng.choice(len(objs), 2, replace=False))
        a, b = objs[i], objs[j]
        if a[key] == b[key]:  # same column (row): skip, the relation would be a judgement call
            return None
        answer, steps, reasoning = _yes_no(a, rel, b)
        return f"Is the {_name(a)} {rel} the {_name(b)}?", ["yes", "no"], answer, steps, reasoning
    which = list(_EXTREMES)[int(rng.integers(len(_EXTREMES)))]
    winner = _unique_extreme(objs, which)
    if winner is None:
        return None
    key = _EXTREMES[which][0]
    if kind == "extreme":
        options, answer = _shuffled_options(rng, _name(winner), [_name(o) for o in objs if o is not winner])
        by_name = {_name(o): o for o in objs}
        steps = [_pos(by_name[o], key) for o in options] + [f"{which}: {_name(winner)}"]
        reasoning = ". ".join(steps[:-1]) + f". {steps[-1]}, option {answer}."
        return f"Which object is the {which}?", options, answer, steps, reasoning
    # two_hop: find the extreme object, then compare it with a named one on the other axis (on the same
    # axis the answer would follow from the extreme alone: the left-most object is left of everything).
    rels = ("above", "below") if key == "col" else ("left of", "right of")
    rel = rels[int(rng.integers(2))]
    rkey = _RELATIONS[rel][0]
    others = [o for o in objs if o is not winner and o[rkey] != winner[rkey]]
    if not others:
        return None
    b = others[int(rng.integers(len(others)))]
    answer, steps, reasoning = _yes_no(winner, rel, b)
    first = f"{which}: {_name(winner)}"
    return (f"Is the {which} object {rel} the {_name(b)}?", ["yes", "no"], answer, [first, *steps],
            f"{first}. {reasoning}")


# ----------------------------------------------------------------------------- sets and splits

MAKERS: dict[str, Callable[[np.random.Generator, int, int], Record]] = {
    "counting": make_counting, "chart": make_chart, "geometry": make_geometry, "spatial": make_spatial,
}
_STREAMS = {"train": 0, "test": 1, "ood": 2}  # seed streams: test and ood never share a generator with train


def record_key(record: Record) -> bytes:
    """Identity of a question: its image bytes (with shape) and its problem text."""
    h = hashlib.sha1()
    for im in record["images"]:
        h.update(repr(im.shape).encode())
        h.update(np.ascontiguousarray(im).tobytes())
    h.update(record["problem"].encode())
    return h.digest()


def _generate(n: int, seed: int, stream: int, categories: tuple[str, ...], difficulties: tuple[int, ...],
              image_size: int, id_prefix: str, exclude: set[bytes] | None) -> list[Record]:
    # Round-robin over (category, difficulty): any prefix of the list is as balanced as it can be.
    pairs = [(c, d) for d in difficulties for c in categories]
    out = []
    for i in range(n):
        cat, d = pairs[i % len(pairs)]
        for attempt in range(_MAX_ATTEMPTS):
            # One generator per (seed, stream, slot, attempt): records do not depend on n or on each other.
            rng = np.random.default_rng([seed, stream, i, attempt])
            rec = MAKERS[cat](rng, d, image_size)
            if exclude is None or record_key(rec) not in exclude:
                break
        else:
            raise ValueError(f"could not draw a {cat} level-{d} record unlike the {len(exclude)} excluded ones "
                             f"in {_MAX_ATTEMPTS} tries: that level is nearly exhausted; use fewer records, "
                             f"more difficulties or a larger image_size")
        out.append({"id": f"{id_prefix}{cat}-{d}-{i:05d}", **rec})
    return out


def generate(n: int, seed: int, categories: str | Iterable[str] = CATEGORIES,
             difficulties: int | Iterable[int] = (1, 2), image_size: int = 112, *,
             id_prefix: str = "") -> list[Record]:
    """`n` records, deterministic in the arguments, interleaved over categories x difficulties."""
    n, seed = _check_count(n, "n"), _check_seed(seed)
    cats, diffs = _check_categories(categories), _check_difficulties(difficulties)
    image_size = _check_image_size(image_size)
    return _generate(n, seed, _STREAMS["train"], cats, diffs, image_size, id_prefix, None)


def make_splits(seed: int, n_train: int, n_test: int, n_ood: int, categories: str | Iterable[str] = CATEGORIES,
                train_difficulties: int | Iterable[int] = (1, 2), ood_difficulty: int = 3,
                image_size: int = 112) -> dict[str, list[Record]]:
    """"train" (= `generate(n_train, seed, ...)`), "test" (same levels, another seed stream, no record
    equal to a train one) and "ood" (only `ood_difficulty`, a level held out of training)."""
    seed = _check_seed(seed)
    n_train, n_test, n_ood = (_check_count(v, k) for k, v in (("n_train", n_train), ("n_test", n_test),
                                                             ("n_ood", n_ood)))
    cats, diffs = _check_categories(categories), _check_difficulties(train_difficulties, "train_difficulties")
    ood = _check_difficulty(ood_difficulty)
    if ood in diffs:
        raise ValueError(f"ood_difficulty {ood} is one of train_difficulties {diffs}; it must be held out")
    image_size = _check_image_size(image_size)
    train = _generate(n_train, seed, _STREAMS["train"], cats, diffs, image_size, "", None)
    seen = {record_key(r) for r in train}
    test = _generate(n_test, seed, _STREAMS["test"], cats, diffs, image_size, "test-", seen)
    seen |= {record_key(r) for r in test}
    ood_set = _generate(n_ood, seed, _STREAMS["ood"], cats, (ood,), image_size, "ood-", seen)
    train_keys = {record_key(r) for r in train}
    assert not any(record_key(r) in train_keys for r in test)  # disjoint by construction (exclude above)
    return {"train": train, "test": test, "ood": ood_set}


__all__ = ["CATEGORIES", "COLOURS", "MAKERS", "SHAPES", "generate", "make_chart", "make_counting", "make_geometry",
           "make_spatial", "make_splits", "record_key"]
