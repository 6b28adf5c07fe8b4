"""Generated clips of one coloured shape moving across a dark-grey frame, with their prompts.

A clip is ``num_frames`` RGB frames (uint8 ``[F, H, W, 3]``, square ``H == W == size``) showing one
shape of one palette colour that moves in a straight line at constant velocity; its prompt names
the four things that vary, e.g. "a red square moves right quickly". The start position is the only
randomness: it is drawn so that the shape stays fully inside the frame for the whole clip.

Geometry (all scales with ``size``; numbers below are for the reference 16 px frame):

* coordinates are ``(x, y)`` in pixels, x to the right, y *down* (so "up" is ``(0, -1)``); pixel
  ``(row i, col j)`` covers ``[j, j+1) x [i, i+1)`` and its centre is ``(j + 0.5, i + 0.5)``;
* the shape fits a ``shape_px(size)`` box (4 px): a square fills it, a circle is inscribed in it,
  a triangle has its apex at the top centre and its base on the bottom edge;
* speeds are ``speed_px(speed, size)`` px per frame: 0.75 ("slowly") and 1.5 ("quickly").

Why sub-pixel speeds: with 8 frames a shape moving 2 px/frame travels 14 px, so with any shape
wider than 2 px it cannot stay inside a 16 px frame; the speeds that fit are below 12/7 px/frame,
and two distinct integer speeds do not exist there. So positions live on a 1/``SUBPIXEL`` px grid
and frames are rendered with exact area coverage (anti-aliased edges; the coverage-weighted
centroid of a square is exactly its centre). Consequence: a "quickly" clip fits only up to
``num_frames = 9`` (a "slowly" one up to 17), at any size, because shape and speed both scale with
the frame; longer clips raise a ValueError that says so.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import product

import numpy as np

from mmrl.checkpoint import checkpointable

REFERENCE_SIZE = 16  # px; SPEEDS and SHAPE_FRACTION are given for this frame size
BACKGROUND: tuple[int, int, int] = (40, 40, 40)
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (235, 215, 40),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
SPEEDS: dict[str, float] = {"slowly": 0.75, "quickly": 1.5}  # px per frame at REFERENCE_SIZE
SHAPE_FRACTION = 0.25  # the shape's box side as a fraction of the frame side (4 px at 16 px)
SUBPIXEL = 4  # positions, speeds and the shape size live on a 1/SUBPIXEL px grid
SUPERSAMPLE = 16  # coverage samples per pixel side when rendering a shape (a multiple of SUBPIXEL)
MIN_SIZE = 8
MIN_FRAMES = 2

_PROMPT_FORM = "a <colour> <shape> moves <direction> <speed>"


def _check_word(kind: str, word: str, accepted) -> None:
    if word not in accepted:
        raise ValueError(f"unknown {kind} {word!r}; accepted: {', '.join(accepted)}")


@checkpointable  # contexts carry it, and a prompt replay buffer keeps contexts in checkpoints
@dataclass(frozen=True)
class ClipSpec:
    """What a clip shows; ``prompt`` is its text and ``from_prompt`` parses it back."""

    colour: str
    shape: str
    direction: str
    speed: str

    def __post_init__(self):
        _check_word("colour", self.colour, COLOURS)
        _check_word("shape", self.shape, SHAPES)
        _check_word("direction", self.direction, tuple(DIRECTIONS))
        _check_word("speed", self.speed, tuple(SPEEDS))

    @property
    def prompt(self) -> str:
        return f"a {self.colour} {self.shape} moves {self.direction} {self.speed}"

    @classmethod
    def from_prompt(cls, text: str) -> "ClipSpec":
        """Parse "a red square moves right quickly" (case, extra spaces and a final '.' are ignored)."""
        if not isinstance(text, str):
            raise ValueError(f"a prompt must be a str, got {type(text).__name__}")
        words = re.sub(r"\.\s*$", "", text.strip()).lower().split()
        if len(words) != 6 or words[0] != "a" or words[3] != "moves":
            raise ValueError(f"cannot parse prompt {text!r}; expected the form {_PROMPT_FORM!r}")
        return cls(colour=words[1], shape=words[2], direction=words[4], speed=words[5])

    def to_dict(self) -> dict[str, str]:
        return {"colour": self.colour, "shape": self.shape, "direction": self.direction, "speed": self.speed}


def all_specs() -> list[ClipSpec]:
    """Every combination, ordered colour, shape, direction, speed (each in its constant's order)."""
    return [ClipSpec(c, s, d, v) for c, s, d, v in product(COLOURS, SHAPES, DIRECTIONS, SPEEDS)]


def split_specs(holdout: int | float, seed: int = 0) -> tuple[list[ClipSpec], list[ClipSpec]]:
    """Split `all_specs()` into (train, held-out) combinations, disjoint and deterministic in `seed`.

    `holdout` is a count (int) or a fraction of all combinations (float in [0, 1)). Held-out
    combinations are drawn in a seeded random order, skipping any whose removal would leave one of
    its words (a colour, shape, direction or speed) in no training combination, so held-out prompts
    are new compositions of seen words. Both lists keep the `all_specs()` order.
    """
    specs = all_specs()
    total = len(specs)
    if isinstance(holdout, bool) or not isinstance(holdout, (int, float)):
        raise ValueError(f"holdout must be an int count or a float fraction, got {holdout!r}")
    if isinstance(holdout, float):
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"holdout fraction must be in [0, 1), got {holdout}")
        count = int(round(holdout * total))
    else:
        count = holdout
    if not 0 <= count < total:
        raise ValueError(f"holdout count must be in [0, {total}) (there are {total} combinations), got {count}")
    uses: dict[tuple[str, str], int] = {}
    for s in specs:
        for key in _word_keys(s):
            uses[key] = uses.get(key, 0) + 1
    held: set[int] = set()
    for i in np.random.default_rng(seed).permutation(total):
        if len(held) == count:
            break
        keys = _word_keys(specs[i])
        if all(uses[k] > 1 for k in keys):
            held.add(int(i))
            for k in keys:
                uses[k] -= 1
    if len(held) < count:
        raise ValueError(f"cannot hold out {count} combinations and keep every word in training; at most {len(held)}")
    return [s for i, s in enumerate(specs) if i not in held], [s for i, s in enumerate(specs) if i in held]


def _word_keys(s: ClipSpec) -> tuple[tuple[str, str], ...]:
    return (("colour", s.colour), ("shape", s.shape), ("direction", s.direction), ("speed", s.speed))


# ---------------------------------------------------------------------------------------------
# Geometry


def _on_grid(value: float) -> float:
    return round(value * SUBPIXEL) / SUBPIXEL


def _check_size(size) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < MIN_SIZE:
        raise ValueError(f"size must be an int >= {MIN_SIZE} px (the shape is {SHAPE_FRACTION} of it), got {size!r}")
    return int(size)


def _check_frames(num_frames) -> int:
    if isinstance(num_frames, bool) or not isinstance(num_frames, (int, np.integer)) or num_frames < MIN_FRAMES:
        raise ValueError(f"num_frames must be an int >= {MIN_FRAMES}, got {num_frames!r}")
    return int(num_frames)


def shape_px(size: int) -> float:
    """Side of the shape's box in px for a `size` px frame (4.0 at 16 px)."""
    return _on_grid(SHAPE_FRACTION * _check_size(size))


def speed_px(speed: str, size: int) -> float:
    """Displacement per frame in px of `speed` in a `size` px frame (0.75 / 1.5 at 16 px)."""
    _check_word("speed", speed, tuple(SPEEDS))
    return max(1.0 / SUBPIXEL, _on_grid(SPEEDS[speed] * _check_size(size) / REFERENCE_SIZE))


def shape_area(shape: str, size: int) -> float:
    """The shape's area in px (square S^2, circle pi S^2 / 4, triangle S^2 / 2, S = shape_px(size))."""
    _check_word("shape", shape, SHAPES)
    side = shape_px(size)
    return {"square": side * side, "circle": math.pi * side * side / 4, "triangle": side * side / 2}[shape]


def direction_vector(direction: str) -> np.ndarray:
    """Unit (x, y) vector of `direction`, y pointing down."""
    _check_word("direction", direction, tuple(DIRECTIONS))
    return np.asarray(DIRECTIONS[direction], dtype=np.float64)


def check_fits(speed: str, num_frames: int, size: int) -> None:
    """Raise ValueError unless a shape moving at `speed` for `num_frames` stays inside a `size` frame."""
    size, num_frames = _check_size(size), _check_frames(num_frames)
    side, step = shape_px(size), speed_px(speed, size)
    need = side + step * (num_frames - 1)
    if need > size:
        longest = int((size - side) // step) + 1
        raise ValueError(
            f"a {speed!r} clip of num_frames={num_frames} does not fit a {size} px frame: shape {side:g} px + travel "
            f"{step:g} px/frame x {num_frames - 1} = {need:g} px > {size} px; use num_frames <= {longest} "
            f"(shape and speed scale with size, so a larger size does not help)")


@lru_cache(maxsize=None)
def _templates(side_q: int) -> np.ndarray:
    """Coverage of each shape at each sub-pixel phase: [len(SHAPES), SUBPIXEL, SUBPIXEL, T, T] float32.

    Window pixel (i, j) of phase (py, px) is covered by the shape whose box's top-left corner is at
    (px, py) / SUBPIXEL px inside the window."""
    side = side_q / SUBPIXEL
    win = _window(side_q)
    r = SUPERSAMPLE
    u = (np.arange(win * r) + 0.5) / r
    out = np.zeros((len(SHAPES), SUBPIXEL, SUBPIXEL, win, win), np.float32)
    for py in range(SUBPIXEL):
        y0 = py / SUBPIXEL
        yy = u[:, None] - y0  # relative to the box's top edge
        for px in range(SUBPIXEL):
            x0 = px / SUBPIXEL
            xx = u[None, :] - x0
            inside = {
                "square": (xx >= 0) & (xx < side) & (yy >= 0) & (yy < side),
                "circle": (xx - side / 2) ** 2 + (yy - side / 2) ** 2 <= (side / 2) ** 2,
                "triangle": (yy >= 0) & (yy < side) & (np.abs(xx - side / 2) <= yy / 2),
            }
            for k, name in enumerate(SHAPES):
                out[k, py, px] = inside[name].reshape(win, r, win, r).mean(axis=(1, 3))
    return out


def _window(side_q: int) -> int:
    return -(-(side_q + SUBPIXEL - 1) // SUBPIXEL)


def _render(specs: list[ClipSpec], rng: np.random.Generator, num_frames: int, size: int):
    """Clips of `specs` (one each): (uint8 [n, F, H, W, 3], bbox-centre tracks [n, F, 2] float (x, y))."""
    n, frames = len(specs), num_frames
    for speed in sorted({s.speed for s in specs}):
        check_fits(speed, num_frames, size)
    side_q = int(round(shape_px(size) * SUBPIXEL))
    size_q = size * SUBPIXEL
    shape_i = np.array([SHAPES.index(s.shape) for s in specs], np.int64)
    dirs = np.array([DIRECTIONS[s.direction] for s in specs], np.int64).reshape(n, 2)
    step_q = np.array([int(round(speed_px(s.speed, size) * SUBPIXEL)) for s in specs], np.int64)
    travel = step_q[:, None] * dirs * (frames - 1)  # [n, 2] signed, sub-pixel units
    lo = np.maximum(0, -travel)
    hi = size_q - side_q - np.maximum(0, travel)
    start = rng.integers(lo, hi + 1)  # [n, 2] top-left corner, inclusive bounds
    t = np.arange(frames)
    pos = start[:, None, :] + t[None, :, None] * step_q[:, None, None] * dirs[:, None, :]  # [n, F, 2]

    win = _window(side_q)
    tmpl = _templates(side_q)
    pix, phase = pos // SUBPIXEL, pos % SUBPIXEL
    m = n * frames
    canvas = np.zeros((m, size + win, size + win), np.float32)
    rows = pix[..., 1].reshape(m, 1) + np.arange(win)
    cols = pix[..., 0].reshape(m, 1) + np.arange(win)
    patches = tmpl[np.repeat(shape_i, frames), phase[..., 1].reshape(m), phase[..., 0].reshape(m)]
    canvas[np.arange(m)[:, None, None], rows[:, :, None], cols[:, None, :]] = patches
    alpha = canvas[:, :size, :size].reshape(n, frames, size, size, 1)

    bg = np.asarray(BACKGROUND, np.float32)
    colour = np.array([PALETTE[s.colour] for s in specs], np.float32).reshape(n, 1, 1, 1, 3)
    clips = np.rint(bg + alpha * (colour - bg)).astype(np.uint8)
    centres = pos.astype(np.float64) / SUBPIXEL + shape_px(size) / 2
    return clips, centres


def _check_spec(spec) -> ClipSpec:
    if not isinstance(spec, ClipSpec):
        raise ValueError(f"spec must be a ClipSpec, got {type(spec).__name__}")
    return spec


def _check_rng(rng) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), "
                         f"got {type(rng).__name__}")
    return rng


def make_clip(spec: ClipSpec, rng: np.random.Generator, num_frames: int = 8, size: int = 16,
              return_track: bool = False):
    """One clip of `spec`: uint8 [F, H, W, 3]; with `return_track`, (frames, centres [F, 2]) where
    centres are the shape box's centre (x, y) in px per frame (it moves exactly `speed_px` per frame)."""
    spec, rng = _check_spec(spec), _check_rng(rng)
    num_frames, size = _check_frames(num_frames), _check_size(size)
    clips, centres = _render([spec], rng, num_frames, size)
    return (clips[0], centres[0]) if return_track else clips[0]


def make_dataset(specs: list[ClipSpec], n: int, seed: int, num_frames: int = 8, size: int = 16,
                 return_tracks: bool = False):
    """`n` seeded clips over `specs` (each spec used n // len(specs) or one more times, in a seeded
    random order): (clips uint8 [n, F, H, W, 3], their specs) and, with `return_tracks`, centres
    [n, F, 2]."""
    specs = [_check_spec(s) for s in specs]
    if not specs:
        raise ValueError("specs is empty; pass at least one ClipSpec (e.g. all_specs())")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    num_frames, size = _check_frames(num_frames), _check_size(size)
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.resize(np.arange(len(specs)), int(n)))
    chosen = [specs[i] for i in order]
    clips, centres = _render(chosen, rng, num_frames, size)
    return (clips, chosen, centres) if return_tracks else (clips, chosen)
