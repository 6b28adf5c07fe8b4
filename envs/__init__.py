"""Simulators and prompt sources. Installed as `mmrl.envs` (no top-level `envs` package).

`TASKS` maps a config's `task.name` to a source class: it yields training contexts with
`group_id`s implied by order, a fixed held-out set, SFT targets and a corpus for a local tokenizer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from mmrl.envs.base import TaskBase

TASKS: dict[str, type] = {}  # registered (imported) task classes
# Shipped tasks load on first use, so a config imports only what it needs: name -> (the module
# that registers it, the extra whose packages it imports; "core": mmrl's own dependencies).
LAZY_TASKS: dict[str, tuple[str, str]] = {
    "arithmetic": ("mmrl.envs.arithmetic", "core"),
    "digit_sort": ("mmrl.envs.arithmetic", "core"),
    "planning": ("mmrl.envs.planning.task", "vision"),
    "caption": ("mmrl.envs.captioning.task", "vision"),
    "tabletop": ("mmrl.envs.tabletop.source", "robot"),
    "libero": ("mmrl.envs.libero.task", "libero"),
    "vqa": ("mmrl.envs.vqa.task", "vision"),
    "video": ("mmrl.envs.video.task", "video"),
}


class MissingExtraError(ImportError):
    """A task (or other component) needs an optional dependency that is not installed."""


def register_task(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        TASKS[name] = cls
        return cls

    return wrap


def task_names() -> list[str]:
    return sorted(set(TASKS) | set(LAZY_TASKS))


def task_class(name: str) -> type:
    """The class of task `name`, importing its module on first use; a missing optional dependency
    is named with the extra that installs it."""
    if name not in TASKS and name in LAZY_TASKS:
        module, extra = LAZY_TASKS[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            install = "pip install mmrl" if extra == "core" else f"pip install 'mmrl[{extra}]'"
            raise MissingExtraError(f"task {name!r} needs the {exc.name or 'a missing'} package: {install}") from exc
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(task_names())}")
    return TASKS[name]


__all__ = ["LAZY_TASKS", "TASKS", "MissingExtraError", "TaskBase", "make_task", "register_task", "task_class",
           "task_names"]


def make_task(name: str, seed: int, **params):
    return task_class(name)(seed=seed, **params)
