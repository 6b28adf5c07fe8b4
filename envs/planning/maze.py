"""Maze: walk from the start to the goal through a grid of cells separated by thin walls.

Walls live on cell sides (``Layout.walls``, a bitmask per cell, see ``grid.WALL_BITS``). The
generator carves a perfect maze by randomised depth-first search (so every cell is reachable and
the shortest path is unique), optionally knocking out extra walls to create loops.
"""

from __future__ import annotations

import numpy as np

from .grid import DELTAS, OPPOSITE, WALL_BITS, Cell, Layout

ALL_WALLS = int(WALL_BITS.sum())


def carve(rng: np.random.Generator, size: int) -> np.ndarray:
    """uint8 [size, size] wall bitmasks of a perfect maze (randomised DFS, iterative)."""
    walls = np.full((size, size), ALL_WALLS, np.uint8)
    seen = np.zeros((size, size), bool)
    start = divmod(int(rng.integers(size * size)), size)
    stack = [start]
    seen[start] = True
    while stack:
        r, c = stack[-1]
        opts = [d for d in range(4)
                if 0 <= r + DELTAS[d, 0] < size and 0 <= c + DELTAS[d, 1] < size
                and not seen[r + DELTAS[d, 0], c + DELTAS[d, 1]]]
        if not opts:
            stack.pop()
            continue
        d = opts[int(rng.integers(len(opts)))]
        nr, nc = r + int(DELTAS[d, 0]), c + int(DELTAS[d, 1])
        walls[r, c] &= ~WALL_BITS[d]
        walls[nr, nc] &= ~WALL_BITS[OPPOSITE[d]]
        seen[nr, nc] = True
        stack.append((nr, nc))
    return walls


def open_extra(rng: np.random.Generator, walls: np.ndarray, frac: float) -> np.ndarray:
    """Remove a fraction ``frac`` of the remaining interior walls (adds loops)."""
    walls = walls.copy()
    h, w = walls.shape
    inner = [(r, c, d) for r in range(h) for c in range(w) for d in (1, 2)  # DOWN, RIGHT sides
             if r + DELTAS[d, 0] < h and c + DELTAS[d, 1] < w and walls[r, c] & WALL_BITS[d]]
    k = int(round(frac * len(inner)))
    for i in rng.permutation(len(inner))[:k]:
        r, c, d = inner[i]
        walls[r, c] &= ~WALL_BITS[d]
        walls[r + DELTAS[d, 0], c + DELTAS[d, 1]] &= ~WALL_BITS[OPPOSITE[d]]
    return walls


def generate(rng: np.random.Generator, size: int, extra_open: float = 0.0) -> Layout:
    """A random size x size maze with a uniform goal and a uniform start != goal."""
    if size < 2:
        raise ValueError(f"maze size must be >= 2, got {size}")
    if not 0.0 <= extra_open <= 1.0:
        raise ValueError(f"extra_open must be in [0, 1], got {extra_open}")
    walls = carve(rng, size)
    if extra_open > 0:
        walls = open_extra(rng, walls, extra_open)
    cells = rng.choice(size * size, size=2, replace=False)
    goal, start = divmod(int(cells[0]), size), divmod(int(cells[1]), size)
    grid = np.full((size, size), Cell.FLOOR, np.uint8)
    grid[goal] = Cell.GOAL
    return Layout("maze", grid, start, goal, walls=walls)
