"""The VPRL planning task (FrozenLake, Maze, MiniBehavior) as a trainer `Task`.

Contexts are plain dicts, one state of one layout each (the format is stable; other adapters
read it)::

    layout          Layout                   the map (task, grid, start, goal, walls, objects)
    state           int64 [5]                current state ([row, col, phase, printer_row, printer_col])
    frame           uint8 [H, W, 3]          render of `state` at `cell_size` px per cell
    prompt          str                      the task in words (text mode), e.g. "Plan the moves ..."
    target_state    int64 [5]                SFT next state: a random valid move (sft_mode random_walk)
                                             or an optimal move (sft_mode optimal); eval: optimal
    target_frame    uint8 [H, W, 3]          render of `target_state`
    target_actions  list[str]                one optimal plan from `state`, as words (up/down/left/right/pick/drop)
    target          str                      ", ".join(target_actions) (text-mode SFT target)
    level           int                      grid side (MiniBehavior: interior side)
    optimal_length  int                      steps of a shortest plan from `state`
    env             str                      frozenlake | maze | minibehavior
    layout_id       str                      "<split>/<size>/<index>"

Training (`next_batch`) draws, per context, a layout and a state: the start state with
probability `rl_start_prob`, otherwise a uniformly random reachable non-terminal state, so that
one-step GRPO sees states all along the way. The stream is a pure function of (seed, cursor), so
the cursor alone resumes it exactly. `eval_batch` returns start states of the held-out layouts,
interleaved across sizes. `evaluate(policy, n)` runs closed-loop plans through the policy's
`plan(contexts, max_steps) -> list[{"states": int [T+1, 5], "frames": [uint8 HxWx3, ...]}]`
(duck-typed) and returns EM / PR / success / invalid share, overall and per level. After
`mmrl train`, the CLI prints the `headline` (EM and PR, before -> after), then
`summarize(results, out_dir, cpu_s)`: that table by size before and after RL (also in report.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from mmrl.envs import TaskBase, register_task
from mmrl.envs.base import Headline, headline_rows

from .grid import INF, Action, Cell, Layout, batch_step, canonical_task, pack_layouts
from .render import render_state
from .splits import PAPER_FILES, load_paper_test_split, make_splits

ACTION_WORDS = {Action.LEFT: "left", Action.DOWN: "down", Action.RIGHT: "right", Action.UP: "up",
                Action.PICK: "pick", Action.DROP: "drop"}
PROMPTS = {
    "frozenlake": "Plan the moves from the agent to the goal without stepping into a hole. "
                  "Answer with moves: up, down, left, right.",
    "maze": "Plan the moves from the agent to the goal through the maze without crossing a wall. "
            "Answer with moves: up, down, left, right.",
    "minibehavior": "Plan the actions that pick up the printer and drop it on the table. "
                    "Answer with actions: up, down, left, right, pick, drop.",
}
SFT_MODES = ("random_walk", "optimal")
RL_STATES = ("reachable", "optimal_path")
SPLITS = ("test", "ood", "paper")


@dataclass(frozen=True)
class StateGraph:
    """Every state reachable from a layout's start through VPRL-valid steps, as lookup arrays.

    ``next[s, a]``: index of the state after action ``a`` from state ``s``, -1 when the step is
    not valid (blocked, a no-op, a FrozenLake hole, or ``s`` is terminal). Index 0 is the start.
    """

    states: np.ndarray  # int64 [S, 5]
    next: np.ndarray  # int64 [S, A]
    dist: np.ndarray  # int64 [S] distance to completion
    terminal: np.ndarray  # bool [S]

    @property
    def live(self) -> np.ndarray:
        """Indices of non-terminal states that can still complete the task."""
        return np.flatnonzero(~self.terminal & (self.dist < INF))

    def optimal_actions(self, s: int) -> np.ndarray:
        nxt = self.next[s]
        ok = (nxt >= 0) & (self.dist[np.maximum(nxt, 0)] == self.dist[s] - 1)
        return np.flatnonzero(ok)

    def valid_actions(self, s: int) -> np.ndarray:
        return np.flatnonzero(self.next[s] >= 0)


def build_state_graph(layout: Layout) -> StateGraph:
    """BFS over states, one vectorised `batch_step` per frontier."""
    pack1 = pack_layouts([layout])
    n_act = layout.n_actions
    index: dict[bytes, int] = {}
    states: list[np.ndarray] = []

    def add(s: np.ndarray) -> int:
        key = s.tobytes()
        if key not in index:
            index[key] = len(states)
            states.append(s)
        return index[key]

    add(layout.start_state())
    frontier = [0]
    edges: dict[int, np.ndarray] = {}
    while frontier:
        src = np.stack([states[i] for i in frontier])
        b = len(frontier)
        rep = np.repeat(src, n_act, axis=0)
        acts = np.tile(np.arange(n_act), b)
        pack = pack1.take(np.zeros(b * n_act, np.int64))
        nxt, valid, _ = batch_step(pack, rep, acts)
        # a valid move into a hole executes (gymnasium) but is a VPRL-invalid step
        hole = layout.grid[nxt[:, 0], nxt[:, 1]] == Cell.HOLE
        ok = (valid & ~hole).reshape(b, n_act)
        nxt = nxt.reshape(b, n_act, -1)
        new_frontier = []
        for j, s in enumerate(frontier):
            row = np.full(n_act, -1, np.int64)
            for a in np.flatnonzero(ok[j]):
                before = len(states)
                t = add(nxt[j, a])
                row[a] = t
                if t == before:
                    new_frontier.append(t)
            edges[s] = row
        # terminal states are not expanded (batch_step marks every action from them invalid)
        frontier = new_frontier
    next_arr = np.stack([edges[i] for i in range(len(states))])
    st = np.stack(states)
    dist = np.array([layout.dist_of(s) for s in st], np.int64)
    terminal = np.array([layout.is_terminal(s) for s in st], bool)
    return StateGraph(st, next_arr, dist, terminal)


@register_task("planning")
class PlanningTask(TaskBase):
    REPORT = "planning"

    def __init__(self, seed: int = 0, env: str = "frozenlake", sizes: list[int] | tuple[int, ...] = (3, 4, 5),
                 n_train: int = 1000, n_test: int = 100, cell_size: int = 16,
                 sft_mode: Literal["random_walk", "optimal"] = "random_walk", paper_split: str | None = None,
                 ood_sizes: list[int] | tuple[int, ...] = (), rl_start_prob: float = 0.25,
                 rl_states: Literal["reachable", "optimal_path"] = "reachable", plan_slack: int = 4,
                 sft_random_move_prob: float = 0.0, generator_params: dict | None = None):
        self.env = canonical_task(env)
        if sft_mode not in SFT_MODES:
            raise ValueError(f"task.params.sft_mode: invalid value {sft_mode!r}; valid: {', '.join(SFT_MODES)}")
        sizes = [int(s) for s in (sizes if isinstance(sizes, (list, tuple)) else [sizes])]
        if not sizes or min(sizes) < 2:
            raise ValueError(f"task.params.sizes must be a non-empty list of sizes >= 2, got {sizes}")
        if n_train < 1 or n_test < 1:
            raise ValueError(f"task.params.n_train and n_test must be >= 1, got {n_train} and {n_test}")
        if rl_states not in RL_STATES:
            raise ValueError(f"task.params.rl_states: invalid value {rl_states!r}; valid: {', '.join(RL_STATES)}")
        if not 0.0 <= rl_start_prob <= 1.0:
            raise ValueError(f"task.params.rl_start_prob must be in [0, 1], got {rl_start_prob}")
        if not 0.0 <= sft_random_move_prob <= 1.0:
            raise ValueError(f"task.params.sft_random_move_prob must be in [0, 1], got {sft_random_move_prob}")
        min_cell = 16 if self.env == "maze" else 12
        if cell_size < min_cell:
            raise ValueError(f"task.params.cell_size must be >= {min_cell} px for {self.env} (the parser "
                             f"needs it), got {cell_size}")
        self.seed = int(seed)
        self.sizes = sizes
        self.cell_size = int(cell_size)
        self.sft_mode = sft_mode
        self.sft_random_move_prob = float(sft_random_move_prob)
        self.rl_start_prob = float(rl_start_prob)
        self.rl_states = rl_states
        self.plan_slack = int(plan_slack)
        self.paper_split_path = paper_split
        # The paper's test split is an evaluation input only: the training split never depends on a
        # file outside the repository (`paper_overlap` says how many paper layouts it contains).
        gen = dict(generator_params or {})
        self.train: list[tuple[str, Layout]] = []
        tests: list[list[tuple[str, Layout]]] = []
        for size in sizes:
            sp = make_splits(self.env, size, n_train, n_test, self.seed, **gen)
            self.train += [(f"train/{size}/{i}", lay) for i, lay in enumerate(sp.train)]
            tests.append([(f"test/{size}/{i}", lay) for i, lay in enumerate(sp.test)])
        # interleaved by size, so the first n held-out layouts cover every size evenly
        self.test = [t for group in zip(*tests) for t in group]
        self.ood_sizes = [int(s) for s in ood_sizes]
        self._ood: list[tuple[str, Layout]] | None = None
        self._graphs: dict[str, StateGraph] = {}
        self.cursor = 0
        self.eval_cpu_s = 0.0  # process time spent in `evaluate`, so a run can report training CPU-s alone

    # ------------------------------------------------------------------ helpers

    def graph(self, layout_id: str, layout: Layout) -> StateGraph:
        g = self._graphs.get(layout_id)
        if g is None:
            g = self._graphs[layout_id] = build_state_graph(layout)
        return g

    def render(self, layout: Layout, state: np.ndarray) -> np.ndarray:
        return render_state(layout, state, self.cell_size)

    def plan_words(self, g: StateGraph, s: int) -> list[str]:
        """One optimal plan from state index `s` (lowest action index first), as words."""
        words = []
        while g.dist[s] > 0 and not g.terminal[s]:
            a = int(g.optimal_actions(s)[0])
            words.append(ACTION_WORDS[Action(a)])
            s = int(g.next[s, a])
        return words

    def make_context(self, layout_id: str, layout: Layout, s: int, target: int | None = None) -> dict[str, Any]:
        """The context of state index `s` of a layout; `target` state index (default: an optimal move)."""
        g = self.graph(layout_id, layout)
        if target is None:
            opt = g.optimal_actions(s)
            target = int(g.next[s, opt[0]]) if len(opt) else s
        words = self.plan_words(g, s)
        state, tstate = g.states[s].copy(), g.states[target].copy()
        return {
            "layout": layout, "state": state, "frame": self.render(layout, state),
            "prompt": PROMPTS[self.env],
            "target_state": tstate, "target_frame": self.render(layout, tstate),
            "target_actions": words, "target": ", ".join(words),
            "level": layout.level, "optimal_length": int(g.dist[s]), "env": self.env, "layout_id": layout_id,
        }

    def _rl_context(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, 7, i])
        lid, lay = self.train[int(rng.integers(len(self.train)))]
        g = self.graph(lid, lay)
        if rng.random() < self.rl_start_prob:
            s = 0
        elif self.rl_states == "optimal_path":
            s = self._optimal_walk(g, rng)
        else:
            live = g.live
            s = int(live[rng.integers(len(live))])
        return self.make_context(lid, lay, s)

    @staticmethod
    def _optimal_walk(g: StateGraph, rng: np.random.Generator) -> int:
        """A state a uniform number of steps along a random optimal plan from the start."""
        s = 0
        for _ in range(int(rng.integers(max(int(g.dist[0]), 1)))):
            opt = g.optimal_actions(s)
            s = int(g.next[s, opt[rng.integers(len(opt))]])
        return s

    # ------------------------------------------------------------------ Task protocol

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        out = [self._rl_context(self.cursor + j) for j in range(n)]
        self.cursor += n
        return out

    def eval_batch(self, n: int) -> list[dict[str, Any]]:
        return [self.make_context(lid, lay, 0) for lid, lay in self.test[: min(n, len(self.test))]]

    def data_summary(self) -> str:
        sizes = "/".join(f"{s}x{s}" for s in self.sizes)
        return (f"{self.env} layouts of {sizes}: {len(self.train)} training, {len(self.test)} held out"
                + (f", out-of-distribution sizes {', '.join(map(str, self.ood_sizes))} held out" if self.ood_sizes else ""))

    def sft_targets(self) -> str:
        return ("random valid moves along random walks" if self.sft_mode != "optimal"
                else "the next states of optimal plans" + (f" ({self.sft_random_move_prob:.0%} random valid moves)"
                                                          if self.sft_random_move_prob > 0 else ""))

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
        """Random-walk mode: a state along a random valid walk from the start, target a random
        valid move (stage 1 of VPRL). Optimal mode: a state along a random optimal plan, target
        its next optimal state (VPFT), or with probability `sft_random_move_prob` a random valid
        move from it."""
        out = []
        for _ in range(n):
            lid, lay = self.train[int(rng.integers(len(self.train)))]
            g = self.graph(lid, lay)
            s = 0
            if self.sft_mode == "optimal":
                s = self._optimal_walk(g, rng)
                # With sft_random_move_prob the label is any valid move instead: the policy keeps
                # probability on the alternatives, so RL's samples still explore after SFT.
                explore = self.sft_random_move_prob > 0 and rng.random() < self.sft_random_move_prob
                moves = g.valid_actions(s) if explore else g.optimal_actions(s)
                t = int(g.next[s, moves[rng.integers(len(moves))]])
            else:
                # walk up to ~the plan horizon; a walk that hits a terminal state restarts
                for _ in range(int(rng.integers(int(g.dist[0]) + self.plan_slack + 1))):
                    va = g.valid_actions(s)
                    nxt = int(g.next[s, va[rng.integers(len(va))]])
                    s = 0 if g.terminal[nxt] else nxt
                va = g.valid_actions(s)
                t = int(g.next[s, va[rng.integers(len(va))]])
            out.append(self.make_context(lid, lay, s, target=t))
        return out

    def corpus(self) -> list[str]:
        """Text of prompts and answers, for a tiny local tokenizer (text mode)."""
        words = " ".join(ACTION_WORDS.values())
        out = [PROMPTS[e] for e in PROMPTS] + [words, ", ".join(ACTION_WORDS.values())]
        for lid, lay in self.train[:500]:
            out.append(PROMPTS[self.env] + " " + ", ".join(self.plan_words(self.graph(lid, lay), 0)))
        return out

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    def tokenizer_frames(self, n_layouts: int = 200) -> list[np.ndarray]:
        """Frames of every reachable state of `n_layouts` train layouts spread over all sizes
        (what an image tokenizer is trained on; never a held-out layout)."""
        pick = np.linspace(0, len(self.train) - 1, min(n_layouts, len(self.train))).round().astype(int)
        frames = []
        for i in np.unique(pick):
            lid, lay = self.train[i]
            frames += [self.render(lay, s) for s in self.graph(lid, lay).states]
        return frames

    # ------------------------------------------------------------------ held-out splits

    def paper_split(self):
        if not self.paper_split_path:
            raise ValueError("task.params.paper_split is not set (a path to the paper's test metadata)")
        if self.env not in PAPER_FILES:
            raise ValueError(f"the paper's test split has no {self.env} records (only {', '.join(PAPER_FILES)})")
        try:
            return load_paper_test_split(self.paper_split_path, self.env)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"task.params.paper_split: {exc} (point it at the folder holding "
                                    "vprl_*_test_meta.json, or set it to null)") from None

    def paper_overlap(self) -> int:
        """How many of the paper's test layouts are also in this task's training split."""
        train_keys = {lay.key() for _, lay in self.train}
        return sum(lay.key() in train_keys for lay in self.paper_split().layouts)

    def ood_layouts(self) -> list[tuple[str, Layout]]:
        if self._ood is None:
            groups = []
            for size in self.ood_sizes:
                sp = make_splits(self.env, size, 1, max(1, len(self.test) // len(self.sizes)), self.seed)
                groups.append([(f"ood/{size}/{i}", lay) for i, lay in enumerate(sp.test)])
            self._ood = [t for group in zip(*groups) for t in group]
        return self._ood

    def split_layouts(self, split: str = "test") -> list[tuple[str, Layout]]:
        if split == "test":
            return self.test
        if split == "ood":
            return self.ood_layouts()
        if split == "paper":  # interleaved by level, like the others
            by_level: dict[int, list[tuple[str, Layout]]] = {}
            for i, lay in enumerate(self.paper_split().layouts):
                by_level.setdefault(lay.level, []).append((f"paper/{lay.level}/{i}", lay))
            groups = [by_level[k] for k in sorted(by_level)]
            return [groups[j][i] for i in range(max(map(len, groups))) for j in range(len(groups)) if i < len(groups[j])]
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")

    def rollout_plans(self, policy, n: int | None = None, split: str = "test", batch_size: int = 64
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Closed-loop plans of `policy` from the start of the first `n` layouts of `split`.

        Returns (contexts, plans); each plan is the policy's dict with at least "states"."""
        if not hasattr(policy, "plan"):
            raise TypeError(f"{type(policy).__name__} has no plan(contexts, max_steps) method")
        layouts = self.split_layouts(split)
        layouts = layouts[: len(layouts) if n is None else min(n, len(layouts))]
        contexts = [self.make_context(lid, lay, 0) for lid, lay in layouts]
        plans: list[dict[str, Any]] = []
        for lo in range(0, len(contexts), batch_size):
            part = contexts[lo:lo + batch_size]
            plans += policy.plan(part, [c["optimal_length"] + self.plan_slack for c in part])
        return contexts, plans

    def evaluate(self, policy, n: int, split: str = "test") -> dict[str, float]:
        """EM, PR, success and the invalid share of failed plans, overall and per level.

        A policy without `plan` (e.g. a one-shot text planner) gets no plan metrics here: {}."""
        from mmrl.envs.planning.metrics import evaluate_plans, evaluate_plans_by_level

        if not hasattr(policy, "plan"):
            return {}
        t0 = time.process_time()
        contexts, plans = self.rollout_plans(policy, n, split)
        layouts = [c["layout"] for c in contexts]
        states = [p["states"] for p in plans]
        out = {k: float(v) for k, v in evaluate_plans(states, layouts).items()}
        for level, m in evaluate_plans_by_level(states, layouts).items():
            out[f"exact_match_L{level}"] = float(m["exact_match"])
            out[f"progress_rate_L{level}"] = float(m["progress_rate"])
        self.eval_cpu_s += time.process_time() - t0
        return out

    def training_cpu_s(self, cpu_s: float) -> float:
        """`cpu_s` (process time of a training call on this task) without the time spent in `evaluate`."""
        return max(cpu_s - self.eval_cpu_s, 0.0)

    def headline(self, before: dict[str, Any], after: dict[str, Any]) -> list[Headline]:
        """EM and PR of greedy closed-loop plans on the held-out layouts, in percent (a one-shot
        text planner has no closed-loop plans: its held-out reward)."""
        return headline_rows(before, after, [("exact match (EM)", "eval/exact_match", ".1%"),
                                             ("progress rate (PR)", "eval/progress_rate", ".1%")])

