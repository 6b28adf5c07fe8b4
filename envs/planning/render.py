"""RGB renderer and noise-robust state parser of the planning tasks.

Picture: every cell is a flat colour of its :class:`~.grid.Cell` type; the agent is a red disc in
its cell; the printer a purple square; an agent carrying the printer shows a purple dot inside the
disc; maze walls are dark bands along the closed cell sides. All shapes are defined in cell units
(fractions of a cell, measured from its centre), so frames of any size (including non-integer cell
sizes, e.g. 256 px for 7 cells) render and parse the same way.

Parser: per cell, the mean colour of a few sample regions (background corners, a ring inside the
agent disc, the core, and for mazes the four wall bands) is classified against the palette with a
distance bound and a confidence margin; any unconfident region, any changed static cell, an agent
count other than one, or an impossible printer makes the frame :data:`~.grid.UNPARSEABLE`.
Everything is vectorised over cells and over a batch of frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import Sequence

import numpy as np

from .grid import (
    INVALID_STATE,
    PHASE,
    PRINTER_COL,
    PRINTER_ROW,
    STATE_DIM,
    WALL_BITS,
    Cell,
    Layout,
    ParsedState,
    Phase,
    _Unparseable,
)


class Colour(IntEnum):
    """Palette indices: the static cell codes, then the two foreground objects."""

    FLOOR = 0
    GOAL = 1
    HOLE = 2
    WALL = 3
    TABLE = 4
    AGENT = 5
    PRINTER = 6


# Flat RGB colours: pairwise >= 115 apart and >= 115 from mid-grey (so uniform noise, whose cell
# means sit near grey, matches nothing).
PALETTE = np.array([
    (235, 235, 235),  # FLOOR: ice / floor
    (250, 200, 20),  # GOAL: gold
    (30, 60, 160),  # HOLE: deep blue
    (45, 45, 45),  # WALL: near black (MiniBehavior ring, maze wall bands)
    (40, 170, 60),  # TABLE: green
    (225, 30, 30),  # AGENT: red
    (160, 40, 210),  # PRINTER: purple
], dtype=np.float32)
# Colours a task can show; regions are classified among these only (wider margins).
TASK_COLOURS = {
    "frozenlake": (Colour.FLOOR, Colour.GOAL, Colour.HOLE, Colour.AGENT),
    "maze": (Colour.FLOOR, Colour.GOAL, Colour.WALL, Colour.AGENT),
    "minibehavior": (Colour.FLOOR, Colour.WALL, Colour.TABLE, Colour.AGENT, Colour.PRINTER),
}
_TASK_MASK = {t: np.isin(np.arange(len(Colour)), [int(c) for c in cs]) for t, cs in TASK_COLOURS.items()}

# Shapes (cell units from the cell centre).
AGENT_RADIUS = 0.30
CARRY_RADIUS = 0.15
PRINTER_HALF = 0.28
WALL_BAND = 0.10
# Sample regions, each kept clear of shape borders by a margin for blur and block artefacts.
CORE_RADIUS = 0.10  # radius <= : inside the carry dot and the printer
RING = (0.20, 0.26)  # radius in [lo, hi]: inside the disc, outside the carry dot
BG_OPEN = (0.35, 0.46)  # max-norm in [lo, hi]: outside disc/printer (no walls drawn)
BG_MAZE = (0.34, 0.37)  # same, inside the maze wall bands
BG_MAZE_LIMITS = (0.32, 0.395)  # how far BG_MAZE may widen when a cell size leaves it empty
WALL_SAMPLE = 0.06  # distance to the side <=, and |along the side| <= WALL_ALONG
WALL_ALONG = 0.30

MAX_REGION_PIXELS = 128
PARSE_CHUNK = 64  # frames per vectorised pass (keeps the gathered pixels in cache)
DEFAULT_CELL_SIZE = 32
DEFAULT_MAX_DIST = 70.0
DEFAULT_MARGIN = 20.0

BG, RING_R, CORE = 0, 1, 2  # region indices; maze adds 3 + direction (LEFT, DOWN, RIGHT, UP)


class ParseFailure(IntEnum):
    """Why a frame was unparseable (``parse_batch_array(..., return_reasons=True)``)."""

    OK = 0
    LOW_CONFIDENCE = 1  # some region matches no palette colour confidently (garbage, heavy noise)
    STATIC_CHANGED = 2  # a static cell (hole, goal, wall, table, maze wall) is not what the map says
    BAD_OBJECT = 3  # a cell shows no valid combination of agent / printer
    AGENT_COUNT = 4  # zero or several agents
    PRINTER = 5  # printer missing, duplicated, carried twice, or somewhere it cannot be
    WRONG_SIZE = 6  # frame is not H x W x 3


def _pixel_coords(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cell index and offset from the cell centre (in cell units) of each pixel along one axis."""
    f = (np.arange(size) + 0.5) * n / size
    idx = np.minimum(np.floor(f).astype(np.int64), n - 1)
    return idx, f - idx - 0.5


@dataclass(frozen=True)
class _Geometry:
    rows: np.ndarray  # [H] cell row of each pixel row
    cols: np.ndarray  # [W]
    v: np.ndarray  # [H, 1] vertical offset
    u: np.ndarray  # [1, W] horizontal offset
    n_regions: int
    perm: np.ndarray  # flat pixel indices sorted by (cell, region) label; ignored pixels dropped
    starts: np.ndarray  # segment starts into perm, one per (cell, region)
    counts: np.ndarray  # pixels per (cell, region)


@lru_cache(maxsize=64)
def _geometry(height: int, width: int, n_rows: int, n_cols: int, maze: bool) -> _Geometry:
    rows, v = _pixel_coords(n_rows, height)
    cols, u = _pixel_coords(n_cols, width)
    v, u = v[:, None], u[None, :]
    mx = np.maximum(np.abs(u), np.abs(v))
    rad = np.sqrt(u * u + v * v)
    n_regions = 7 if maze else 3
    region = np.full((height, width), -1, np.int64)
    region[rad <= CORE_RADIUS] = CORE
    region[(rad >= RING[0]) & (rad <= RING[1])] = RING_R
    cell = rows[:, None] * n_cols + cols[None, :]
    lo, hi = BG_MAZE if maze else BG_OPEN
    if maze:  # the maze band is thin: widen it (within limits) until every cell has pixels in it
        while True:
            band = (mx >= lo) & (mx <= hi)
            if np.bincount(cell[band], minlength=n_rows * n_cols).min() > 0 or (
                    lo <= BG_MAZE_LIMITS[0] and hi >= BG_MAZE_LIMITS[1]):
                break
            lo, hi = max(BG_MAZE_LIMITS[0], lo - 0.005), min(BG_MAZE_LIMITS[1], hi + 0.005)
    region[(mx >= lo) & (mx <= hi)] = BG
    if maze:
        # distance to the side crossed by each action: LEFT, DOWN, RIGHT, UP
        dist_side = [u + 0.5, 0.5 - v, 0.5 - u, v + 0.5]
        along = [np.abs(v), np.abs(u), np.abs(v), np.abs(u)]
        for d in range(4):
            region[np.broadcast_to(dist_side[d] <= WALL_SAMPLE, (height, width))
                   & np.broadcast_to(along[d] <= WALL_ALONG, (height, width))] = 3 + d
    label = np.where(region >= 0, cell * n_regions + region, -1).ravel()
    keep = np.flatnonzero(label >= 0)
    order = np.argsort(label[keep], kind="stable")
    perm = keep[order]
    counts = np.bincount(label[perm], minlength=n_rows * n_cols * n_regions)
    if counts.min() == 0:
        raise ValueError(f"frame {height}x{width} is too small for a {n_rows}x{n_cols} grid: cells of "
                         f"{height / n_rows:.1f}x{width / n_cols:.1f} px leave a sample region empty; "
                         "use cells of >= 12 px (>= 16 px for mazes)")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    # keep at most MAX_REGION_PIXELS evenly spread pixels per region: the mean of ~100 pixels is
    # already precise to a few grey levels under heavy noise, and this bounds the parse cost
    take = [np.unique(np.linspace(s, s + c - 1, min(c, MAX_REGION_PIXELS)).round().astype(np.int64))
            for s, c in zip(starts, counts)]
    counts = np.array([len(t) for t in take], np.int64)
    perm = perm[np.concatenate(take)]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return _Geometry(rows, cols, v, u, n_regions, perm, starts, counts)


# ----------------------------------------------------------------------------- rendering


def frame_shape(layout: Layout, cell_size: int = DEFAULT_CELL_SIZE) -> tuple[int, int, int]:
    return (layout.shape[0] * int(cell_size), layout.shape[1] * int(cell_size), 3)


def render_state(layout: Layout, state: np.ndarray | ParsedState | None = None,
           cell_size: int = DEFAULT_CELL_SIZE, image_size: tuple[int, int] | int | None = None) -> np.ndarray:
    """uint8 [H, W, 3] picture of ``state`` (default: the start) on ``layout``.

    ``cell_size``: pixels per cell. ``image_size``: (H, W) or an int (square) to render at an exact
    frame size instead (cells may then be fractional).
    """
    if int(cell_size) < 1:
        raise ValueError(f"cell_size must be >= 1, got {cell_size}")
    n_rows, n_cols = layout.shape
    if image_size is None:
        height, width = n_rows * int(cell_size), n_cols * int(cell_size)
    elif isinstance(image_size, (int, np.integer)):
        height = width = int(image_size)
    else:
        height, width = (int(x) for x in image_size)
    s = layout.start_state() if state is None else (
        state.to_array() if isinstance(state, ParsedState) else np.asarray(state, np.int64))
    if s[0] < 0:
        raise ValueError("cannot render an unparseable state")
    rows, v = _pixel_coords(n_rows, height)
    cols, u = _pixel_coords(n_cols, width)
    v, u = v[:, None], u[None, :]
    rr, cc = rows[:, None], cols[None, :]
    cls = layout.grid[rr, cc].astype(np.int64)  # [H, W] palette index
    if layout.walls is not None:
        w = layout.walls[rr, cc]
        for d, dist in enumerate((u + 0.5, 0.5 - v, 0.5 - u, v + 0.5)):
            cls = np.where(((w & WALL_BITS[d]) != 0) & (dist < WALL_BAND), Colour.WALL, cls)
    mx = np.maximum(np.abs(u), np.abs(v))
    rad2 = u * u + v * v
    if s[PRINTER_ROW] >= 0:
        here = (rr == s[PRINTER_ROW]) & (cc == s[PRINTER_COL])
        cls = np.where(here & (mx < PRINTER_HALF), Colour.PRINTER, cls)
    agent = (rr == s[0]) & (cc == s[1])
    cls = np.where(agent & (rad2 < AGENT_RADIUS ** 2), Colour.AGENT, cls)
    if s[PHASE] == Phase.CARRYING:
        cls = np.where(agent & (rad2 < CARRY_RADIUS ** 2), Colour.PRINTER, cls)
    return PALETTE.astype(np.uint8)[cls]


def render_batch(layouts: Sequence[Layout], states: np.ndarray | None = None,
                 cell_size: int = DEFAULT_CELL_SIZE, image_size: tuple[int, int] | int | None = None
                 ) -> np.ndarray:
    """uint8 [B, H, W, 3]; all frames must come out the same size (same grid shape or image_size)."""
    if states is None:
        states = [None] * len(layouts)
    frames = [render_state(lay, s, cell_size, image_size) for lay, s in zip(layouts, states)]
    shapes = {f.shape for f in frames}
    if len(shapes) > 1:
        raise ValueError(f"frames of different sizes {sorted(shapes)}; pass image_size to batch them")
    return np.stack(frames) if frames else np.zeros((0, 1, 1, 3), np.uint8)


# ----------------------------------------------------------------------------- parsing


def _as_uint8_frames(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.dtype == np.uint8:
        return frames
    if np.issubdtype(frames.dtype, np.floating) and frames.size and float(np.nanmax(frames)) <= 1.0 + 1e-6:
        frames = frames * 255.0  # decoders often return [0, 1] floats
    return np.clip(np.nan_to_num(frames), 0, 255).astype(np.uint8)


def _expected(layout: Layout) -> tuple[np.ndarray, np.ndarray | None]:
    """Expected background class per cell, and expected class of each maze wall band [H, W, 4]."""
    bg = layout.grid.astype(np.int64)
    if layout.walls is None:
        return bg, None
    closed = (layout.walls[..., None] & WALL_BITS[None, None, :]) != 0
    return bg, np.where(closed, Colour.WALL, bg[..., None])


def _classify(means: np.ndarray, allowed: np.ndarray, max_dist: float, margin: float) -> np.ndarray:
    """Nearest allowed palette index of each mean colour [B, ...], or -1 when not confident."""
    diff = means[..., None, :] - PALETTE
    d2 = np.einsum("...k,...k->...", diff, diff)  # squared distances [B, ..., P]
    d2 = np.where(allowed.reshape((len(allowed),) + (1,) * (d2.ndim - 2) + (-1,)), d2, np.inf)
    best = d2.argmin(-1)
    two = np.sqrt(np.partition(d2, 1, axis=-1)[..., :2])
    ok = (two[..., 0] <= max_dist) & (two[..., 1] - two[..., 0] >= margin)
    return np.where(ok, best, -1)


def _parse_group(frames: np.ndarray, layouts: Sequence[Layout], max_dist: float, margin: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Frames of one size and one grid shape/task family -> states [B, 5] and reasons [B]."""
    b, height, width, _ = frames.shape
    n_rows, n_cols = layouts[0].shape
    maze = layouts[0].walls is not None
    geo = _geometry(height, width, n_rows, n_cols, maze)
    k = n_rows * n_cols
    flat = frames.reshape(b, height * width, 3)
    sums = np.empty((b, len(geo.starts), 3), np.float32)
    for lo in range(0, b, PARSE_CHUNK):
        pix = np.take(flat[lo:lo + PARSE_CHUNK], geo.perm, axis=1).astype(np.float32)
        sums[lo:lo + PARSE_CHUNK] = np.add.reduceat(pix, geo.starts, axis=1)
    means = (sums / geo.counts[None, :, None]).reshape(b, k, geo.n_regions, 3)
    allowed = np.stack([_TASK_MASK[lay.task] for lay in layouts])
    cls = _classify(means, allowed, max_dist, margin)  # [B, K, R]

    exp = [_expected(lay) for lay in layouts]
    exp_bg = np.stack([e[0].reshape(k) for e in exp])  # [B, K]
    reasons = np.zeros(b, np.int64)
    low = (cls < 0).any(axis=(1, 2))
    static_bad = (cls[:, :, BG] != exp_bg).any(1)
    if maze:
        exp_w = np.stack([e[1].reshape(k, 4) for e in exp])
        static_bad |= (cls[:, :, 3:] != exp_w).any(axis=(1, 2))
    ring, core = cls[:, :, RING_R], cls[:, :, CORE]
    empty = (ring == exp_bg) & (core == exp_bg)
    agent = (ring == Colour.AGENT) & (core == Colour.AGENT)
    carry = (ring == Colour.AGENT) & (core == Colour.PRINTER)
    printer = (ring == Colour.PRINTER) & (core == Colour.PRINTER)
    bad_obj = ~(empty | agent | carry | printer).all(1)
    n_agents = (agent | carry).sum(1)
    n_carry = carry.sum(1)
    n_printer = printer.sum(1)
    pidx = printer.argmax(1)
    aidx = (agent | carry).argmax(1)

    is_mini = np.array([lay.task == "minibehavior" for lay in layouts])
    home = np.array([lay.printer[0] * n_cols + lay.printer[1] if lay.printer else -1 for lay in layouts])
    on_table = exp_bg[np.arange(b), pidx] == Cell.TABLE
    phase = np.where(n_carry > 0, Phase.CARRYING, np.where(on_table, Phase.DONE, Phase.INITIAL))
    printer_ok = np.where(
        is_mini,
        np.where(n_carry > 0, n_printer == 0, (n_printer == 1) & ((pidx == home) | on_table)),
        (n_printer == 0) & (n_carry == 0),
    )
    for code, cond in ((ParseFailure.PRINTER, ~printer_ok), (ParseFailure.AGENT_COUNT, n_agents != 1),
                       (ParseFailure.BAD_OBJECT, bad_obj), (ParseFailure.STATIC_CHANGED, static_bad),
                       (ParseFailure.LOW_CONFIDENCE, low)):
        reasons = np.where(cond, int(code), reasons)  # later assignments take precedence

    states = np.empty((b, STATE_DIM), np.int64)
    states[:, 0], states[:, 1] = np.divmod(aidx, n_cols)
    states[:, PHASE] = np.where(is_mini, phase, 0)
    has_p = is_mini & (phase != Phase.CARRYING)
    states[:, PRINTER_ROW] = np.where(has_p, pidx // n_cols, -1)
    states[:, PRINTER_COL] = np.where(has_p, pidx % n_cols, -1)
    states[reasons != 0] = INVALID_STATE
    return states, reasons


def parse_batch_array(frames: np.ndarray | Sequence[np.ndarray], layouts: Sequence[Layout], *,
                      max_dist: float = DEFAULT_MAX_DIST, margin: float = DEFAULT_MARGIN,
                      return_reasons: bool = False):
    """Parse B frames to int64 states [B, 5] (rows of -1 where unparseable).

    Frames may differ in size and layouts in shape: each (frame size, grid shape, maze?) group is
    parsed in one vectorised pass. ``return_reasons`` also returns :class:`ParseFailure` codes [B].
    """
    layouts = list(layouts)
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        frame_list = None
        if len(frames) != len(layouts):
            raise ValueError(f"{len(frames)} frames for {len(layouts)} layouts")
    else:
        frame_list = [np.asarray(f) for f in frames]
        if len(frame_list) != len(layouts):
            raise ValueError(f"{len(frame_list)} frames for {len(layouts)} layouts")
    b = len(layouts)
    states = np.tile(INVALID_STATE, (b, 1))
    reasons = np.full(b, int(ParseFailure.WRONG_SIZE), np.int64)
    groups: dict[tuple, list[int]] = {}
    for i, lay in enumerate(layouts):
        shape = frames.shape[1:] if frame_list is None else frame_list[i].shape
        if len(shape) != 3 or shape[2] != 3:
            continue
        groups.setdefault((shape[0], shape[1], lay.shape, lay.walls is not None), []).append(i)
    for (_, _, _, _), idx in groups.items():
        ix = np.asarray(idx)
        if frame_list is None:
            batch = frames if len(ix) == b else frames[ix]
        else:
            batch = np.stack([frame_list[i] for i in idx])
        st, rs = _parse_group(_as_uint8_frames(batch), [layouts[i] for i in idx], max_dist, margin)
        states[ix], reasons[ix] = st, rs
    return (states, reasons) if return_reasons else states


def parse_batch(frames: np.ndarray | Sequence[np.ndarray], layouts: Sequence[Layout], *,
                max_dist: float = DEFAULT_MAX_DIST, margin: float = DEFAULT_MARGIN
                ) -> list[ParsedState | _Unparseable]:
    """Parse B frames [B, H, W, 3] (one layout each) to ParsedState / UNPARSEABLE."""
    states = parse_batch_array(frames, layouts, max_dist=max_dist, margin=margin)
    return [ParsedState.from_array(s) for s in states]


def parse(frame: np.ndarray, layout: Layout, *, max_dist: float = DEFAULT_MAX_DIST,
          margin: float = DEFAULT_MARGIN) -> ParsedState | _Unparseable:
    """Parse one frame [H, W, 3] (uint8, or float in [0, 1]) of ``layout``."""
    return parse_batch([frame], [layout], max_dist=max_dist, margin=margin)[0]

