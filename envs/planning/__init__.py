"""VPRL visual-planning environments: FrozenLake, Maze and MiniBehavior (pick-and-place).

Symbolic core in :mod:`.grid`, per-task generators in :mod:`.frozenlake`, :mod:`.maze`,
:mod:`.minibehavior`, pictures and the frame parser in :mod:`.render`, seeded splits and the
paper's test split in :mod:`.splits`, gymnasium wrappers in :mod:`.gym_env` (imported lazily so
the rest works without gymnasium). The step judge (the VPRL reward) in :mod:`.judge`, text plans in
:mod:`.text_plan`; metrics:
:mod:`.metrics`.
"""

from .grid import (
    INF,
    STATE_DIM,
    TASKS,
    UNPARSEABLE,
    Action,
    Cell,
    Layout,
    LayoutBatch,
    ParsedState,
    Phase,
    batch_distance,
    batch_step,
    batch_terminal,
    canonical_task,
    distance_maps,
    is_optimal_plan,
    optimal_paths,
    optimal_successors,
    pack_layouts,
    shortest_path,
    state_array,
    states_array,
    step_state,
    successors,
)
from .render import PALETTE, ParseFailure, frame_shape, parse, parse_batch, parse_batch_array, render_batch, render_state
from .splits import PaperTestSplit, Split, generate_layout, generate_layouts, load_paper_test_split, make_splits

__all__ = [
    "INF", "STATE_DIM", "TASKS", "UNPARSEABLE", "Action", "Cell", "Layout", "LayoutBatch", "ParsedState",
    "Phase", "batch_distance", "batch_step", "batch_terminal", "canonical_task", "distance_maps",
    "is_optimal_plan", "optimal_paths", "optimal_successors", "pack_layouts", "shortest_path", "state_array",
    "states_array", "step_state", "successors", "PALETTE", "ParseFailure", "frame_shape", "parse",
    "parse_batch", "parse_batch_array", "render_state", "render_batch", "PaperTestSplit", "Split",
    "generate_layout", "generate_layouts", "load_paper_test_split", "make_splits",
    "PlanningEnv", "BatchPlanningEnv", "register_envs",
]


def __getattr__(name: str):
    if name in ("PlanningEnv", "BatchPlanningEnv", "register_envs"):
        from . import gym_env

        return getattr(gym_env, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
