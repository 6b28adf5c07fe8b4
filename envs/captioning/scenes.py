"""Synthetic captioning scenes: a seeded scene graph, its image, a templated caption and
multiple-choice questions generated from the graph.

A scene is a `grid` x `grid` board of cells (default 2x2 of 28 px: a 56 px image, which a
Qwen2.5-VL turns into exactly one LM token per cell). Each occupied cell holds one object with a
colour, a size and a shape, or a text glyph (a capital letter). No two objects share colour and
shape, so "the red circle" always names one object.

Questions are asked and answered through one small query language, so that the generator (on the
true graph) and the lexical judge (on the graph it parses from a caption) answer the same way:
``answer_query(parse_question(q), objects)``. A query whose referent is missing or ambiguous in the
given objects has no answer (None); the judge then picks "cannot answer".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 90, 230), "yellow": (235, 200, 40),
}
SHAPES = ("circle", "square", "triangle")
SIZES = ("small", "large")
GLYPHS = ("A", "E", "H", "X")
LETTER = "letter"  # the shape word of a glyph object
ROW_WORDS = {2: ("top", "bottom"), 3: ("top", "middle", "bottom")}
COL_WORDS = {2: ("left", "right"), 3: ("left", "center", "right")}
RELATIONS = ("left of", "right of", "above", "below")
BACKGROUND = (245, 245, 240)
PROMPT = "Describe the image."


@dataclass(frozen=True)
class SceneObject:
    colour: str
    shape: str  # one of SHAPES or LETTER
    size: str
    row: int
    col: int
    text: str = ""  # the glyph of a LETTER object

    @property
    def noun(self) -> str:
        """How captions and questions name the kind: "circle" or "letter E"."""
        return f"{LETTER} {self.text}" if self.shape == LETTER else self.shape


@dataclass(frozen=True)
class Scene:
    grid: int
    cell_px: int
    objects: tuple[SceneObject, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"grid": self.grid, "cell_px": self.cell_px, "objects": [asdict(o) for o in self.objects]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scene:
        return cls(d["grid"], d["cell_px"], tuple(SceneObject(**o) for o in d["objects"]))


def position_words(grid: int) -> list[str]:
    """Cell names in reading order: "top left", ..., "bottom right"."""
    if grid not in ROW_WORDS:
        raise ValueError(f"grid must be one of {sorted(ROW_WORDS)}, got {grid}")
    return [f"{r} {c}" for r in ROW_WORDS[grid] for c in COL_WORDS[grid]]


# ----------------------------------------------------------------------------- generation


def make_scene(rng: np.random.Generator, grid: int = 2, cell_px: int = 28, min_objects: int = 1,
               max_objects: int = 3, glyph_prob: float = 0.15) -> Scene:
    """One random scene: distinct cells, distinct (colour, kind) pairs, objects in reading order."""
    n_cells = grid * grid
    position_words(grid)  # validates grid
    if not 1 <= min_objects <= max_objects <= n_cells:
        raise ValueError(f"need 1 <= min_objects <= max_objects <= {n_cells} cells, got {min_objects}, {max_objects}")
    n = int(rng.integers(min_objects, max_objects + 1))
    cells = sorted(rng.choice(n_cells, size=n, replace=False).tolist())
    used: set[tuple[str, str]] = set()
    objects = []
    for cell in cells:
        while True:
            colour = str(rng.choice(list(COLOURS)))
            if rng.random() < glyph_prob:
                shape, text = LETTER, str(rng.choice(GLYPHS))
            else:
                shape, text = str(rng.choice(SHAPES)), ""
            key = (colour, shape if shape != LETTER else LETTER)
            if key not in used:
                used.add(key)
                break
        objects.append(SceneObject(colour, shape, str(rng.choice(SIZES)), cell // grid, cell % grid, text))
    return Scene(grid, cell_px, tuple(objects))


def scene_for_seed(seed: int, **params) -> Scene:
    return make_scene(np.random.default_rng(seed), **params)


_FONTS: dict[int, Any] = {}


def _font(px: int):
    from PIL import ImageFont

    if px not in _FONTS:
        _FONTS[px] = ImageFont.load_default(size=px)
    return _FONTS[px]


def render(scene: Scene) -> np.ndarray:
    """The scene as a uint8 [H, W, 3] image (H = W = grid * cell_px)."""
    from PIL import Image, ImageDraw

    c = scene.cell_px
    img = Image.new("RGB", (scene.grid * c, scene.grid * c), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for o in scene.objects:
        x0, y0 = o.col * c, o.row * c
        half = (0.42 if o.size == "large" else 0.24) * c
        cx, cy = x0 + c / 2, y0 + c / 2
        box = (cx - half, cy - half, cx + half, cy + half)
        fill = COLOURS[o.colour]
        if o.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif o.shape == "square":
            draw.rectangle(box, fill=fill)
        elif o.shape == "triangle":
            draw.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=fill)
        else:
            draw.text((cx, cy), o.text, fill=fill, font=_font(max(8, int(2.2 * half))), anchor="mm",
                      stroke_width=1, stroke_fill=fill)
    return np.asarray(img, dtype=np.uint8)


CAPTION_STYLES = ("cells", "objects")


def caption_of(scene: Scene, style: str = "cells", terse: Sequence[bool] | None = None) -> str:
    """The templated caption. `cells`: every cell in reading order, its position first ("top left
    large red circle, top right empty, ..."), a fixed layout in which each clause reads one cell
    (what a tiny captioner learns to ground fastest); `objects`: only the objects ("large red
    circle top left, small blue letter E bottom right"). Objects flagged in `terse` (one flag per
    object) lose their size and colour ("top left circle"), as in the terse captions of SFT data."""
    words = position_words(scene.grid)
    flags = list(terse) if terse is not None else [False] * len(scene.objects)
    if len(flags) != len(scene.objects):
        raise ValueError(f"terse has {len(flags)} flags for {len(scene.objects)} objects")
    desc = {o.row * scene.grid + o.col: o.noun if short else f"{o.size} {o.colour} {o.noun}"
            for o, short in zip(scene.objects, flags)}
    if style == "objects":
        return ", ".join(f"{desc[o.row * scene.grid + o.col]} {words[o.row * scene.grid + o.col]}"
                         for o in scene.objects)
    if style != "cells":
        raise ValueError(f"unknown caption style {style!r}; valid: {', '.join(CAPTION_STYLES)}")
    return ", ".join(f"{w} {desc.get(i, 'empty')}" for i, w in enumerate(words))


# ----------------------------------------------------------------------------- queries

_C = "|".join(COLOURS)
_S = "|".join(SHAPES)
_Z = "|".join(SIZES)
_G = "|".join(g.lower() for g in GLYPHS)  # questions are matched lower-cased
_NOUN = rf"(?:{_S}|{LETTER} (?:{_G}))"
# kind -> (question template, regex of the question). The templates fill in SceneObject references.
QUESTION_FORMS: dict[str, tuple[str, re.Pattern]] = {
    "colour": ("What colour is the {a}?", re.compile(rf"^what colou?r is the ({_NOUN})\?$")),
    "shape": ("What shape is the {a} object?", re.compile(rf"^what shape is the ({_C}) object\?$")),
    "size": ("What size is the {a}?", re.compile(rf"^what size is the ({_C}) ({_NOUN})\?$")),
    "where": ("Where is the {a}?", re.compile(rf"^where is the ({_C}) ({_NOUN})\?$")),
    "count": ("How many objects are there?", re.compile(r"^how many objects are there\?$")),
    "count_colour": ("How many {a} objects are there?", re.compile(rf"^how many ({_C}) objects are there\?$")),
    "relation": ("Where is the {a} relative to the {b}?",
                 re.compile(rf"^where is the ({_C}) ({_NOUN}) relative to the ({_C}) ({_NOUN})\?$")),
    "letter": ("Which letter is written in the image?", re.compile(r"^which letter is written in the image\?$")),
}


def parse_question(question: str) -> tuple[str, dict[str, Any]] | None:
    """(kind, referent attributes) of a question in one of QUESTION_FORMS; None for any other text."""
    q = " ".join(question.lower().split())
    for kind, (_, pattern) in QUESTION_FORMS.items():
        m = pattern.match(q)
        if not m:
            continue
        g = m.groups()
        if kind == "colour":
            return kind, {"a": _noun_attrs(g[0])}
        if kind == "shape":
            return kind, {"a": {"colour": g[0]}}
        if kind in ("size", "where"):
            return kind, {"a": {"colour": g[0], **_noun_attrs(g[1])}}
        if kind == "count_colour":
            return kind, {"colour": g[0]}
        if kind == "relation":
            return kind, {"a": {"colour": g[0], **_noun_attrs(g[1])}, "b": {"colour": g[2], **_noun_attrs(g[3])}}
        return kind, {}
    return None


def _noun_attrs(noun: str) -> dict[str, str]:
    parts = noun.split()
    if parts[0] == LETTER:
        return {"shape": LETTER, "text": parts[1].upper()}
    return {"shape": parts[0]}


def _find(objects: list[dict], attrs: dict[str, str]) -> dict | None:
    """The one object whose attributes include `attrs`; None when none or several match."""
    hits = [o for o in objects if all(o.get(k) == v for k, v in attrs.items())]
    return hits[0] if len(hits) == 1 else None


def answer_query(kind: str, args: dict[str, Any], objects: list[dict], grid: int) -> str | None:
    """The answer text of a parsed question over `objects` (dicts of SceneObject fields, any of
    them possibly None); None when the objects do not determine it."""
    if not objects:
        return None  # nothing described: not even a count can be read off
    if kind == "count":
        return str(len(objects))
    if kind == "count_colour":
        return str(sum(o.get("colour") == args["colour"] for o in objects))
    if kind == "letter":
        letters = [o for o in objects if o.get("shape") == LETTER]
        return letters[0].get("text") or None if len(letters) == 1 else None
    a = _find(objects, args["a"])
    if a is None:
        return None
    if kind == "colour":
        return a.get("colour")
    if kind == "shape":
        return a.get("shape")
    if kind == "size":
        return a.get("size")
    if kind == "where":
        if a.get("row") is None or a.get("col") is None:
            return None
        return position_words(grid)[a["row"] * grid + a["col"]]
    if kind == "relation":
        b = _find(objects, args["b"])
        if b is None or None in (a.get("row"), a.get("col"), b.get("row"), b.get("col")):
            return None
        if a["row"] == b["row"] and a["col"] != b["col"]:
            return "left of" if a["col"] < b["col"] else "right of"
        if a["col"] == b["col"] and a["row"] != b["row"]:
            return "above" if a["row"] < b["row"] else "below"
        return None
    raise ValueError(f"unknown question kind {kind!r}; valid: {', '.join(QUESTION_FORMS)}")


def _choices_for(kind: str, grid: int) -> list[str]:
    n_cells = grid * grid
    return {
        "colour": list(COLOURS), "shape": [*SHAPES, LETTER], "size": list(SIZES), "where": position_words(grid),
        "count": [str(i) for i in range(1, n_cells + 1)], "count_colour": [str(i) for i in range(n_cells + 1)],
        "relation": list(RELATIONS), "letter": list(GLYPHS),
    }[kind]


def make_questions(scene: Scene, rng: np.random.Generator, n_choices: int = 4) -> list[dict[str, Any]]:
    """Every question the scene supports, as {"question", "choices", "answer", "kind"}: the answer is
    one of the choices; the other choices are random wrong values of the same kind."""
    objs = [asdict(o) for o in scene.objects]
    asks: list[tuple[str, dict[str, str]]] = [("count", {}), ("count_colour", {"a": str(rng.choice(list(COLOURS)))})]
    for o in scene.objects:
        ref = f"{o.colour} {o.noun}"
        asks += [("where", {"a": ref}), ("size", {"a": ref})]
        if sum(p.noun == o.noun for p in scene.objects) == 1:
            asks.append(("colour", {"a": o.noun}))
        if sum(p.colour == o.colour for p in scene.objects) == 1:
            asks.append(("shape", {"a": o.colour}))
    for o in scene.objects:
        for p in scene.objects:
            if o is not p and (o.row == p.row or o.col == p.col):
                asks.append(("relation", {"a": f"{o.colour} {o.noun}", "b": f"{p.colour} {p.noun}"}))
    if sum(o.shape == LETTER for o in scene.objects) == 1:
        asks.append(("letter", {}))
    out = []
    for kind, fill in asks:
        question = QUESTION_FORMS[kind][0].format(**fill)
        parsed = parse_question(question)
        assert parsed is not None and parsed[0] == kind, question  # the templates and regexes agree
        answer = answer_query(kind, parsed[1], objs, scene.grid)
        if answer is None:
            continue
        wrong = [c for c in _choices_for(kind, scene.grid) if c != answer]
        picked = rng.choice(len(wrong), size=min(n_choices - 1, len(wrong)), replace=False)
        choices = [answer, *[wrong[i] for i in picked]]
        rng.shuffle(choices)
        out.append({"question": question, "choices": choices, "answer": answer, "kind": kind})
    return out


# ----------------------------------------------------------------------------- reading captions

def parse_caption(caption: str, grid: int = 2) -> list[dict[str, Any]]:
    """Objects a caption describes: each clause (split at , ; . and "and") that names a colour or a
    kind becomes one object with the attributes it states (the rest None). Word order within a
    clause is free; a clause that states two values of one attribute keeps the first."""
    rows, cols = ROW_WORDS[grid], COL_WORDS[grid]
    out = []
    for clause in re.split(r"[,;.]| and ", caption.lower()):
        words = re.findall(r"[a-z]+", clause)
        if not words:
            continue
        o: dict[str, Any] = {"colour": None, "shape": None, "size": None, "row": None, "col": None, "text": None}
        for i, w in enumerate(words):
            if w in COLOURS and o["colour"] is None:
                o["colour"] = w
            elif w in SHAPES and o["shape"] is None:
                o["shape"] = w
            elif w == LETTER and o["shape"] is None and i + 1 < len(words) and words[i + 1].upper() in GLYPHS:
                o["shape"], o["text"] = LETTER, words[i + 1].upper()
            elif w in SIZES and o["size"] is None:
                o["size"] = w
            elif w in rows and o["row"] is None and i + 1 < len(words) and words[i + 1] in cols:
                o["row"], o["col"] = rows.index(w), cols.index(words[i + 1])
        if o["colour"] is not None or o["shape"] is not None:
            out.append(o)
    return out
