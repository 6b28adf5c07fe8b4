"""MiniBehavior "install a printer": walk to the printer, PICK it, carry it to the table, DROP it.

The grid includes a ring of walls (7x7 for the paper's level 5, 8x8 for level 6). The table is a
2 x 3 block of cells (as in every record of the paper's test split); table and printer cells are
obstacles, the printer's cell frees up once it is picked. PICK is legal from a cell 4-adjacent to
the printer, DROP from a cell 4-adjacent to the table; the printer lands on that table cell.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .grid import INF, Cell, Layout

DEFAULT_TABLE_SHAPE = (2, 3)


def make_layout(interior: int, start: tuple[int, int], printer: tuple[int, int],
                table: Sequence[tuple[int, int]], start_dir: int = 0, interior_coords: bool = True,
                meta: dict | None = None) -> Layout:
    """A layout from object positions. ``interior_coords``: cells given inside the walls (paper)."""
    off = 1 if interior_coords else 0
    n = interior + 2
    grid = np.full((n, n), Cell.FLOOR, np.uint8)
    grid[0, :] = grid[-1, :] = grid[:, 0] = grid[:, -1] = Cell.WALL
    tcells = tuple((int(r) + off, int(c) + off) for r, c in table)
    for rc in tcells:
        if not (1 <= rc[0] <= interior and 1 <= rc[1] <= interior):
            raise ValueError(f"table cell {rc} lies outside the {interior}x{interior} interior")
        grid[rc] = Cell.TABLE
    shift = (lambda rc: (int(rc[0]) + off, int(rc[1]) + off))
    return Layout("minibehavior", grid, shift(start), printer=shift(printer), table=tcells,
                  start_dir=start_dir, meta=meta or {})


def generate(rng: np.random.Generator, size: int, table_shape: tuple[int, int] = DEFAULT_TABLE_SHAPE,
             max_tries: int = 1000) -> Layout:
    """A random room with ``size`` x ``size`` interior, a table block, a printer and a start."""
    th, tw = table_shape
    if size < max(th, tw) + 1:
        raise ValueError(f"minibehavior interior {size} too small for a {th}x{tw} table")
    for _ in range(max_tries):
        tr, tc = int(rng.integers(size - th + 1)), int(rng.integers(size - tw + 1))
        table = [(tr + i, tc + j) for i in range(th) for j in range(tw)]
        free = [(r, c) for r in range(size) for c in range(size) if (r, c) not in set(table)]
        i, j = rng.choice(len(free), size=2, replace=False)
        layout = make_layout(size, free[int(j)], free[int(i)], table, start_dir=int(rng.integers(4)))
        if layout.distance[0][layout.start] < INF:
            return layout
    raise RuntimeError(f"could not draw a solvable minibehavior room of interior {size} in {max_tries} tries")
