"""The MuJoCo tabletop task (`tabletop`): contexts, scripted-expert SFT demos and evaluation (the
shared parts are `mmrl.envs.robot_task`).

Init states are seeds of the task's state sampler: training and evaluation ids are drawn
without replacement from one pool, so they are disjoint, and demos are recorded from a third,
separate seed range (`DEMO_SEED_BASE`), so no held-out state was ever demonstrated. Demos are
recorded with the scripted experts on first use into a LeRobotDataset whose directory name encodes
everything that determines it, so every run with the same settings (and seed) reuses it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from mmrl.envs import register_task
from mmrl.envs.robot_task import EVAL_MODES, RobotTask, check_choice, load_sft_frames, quiet_lerobot

INIT_POOL = 10**6  # train/eval init-state ids are drawn from [0, INIT_POOL)
DEMO_SEED_BASE = 10**7  # demo seeds start here (+ 1000 * seed): never a train or eval state
DEMO_MODES = ("episodes", "per_instruction")


# ----------------------------------------------------------------------------- demos


DEMO_REVISION = 2  # bump when the experts change, so cached demos of an older expert are not reused


def _demo_dir_name(tasks: Sequence[str], mode: str, count: int, seed: int, image_size: int,
                   cameras: Sequence[str], position_jitter: float | None = None, layout_seed: int = 0) -> str:
    per = "x" if mode == "episodes" else "per_instr"
    # Jittered-template demos get their own name (uniform ones keep the old one, so caches stay valid).
    layout = "" if position_jitter is None else f"_jit{position_jitter:g}_lay{layout_seed}"
    return (f"{'-'.join(tasks)}_{per}{count}_seed{seed}_{image_size}px_{'-'.join(cameras)}{layout}"
            f"_r{DEMO_REVISION}")


def ensure_demos(root: Path, tasks: Sequence[str], mode: str, count: int, seed: int, image_size: int,
                 cameras: Sequence[str], position_jitter: float | None = None, layout_seed: int = 0) -> Path:
    """Record the scripted-expert demos into `root` unless a finished dataset is already there.
    Recording goes to a sibling temp dir first and is renamed into place, so an interrupted or
    concurrent recording never leaves a half-written dataset at `root`."""
    from mmrl.envs.tabletop.demos import record_demos

    if (root / "meta" / "info.json").is_file():
        return root
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"task.params.demo_root {root} exists but holds no LeRobotDataset (no meta/info.json)")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent)) / root.name
    kw = {"n_episodes": count} if mode == "episodes" else {"n_per_task": count}
    with quiet_lerobot():
        record_demos(list(tasks), root=tmp, seed=DEMO_SEED_BASE + 1000 * seed, image_size=image_size,
                     cameras=tuple(cameras), position_jitter=position_jitter, layout_seed=layout_seed, **kw)
    try:
        if root.exists():
            root.rmdir()  # an empty placeholder
        os.rename(tmp, root)
    except OSError:
        if not (root / "meta" / "info.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)
    return root


# ----------------------------------------------------------------------------- the task


def _instructions(task: str) -> list[str]:
    from mmrl.envs.tabletop import get_task_def

    td = get_task_def(task)
    return [td.instruction(obj, zone) for obj, zone in td.instruction_variants()]


@register_task("tabletop")
class TabletopTask(RobotTask):
    """Trajectory contexts on the MuJoCo tabletop tasks, with scripted-expert SFT demos.

    tasks: tabletop task names (reach, push, pick_place); n_train / n_eval: initial states per task
    (disjoint); demos_per_task with demo_mode "episodes" (that many demos per task) or
    "per_instruction" (that many per language instruction, the one-demo-per-task setting of
    SimpleVLA-RL); demo_root: where the demos live (default: a cache dir under the system temp dir
    named by the settings); image_size / cameras: what the env renders and the demos hold;
    num_workers: env worker processes (0 = in this process); eval_mode greedy | sampled | both and
    eval_samples episodes per held-out state when sampled; prefetch_resets: with workers, reset
    them to the next training batch's states while the policy update runs; eval_grounding: each
    evaluation also runs with images shuffled across episodes and reports the SFT loss gap (what
    `mmrl eval` always does; see `RobotTask.evaluate`).

    position_jitter: null (default) draws every scene uniformly; a number j in metres makes the
    scenes LIBERO-like: each language instruction has one fixed layout (from layout_seed) and each
    init-state id (train, eval and demo alike) moves its objects and the gripper start by up to +-j
    (see `sample_init_state`)."""

    def __init__(self, seed: int = 0, tasks: Sequence[str] = ("reach",), n_train: int = 64, n_eval: int = 16,
                 demos_per_task: int = 10, demo_mode: str = "episodes", demo_root: str | None = None,
                 image_size: int = 64, cameras: Sequence[str] = ("front",), chunk_size: int = 8,
                 num_workers: int = 0, max_episode_steps: int | None = None, eval_mode: str = "sampled",
                 eval_samples: int = 4, prefetch_resets: bool = True, position_jitter: float | None = None,
                 layout_seed: int = 0, eval_grounding: bool = False):
        from mmrl.envs.tabletop import CAMERAS, TASK_NAMES
        from mmrl.envs.tabletop.tasks import check_position_jitter

        tasks = [tasks] if isinstance(tasks, str) else list(tasks)
        bad = [t for t in tasks if t not in TASK_NAMES]
        if bad or not tasks:
            raise ValueError(f"task.params.tasks: unknown tabletop task {bad[0] if bad else tasks!r}; "
                             f"valid: {', '.join(TASK_NAMES)}")
        bad_cams = [c for c in cameras if c not in CAMERAS]
        if bad_cams or not cameras:
            raise ValueError(f"task.params.cameras: unknown camera {bad_cams[0] if bad_cams else cameras!r}; "
                             f"valid: {', '.join(CAMERAS)}")
        check_choice("demo_mode", demo_mode, DEMO_MODES)
        check_choice("eval_mode", eval_mode, EVAL_MODES)
        for name, v, lo in (("n_train", n_train, 1), ("n_eval", n_eval, 1), ("demos_per_task", demos_per_task, 0),
                            ("image_size", image_size, 16), ("chunk_size", chunk_size, 1),
                            ("num_workers", num_workers, 0), ("eval_samples", eval_samples, 1),
                            ("layout_seed", layout_seed, 0)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"task.params.{name} must be an integer >= {lo}, got {v!r}")
        self.position_jitter = check_position_jitter(position_jitter, "task.params.position_jitter")
        self.layout_seed = layout_seed
        self.seed, self.tasks, self.cameras = seed, tasks, list(cameras)
        self.image_size, self.chunk_size = image_size, chunk_size
        self.demos_per_task, self.demo_mode = demos_per_task, demo_mode
        self.eval_mode, self.eval_samples = eval_mode, eval_samples
        self.num_workers, self.max_episode_steps = num_workers, max_episode_steps
        self.prefetch_resets = bool(prefetch_resets)
        self.eval_grounding = bool(eval_grounding)
        self._demo_root = Path(demo_root) if demo_root else None
        self._frames: list[dict] | None = None
        self._env_factory = None
        # Per task, n_train + n_eval distinct ids from one pool: disjoint by construction.
        rng = np.random.default_rng([seed, 424242])
        self.train: list[dict] = []
        self.test: list[dict] = []
        for t in tasks:
            ids = rng.choice(INIT_POOL, n_train + n_eval, replace=False).tolist()
            self.train += [{"task": t, "init_state_id": i} for i in ids[:n_train]]
            self.test += [{"task": t, "init_state_id": i} for i in ids[n_train:]]
        # Interleave tasks in the held-out list, so the first n cover every task evenly.
        self.test = [self.test[k * n_eval + j] for j in range(n_eval) for k in range(len(tasks))]
        self.cursor = 0

    # ------------------------------------------------------------------ contexts

    def corpus(self) -> list[str]:
        """Every instruction the tasks can produce (the tiny tokenizer's text)."""
        return [ins for t in self.tasks for ins in _instructions(t)]

    # ------------------------------------------------------------------ envs (the policy's env hook)

    @property
    def env_factory(self):
        """The vector envs of this task's contexts; policies built by `from_config` use it, so the
        image size and cameras are the task's (the demos were rendered with them). With worker
        processes and `prefetch_resets`, the next training batch's resets overlap the update."""
        if self._env_factory is None:
            from mmrl.envs.episodes import VectorEnvFactory

            extra = {"max_episode_steps": self.max_episode_steps} if self.max_episode_steps else {}
            if self.position_jitter is not None:
                extra.update(position_jitter=self.position_jitter, layout_seed=self.layout_seed)
            # Training, greedy eval and sampled eval batches differ in size: keep one env set for each.
            self._env_factory = VectorEnvFactory("tabletop", num_workers=self.num_workers, image_size=self.image_size,
                                                 cameras=self.cameras, cache_size=4, upcoming=self._upcoming(),
                                                 max_envs=self.eval_envs, **extra)
        return self._env_factory

    # ------------------------------------------------------------------ demos

    @property
    def demo_root(self) -> Path:
        if self._demo_root is None:
            name = _demo_dir_name(self.tasks, self.demo_mode, self.demos_per_task, self.seed, self.image_size,
                                  self.cameras, self.position_jitter, self.layout_seed)
            self._demo_root = Path(tempfile.gettempdir()) / "mmrl_tabletop_demos" / name
        return self._demo_root

    def demo_frames(self) -> list[dict]:
        if self._frames is None:
            if self.demos_per_task == 0:
                raise ValueError("task.params.demos_per_task is 0: there are no demos for SFT (set sft.steps: 0)")
            root = ensure_demos(self.demo_root, self.tasks, self.demo_mode, self.demos_per_task, self.seed,
                                self.image_size, self.cameras, self.position_jitter, self.layout_seed)
            task_of = {ins: t for t in self.tasks for ins in _instructions(t)}
            self._frames = load_sft_frames(root, self.chunk_size, self.cameras, task_of)
        return self._frames

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[dict]:
        frames = self.demo_frames()
        return [frames[int(i)] for i in rng.integers(0, len(frames), n)]
