"""LIBERO (hf-libero + robosuite 1.4, through `lerobot[libero]`) behind the tabletop env interface.

    env = LiberoEnv("libero_spatial", task_id=0, image_size=128)
    obs, info = env.reset(options={"init_state_id": 0})   # one of the suite's official init states
    obs, reward, terminated, truncated, info = env.step(np.zeros(7))

Observation: `{"images": {"agentview": HxWx3, "wrist": HxWx3}, "state": float32[8]}` with images
upright (robosuite renders them upside down) and state = eef position (3), eef axis-angle (3),
gripper finger positions (2), the layout LIBERO policies (OpenVLA, SmolVLA, pi0) are trained on.
Action: 7-D OSC_POSE delta (3 pos, 3 rot, gripper -1 open / +1 close), as in the LIBERO datasets.

Offline use: importing `libero.libero` without a config asks questions on stdin,
and asset lookups fall back to a hub download. `configure_libero()` writes a config into a temp dir
and points `LIBERO_CONFIG_PATH` at it before the first import, and pins the asset directory
(`assets_dir`, else `MMRL_LIBERO_ASSETS`, else the cache folder `mmrl fetch-assets libero` fills;
`mmrl.envs.libero.assets`, docs/libero.md). Nothing is downloaded here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from mmrl.envs.libero.assets import ASSETS_ENV_VAR, default_assets_dir, find_assets  # noqa: F401 (re-exported)
from mmrl.envs.tabletop.gl import close_at_exit, select_gl_backend

select_gl_backend()  # robosuite imports mujoco and reads MUJOCO_GL then

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
from gymnasium import spaces  # noqa: E402

SUITES: dict[str, str] = {"spatial": "libero_spatial", "object": "libero_object", "goal": "libero_goal",
                          "long": "libero_10", "10": "libero_10"}
# Episode budgets of the OpenVLA / SimpleVLA-RL LIBERO evaluations (longest demo plus a margin).
MAX_EPISODE_STEPS: dict[str, int] = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520}
CAMERAS: dict[str, str] = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}  # ours -> robosuite's
DUMMY_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], np.float32)  # hold still, gripper open

_configured_assets: Path | None = None


def suite_name(suite: str) -> str:
    """Accepts "spatial" or "libero_spatial" (and "long"/"10" for libero_10)."""
    name = SUITES.get(suite, suite)
    if name not in MAX_EPISODE_STEPS:
        valid = sorted(set(MAX_EPISODE_STEPS) | set(SUITES))
        raise ValueError(f"unknown LIBERO suite {suite!r}; valid: {', '.join(valid)}")
    return name


def configure_libero(assets_dir: str | Path | None = None) -> Path:
    """Make `libero.libero` importable offline and point it at `assets_dir`; returns that dir."""
    global _configured_assets
    assets = find_assets(assets_dir)  # one line saying where they come from when they are not there
    if "libero.libero" not in sys.modules:
        spec = importlib.util.find_spec("libero.libero")  # imports only the empty `libero` package
        if spec is None or spec.origin is None:
            raise ImportError("hf-libero is not installed: pip install 'mmrl[libero]' (lerobot[libero]==0.6.1)")
        pkg = Path(spec.origin).parent
        config_dir = os.environ.get("LIBERO_CONFIG_PATH")
        if not config_dir or not (Path(config_dir) / "config.yaml").exists():
            # Without config.yaml the import calls input() (and hangs CI): write one first.
            config_dir = tempfile.mkdtemp(prefix="mmrl_libero_")
            lines = {"benchmark_root": pkg, "bddl_files": pkg / "bddl_files", "init_states": pkg / "init_files",
                     "datasets": Path(config_dir) / "datasets", "assets": assets}
            (Path(config_dir) / "config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in lines.items()))
            os.environ["LIBERO_CONFIG_PATH"] = config_dir
    import libero.libero as libero_pkg

    # get_assets_path() returns this cache before trying anything else (a hub download among them).
    libero_pkg._assets_path_cache = str(assets)
    _configured_assets = assets
    return assets


def task_names(suite: str, assets_dir: str | Path | None = None) -> list[str]:
    """The instructions of a suite's tasks, in task_id order."""
    configure_libero(assets_dir)
    from libero.libero import benchmark

    return [t.language for t in benchmark.get_benchmark_dict()[suite_name(suite)]().tasks]


def _quat_to_axis_angle(quat_xyzw: np.ndarray) -> np.ndarray:
    q = np.asarray(quat_xyzw, np.float64)
    w = np.clip(q[3], -1.0, 1.0)
    s = np.sqrt(max(1.0 - w * w, 0.0))
    if s < 1e-8:
        return np.zeros(3)
    return q[:3] / s * 2.0 * np.arccos(w)


def _blank_sensor(observable, height: int, width: int):
    """A stand-in for a robosuite camera sensor that renders nothing."""
    blank = np.zeros((height, width, 3), np.uint8)

    def sensor(obs_cache):
        return blank

    sensor.__modality__ = observable.modality  # robosuite groups observations by it
    return sensor


class LiberoEnv(gym.Env):
    """One LIBERO task. `reset(options={"init_state_id": i})` loads official init state i (mod the
    number of states, 50 per task); `seed` seeds robosuite. `settle_steps` no-op steps after a reset
    let objects come to rest, as in the standard evaluation (they do not count as episode steps).
    `hard_reset=True` (the default, as in the official evaluation) rebuilds the model from XML on
    every reset: a reset then depends only on the init state and seed. `hard_reset=False` is about
    2x faster but carries state over from the previous episode (measured: eef position differs by
    ~1 cm after resetting to the same official state), so it is not reproducible."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(self, suite: str = "libero_spatial", task_id: int = 0, *, image_size: int | tuple[int, int] = 128,
                 cameras: tuple[str, ...] = ("agentview", "wrist"), max_episode_steps: int | None = None,
                 settle_steps: int = 10, assets_dir: str | Path | None = None, control_freq: int = 20,
                 hard_reset: bool = True):
        bad = [c for c in cameras if c not in CAMERAS]
        if bad or not cameras:
            raise ValueError(f"unknown camera(s) {bad or cameras!r}; valid: {', '.join(CAMERAS)}")
        self.suite = suite_name(suite)
        configure_libero(assets_dir)
        import torch

        torch.set_num_threads(1)  # init states are torch pickles; keep the worker single-threaded
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        bench = benchmark.get_benchmark_dict()[self.suite]()
        if not 0 <= task_id < bench.n_tasks:
            raise ValueError(f"task_id {task_id} out of range for {self.suite} (0..{bench.n_tasks - 1})")
        task = bench.get_task(task_id)
        self.task_id, self.task_name = task_id, task.name
        self.instruction = task.language
        self.init_states = np.asarray(bench.get_task_init_states(task_id))
        self.height, self.width = (image_size, image_size) if isinstance(image_size, int) else image_size
        self.cameras = tuple(cameras)
        self.settle_steps = int(settle_steps)
        self.max_episode_steps = int(max_episode_steps or MAX_EPISODE_STEPS[self.suite])
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        self._env = OffScreenRenderEnv(bddl_file_name=bddl, camera_names=[CAMERAS[c] for c in self.cameras],
                                       camera_heights=self.height, camera_widths=self.width,
                                       control_freq=control_freq, hard_reset=hard_reset)
        close_at_exit(self)  # robosuite opened its EGL context: closed before the display at exit
        self._camera_obs = [self._env.env._observables[f"{CAMERAS[c]}_image"] for c in self.cameras]
        self._blank_sensors = [_blank_sensor(ob, self.height, self.width) for ob in self._camera_obs]
        self._real_sensors: dict[str, Any] = {}

        img = spaces.Box(0, 255, (self.height, self.width, 3), np.uint8)
        self.observation_space = spaces.Dict({"images": spaces.Dict({c: img for c in self.cameras}),
                                              "state": spaces.Box(-np.inf, np.inf, (8,), np.float32)})
        self.action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)
        self.init_state_id: int | None = None
        self.elapsed_steps = 0
        self._success = False

    @property
    def success(self) -> bool:
        return self._success

    @property
    def num_init_states(self) -> int:
        return len(self.init_states)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        sid = (options or {}).get("init_state_id", seed if seed is not None else 0)
        self.init_state_id = int(sid) % len(self.init_states)
        if seed is not None:
            self._env.seed(seed)
        # Rendering is most of a reset's cost: robosuite renders after rebuilding the model, after
        # loading the state and at every settle step, and only the last image is returned.
        inner = self._env.env
        for ob in self._camera_obs:
            ob._enabled = False  # skip the forced render at the end of robosuite's reset ...
        try:
            self._env.reset()
        finally:
            for ob in self._camera_obs:
                # ... and leave the clock as that forced sample would have (it also advances it).
                ob._enabled, ob._sampled = True, True
                ob._time_since_last_sample += inner.model_timestep
        try:
            self._mute_cameras(self.settle_steps >= 2)
            raw = self._env.set_init_state(self.init_states[self.init_state_id])
            for k in range(self.settle_steps):
                self._mute_cameras(k < self.settle_steps - 1)
                raw, _, _, _ = self._env.step(DUMMY_ACTION)
        finally:
            self._mute_cameras(False)
        self.elapsed_steps, self._success = 0, False
        return self._format(self._fresh(raw)), self._info()

    def step(self, action):
        raw = self._sim_step(action)
        return self._format(raw), *self._outcome()

    def step_chunk(self, actions):
        """K actions, rendering only for the last one (rendering is most of LIBERO's cost); the
        last observation equals what K plain `step`s would give."""
        actions = np.asarray(actions, np.float32)
        total, executed, raw = 0.0, 0, {}
        terminated = truncated = False
        try:
            for k, a in enumerate(actions):
                self._mute_cameras(k < len(actions) - 1)
                raw = self._sim_step(a)
                executed += 1
                r, terminated, truncated, _ = self._outcome()
                total += r
                if terminated or truncated:
                    break
        finally:
            self._mute_cameras(False)
        info = self._info()
        info["steps_executed"] = executed
        return self._format(self._fresh(raw)), total, terminated, truncated, info

    def render(self) -> np.ndarray:
        raw = self._env.env._get_observations(force_update=True)
        return self._format(raw)["images"][self.cameras[0]]

    def close(self) -> None:
        if getattr(self, "_env", None) is not None:
            self._env.close()
            self._env = None

    # --------------------------------------------------------------- internals
    def _sim_step(self, action) -> dict:
        if self.init_state_id is None:
            raise RuntimeError("call reset() before step()")
        a = np.asarray(action, np.float64).reshape(-1)
        if a.shape != (7,):
            raise ValueError(f"action must have 7 values (3 dpos, 3 drot, 1 gripper), got shape {a.shape}")
        raw, _, _, _ = self._env.step(np.clip(a, -1.0, 1.0))
        self.elapsed_steps += 1
        self._success = self._success or bool(self._env.check_success())
        return raw

    def _mute_cameras(self, mute: bool) -> None:
        """Swap the camera sensors for a blank image (or back). The observables' sampling clocks keep
        running either way, so a camera samples at exactly the sub-steps it always would."""
        for ob, blank in zip(self._camera_obs, self._blank_sensors):
            if mute and ob._sensor is not blank:
                self._real_sensors[ob.name] = ob._sensor
                ob._sensor = blank
            elif not mute and ob._sensor is blank:
                ob._sensor = self._real_sensors[ob.name]

    def _fresh(self, raw: dict) -> dict:
        """If the last camera sample was a muted one (an episode ended early inside a chunk), render now."""
        if any(not np.any(raw.get(f"{CAMERAS[c]}_image", 0)) for c in self.cameras):
            self._env.env._update_observables(force=True)
            raw = self._env.env._get_observations()
        return raw

    def _outcome(self) -> tuple[float, bool, bool, dict]:
        terminated = self._success
        truncated = not terminated and self.elapsed_steps >= self.max_episode_steps
        return (1.0 if terminated else 0.0), terminated, truncated, self._info()

    def _info(self) -> dict[str, Any]:
        return {"success": self._success, "instruction": self.instruction, "elapsed_steps": self.elapsed_steps,
                "init_state_id": self.init_state_id}

    def _format(self, raw: dict) -> dict[str, Any]:
        # robosuite's offscreen images are upside down; flip both axes like the LIBERO datasets' users do.
        images = {c: np.ascontiguousarray(raw[f"{CAMERAS[c]}_image"][::-1, ::-1]) for c in self.cameras}
        state = np.concatenate([raw["robot0_eef_pos"], _quat_to_axis_angle(raw["robot0_eef_quat"]),
                                raw["robot0_gripper_qpos"]]).astype(np.float32)
        return {"images": images, "state": state}


def make_libero_env(suite: str = "libero_spatial", task_id: int = 0, **kwargs) -> LiberoEnv:
    return LiberoEnv(suite, task_id, **kwargs)
