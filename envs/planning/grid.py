"""Shared grid machinery of the VPRL planning tasks (FrozenLake, Maze, MiniBehavior).

Everything here is symbolic (no pixels): the :class:`Layout` dataclass, the state vector, BFS
distance maps, optimal-path sets and the move dynamics, single and batched.

State vector (int64, length :data:`STATE_DIM`)::

    [row, col, phase, printer_row, printer_col]

``phase`` is 0 for FrozenLake/Maze. For MiniBehavior it is 0 (printer at its start cell),
1 (the agent carries the printer) or 2 (printer dropped on the table: the task is done);
``printer_*`` is the printer's cell (-1, -1 while carried or for the other tasks). An unparseable
state is the row of -1s (:data:`INVALID_STATE`).

Coordinates are (row, col) in the full grid. MiniBehavior grids include their ring of walls, so
an interior cell (r, c) of the paper's metadata is (r + 1, c + 1) here.

Actions follow gymnasium's FrozenLake: 0 LEFT, 1 DOWN, 2 RIGHT, 3 UP, plus 4 PICK and 5 DROP for
MiniBehavior. Blocked actions leave the state unchanged (``valid`` is False), as in gymnasium.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Any, Iterable, Sequence

import numpy as np

from mmrl.checkpoint import checkpointable

TASKS: tuple[str, ...] = ("frozenlake", "maze", "minibehavior")
_TASK_ALIASES = {
    "frozenlake": "frozenlake",
    "frozen_lake": "frozenlake",
    "frozen-lake": "frozenlake",
    "maze": "maze",
    "minibehavior": "minibehavior",
    "minibehaviour": "minibehavior",
    "mini_behavior": "minibehavior",
    "mini": "minibehavior",
}


def canonical_task(name: str) -> str:
    """Normalise a task name (case-insensitive, a few aliases); unknown names raise ValueError."""
    key = str(name).strip().lower()
    if key not in _TASK_ALIASES:
        raise ValueError(f"unknown planning task {name!r}; valid tasks: {', '.join(TASKS)}")
    return _TASK_ALIASES[key]


class Cell(IntEnum):
    """Static cell codes of ``Layout.grid`` (also the first palette indices of the renderer)."""

    FLOOR = 0  # frozen ice / maze floor / room floor; FrozenLake's 'S' is floor too
    GOAL = 1
    HOLE = 2
    WALL = 3  # MiniBehavior's outer ring
    TABLE = 4


class Action(IntEnum):
    LEFT = 0
    DOWN = 1
    RIGHT = 2
    UP = 3
    PICK = 4
    DROP = 5


class Phase(IntEnum):
    INITIAL = 0
    CARRYING = 1
    DONE = 2


STATE_DIM = 5
ROW, COL, PHASE, PRINTER_ROW, PRINTER_COL = range(STATE_DIM)
INVALID_STATE = np.full(STATE_DIM, -1, dtype=np.int64)
INF = 1_000_000  # "unreachable" in distance maps
N_PHASES = 3

# (d_row, d_col) per move action, in Action order (LEFT, DOWN, RIGHT, UP).
DELTAS = np.array([[0, -1], [1, 0], [0, 1], [-1, 0]], dtype=np.int64)
# Maze wall bits, one per side, in the same order: bit d closes the side that action d crosses.
WALL_BITS = np.array([1, 2, 4, 8], dtype=np.uint8)
OPPOSITE = np.array([2, 3, 0, 1], dtype=np.int64)
N_ACTIONS = {"frozenlake": 4, "maze": 4, "minibehavior": 6}


def _cell(value: Any, name: str) -> tuple[int, int]:
    try:
        r, c = (int(v) for v in value)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{name} must be a (row, col) pair, got {value!r}") from exc
    return (r, c)


@checkpointable  # contexts carry it, and a prompt replay buffer keeps contexts in checkpoints
@dataclass(frozen=True, eq=False)
class Layout:
    """One planning instance: the static map plus the start (and MiniBehavior's objects).

    ``grid``: uint8 [H, W] of :class:`Cell` codes. ``walls``: Maze only, uint8 [H, W] bitmask of
    closed sides (:data:`WALL_BITS`). ``printer`` / ``table``: MiniBehavior only. ``start_dir``
    is metadata (MiniGrid facing) and takes no part in the dynamics, the picture or ``key()``.
    """

    task: str
    grid: np.ndarray
    start: tuple[int, int]
    goal: tuple[int, int] | None = None
    walls: np.ndarray | None = None
    printer: tuple[int, int] | None = None
    table: tuple[tuple[int, int], ...] = ()
    start_dir: int = 0
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        task = canonical_task(self.task)
        grid = np.array(self.grid, dtype=np.uint8, copy=True)
        if grid.ndim != 2 or min(grid.shape) < 1:
            raise ValueError(f"grid must be a non-empty 2-D array, got shape {grid.shape}")
        if grid.max(initial=0) > max(Cell):
            raise ValueError(f"grid holds unknown cell codes {sorted(set(grid.ravel()) - set(map(int, Cell)))}")
        grid.setflags(write=False)
        object.__setattr__(self, "task", task)
        object.__setattr__(self, "grid", grid)
        start = _cell(self.start, "start")
        object.__setattr__(self, "start", start)
        if not self.in_grid(start):
            raise ValueError(f"start {start} lies outside the {grid.shape} grid")
        if grid[start] != Cell.FLOOR:
            raise ValueError(f"start {start} must be a floor cell, found {Cell(grid[start]).name}")
        if task in ("frozenlake", "maze"):
            if self.goal is None:
                raise ValueError(f"{task} layout needs a goal cell")
            goal = _cell(self.goal, "goal")
            object.__setattr__(self, "goal", goal)
            goals = np.argwhere(grid == Cell.GOAL)
            if len(goals) != 1 or tuple(goals[0]) != goal:
                raise ValueError(f"goal {goal} must be the single GOAL cell; GOAL cells: {goals.tolist()}")
            if self.printer is not None or self.table:
                raise ValueError(f"{task} layouts take no printer/table")
            bad = set(np.unique(grid).tolist()) - ({0, 1, 2} if task == "frozenlake" else {0, 1})
            if bad:
                raise ValueError(f"{task} grid holds cell codes {[Cell(b).name for b in bad]}")
        if task == "maze":
            walls = np.zeros(grid.shape, np.uint8) if self.walls is None else np.array(self.walls, np.uint8)
            if walls.shape != grid.shape:
                raise ValueError(f"walls shape {walls.shape} != grid shape {grid.shape}")
            _check_wall_symmetry(walls)
            walls.setflags(write=False)
            object.__setattr__(self, "walls", walls)
        elif self.walls is not None:
            raise ValueError(f"walls are for maze layouts only, not {task}")
        if task == "minibehavior":
            if self.goal is not None:
                raise ValueError("minibehavior layouts have no goal cell (the goal is printer-on-table)")
            if self.printer is None or not self.table:
                raise ValueError("minibehavior layout needs a printer cell and table cells")
            printer = _cell(self.printer, "printer")
            table = tuple(sorted(_cell(t, "table cell") for t in self.table))
            object.__setattr__(self, "printer", printer)
            object.__setattr__(self, "table", table)
            if not self.in_grid(printer) or grid[printer] != Cell.FLOOR:
                raise ValueError(f"printer {printer} must be on a floor cell")
            if printer == start:
                raise ValueError(f"start {start} coincides with the printer")
            tcells = {tuple(int(v) for v in x) for x in np.argwhere(grid == Cell.TABLE)}
            if tcells != set(table):
                raise ValueError(f"table cells {list(table)} disagree with the grid's TABLE cells {sorted(tcells)}")
            if set(np.unique(grid).tolist()) - {0, 3, 4}:
                raise ValueError("minibehavior grid may hold only FLOOR, WALL and TABLE cells")
        object.__setattr__(self, "start_dir", int(self.start_dir) % 4)

    # ----------------------------------------------------------------- identity
    def key(self) -> str:
        """Stable identity (hex digest) of the instance: task, map, start, goal, walls, objects."""
        return self._key

    @cached_property
    def _key(self) -> str:
        h = hashlib.sha1()
        h.update(self.task.encode())
        h.update(np.asarray(self.grid.shape, np.int64).tobytes())
        h.update(self.grid.tobytes())
        h.update(repr((self.start, self.goal, self.printer, self.table)).encode())
        if self.walls is not None:
            h.update(self.walls.tobytes())
        return h.hexdigest()[:20]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.key() == self.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"Layout({self.task}, level={self.level}, start={self.start}, key={self.key()})"

    # ----------------------------------------------------------------- geometry
    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.grid.shape[0]), int(self.grid.shape[1]))

    @property
    def level(self) -> int:
        """The paper's level: grid side for FrozenLake/Maze, interior side for MiniBehavior."""
        return self.shape[0] - 2 if self.task == "minibehavior" else self.shape[0]

    @property
    def n_actions(self) -> int:
        return N_ACTIONS[self.task]

    def in_grid(self, cell: tuple[int, int]) -> bool:
        return 0 <= cell[0] < self.grid.shape[0] and 0 <= cell[1] < self.grid.shape[1]

    def start_state(self) -> np.ndarray:
        pr, pc = self.printer if self.printer is not None else (-1, -1)
        return np.array([self.start[0], self.start[1], 0, pr, pc], dtype=np.int64)

    def as_text(self) -> list[str]:
        """FrozenLake-style rows ('S', 'F', 'H', 'G'; 'W' wall, 'T' table, 'P' printer)."""
        chars = np.array(["F", "G", "H", "W", "T"])[self.grid]
        chars[self.start] = "S"
        if self.printer is not None:
            chars[self.printer] = "P"
        return ["".join(row) for row in chars]

    # ----------------------------------------------------------------- derived maps
    @cached_property
    def distance(self) -> np.ndarray:
        """int32 [3, H, W]: BFS steps to task completion from (phase, row, col); INF if none."""
        d = distance_maps(self)
        d.setflags(write=False)
        return d

    @cached_property
    def table_dir(self) -> np.ndarray:
        """int8 [H, W]: the first action direction whose neighbour is a table cell, else -1."""
        return _adjacent_dir(self.grid, self.grid == Cell.TABLE)

    @cached_property
    def printer_adjacent(self) -> np.ndarray:
        """bool [H, W]: cells 4-adjacent to the printer's start cell (where PICK is legal)."""
        mask = np.zeros(self.shape, bool)
        if self.printer is not None:
            pmask = np.zeros(self.shape, bool)
            pmask[self.printer] = True
            mask = _adjacent_dir(self.grid, pmask) >= 0
        return mask

    @property
    def optimal_length(self) -> int:
        """Steps of a shortest plan from the start (moves, plus pick and drop for MiniBehavior)."""
        return int(self.distance[0][self.start])

    def dist_of(self, state: np.ndarray) -> int:
        s = np.asarray(state)
        if s[ROW] < 0 or not self.in_grid((int(s[ROW]), int(s[COL]))) or not 0 <= s[PHASE] < N_PHASES:
            return INF
        return int(self.distance[int(s[PHASE]), int(s[ROW]), int(s[COL])])

    def is_terminal(self, state: np.ndarray) -> bool:
        s = np.asarray(state)
        if self.task == "minibehavior":
            return int(s[PHASE]) == Phase.DONE
        return int(self.grid[int(s[ROW]), int(s[COL])]) in (Cell.GOAL, Cell.HOLE)

    def is_goal(self, state: np.ndarray) -> bool:
        return self.dist_of(state) == 0


def _check_wall_symmetry(walls: np.ndarray) -> None:
    h, w = walls.shape
    for d, (dr, dc) in enumerate(DELTAS):
        has = (walls & WALL_BITS[d]) != 0
        rs, cs = np.nonzero(has)
        nr, nc = rs + dr, cs + dc
        inside = (nr >= 0) & (nr < h) & (nc >= 0) & (nc < w)
        back = (walls[nr[inside], nc[inside]] & WALL_BITS[OPPOSITE[d]]) != 0
        if not back.all():
            i = np.flatnonzero(~back)[0]
            raise ValueError(f"maze wall at cell ({rs[inside][i]}, {cs[inside][i]}) side {Action(d).name} "
                             "is not mirrored by its neighbour")


def _adjacent_dir(grid: np.ndarray, target: np.ndarray) -> np.ndarray:
    """For each cell, the first direction d (Action order) whose neighbour is in ``target``."""
    h, w = grid.shape
    out = np.full((h, w), -1, np.int8)
    padded = np.pad(target, 1)
    for d in range(3, -1, -1):  # reverse so the lowest direction index wins
        dr, dc = int(DELTAS[d, 0]), int(DELTAS[d, 1])
        out[padded[1 + dr:1 + dr + h, 1 + dc:1 + dc + w]] = d
    return out


# ----------------------------------------------------------------------------- BFS


def passable(layout: Layout, phase: int) -> np.ndarray:
    """bool [H, W]: cells the agent may stand on as a non-terminal, VPRL-valid state."""
    g = layout.grid
    ok = (g == Cell.FLOOR) | (g == Cell.GOAL)
    if layout.task == "minibehavior" and phase == Phase.INITIAL:
        ok = ok.copy()
        ok[layout.printer] = False
    return ok


def _open_moves(layout: Layout, r: int, c: int) -> Iterable[tuple[int, int, int]]:
    h, w = layout.shape
    walls = layout.walls
    for d in range(4):
        nr, nc = r + int(DELTAS[d, 0]), c + int(DELTAS[d, 1])
        if 0 <= nr < h and 0 <= nc < w and not (walls is not None and walls[r, c] & WALL_BITS[d]):
            yield d, nr, nc


def _multi_source_bfs(layout: Layout, phase: int, init: dict[tuple[int, int], int]) -> np.ndarray:
    """Shortest unit-step distances with per-source start values (Dijkstra on a tiny grid)."""
    ok = passable(layout, phase)
    dist = np.full(layout.shape, INF, np.int32)
    heap = [(v, cell) for cell, v in init.items() if ok[cell]]
    for v, cell in heap:
        dist[cell] = min(dist[cell], v)
    heapq.heapify(heap)
    while heap:
        v, (r, c) = heapq.heappop(heap)
        if v > dist[r, c]:
            continue
        # moves are symmetric (walls mirrored), so expanding outward from the sources is exact
        for _, nr, nc in _open_moves(layout, r, c):
            if ok[nr, nc] and v + 1 < dist[nr, nc]:
                dist[nr, nc] = v + 1
                heapq.heappush(heap, (v + 1, (nr, nc)))
    return dist


def distance_maps(layout: Layout) -> np.ndarray:
    """int32 [3, H, W] BFS distance to completion per phase (see :attr:`Layout.distance`).

    FrozenLake/Maze: phase 0 is the distance to the goal avoiding holes (holes are terminal and
    count as unreachable, as in the paper's ``distance_map``). MiniBehavior: phase 1 = steps to a
    table neighbour + 1 (drop); phase 0 = steps to a printer neighbour + 1 (pick) + phase-1 value,
    minimised jointly, which is the paper's ``best_paths`` criterion; phase 2 = 0 (done).
    """
    d = np.full((N_PHASES,) + layout.shape, INF, np.int32)
    if layout.task in ("frozenlake", "maze"):
        d[0] = _multi_source_bfs(layout, 0, {layout.goal: 0})
        return d
    free1 = passable(layout, Phase.CARRYING)
    table_adj = layout.table_dir >= 0
    d[1] = _multi_source_bfs(layout, 1, {tuple(map(int, rc)): 1 for rc in np.argwhere(free1 & table_adj)})
    free0 = passable(layout, Phase.INITIAL)
    init0 = {tuple(map(int, rc)): int(d[1][tuple(rc)]) + 1
             for rc in np.argwhere(free0 & layout.printer_adjacent) if d[1][tuple(rc)] < INF}
    d[0] = _multi_source_bfs(layout, 0, init0)
    d[2] = np.where(free1, 0, INF)
    return d


# ----------------------------------------------------------------------------- states


@dataclass(frozen=True)
class ParsedState:
    """A symbolic state, as parsed from a frame. ``printer`` is None while carried / absent."""

    agent: tuple[int, int]
    phase: int = 0
    printer: tuple[int, int] | None = None

    @property
    def carrying(self) -> bool:
        return self.phase == Phase.CARRYING

    def to_array(self) -> np.ndarray:
        pr, pc = self.printer if self.printer is not None else (-1, -1)
        return np.array([self.agent[0], self.agent[1], self.phase, pr, pc], dtype=np.int64)

    @staticmethod
    def from_array(a: np.ndarray) -> "ParsedState | _Unparseable":
        a = np.asarray(a)
        if a[ROW] < 0:
            return UNPARSEABLE
        printer = None if a[PRINTER_ROW] < 0 else (int(a[PRINTER_ROW]), int(a[PRINTER_COL]))
        return ParsedState((int(a[ROW]), int(a[COL])), int(a[PHASE]), printer)


class _Unparseable:
    """Singleton returned by the parser for frames it cannot read. Falsy."""

    _instance: "_Unparseable | None" = None

    def __new__(cls) -> "_Unparseable":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "UNPARSEABLE"

    def __reduce__(self) -> str:
        return "UNPARSEABLE"

    def to_array(self) -> np.ndarray:
        return INVALID_STATE.copy()


UNPARSEABLE = _Unparseable()


def state_array(obj: Any, layout: Layout) -> np.ndarray:
    """Normalise one state to the int64 [5] vector.

    Accepts a :class:`ParsedState`, ``UNPARSEABLE``/``None``, a (row, col) pair, a
    (row, col, phase) triple or a full 5-vector. Missing printer fields are filled from the
    layout: the start cell in phase 0, none in phase 1, the table cell next to the agent in phase 2.
    """
    if obj is None or obj is UNPARSEABLE:
        return INVALID_STATE.copy()
    if isinstance(obj, ParsedState):
        return obj.to_array()
    a = np.asarray(obj, dtype=np.int64).ravel()
    if a.size == STATE_DIM:
        return a.copy()
    if a.size not in (2, 3):
        raise ValueError(f"a state must have 2, 3 or {STATE_DIM} ints, got {obj!r}")
    phase = int(a[2]) if a.size == 3 else 0
    out = np.array([a[0], a[1], phase, -1, -1], dtype=np.int64)
    if layout.task == "minibehavior":
        if phase == Phase.INITIAL:
            out[3:] = layout.printer
        elif phase == Phase.DONE and layout.in_grid((int(a[0]), int(a[1]))):
            d = int(layout.table_dir[int(a[0]), int(a[1])])
            if d >= 0:
                out[3:] = (a[0] + DELTAS[d, 0], a[1] + DELTAS[d, 1])
    return out


def states_array(states: Any, layouts: Sequence[Layout]) -> np.ndarray:
    """Normalise a batch of states (an int array [B, 5] or a sequence of state-likes)."""
    if isinstance(states, np.ndarray) and states.ndim == 2 and states.shape[1] == STATE_DIM:
        if len(states) != len(layouts):
            raise ValueError(f"{len(states)} states for {len(layouts)} layouts")
        return states.astype(np.int64, copy=False)
    states = list(states)
    if len(states) != len(layouts):
        raise ValueError(f"{len(states)} states for {len(layouts)} layouts")
    if not states:
        return np.zeros((0, STATE_DIM), np.int64)
    return np.stack([state_array(s, lay) for s, lay in zip(states, layouts)])


# ----------------------------------------------------------------------------- dynamics


def step_state(layout: Layout, state: np.ndarray, action: int) -> tuple[np.ndarray, bool, bool]:
    """One gymnasium-style transition: ``(next_state, valid, terminated)``.

    ``valid`` is False when the action could not be executed (bump into the border, a maze wall,
    a wall/table/printer cell; PICK/DROP where illegal; any action from a terminal state); the
    state is then unchanged. Moving into a FrozenLake hole is executed and terminates, exactly
    like gymnasium's non-slippery FrozenLake (VPRL's -5 for holes lives in the reward).
    """
    action = int(action)
    if not 0 <= action < layout.n_actions:
        raise ValueError(f"action {action} out of range for {layout.task} (0..{layout.n_actions - 1})")
    s = np.array(state, dtype=np.int64)
    if layout.is_terminal(s):
        return s, False, True
    r, c, phase = int(s[ROW]), int(s[COL]), int(s[PHASE])
    if action < 4:
        h, w = layout.shape
        nr, nc = r + int(DELTAS[action, 0]), c + int(DELTAS[action, 1])
        ok = 0 <= nr < h and 0 <= nc < w
        if ok and layout.walls is not None and layout.walls[r, c] & WALL_BITS[action]:
            ok = False
        if ok and layout.grid[nr, nc] in (Cell.WALL, Cell.TABLE):
            ok = False
        if ok and phase == Phase.INITIAL and layout.printer == (nr, nc):
            ok = False
        if not ok:
            return s, False, False
        s[ROW], s[COL] = nr, nc
        return s, True, layout.is_terminal(s)
    if action == Action.PICK:
        if phase != Phase.INITIAL or not layout.printer_adjacent[r, c]:
            return s, False, False
        s[PHASE], s[PRINTER_ROW], s[PRINTER_COL] = Phase.CARRYING, -1, -1
        return s, True, False
    d = int(layout.table_dir[r, c])
    if phase != Phase.CARRYING or d < 0:
        return s, False, False
    s[PHASE], s[PRINTER_ROW], s[PRINTER_COL] = Phase.DONE, r + DELTAS[d, 0], c + DELTAS[d, 1]
    return s, True, True


@dataclass(frozen=True)
class LayoutBatch:
    """Layouts stacked into padded arrays (pads are WALL cells) for vectorised steps/rewards."""

    layouts: tuple[Layout, ...]
    grid: np.ndarray  # uint8 [B, H, W]
    walls: np.ndarray  # uint8 [B, H, W]
    dist: np.ndarray  # int32 [B, 3, H, W]
    size: np.ndarray  # int64 [B, 2]
    printer: np.ndarray  # int64 [B, 2]
    table_dir: np.ndarray  # int8 [B, H, W]
    printer_adj: np.ndarray  # bool [B, H, W]
    is_mini: np.ndarray  # bool [B]
    n_actions: np.ndarray  # int64 [B]

    def __len__(self) -> int:
        return len(self.layouts)

    def take(self, index: np.ndarray) -> "LayoutBatch":
        index = np.asarray(index, np.int64)
        return LayoutBatch(tuple(self.layouts[i] for i in index), self.grid[index], self.walls[index],
                           self.dist[index], self.size[index], self.printer[index], self.table_dir[index],
                           self.printer_adj[index], self.is_mini[index], self.n_actions[index])


def pack_layouts(layouts: Sequence[Layout] | LayoutBatch) -> LayoutBatch:
    if isinstance(layouts, LayoutBatch):
        return layouts
    layouts = tuple(layouts)
    for i, lay in enumerate(layouts):
        if not isinstance(lay, Layout):
            raise TypeError(f"layouts[{i}] is a {type(lay).__name__}, not a Layout")
    b = len(layouts)
    hm = max((lay.shape[0] for lay in layouts), default=1)
    wm = max((lay.shape[1] for lay in layouts), default=1)
    grid = np.full((b, hm, wm), Cell.WALL, np.uint8)
    walls = np.zeros((b, hm, wm), np.uint8)
    dist = np.full((b, N_PHASES, hm, wm), INF, np.int32)
    table_dir = np.full((b, hm, wm), -1, np.int8)
    printer_adj = np.zeros((b, hm, wm), bool)
    # group identical layout objects so repeated layouts (plans of one map) pack once
    cache: dict[int, int] = {}
    for i, lay in enumerate(layouts):
        j = cache.setdefault(id(lay), i)
        if j != i:
            grid[i], walls[i], dist[i] = grid[j], walls[j], dist[j]
            table_dir[i], printer_adj[i] = table_dir[j], printer_adj[j]
            continue
        h, w = lay.shape
        grid[i, :h, :w] = lay.grid
        if lay.walls is not None:
            walls[i, :h, :w] = lay.walls
        dist[i, :, :h, :w] = lay.distance
        if lay.task == "minibehavior":
            table_dir[i, :h, :w] = lay.table_dir
            printer_adj[i, :h, :w] = lay.printer_adjacent
    size = np.array([lay.shape for lay in layouts], np.int64).reshape(b, 2)
    printer = np.array([lay.printer if lay.printer is not None else (-1, -1) for lay in layouts],
                       np.int64).reshape(b, 2)
    is_mini = np.array([lay.task == "minibehavior" for lay in layouts], bool)
    n_actions = np.array([lay.n_actions for lay in layouts], np.int64)
    return LayoutBatch(layouts, grid, walls, dist, size, printer, table_dir, printer_adj, is_mini, n_actions)


def _gather(arr: np.ndarray, b: np.ndarray, r: np.ndarray, c: np.ndarray, size: np.ndarray, fill: Any):
    """arr[b, r, c] with out-of-grid (r, c) mapped to ``fill``."""
    inside = (r >= 0) & (c >= 0) & (r < size[:, 0]) & (c < size[:, 1])
    hm, wm = arr.shape[-2:]
    val = arr[b, np.clip(r, 0, hm - 1), np.clip(c, 0, wm - 1)]
    return np.where(inside, val, fill), inside


def batch_terminal(pack: LayoutBatch, states: np.ndarray) -> np.ndarray:
    """bool [B]: the state is terminal (goal or hole; MiniBehavior: printer on the table)."""
    b = np.arange(len(pack))
    code, _ = _gather(pack.grid, b, states[:, ROW], states[:, COL], pack.size, Cell.WALL)
    cell_term = (code == Cell.GOAL) | (code == Cell.HOLE)
    return np.where(pack.is_mini, states[:, PHASE] == Phase.DONE, cell_term)


def batch_distance(pack: LayoutBatch, states: np.ndarray) -> np.ndarray:
    """int64 [B]: distance to completion of each state (INF for invalid/out-of-grid states)."""
    b = np.arange(len(pack))
    ph = states[:, PHASE]
    okp = (ph >= 0) & (ph < N_PHASES)
    hm, wm = pack.grid.shape[1:]
    inside = (states[:, ROW] >= 0) & (states[:, COL] >= 0) & (states[:, ROW] < pack.size[:, 0]) & (
        states[:, COL] < pack.size[:, 1])
    d = pack.dist[b, np.clip(ph, 0, N_PHASES - 1), np.clip(states[:, ROW], 0, hm - 1),
                  np.clip(states[:, COL], 0, wm - 1)]
    return np.where(okp & inside, d, INF).astype(np.int64)


def batch_step(pack: LayoutBatch, states: np.ndarray, actions: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised :func:`step_state` over B (layout, state, action) triples, no Python loop.

    Returns ``(next_states [B, 5], valid [B], terminated [B])``.
    """
    states = np.asarray(states, np.int64)
    actions = np.asarray(actions, np.int64).ravel()
    n = len(pack)
    if states.shape != (n, STATE_DIM) or actions.shape != (n,):
        raise ValueError(f"expected states [{n}, {STATE_DIM}] and actions [{n}], got "
                         f"{states.shape} and {actions.shape}")
    bad = (actions < 0) | (actions >= pack.n_actions)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"action {int(actions[i])} out of range for env {i} "
                         f"({pack.layouts[i].task}: 0..{int(pack.n_actions[i]) - 1})")
    b = np.arange(n)
    r, c, ph = states[:, ROW], states[:, COL], states[:, PHASE]
    done = batch_terminal(pack, states)
    is_move = actions < 4
    a4 = np.clip(actions, 0, 3)
    nr, nc = r + DELTAS[a4, 0], c + DELTAS[a4, 1]
    code, inside = _gather(pack.grid, b, nr, nc, pack.size, Cell.WALL)
    wall_between = (pack.walls[b, r, c] & WALL_BITS[a4]) != 0
    on_printer = (ph == Phase.INITIAL) & (nr == pack.printer[:, 0]) & (nc == pack.printer[:, 1])
    move_ok = is_move & inside & ~wall_between & (code != Cell.WALL) & (code != Cell.TABLE) & ~on_printer
    pick_ok = (actions == Action.PICK) & (ph == Phase.INITIAL) & pack.printer_adj[b, r, c]
    tdir = pack.table_dir[b, r, c].astype(np.int64)
    drop_ok = (actions == Action.DROP) & (ph == Phase.CARRYING) & (tdir >= 0)
    valid = (move_ok | pick_ok | drop_ok) & ~done
    nxt = states.copy()
    m = valid & move_ok
    nxt[m, ROW], nxt[m, COL] = nr[m], nc[m]
    p = valid & pick_ok
    nxt[p, PHASE], nxt[p, PRINTER_ROW], nxt[p, PRINTER_COL] = Phase.CARRYING, -1, -1
    q = valid & drop_ok
    td = np.clip(tdir, 0, 3)
    nxt[q, PHASE] = Phase.DONE
    nxt[q, PRINTER_ROW] = (r + DELTAS[td, 0])[q]
    nxt[q, PRINTER_COL] = (c + DELTAS[td, 1])[q]
    return nxt, valid, batch_terminal(pack, nxt)


# ----------------------------------------------------------------------------- optimal paths


def successors(layout: Layout, state: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """All (action, next_state) pairs that execute (valid dynamics) from ``state``."""
    out = []
    for a in range(layout.n_actions):
        nxt, valid, _ = step_state(layout, state, a)
        if valid:
            out.append((a, nxt))
    return out


def optimal_successors(layout: Layout, state: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Successors that lower the distance to completion by exactly one (on some shortest plan)."""
    d = layout.dist_of(state)
    if d == 0 or d >= INF:
        return []
    return [(a, s) for a, s in successors(layout, state) if layout.dist_of(s) == d - 1]


def shortest_path(layout: Layout, state: np.ndarray | None = None) -> np.ndarray:
    """One shortest plan as states [T+1, 5] (start included); first optimal action in order."""
    s = layout.start_state() if state is None else np.asarray(state, np.int64)
    if layout.dist_of(s) >= INF:
        raise ValueError(f"no plan reaches the goal from {s.tolist()} in {layout!r}")
    path = [s]
    while layout.dist_of(s) > 0:
        s = optimal_successors(layout, s)[0][1]
        path.append(s)
    return np.stack(path)


def optimal_paths(layout: Layout, limit: int = 10_000) -> list[np.ndarray]:
    """The set of all shortest plans from the start (states [T+1, 5] each), at most ``limit``."""
    start = layout.start_state()
    if layout.dist_of(start) >= INF:
        return []
    out: list[np.ndarray] = []
    stack = [[start]]
    while stack and len(out) < limit:
        path = stack.pop()
        nxts = optimal_successors(layout, path[-1])
        if not nxts:
            out.append(np.stack(path))
            continue
        for _, s in reversed(nxts):
            stack.append(path + [s])
    return out


def is_optimal_plan(plan: Sequence[Any] | np.ndarray, layout: Layout) -> bool:
    """True iff ``plan`` (states, start included) is one of the layout's shortest plans."""
    states = np.stack([state_array(s, layout) for s in plan]) if len(plan) else np.zeros((0, STATE_DIM))
    if len(states) == 0 or not np.array_equal(states[0], layout.start_state()):
        return False
    if len(states) - 1 != layout.optimal_length:
        return False
    for prev, nxt in zip(states[:-1], states[1:]):
        if not any(np.array_equal(nxt, s) for _, s in optimal_successors(layout, prev)):
            return False
    return layout.is_goal(states[-1])
