"""MuJoCo tabletop tasks for VLA post-training: `reach`, `push`, `pick_place`.

    env = make_tabletop_env("push", image_size=64)
    obs, info = env.reset(seed=3)           # seeded initial state; env.instruction names the goal
    obs, reward, terminated, truncated, info = env.step(action)   # 7-D action in [-1, 1]

Scripted experts (`make_expert`) and LeRobotDataset demos (`demos.record_demos`) come with them.
"""

from .gl import select_gl_backend

select_gl_backend()  # before anything imports mujoco

from .env import (  # noqa: E402
    ACTION_DIM,
    CAMERAS,
    ENV_CLASSES,
    STATE_DIM,
    PickPlaceEnv,
    PushEnv,
    ReachEnv,
    TabletopEnv,
    make_tabletop_env,
)
from .expert import EXPERTS, Expert, make_expert, run_expert  # noqa: E402
from .tasks import COLORS, TASK_DEFS, InitState, TaskDef, get_task_def, sample_init_state  # noqa: E402

TASK_NAMES = tuple(TASK_DEFS)

__all__ = [
    "ACTION_DIM", "CAMERAS", "COLORS", "ENV_CLASSES", "EXPERTS", "STATE_DIM", "TASK_DEFS", "TASK_NAMES",
    "Expert", "InitState", "PickPlaceEnv", "PushEnv", "ReachEnv", "TabletopEnv", "TaskDef",
    "get_task_def", "make_expert", "make_tabletop_env", "run_expert", "sample_init_state",
]
