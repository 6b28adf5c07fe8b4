"""Task definitions: which objects a scene holds, how an initial state is drawn from a seed, and
what the instruction says. Pure numpy, no MuJoCo, so samplers are cheap and testable alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from .scene import ZONE_HALF, SceneLayout

COLORS: dict[str, tuple[float, float, float, float]] = {
    "red": (0.85, 0.12, 0.12, 1.0),
    "green": (0.15, 0.7, 0.25, 1.0),
    "blue": (0.15, 0.3, 0.9, 1.0),
    "yellow": (0.95, 0.82, 0.1, 1.0),
    "purple": (0.6, 0.25, 0.8, 1.0),
}


@dataclass(frozen=True)
class TaskDef:
    name: str
    layout: SceneLayout
    object_colors: tuple[str, ...]  # pool the objects' colours are drawn from (without repeats)
    zone_colors: tuple[str, ...]
    template: str  # formatted with {obj} and {zone}
    max_episode_steps: int

    @property
    def object_kind(self) -> str:
        return "ball" if self.layout.n_balls else "block"

    @property
    def n_objects(self) -> int:
        return self.layout.n_balls + self.layout.n_blocks

    def instruction(self, obj: str, zone: str | None = None) -> str:
        return self.template.format(obj=obj, zone=zone)

    def instruction_variants(self) -> list[tuple[str, str | None]]:
        """Every (object colour, zone colour) pair the sampler can ask for: the language tasks."""
        zones: list[str | None] = list(self.zone_colors) if self.layout.n_zones else [None]
        return list(itertools.product(self.object_colors, zones))


TASK_DEFS: dict[str, TaskDef] = {
    "reach": TaskDef("reach", SceneLayout(n_balls=3), ("red", "green", "blue", "yellow"), (),
                     "touch the {obj} ball", max_episode_steps=40),
    "push": TaskDef("push", SceneLayout(n_blocks=2, n_zones=1), ("red", "blue", "yellow"), ("green", "purple"),
                    "push the {obj} block to the {zone} zone", max_episode_steps=80),
    "pick_place": TaskDef("pick_place", SceneLayout(n_blocks=2, n_zones=2), ("red", "blue", "yellow"),
                          ("green", "purple"), "put the {obj} block in the {zone} zone", max_episode_steps=96),
}


def get_task_def(name: str) -> TaskDef:
    if name not in TASK_DEFS:
        raise ValueError(f"unknown tabletop task {name!r}; valid: {', '.join(TASK_DEFS)}")
    return TASK_DEFS[name]


@dataclass(frozen=True)
class InitState:
    """Everything that differs between episodes of one task. Object 0 is the target; zone 0 the goal."""

    task: str
    seed: int
    object_colors: tuple[str, ...]
    zone_colors: tuple[str, ...]
    object_xy: np.ndarray = field(repr=False)  # [n_objects, 2]
    object_yaw: np.ndarray = field(repr=False)  # [n_objects]
    zone_xy: np.ndarray = field(repr=False)  # [n_zones, 2]
    gripper_xyz: np.ndarray = field(repr=False)  # [3]
    instruction: str = ""


def _far(p: np.ndarray, others: list[np.ndarray], min_dist: float) -> bool:
    return all(np.linalg.norm(p - o) >= min_dist for o in others)


def _seg_dist(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    ab = b - a
    t = np.clip(np.dot(p - a, ab) / max(np.dot(ab, ab), 1e-12), 0.0, 1.0)
    return float(np.linalg.norm(p - (a + t * ab)))


def sample_init_state(task: str, seed: int, colors: tuple[str, str | None] | None = None) -> InitState:
    """The initial state of `task` for `seed` (same seed, same state, on any machine).

    `colors=(object colour, zone colour)` pins the language task (used for one demo per task);
    otherwise the seed draws it. Rejection sampling keeps objects apart, blocks out of zones, and
    (push) the distractor off the target's path, so every state is solvable.
    """
    td = get_task_def(task)
    rng = np.random.default_rng([seed, 7919])  # decorrelated from other uses of the same seed
    n_obj, n_zone = td.n_objects, td.layout.n_zones
    if colors is not None:
        obj_c, zone_c = colors
        if obj_c not in td.object_colors or (n_zone and zone_c not in td.zone_colors):
            raise ValueError(f"colours {colors!r} are not valid for {task!r}; valid: {td.instruction_variants()}")
        rest = [c for c in td.object_colors if c != obj_c]
        obj_colors = (obj_c, *(str(c) for c in rng.permutation(rest)[: n_obj - 1]))
        zone_rest = [c for c in td.zone_colors if c != zone_c]
        zone_colors = ((zone_c, *(str(c) for c in rng.permutation(zone_rest)[: n_zone - 1])) if n_zone else ())
    else:
        obj_colors = tuple(str(c) for c in rng.permutation(td.object_colors)[:n_obj])
        zone_colors = tuple(str(c) for c in rng.permutation(td.zone_colors)[:n_zone])

    lo, hi = -0.16, 0.16
    for _ in range(10_000):
        zones: list[np.ndarray] = []
        while len(zones) < n_zone:
            z = rng.uniform(lo + 0.02, hi - 0.02, 2)
            if _far(z, zones, 2 * ZONE_HALF + 0.04):
                zones.append(z)
        objs: list[np.ndarray] = []
        for i in range(n_obj):
            p = rng.uniform(lo, hi, 2)
            if not _far(p, objs, 0.09):
                break
            # Blocks never start inside (or touching) a zone.
            if td.object_kind == "block" and not all(np.abs(p - z).max() > ZONE_HALF + 0.035 for z in zones):
                break
            objs.append(p)
        if len(objs) < n_obj:
            continue
        if task == "push":
            d = np.linalg.norm(zones[0] - objs[0])
            # Far enough to need a push, near enough to finish in time; the path and the push-off
            # point behind the target stay clear of the distractor.
            behind = objs[0] - 0.06 * (zones[0] - objs[0]) / max(d, 1e-9)
            if not 0.12 <= d <= 0.24 or _seg_dist(objs[1], behind, zones[0]) < 0.09:
                continue
        gripper = np.array([*rng.uniform(-0.08, 0.08, 2), rng.uniform(0.12, 0.18)])
        yaw = rng.uniform(-np.pi / 4, np.pi / 4, n_obj) if td.object_kind == "block" else np.zeros(n_obj)
        return InitState(
            task=task, seed=int(seed), object_colors=obj_colors, zone_colors=zone_colors,
            object_xy=np.array(objs), object_yaw=yaw, zone_xy=np.array(zones).reshape(n_zone, 2),
            gripper_xyz=gripper,
            instruction=td.instruction(obj_colors[0], zone_colors[0] if n_zone else None),
        )
    raise RuntimeError(f"could not sample an initial state for {task!r} with seed {seed}")
