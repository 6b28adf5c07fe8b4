"""Gymnasium-style MuJoCo tabletop envs: `reach`, `push`, `pick_place`.

Observation: `{"images": {"front" | "wrist" | "top" | "follow": HxWx3 uint8}, "state": float32[8]}` where
state = tcp position (3), tcp velocity (3), finger openings (2). Action (7-D, in [-1, 1]): tcp delta
position (3, scaled by `max_delta` metres), delta rotation (3, ignored: the gripper keeps a fixed
orientation), gripper (-1 open ... +1 closed, the LIBERO convention). The episode terminates on
success with reward 1 (the 0/1 success reward), and truncates at `max_episode_steps`.
"""

from __future__ import annotations

from typing import Any

from .gl import close_at_exit, select_gl_backend

select_gl_backend()

import gymnasium as gym  # noqa: E402
import mujoco  # noqa: E402
import numpy as np  # noqa: E402
from gymnasium import spaces  # noqa: E402

from .scene import (  # noqa: E402
    BLOCK_HALF,
    FINGER_OPEN,
    N_SUBSTEPS,
    WORKSPACE_HIGH,
    WORKSPACE_LOW,
    ZONE_HALF,
    build_mjcf,
)
from .tasks import (  # noqa: E402
    COLORS,
    InitState,
    TaskDef,
    check_position_jitter,
    get_task_def,
    sample_init_state,
)

CAMERAS = ("front", "wrist", "top", "follow")
DEFAULT_CAMERAS = ("front", "wrist")  # what an env renders unless told
STATE_DIM = 8
ACTION_DIM = 7
# The servo target may lead the tcp by at most this much, so pressing into the table or a block
# does not wind up a target that takes many steps to come back.
_MAX_LEAD = 0.03


class TabletopEnv(gym.Env):
    """One tabletop task. `reset(seed=s)` (or `options={"init_state_id": s}`) always gives the same
    initial state for the same s; `options={"init_state": InitState}` sets one directly."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}
    task_name: str = ""

    def __init__(self, task: str | None = None, *, image_size: int | tuple[int, int] = 64,
                 cameras: tuple[str, ...] = DEFAULT_CAMERAS, max_delta: float = 0.02,
                 max_episode_steps: int | None = None, render_mode: str | None = "rgb_array",
                 position_jitter: float | None = None, layout_seed: int = 0):
        task = task or self.task_name
        self.task_def: TaskDef = get_task_def(task)
        bad = [c for c in cameras if c not in CAMERAS]
        if bad or not cameras:
            raise ValueError(f"unknown camera(s) {bad or cameras!r}; valid: {', '.join(CAMERAS)}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"unsupported render_mode {render_mode!r}; valid: 'rgb_array'")
        self.task = task
        self.render_mode = render_mode
        self.height, self.width = (image_size, image_size) if isinstance(image_size, int) else image_size
        self.cameras = tuple(cameras)
        self.max_delta = float(max_delta)
        self.max_episode_steps = int(max_episode_steps or self.task_def.max_episode_steps)
        # Seeded resets: uniform layouts (None) or fixed per-instruction layouts jittered by this much.
        self.position_jitter = check_position_jitter(position_jitter)
        self.layout_seed = int(layout_seed)

        self.model = mujoco.MjModel.from_xml_string(build_mjcf(self.task_def.layout))
        self.data = mujoco.MjData(self.model)
        self._renderer: mujoco.Renderer | None = None
        m = self.model
        name = lambda kind, n: mujoco.mj_name2id(m, kind, n)  # noqa: E731
        self._tcp = name(mujoco.mjtObj.mjOBJ_SITE, "tcp")
        self._ee_qpos = [m.jnt_qposadr[name(mujoco.mjtObj.mjOBJ_JOINT, j)] for j in ("ee_x", "ee_y", "ee_z")]
        self._ee_dof = [m.jnt_dofadr[name(mujoco.mjtObj.mjOBJ_JOINT, j)] for j in ("ee_x", "ee_y", "ee_z")]
        self._finger_qpos = [m.jnt_qposadr[name(mujoco.mjtObj.mjOBJ_JOINT, f"finger_{s}")] for s in "lr"]
        self._finger_geoms = {name(mujoco.mjtObj.mjOBJ_GEOM, f"finger_{s}") for s in "lr"}
        self._gripper_geoms = self._finger_geoms | {name(mujoco.mjtObj.mjOBJ_GEOM, "palm")}
        lay = self.task_def.layout
        kind = self.task_def.object_kind
        self._obj_geoms = [name(mujoco.mjtObj.mjOBJ_GEOM, f"{kind}{i}") for i in range(self.task_def.n_objects)]
        self._block_qpos = [m.jnt_qposadr[name(mujoco.mjtObj.mjOBJ_JOINT, f"block{i}")] for i in range(lay.n_blocks)]
        self._zone_geoms = [name(mujoco.mjtObj.mjOBJ_GEOM, f"zone{i}") for i in range(lay.n_zones)]

        img = spaces.Box(0, 255, (self.height, self.width, 3), np.uint8)
        self.observation_space = spaces.Dict({
            "images": spaces.Dict({c: img for c in self.cameras}),
            "state": spaces.Box(-np.inf, np.inf, (STATE_DIM,), np.float32),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
        self._lo, self._hi = np.array(WORKSPACE_LOW), np.array(WORKSPACE_HIGH)
        self.init_state: InitState | None = None
        self.instruction = ""
        self.elapsed_steps = 0
        self._target = np.zeros(3)
        self._success = False

    # ----------------------------------------------------------------- gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        state = options.get("init_state")
        if state is None:
            sid = options.get("init_state_id", seed)
            if sid is None:
                sid = int(self.np_random.integers(2**31 - 1))
            state = sample_init_state(self.task, int(sid), colors=options.get("colors"),
                                      position_jitter=self.position_jitter, layout_seed=self.layout_seed)
        elif state.task != self.task:
            raise ValueError(f"init_state is for task {state.task!r}, this env runs {self.task!r}")
        self._apply(state)
        return self._obs(), self._info()

    def step(self, action):
        self.apply_action(action)
        obs = self._obs()
        return obs, *self._outcome()

    def step_chunk(self, actions):
        """Run up to K actions, stopping at the episode's end; observe (render) only once, at the end.
        Returns (obs, summed reward, terminated, truncated, info with "steps_executed")."""
        actions = np.asarray(actions, np.float32)
        total, executed = 0.0, 0
        terminated = truncated = False
        for a in actions:
            self.apply_action(a)
            executed += 1
            r, terminated, truncated, _ = self._outcome()
            total += r
            if terminated or truncated:
                break
        info = self._info()
        info["steps_executed"] = executed
        return self._obs(), total, terminated, truncated, info

    def render(self) -> np.ndarray:
        return self.render_cameras(("front",))["front"]

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()  # explicitly: a GL context freed at interpreter exit raises noise
            self._renderer = None

    @property
    def success(self) -> bool:
        return self._success

    # ----------------------------------------------------------- privileged state (experts, tests)
    @property
    def tcp_pos(self) -> np.ndarray:
        return self.data.site_xpos[self._tcp].copy()

    @property
    def servo_target(self) -> np.ndarray:
        """The commanded tcp position the position servos track (the measured tcp lags it)."""
        return self._target.copy()

    @property
    def finger_q(self) -> np.ndarray:
        return self.data.qpos[self._finger_qpos].copy()

    @property
    def object_pos(self) -> np.ndarray:
        """[n_objects, 3] centres; object 0 is the one the instruction names."""
        return np.array([self.data.geom_xpos[g] for g in self._obj_geoms])

    @property
    def zone_xy(self) -> np.ndarray:
        """[n_zones, 2] centres; zone 0 is the goal."""
        return np.array([self.model.geom_pos[g][:2] for g in self._zone_geoms]).reshape(-1, 2)

    def gripper_touches(self, geom: int) -> bool:
        for c in self.data.contact[: self.data.ncon]:
            pair = {int(c.geom1), int(c.geom2)}
            if geom in pair and pair & self._gripper_geoms:
                return True
        return False

    def render_cameras(self, cameras: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        if self._renderer is None:
            # Created lazily, in the process that renders (GL contexts do not survive fork/pickle).
            self._renderer = mujoco.Renderer(self.model, self.height, self.width)
            close_at_exit(self)
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        out = {}
        for cam in cameras or self.cameras:
            self._renderer.update_scene(self.data, camera=cam)
            out[cam] = self._renderer.render().copy()
        return out

    # --------------------------------------------------------------- internals
    def _apply(self, s: InitState) -> None:
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        for i, g in enumerate(self._obj_geoms):
            m.geom_rgba[g] = COLORS[s.object_colors[i]]
        for i, g in enumerate(self._zone_geoms):
            m.geom_rgba[g] = (*COLORS[s.zone_colors[i]][:3], 1.0)
            m.geom_pos[g][:2] = s.zone_xy[i]
        if self.task_def.object_kind == "ball":
            for i, g in enumerate(self._obj_geoms):
                m.body_pos[m.geom_bodyid[g]][:2] = s.object_xy[i]
        for i, adr in enumerate(self._block_qpos):
            yaw = s.object_yaw[i]
            d.qpos[adr: adr + 7] = [*s.object_xy[i], BLOCK_HALF, np.cos(yaw / 2), 0, 0, np.sin(yaw / 2)]
        d.qpos[self._ee_qpos] = s.gripper_xyz
        d.qpos[self._finger_qpos] = FINGER_OPEN
        self._target = np.array(s.gripper_xyz, dtype=float)
        d.ctrl[:3] = self._target
        d.ctrl[3:] = FINGER_OPEN
        mujoco.mj_forward(m, d)
        self.init_state, self.instruction = s, s.instruction
        self.elapsed_steps, self._success = 0, False

    def apply_action(self, action) -> None:
        """The physics of one control step under `action` (no observation rendered)."""
        if self.init_state is None:
            raise RuntimeError("call reset() before step()")
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != (ACTION_DIM,):
            raise ValueError(f"action must have {ACTION_DIM} values (3 dpos, 3 drot, 1 gripper), got shape {a.shape}")
        a = np.clip(np.nan_to_num(a), -1.0, 1.0)
        tcp = self.tcp_pos
        self._target = np.clip(self._target + a[:3] * self.max_delta, self._lo, self._hi)
        self._target = np.clip(self._target, tcp - _MAX_LEAD, tcp + _MAX_LEAD)
        self.data.ctrl[:3] = self._target
        self.data.ctrl[3:] = FINGER_OPEN * (1.0 - a[6]) / 2.0
        mujoco.mj_step(self.model, self.data, nstep=N_SUBSTEPS)
        self.elapsed_steps += 1
        self._success = self._success or self._check_success()

    def _outcome(self) -> tuple[float, bool, bool, dict]:
        terminated = self._success
        truncated = not terminated and self.elapsed_steps >= self.max_episode_steps
        # Reward 1 only on the step that succeeds: the return of an episode is its 0/1 success.
        reward = 1.0 if terminated else 0.0
        return reward, terminated, truncated, self._info()

    def _info(self) -> dict[str, Any]:
        return {"success": self._success, "instruction": self.instruction, "elapsed_steps": self.elapsed_steps,
                "init_state_id": self.init_state.seed if self.init_state else None}

    def _obs(self) -> dict[str, Any]:
        d = self.data
        state = np.concatenate([self.tcp_pos, d.qvel[self._ee_dof], self.finger_q]).astype(np.float32)
        return {"images": self.render_cameras() if self.render_mode else {}, "state": state}

    def _check_success(self) -> bool:
        raise NotImplementedError


class ReachEnv(TabletopEnv):
    """Touch the named ball with the gripper (a real contact, not a distance threshold)."""

    task_name = "reach"

    def _check_success(self) -> bool:
        return self.gripper_touches(self._obj_geoms[0])


class PushEnv(TabletopEnv):
    """Push the named block until its centre lies inside the goal zone, still on the table."""

    task_name = "push"

    def _check_success(self) -> bool:
        p = self.object_pos[0]
        return bool(np.abs(p[:2] - self.zone_xy[0]).max() < ZONE_HALF and p[2] < BLOCK_HALF + 0.01)


class PickPlaceEnv(TabletopEnv):
    """Put the named block in the goal zone: centre inside, resting on the table, released."""

    task_name = "pick_place"

    def _check_success(self) -> bool:
        p = self.object_pos[0]
        inside = np.abs(p[:2] - self.zone_xy[0]).max() < ZONE_HALF and p[2] < BLOCK_HALF + 0.01
        return bool(inside and not self.gripper_touches(self._obj_geoms[0]))


ENV_CLASSES: dict[str, type[TabletopEnv]] = {"reach": ReachEnv, "push": PushEnv, "pick_place": PickPlaceEnv}


def make_tabletop_env(task: str, **kwargs) -> TabletopEnv:
    """`make_tabletop_env("push", image_size=64)`; kwargs go to `TabletopEnv`."""
    if task not in ENV_CLASSES:
        raise ValueError(f"unknown tabletop task {task!r}; valid: {', '.join(ENV_CLASSES)}")
    return ENV_CLASSES[task](**kwargs)
