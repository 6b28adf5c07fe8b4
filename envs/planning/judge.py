"""The VPRL step judge for visual planning (FrozenLake, Maze, MiniBehavior), as pure functions: the
progress reward of a step or a plan (mmrl.rewards.planning registers it as the `vprl_progress` reward).

For a generated step from state ``s`` to the parsed state ``s'``:

* **+1** if the step is valid and lowers the BFS distance to completion (reaching the goal counts;
  a legal PICK or DROP always does);
* **0** if it is valid without progress (moving away from the goal, or sideways in MiniBehavior);
* **-5** if it is invalid: an unparseable frame, leaving the grid, walking into a wall / maze wall /
  table / printer, into a FrozenLake hole, a teleport (a jump of more than one cell, diagonals
  included), a frame where nothing changed (how a bump into a wall shows up in pictures; the
  paper's parser calls it invalid too), a PICK away from the printer, a DROP away from the table,
  or any other illegal change of what is carried (moving while picking, un-picking, ...).

This follows the paper's reward code (``action_reward_func`` / the MiniBehavior parser, where a
pick or drop gets +1 and a move +1 iff it follows some optimal route). One deliberate difference:
the paper's FrozenLake ``distance_map`` only lists cells reachable from the start, and a move to an
unlisted cell scores -5; such a cell can only be reached through the goal or a hole, so the two
agree on every reachable transition, and here a valid move to a cell that cannot reach the goal
scores 0 (it is not in the list of invalid moves).

Multi-step plans (:func:`plan_step_rewards`): the paper trains on single steps, so it has no rule
for later steps; its evaluator counts a plan complete only if every step up to the goal is valid,
and (MiniBehavior) treats every step after the first invalid one as invalid. Here a plan is scored
up to and including the step that reaches the goal or the first invalid step; later steps are
masked out (``mask`` False, reward 0) so they neither help nor hurt.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal, Sequence

import numpy as np

from .grid import (
    COL,
    DELTAS,
    INF,
    PHASE,
    PRINTER_COL,
    PRINTER_ROW,
    ROW,
    STATE_DIM,
    WALL_BITS,
    Cell,
    Layout,
    LayoutBatch,
    Phase,
    batch_distance,
    batch_terminal,
    pack_layouts,
    state_array,
    states_array,
)

REWARD_PROGRESS = 1.0
REWARD_NO_PROGRESS = 0.0
REWARD_INVALID = -5.0


class StepKind(IntEnum):
    """Judgement of one step; every kind >= UNPARSEABLE is invalid (-5)."""

    PROGRESS = 0  # valid, lowers the distance to completion
    NO_PROGRESS = 1  # valid, distance not lowered
    AFTER_END = 2  # the previous state was already terminal: not scored
    UNPARSEABLE = 3
    OUT_OF_GRID = 4
    BLOCKED = 5  # into a wall, a maze wall, the table or the printer
    HOLE = 6
    TELEPORT = 7  # moved by more than one cell (or diagonally)
    NOOP = 8  # nothing changed
    ILLEGAL_PICK = 9  # picked while not next to the printer
    ILLEGAL_DROP = 10  # dropped while not next to the table (or the printer not on that table cell)
    ILLEGAL_PHASE = 11  # other impossible change of the printer / carrying (or a phase on FrozenLake/Maze)


INVALID_KINDS = tuple(k for k in StepKind if k >= StepKind.UNPARSEABLE)

# direction index (Action order) of a unit move, looked up by (d_row + 1) * 3 + (d_col + 1)
_DIR_OF = np.full(9, 0, np.int64)
for _d, (_dr, _dc) in enumerate(DELTAS):
    _DIR_OF[(_dr + 1) * 3 + (_dc + 1)] = _d


@dataclass(frozen=True)
class StepJudgement:
    kind: np.ndarray  # int64 [B] StepKind
    reward: np.ndarray  # float32 [B]
    dist_prev: np.ndarray  # int64 [B] (INF when unknown)
    dist_next: np.ndarray  # int64 [B]

    @property
    def invalid(self) -> np.ndarray:
        return self.kind >= StepKind.UNPARSEABLE

    @property
    def reached_goal(self) -> np.ndarray:
        return (self.kind == StepKind.PROGRESS) & (self.dist_next == 0)


def classify_steps(prev_states: Any, next_states: Any, layouts: Sequence[Layout] | LayoutBatch, *,
                   progress_reward: float = REWARD_PROGRESS, no_progress_reward: float = REWARD_NO_PROGRESS,
                   invalid_reward: float = REWARD_INVALID) -> StepJudgement:
    """Judge B steps at once (vectorised): kind, reward and the distances before/after.

    States: int arrays [B, 5] or sequences of ParsedState / UNPARSEABLE / (row, col[, phase]).
    """
    pack = pack_layouts(layouts)
    prev = states_array(prev_states, pack.layouts)
    nxt = states_array(next_states, pack.layouts)
    n = len(pack)
    b = np.arange(n)
    size = pack.size

    def inside(s: np.ndarray) -> np.ndarray:
        return (s[:, ROW] >= 0) & (s[:, COL] >= 0) & (s[:, ROW] < size[:, 0]) & (s[:, COL] < size[:, 1])

    prev_ok = inside(prev) & (prev[:, PHASE] >= 0) & (prev[:, PHASE] <= Phase.DONE)
    prev_c = np.where(prev_ok[:, None], prev, 0)
    d_prev = np.where(prev_ok, batch_distance(pack, prev_c), INF)
    prev_term = prev_ok & batch_terminal(pack, prev_c)
    next_unp = (nxt[:, :3] == -1).all(1)  # the UNPARSEABLE row; other negatives are off-grid
    next_in = inside(nxt)
    d_next = batch_distance(pack, nxt)

    dr, dc = nxt[:, ROW] - prev[:, ROW], nxt[:, COL] - prev[:, COL]
    man = np.abs(dr) + np.abs(dc)
    moved = man == 1
    hm, wm = pack.grid.shape[1:]
    nr, nc = np.clip(nxt[:, ROW], 0, hm - 1), np.clip(nxt[:, COL], 0, wm - 1)
    pr, pc = np.clip(prev[:, ROW], 0, hm - 1), np.clip(prev[:, COL], 0, wm - 1)
    code_next = pack.grid[b, nr, nc]
    dirs = _DIR_OF[np.clip((dr + 1) * 3 + (dc + 1), 0, 8)]
    wall_between = (pack.walls[b, pr, pc] & WALL_BITS[dirs]) != 0
    p_phase, n_phase = prev[:, PHASE], nxt[:, PHASE]
    at_home = (nr == pack.printer[:, 0]) & (nc == pack.printer[:, 1])
    blocked = moved & (wall_between | (code_next == Cell.WALL) | (code_next == Cell.TABLE)
                       | (pack.is_mini & (n_phase == Phase.INITIAL) & at_home))
    hole = moved & (code_next == Cell.HOLE)

    # what happened to the printer / carrying
    dphase = n_phase - p_phase
    mini = pack.is_mini
    pick = mini & (p_phase == Phase.INITIAL) & (n_phase == Phase.CARRYING)
    drop = mini & (p_phase == Phase.CARRYING) & (n_phase == Phase.DONE)
    home_ok = (nxt[:, PRINTER_ROW] == pack.printer[:, 0]) & (nxt[:, PRINTER_COL] == pack.printer[:, 1])
    printer_ok = np.where(n_phase == Phase.INITIAL, home_ok,
                          np.where(n_phase == Phase.CARRYING, nxt[:, PRINTER_ROW] < 0, True))
    illegal_phase = np.where(mini, ((dphase != 0) & ~pick & ~drop) | ((pick | drop) & (man != 0))
                             | ((dphase == 0) & ~printer_ok),
                             (n_phase != 0) | (p_phase != 0))
    pick_bad = pick & (man == 0) & ~pack.printer_adj[b, pr, pc]
    tr, tc = nxt[:, PRINTER_ROW], nxt[:, PRINTER_COL]
    t_code = pack.grid[b, np.clip(tr, 0, hm - 1), np.clip(tc, 0, wm - 1)]
    drop_bad = drop & (man == 0) & ~((tr >= 0) & (t_code == Cell.TABLE)
                                     & (np.abs(tr - prev[:, ROW]) + np.abs(tc - prev[:, COL]) == 1))
    noop = (man == 0) & (dphase == 0)

    kind = np.where(d_next < d_prev, StepKind.PROGRESS, StepKind.NO_PROGRESS).astype(np.int64)
    # lowest priority first: each later assignment overrides
    for k, cond in ((StepKind.NOOP, noop), (StepKind.HOLE, hole), (StepKind.BLOCKED, blocked),
                    (StepKind.ILLEGAL_DROP, drop_bad), (StepKind.ILLEGAL_PICK, pick_bad),
                    (StepKind.ILLEGAL_PHASE, illegal_phase), (StepKind.TELEPORT, man > 1),
                    (StepKind.OUT_OF_GRID, ~next_in), (StepKind.UNPARSEABLE, next_unp),
                    (StepKind.AFTER_END, prev_term), (StepKind.UNPARSEABLE, ~prev_ok)):
        kind = np.where(cond, int(k), kind)
    reward = np.select([kind == StepKind.PROGRESS, kind == StepKind.NO_PROGRESS, kind == StepKind.AFTER_END],
                       [progress_reward, no_progress_reward, 0.0], invalid_reward).astype(np.float32)
    return StepJudgement(kind, reward, d_prev.astype(np.int64), np.where(kind >= StepKind.UNPARSEABLE, INF, d_next))


def step_rewards(prev_states: Any, next_states: Any, layouts: Sequence[Layout] | LayoutBatch,
                 **reward_values: float) -> np.ndarray:
    """float32 [B] VPRL reward of each step prev -> next (+1 / 0 / -5; 0 after a terminal state)."""
    return classify_steps(prev_states, next_states, layouts, **reward_values).reward


def step_rewards_from_frames(prev_states: Any, next_frames: np.ndarray, layouts: Sequence[Layout],
                             **reward_values: float) -> np.ndarray:
    """Parse generated frames [B, H, W, 3] and score them against the known previous states."""
    from .render import parse_batch_array

    return step_rewards(prev_states, parse_batch_array(next_frames, layouts), layouts, **reward_values)


@dataclass(frozen=True)
class PlanScores:
    rewards: np.ndarray  # float32 [B, T] (0 where masked)
    mask: np.ndarray  # bool [B, T]: the step is scored
    kinds: np.ndarray  # int64 [B, T] StepKind (AFTER_END beyond each plan's length)
    dist_prev: np.ndarray  # int64 [B, T]
    dist_next: np.ndarray  # int64 [B, T]
    n_steps: np.ndarray  # int64 [B]: steps in each plan (states - 1)


def _plan_array(plan: Any, layout: Layout) -> np.ndarray:
    if isinstance(plan, np.ndarray) and plan.ndim == 2 and plan.shape[1] == STATE_DIM:
        return plan.astype(np.int64, copy=False)
    return np.stack([state_array(s, layout) for s in plan]) if len(plan) else np.zeros((0, STATE_DIM), np.int64)


def plan_step_rewards(plans: Sequence[Any], layouts: Sequence[Layout], **reward_values: float) -> PlanScores:
    """Score B plans (each a sequence of states, the start state first) step by step.

    Steps after the one that reaches the goal or the first invalid step are masked out.
    """
    layouts = list(layouts)
    if len(plans) != len(layouts):
        raise ValueError(f"{len(plans)} plans for {len(layouts)} layouts")
    arrays = [_plan_array(p, lay) for p, lay in zip(plans, layouts)]
    n_steps = np.array([max(len(a) - 1, 0) for a in arrays], np.int64)
    bsz, tmax = len(arrays), int(n_steps.max(initial=0))
    kinds = np.full((bsz, tmax), int(StepKind.AFTER_END), np.int64)
    rewards = np.zeros((bsz, tmax), np.float32)
    dprev = np.full((bsz, tmax), INF, np.int64)
    dnext = np.full((bsz, tmax), INF, np.int64)
    if tmax:
        rows = np.repeat(np.arange(bsz), n_steps)
        cols = np.concatenate([np.arange(k) for k in n_steps])
        prev = np.concatenate([a[:-1] for a in arrays if len(a) > 1])
        nxt = np.concatenate([a[1:] for a in arrays if len(a) > 1])
        pack = pack_layouts(layouts).take(rows)
        j = classify_steps(prev, nxt, pack, **reward_values)
        kinds[rows, cols], rewards[rows, cols] = j.kind, j.reward
        dprev[rows, cols], dnext[rows, cols] = j.dist_prev, j.dist_next
    ends = (kinds >= StepKind.UNPARSEABLE) | ((kinds == StepKind.PROGRESS) & (dnext == 0))
    ended_before = np.cumsum(ends, axis=1) - ends > 0
    mask = (np.arange(tmax)[None, :] < n_steps[:, None]) & ~ended_before & (kinds != StepKind.AFTER_END)
    return PlanScores(np.where(mask, rewards, 0.0).astype(np.float32), mask, kinds, dprev, dnext, n_steps)


def plan_reward(step_rewards: np.ndarray, mask: np.ndarray | None = None,
                reduce: Literal["sum", "mean"] = "sum") -> np.ndarray:
    """Reduce per-step rewards [B, T] over scored steps to one reward per plan [B]."""
    r = np.asarray(step_rewards, np.float32)
    if r.ndim != 2:
        raise ValueError(f"step_rewards must be [B, T], got shape {r.shape}")
    m = np.ones_like(r, bool) if mask is None else np.asarray(mask, bool)
    if m.shape != r.shape:
        raise ValueError(f"mask shape {m.shape} != step_rewards shape {r.shape}")
    total = np.where(m, r, 0.0).sum(1)
    if reduce == "sum":
        return total.astype(np.float32)
    if reduce == "mean":
        return (total / np.maximum(m.sum(1), 1)).astype(np.float32)
    raise ValueError(f"unknown reduce {reduce!r}; valid: 'sum', 'mean'")
