"""The LIBERO task (`libero`): contexts on the official initial states, SFT from a local LeRobotDataset
of the suite's demos, and the paper's evaluation protocol (the shared parts are `mmrl.envs.robot_task`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from mmrl.envs import register_task
from mmrl.envs.robot_task import EVAL_MODES, RobotTask, check_choice, load_sft_frames


@register_task("libero")
class LiberoTask(RobotTask):
    """LIBERO contexts on the official initial states (50 per task).

    suite: spatial | object | goal | long (or libero_*); task_ids: which tasks (default all 10);
    train_states: how many of each task's official states RL trains on (default all 50, as
    SimpleVLA-RL does: LIBERO has no separate training states); eval_trials: episodes per task in
    `evaluate`, on official states 0..eval_trials-1 (the standard protocol: 50 per task);
    demo_root: a local LIBERO LeRobotDataset for SFT (none is downloaded); image_size, cameras
    (agentview, wrist), num_workers, assets_dir as for `LiberoEnv`; prefetch_resets as for the
    tabletop (LIBERO resets take seconds)."""

    group_key = "task_id"

    def __init__(self, seed: int = 0, suite: str = "spatial", task_ids: Sequence[int] | None = None,
                 train_states: int = 50, eval_trials: int = 50, demo_root: str | None = None,
                 image_size: int = 128, cameras: Sequence[str] = ("agentview",), chunk_size: int = 8,
                 num_workers: int = 0, assets_dir: str | None = None, max_episode_steps: int | None = None,
                 eval_mode: str = "greedy", eval_samples: int = 1, instructions: Sequence[str] | None = None,
                 prefetch_resets: bool = True, eval_grounding: bool = False):
        from mmrl.envs.libero.env import CAMERAS, suite_name

        self.suite = suite_name(suite)
        n_tasks = 10
        task_ids = list(range(n_tasks)) if task_ids is None else [int(t) for t in task_ids]
        bad = [t for t in task_ids if not 0 <= t < n_tasks]
        if bad or not task_ids:
            raise ValueError(f"task.params.task_ids: {bad[0] if bad else task_ids!r} out of range 0..{n_tasks - 1}")
        bad_cams = [c for c in cameras if c not in CAMERAS]
        if bad_cams or not cameras:
            raise ValueError(f"task.params.cameras: unknown camera {bad_cams[0] if bad_cams else cameras!r}; "
                             f"valid: {', '.join(CAMERAS)}")
        if not 1 <= train_states <= 50 or not 1 <= eval_trials:
            raise ValueError(f"task.params.train_states must be in [1, 50] and eval_trials >= 1; "
                             f"got {train_states}, {eval_trials}")
        check_choice("eval_mode", eval_mode, EVAL_MODES)
        self.seed, self.task_ids, self.cameras = seed, task_ids, list(cameras)
        self.image_size, self.chunk_size, self.num_workers = image_size, chunk_size, num_workers
        self.prefetch_resets = bool(prefetch_resets)
        self.eval_grounding = bool(eval_grounding)
        self.assets_dir, self.max_episode_steps = assets_dir, max_episode_steps
        self.eval_mode, self.eval_samples, self.eval_trials = eval_mode, eval_samples, eval_trials
        self.demo_root = Path(demo_root) if demo_root else None
        self._instructions = list(instructions) if instructions else None
        self._frames: list[dict] | None = None
        self._env_factory = None
        self.train = [{"suite": self.suite, "task_id": t, "init_state_id": i}
                      for t in task_ids for i in range(train_states)]
        # Trial-major: the first n contexts spread over every task (official states wrap mod 50).
        self.test = [{"suite": self.suite, "task_id": t, "init_state_id": i}
                     for i in range(eval_trials) for t in task_ids]
        self.cursor = 0

    def corpus(self) -> list[str]:
        """The suite's instructions (read from hf-libero, or given as `instructions`)."""
        if self._instructions is None:
            from mmrl.envs.libero.env import task_names

            names = task_names(self.suite, self.assets_dir)
            self._instructions = [names[t] for t in self.task_ids]
        return list(self._instructions)

    @property
    def env_factory(self):
        if self._env_factory is None:
            from mmrl.envs.episodes import VectorEnvFactory

            extra = {k: v for k, v in (("assets_dir", self.assets_dir), ("max_episode_steps", self.max_episode_steps))
                     if v is not None}
            self._env_factory = VectorEnvFactory("libero", num_workers=self.num_workers, image_size=self.image_size,
                                                 cameras=self.cameras, cache_size=4, upcoming=self._upcoming(),
                                                 max_envs=self.eval_envs, **extra)
        return self._env_factory

    def evaluate(self, policy, n: int) -> dict[str, float]:
        """The paper protocol: `eval_trials` episodes per task (n is ignored)."""
        return super().evaluate(policy, len(self.test))

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[dict]:
        if self._frames is None:
            if self.demo_root is None:
                raise ValueError("LIBERO SFT needs task.params.demo_root: a local LeRobotDataset of the suite's "
                                 "demos (nothing is downloaded); or set sft.steps: 0")
            self._frames = load_sft_frames(self.demo_root, self.chunk_size, self.cameras)
        return [self._frames[int(i)] for i in rng.integers(0, len(self._frames), n)]
