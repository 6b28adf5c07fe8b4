"""Task definitions: which objects a scene holds, how an initial state is drawn from a seed, and
what the instruction says. Pure numpy, no MuJoCo, so samplers are cheap and testable alone.
"""

from __future__ import annotations

import functools
import itertools
import zlib
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


MAX_POSITION_JITTER = 0.05  # metres; larger jitter leaves no room for separated layout templates
_LO, _HI = -0.16, 0.16  # objects' xy range (metres)
_OBJ_SEP = 0.09  # minimum distance between objects' centres


def check_position_jitter(position_jitter: float | None, name: str = "position_jitter") -> float | None:
    """`position_jitter` as a float (None stays None: uniform layouts); a ValueError naming `name`
    unless it is a number in [0, MAX_POSITION_JITTER]."""
    if position_jitter is None:
        return None
    if isinstance(position_jitter, bool) or not isinstance(position_jitter, (int, float)) \
            or not 0.0 <= float(position_jitter) <= MAX_POSITION_JITTER:
        raise ValueError(f"{name} must be null (uniform layouts) or a number of metres in "
                         f"[0, {MAX_POSITION_JITTER}], got {position_jitter!r}")
    return float(position_jitter)


def _check_colors(td: TaskDef, colors: tuple[str, str | None]) -> None:
    obj_c, zone_c = colors
    if obj_c not in td.object_colors or (td.layout.n_zones and zone_c not in td.zone_colors):
        raise ValueError(f"colours {colors!r} are not valid for {td.name!r}; valid: {td.instruction_variants()}")


def _scene_colors(td: TaskDef, colors: tuple[str, str | None] | None, rng: np.random.Generator
                  ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Objects' and zones' colours: the pinned (target object, goal zone) first and distractors
    drawn from the rest, or, with `colors=None`, all drawn."""
    n_obj, n_zone = td.n_objects, td.layout.n_zones
    if colors is None:
        return (tuple(str(c) for c in rng.permutation(td.object_colors)[:n_obj]),
                tuple(str(c) for c in rng.permutation(td.zone_colors)[:n_zone]))
    obj_c, zone_c = colors
    rest = [c for c in td.object_colors if c != obj_c]
    obj_colors = (obj_c, *(str(c) for c in rng.permutation(rest)[: n_obj - 1]))
    zone_rest = [c for c in td.zone_colors if c != zone_c]
    zone_colors = ((zone_c, *(str(c) for c in rng.permutation(zone_rest)[: n_zone - 1])) if n_zone else ())
    return obj_colors, zone_colors


def _draw_layout(td: TaskDef, rng: np.random.Generator, margin: float, sep_extra: float,
                 push_margin: float, tries: int = 10_000) -> tuple[np.ndarray, np.ndarray] | None:
    """Zones and objects' xy by rejection sampling (see `sample_init_state`): objects inside the
    range shrunk by `margin`, apart by `_OBJ_SEP + sep_extra`, blocks clear of zones by
    `sep_extra` more than needed, push distances inside [0.12, 0.24] shrunk by `push_margin`."""
    n_obj, n_zone = td.n_objects, td.layout.n_zones
    lo, hi = _LO + margin, _HI - margin
    for _ in range(tries):
        zones: list[np.ndarray] = []
        for _z in range(100):
            if len(zones) == n_zone:
                break
            z = rng.uniform(lo + 0.02, hi - 0.02, 2)
            if _far(z, zones, 2 * ZONE_HALF + 0.04 + sep_extra):
                zones.append(z)
        if len(zones) < n_zone:
            continue
        objs: list[np.ndarray] = []
        for _i in range(n_obj):
            p = rng.uniform(lo, hi, 2)
            if not _far(p, objs, _OBJ_SEP + sep_extra):
                break
            # Blocks never start inside (or touching) a zone.
            if td.object_kind == "block" and not all(np.abs(p - z).max() > ZONE_HALF + 0.035 + sep_extra
                                                     for z in zones):
                break
            objs.append(p)
        if len(objs) < n_obj:
            continue
        if td.name == "push" and not _push_ok(objs, zones, push_margin, sep_extra):
            continue
        return np.array(objs), np.array(zones).reshape(n_zone, 2)
    return None


def _push_ok(objs, zones, margin: float = 0.0, sep_extra: float = 0.0) -> bool:
    # Far enough to need a push, near enough to finish in time; the path and the push-off point
    # behind the target stay clear of the distractor.
    d = np.linalg.norm(zones[0] - objs[0])
    behind = objs[0] - 0.06 * (zones[0] - objs[0]) / max(d, 1e-9)
    return 0.12 + margin <= d <= 0.24 - margin and _seg_dist(objs[1], behind, zones[0]) >= 0.09 + sep_extra


def layout_template(task: str, colors: tuple[str, str | None], position_jitter: float, layout_seed: int = 0
                    ) -> InitState:
    """The fixed scene of one language task (`colors` = (object colour, zone colour)): distractor
    colours, zones, objects and the gripper start, a pure function of (task, instruction,
    `layout_seed`). Drawn with margins that leave room for +-`position_jitter` per coordinate.
    Its `seed` is -1 (it is no episode's state); its arrays are read-only (templates are cached)."""
    return _layout_template(task, tuple(colors), check_position_jitter(position_jitter), int(layout_seed))


@functools.lru_cache(maxsize=256)
def _layout_template(task: str, colors: tuple[str, str | None], position_jitter: float, layout_seed: int
                     ) -> InitState:
    td = get_task_def(task)
    _check_colors(td, colors)
    instruction = td.instruction(colors[0], colors[1] if td.layout.n_zones else None)
    # crc32 of the names: the same template on any machine and Python (str hashes are salted).
    rng = np.random.default_rng([int(layout_seed), 104729, zlib.crc32(f"{task}|{instruction}".encode())])
    n_obj = td.n_objects
    obj_colors, zone_colors = _scene_colors(td, colors, rng)
    j = position_jitter or 0.0
    drawn = _draw_layout(td, rng, margin=j, sep_extra=j, push_margin=j)
    if drawn is None:
        raise RuntimeError(f"could not draw a layout template for {instruction!r} with jitter {j}")
    objs, zones = drawn
    gripper = np.array([*rng.uniform(-0.08, 0.08, 2), rng.uniform(0.13, 0.17)])
    yaw = rng.uniform(-np.pi / 4, np.pi / 4, n_obj) if td.object_kind == "block" else np.zeros(n_obj)
    for x in (objs, yaw, zones, gripper):
        x.setflags(write=False)
    return InitState(task=task, seed=-1, object_colors=obj_colors, zone_colors=zone_colors, object_xy=objs,
                     object_yaw=yaw, zone_xy=zones, gripper_xyz=gripper, instruction=instruction)


def _jittered_state(td: TaskDef, seed: int, rng: np.random.Generator, colors: tuple[str, str | None] | None,
                    position_jitter: float, layout_seed: int) -> InitState:
    """A LIBERO-like state: the instruction's fixed template, every object, zone and the gripper
    moved by uniform noise of +-`position_jitter` per coordinate (rejected until the usual
    separation rules hold)."""
    if colors is None:
        variants = td.instruction_variants()
        colors = variants[int(rng.integers(len(variants)))]
    t = layout_template(td.name, colors, position_jitter, layout_seed)
    j = position_jitter
    n_obj, n_zone = td.n_objects, td.layout.n_zones
    for _ in range(10_000):
        objs = t.object_xy + rng.uniform(-j, j, t.object_xy.shape)
        zones = t.zone_xy + rng.uniform(-j, j, t.zone_xy.shape)
        ok = all(_far(objs[i], list(objs[:i]), _OBJ_SEP) for i in range(n_obj))
        ok = ok and all(_far(zones[i], list(zones[:i]), 2 * ZONE_HALF + 0.04) for i in range(n_zone))
        if ok and td.object_kind == "block":
            ok = all(np.abs(p - z).max() > ZONE_HALF + 0.035 for p in objs for z in zones)
        if ok and td.name == "push":
            ok = _push_ok(list(objs), list(zones))
        if ok:
            break
    else:
        raise RuntimeError(f"could not jitter the template of {t.instruction!r} for seed {seed}")
    gripper = t.gripper_xyz + np.array([*rng.uniform(-j, j, 2), rng.uniform(-min(j, 0.01), min(j, 0.01))])
    yaw = t.object_yaw + (rng.uniform(-0.2, 0.2, n_obj) if td.object_kind == "block" else 0.0)
    return InitState(task=td.name, seed=int(seed), object_colors=t.object_colors, zone_colors=t.zone_colors,
                     object_xy=objs, object_yaw=yaw, zone_xy=zones, gripper_xyz=gripper,
                     instruction=t.instruction)


def sample_init_state(task: str, seed: int, colors: tuple[str, str | None] | None = None,
                      position_jitter: float | None = None, layout_seed: int = 0) -> InitState:
    """The initial state of `task` for `seed` (same seed, same state, on any machine).

    `colors=(object colour, zone colour)` pins the language task (used for one demo per task);
    otherwise the seed draws it. Rejection sampling keeps objects apart, blocks out of zones, and
    (push) the distractor off the target's path, so every state is solvable.

    `position_jitter=None` (the default) draws every layout uniformly. A number j (metres) makes
    the scenes LIBERO-like: each language task has one fixed layout (`layout_template`, from
    `layout_seed`) and a seed only moves each object, zone and the gripper by up to +-j per
    coordinate (block yaws by up to +-0.2 rad).
    """
    td = get_task_def(task)
    position_jitter = check_position_jitter(position_jitter)
    rng = np.random.default_rng([seed, 7919])  # decorrelated from other uses of the same seed
    if position_jitter is not None:
        return _jittered_state(td, seed, rng, colors, position_jitter, layout_seed)
    if colors is not None:
        _check_colors(td, colors)
    obj_colors, zone_colors = _scene_colors(td, colors, rng)
    drawn = _draw_layout(td, rng, margin=0.0, sep_extra=0.0, push_margin=0.0)
    if drawn is None:
        raise RuntimeError(f"could not sample an initial state for {task!r} with seed {seed}")
    objs, zones = drawn
    n_obj = td.n_objects
    gripper = np.array([*rng.uniform(-0.08, 0.08, 2), rng.uniform(0.12, 0.18)])
    yaw = rng.uniform(-np.pi / 4, np.pi / 4, n_obj) if td.object_kind == "block" else np.zeros(n_obj)
    return InitState(
        task=task, seed=int(seed), object_colors=obj_colors, zone_colors=zone_colors,
        object_xy=objs, object_yaw=yaw, zone_xy=zones, gripper_xyz=gripper,
        instruction=td.instruction(obj_colors[0], zone_colors[0] if td.layout.n_zones else None),
    )
