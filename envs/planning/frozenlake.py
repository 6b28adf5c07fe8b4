"""FrozenLake: reach the goal G over frozen ice F without falling into a hole H.

Dynamics are gymnasium's non-slippery ``FrozenLake-v1`` (4 moves, bump = stay, hole and goal
terminate). The generator draws the goal and the start anywhere, like the VPRL test split, rather
than gymnasium's fixed corners.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .grid import INF, Cell, Layout

DEFAULT_HOLE_PROB = 0.2
_CHARS = {"F": Cell.FLOOR, "S": Cell.FLOOR, "G": Cell.GOAL, "H": Cell.HOLE}


def from_text(rows: Sequence[str] | Sequence[Sequence[str]]) -> Layout:
    """Build a layout from FrozenLake rows such as ``["SFF", "FHF", "FFG"]``."""
    grid = np.zeros((len(rows), len(rows[0])), np.uint8)
    start = goal = None
    for r, row in enumerate(rows):
        if len(row) != grid.shape[1]:
            raise ValueError(f"row {r} has {len(row)} cells, expected {grid.shape[1]}")
        for c, ch in enumerate(row):
            if ch not in _CHARS:
                raise ValueError(f"unknown FrozenLake cell {ch!r} at ({r}, {c}); valid: S F H G")
            grid[r, c] = _CHARS[ch]
            if ch == "S":
                start = (r, c)
            elif ch == "G":
                goal = (r, c)
    if start is None or goal is None:
        raise ValueError("a FrozenLake map needs one S and one G")
    return Layout("frozenlake", grid, start, goal)


def to_gym_desc(layout: Layout) -> list[str]:
    """The map as gymnasium's ``desc`` rows (for ``gymnasium.make('FrozenLake-v1', desc=...)``)."""
    if layout.task != "frozenlake":
        raise ValueError(f"to_gym_desc needs a frozenlake layout, got {layout.task}")
    return layout.as_text()


def generate(rng: np.random.Generator, size: int, hole_prob: float = DEFAULT_HOLE_PROB,
             max_tries: int = 1000) -> Layout:
    """A random size x size map: uniform goal, i.i.d. holes, a uniform start that reaches the goal."""
    if size < 2:
        raise ValueError(f"frozenlake size must be >= 2, got {size}")
    if not 0.0 <= hole_prob < 1.0:
        raise ValueError(f"hole_prob must be in [0, 1), got {hole_prob}")
    for _ in range(max_tries):
        goal = divmod(int(rng.integers(size * size)), size)
        grid = np.where(rng.random((size, size)) < hole_prob, Cell.HOLE, Cell.FLOOR).astype(np.uint8)
        grid[goal] = Cell.GOAL
        probe = Layout("frozenlake", grid, _any_floor(grid), goal) if (grid == Cell.FLOOR).any() else None
        if probe is None:
            continue
        starts = np.argwhere((probe.distance[0] < INF) & (grid == Cell.FLOOR))
        if len(starts) == 0:
            continue
        start = tuple(int(v) for v in starts[rng.integers(len(starts))])
        return Layout("frozenlake", grid, start, goal)
    raise RuntimeError(f"could not draw a solvable {size}x{size} FrozenLake map in {max_tries} tries")


def _any_floor(grid: np.ndarray) -> tuple[int, int]:
    r, c = np.argwhere(grid == Cell.FLOOR)[0]
    return (int(r), int(c))
