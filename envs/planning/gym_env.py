"""gymnasium wrappers: one planning env per instance, and a vectorised numpy batch env.

``PlanningEnv`` observations are rendered RGB frames (``render_mode="rgb_array"``). Dynamics are
the symbolic ones of :mod:`.grid` (gymnasium-compatible FrozenLake). Reward modes:

* ``"progress"`` (default): the VPRL step reward of the transition (+1 / 0 / -5, see
  :mod:`.judge`); bumping into a wall is a no-op and scores -5, a hole -5;
* ``"sparse"``: gymnasium's FrozenLake reward, 1.0 on reaching the goal, else 0.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .grid import (
    Layout,
    ParsedState,
    batch_distance,
    batch_step,
    batch_terminal,
    canonical_task,
    pack_layouts,
    step_state,
)
from .render import DEFAULT_CELL_SIZE, frame_shape, render_batch, render_state
from .splits import generate_layout

REWARD_MODES = ("progress", "sparse")


def _check_reward_mode(mode: str) -> str:
    if mode not in REWARD_MODES:
        raise ValueError(f"unknown reward_mode {mode!r}; valid: {', '.join(REWARD_MODES)}")
    return mode


class PlanningEnv(gym.Env):
    """A single VPRL planning env. Each ``reset`` picks a layout from ``layouts`` (uniformly with
    the env's seeded RNG), uses the fixed ``layout``, or draws a fresh one of ``task``/``size``.
    ``options={"layout": Layout}`` on reset overrides all of these."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, task: str = "frozenlake", size: int = 4, *, layout: Layout | None = None,
                 layouts: Sequence[Layout] | None = None, cell_size: int = DEFAULT_CELL_SIZE,
                 render_mode: str | None = "rgb_array", reward_mode: str = "progress",
                 max_episode_steps: int | None = None, generator_kwargs: dict | None = None) -> None:
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"unsupported render_mode {render_mode!r}; valid: 'rgb_array'")
        self.layouts = tuple(layouts) if layouts is not None else None
        if self.layouts is not None and not self.layouts:
            raise ValueError("layouts is empty")
        ref = layout or (self.layouts[0] if self.layouts else None)
        self.task = ref.task if ref is not None else canonical_task(task)
        self.size = ref.level if ref is not None else int(size)
        pool = ([layout] if layout is not None else []) + list(self.layouts or [])
        shapes = {lay.shape for lay in pool} | ({ref.shape} if ref is not None else set())
        if len(shapes) > 1 or any(lay.task != self.task for lay in pool):
            raise ValueError(f"all layouts must share one task and grid shape; got {sorted(shapes)}")
        self.fixed_layout = layout
        self.cell_size = int(cell_size)
        self.render_mode = render_mode
        self.reward_mode = _check_reward_mode(reward_mode)
        self.max_episode_steps = max_episode_steps
        self.generator_kwargs = dict(generator_kwargs or {})
        probe = ref or generate_layout(self.task, self.size, np.random.default_rng(0), **self.generator_kwargs)
        self.observation_space = spaces.Box(0, 255, frame_shape(probe, self.cell_size), np.uint8)
        self.action_space = spaces.Discrete(probe.n_actions)
        self.layout: Layout = probe
        self.state: np.ndarray = probe.start_state()
        self._steps = 0

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if options.get("layout") is not None:
            layout = options["layout"]
            if layout.task != self.task or frame_shape(layout, self.cell_size) != self.observation_space.shape:
                raise ValueError(f"options['layout'] {layout!r} does not fit this env ({self.task}, "
                                 f"obs {self.observation_space.shape})")
        elif self.fixed_layout is not None:
            layout = self.fixed_layout
        elif self.layouts is not None:
            layout = self.layouts[int(self.np_random.integers(len(self.layouts)))]
        else:
            layout = generate_layout(self.task, self.size, self.np_random, **self.generator_kwargs)
        self.layout, self.state, self._steps = layout, layout.start_state(), 0
        return self._obs(), self._info(valid=True)

    def step(self, action: int):
        if not self.action_space.contains(int(action)):
            raise ValueError(f"action {action!r} not in {self.action_space}")
        prev = self.state
        self.state, valid, terminated = step_state(self.layout, prev, int(action))
        self._steps += 1
        if self.reward_mode == "sparse":
            # paid once, on the step that enters the goal (gymnasium's FrozenLake pays 0 after it)
            reward = float(terminated and self.layout.is_goal(self.state) and not self.layout.is_goal(prev))
            kind = None
        else:
            from .judge import classify_steps

            j = classify_steps(prev[None], self.state[None], [self.layout])
            reward, kind = float(j.reward[0]), int(j.kind[0])
        truncated = bool(self.max_episode_steps is not None and self._steps >= self.max_episode_steps
                         and not terminated)
        info = self._info(valid=valid)
        info["step_kind"] = kind
        return self._obs(), reward, bool(terminated), truncated, info

    def render(self) -> np.ndarray | None:
        if self.render_mode is None:
            return None
        return self._obs()

    # ------------------------------------------------------------------ helpers
    def _obs(self) -> np.ndarray:
        return render_state(self.layout, self.state, self.cell_size)

    def _info(self, valid: bool) -> dict[str, Any]:
        return {
            "state": self.state.copy(),
            "parsed_state": ParsedState.from_array(self.state),
            "layout": self.layout,
            "valid": bool(valid),
            "distance": self.layout.dist_of(self.state),
            "is_success": self.layout.is_goal(self.state),
            "optimal_length": self.layout.optimal_length,
        }


class BatchStep(NamedTuple):
    states: np.ndarray  # int64 [B, 5]; columns 0-1 are the agent cells
    valid: np.ndarray  # bool [B]: the action executed
    done: np.ndarray  # bool [B]: terminal after the step
    reward: np.ndarray  # float32 [B]
    success: np.ndarray  # bool [B]: reached the goal / completed the task

    @property
    def cells(self) -> np.ndarray:
        return self.states[:, :2]


class BatchPlanningEnv:
    """B planning envs stepped together in numpy (no Python loop over envs in ``step``).

    Layouts may differ in task and size (arrays are padded). Terminal envs stay put (``valid``
    False) until ``reset``; with ``auto_reset=True`` they restart from their start state instead.
    """

    def __init__(self, layouts: Sequence[Layout], *, reward_mode: str = "progress", auto_reset: bool = False,
                 cell_size: int = DEFAULT_CELL_SIZE) -> None:
        if len(layouts) == 0:
            raise ValueError("BatchPlanningEnv needs at least one layout")
        self.reward_mode = _check_reward_mode(reward_mode)
        self.auto_reset = bool(auto_reset)
        self.cell_size = int(cell_size)
        self.set_layouts(layouts)

    def set_layouts(self, layouts: Sequence[Layout]) -> None:
        self.pack = pack_layouts(layouts)
        self.layouts = self.pack.layouts
        self.start_states = np.stack([lay.start_state() for lay in self.layouts])
        self.states = self.start_states.copy()

    @property
    def num_envs(self) -> int:
        return len(self.layouts)

    def reset(self, layouts: Sequence[Layout] | None = None, indices: np.ndarray | None = None) -> np.ndarray:
        """Back to the start states (all, or ``indices``); optionally swap in new layouts first."""
        if layouts is not None:
            self.set_layouts(layouts)
        if indices is None:
            self.states = self.start_states.copy()
        else:
            self.states[indices] = self.start_states[indices]
        return self.states.copy()

    def step(self, actions: np.ndarray) -> BatchStep:
        prev = self.states
        nxt, valid, done = batch_step(self.pack, prev, actions)
        success = done & (batch_distance(self.pack, nxt) == 0)
        if self.reward_mode == "sparse":
            reward = (success & valid).astype(np.float32)
        else:
            from .judge import step_rewards

            reward = step_rewards(prev, nxt, self.pack)
        self.states = nxt
        if self.auto_reset and done.any():
            self.states = np.where(done[:, None], self.start_states, nxt)
        return BatchStep(nxt, valid, done, reward, success)

    def terminal(self) -> np.ndarray:
        return batch_terminal(self.pack, self.states)

    def render(self, image_size: tuple[int, int] | int | None = None) -> np.ndarray:
        """uint8 [B, H, W, 3] frames of the current states (same-size grids, or give image_size)."""
        return render_batch(self.layouts, self.states, self.cell_size, image_size)


def register_envs() -> list[str]:
    """Register ``mmrl/VPRL-{FrozenLake,Maze,MiniBehavior}-v0`` with gymnasium; returns the ids."""
    ids = []
    for name, task in (("FrozenLake", "frozenlake"), ("Maze", "maze"), ("MiniBehavior", "minibehavior")):
        env_id = f"mmrl/VPRL-{name}-v0"
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=f"{__name__}:PlanningEnv", kwargs={"task": task})
        ids.append(env_id)
    return ids
