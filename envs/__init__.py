"""Simulators and prompt sources. Installed as `mmrl.envs` (no top-level `envs` package).

`TASKS` maps a config's `task.name` to a source class: it yields training contexts with
`group_id`s implied by order, a fixed held-out set, SFT targets and a corpus for a local tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable

TASKS: dict[str, type] = {}


def register_task(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        TASKS[name] = cls
        return cls

    return wrap


def make_task(name: str, seed: int, **params):
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(sorted(TASKS))}")
    return TASKS[name](seed=seed, **params)


from mmrl.envs import arithmetic  # noqa: E402,F401  (registers its task)
from mmrl.envs.planning import task as _planning_task  # noqa: E402,F401  (registers "planning")
from mmrl.envs.captioning import task as _caption_task  # noqa: E402,F401  (registers "caption")
try:  # the robot tasks need mujoco (mmrl[robot]); without it "tabletop"/"libero" are just not registered
    from mmrl.envs.tabletop import source as _robot_tasks  # noqa: E402,F401  (registers "tabletop", "libero")
except ImportError:
    pass
