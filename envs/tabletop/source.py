"""Tasks (context sources) for robot policies: the MuJoCo tabletop (`tabletop`) and LIBERO (`libero`).

A context is an initial state, `{"task": "reach", "init_state_id": 17}` (tabletop) or
`{"suite": "libero_spatial", "task_id": 3, "init_state_id": 7}` (LIBERO); the policy's `sample`
runs G episodes from each (trajectory-level GRPO). SFT contexts are frames of scripted (tabletop)
or recorded (LIBERO) demonstrations with the next `chunk_size` expert actions:

    {"images": {"front": HxWx3 uint8}, "state": float32[8], "instruction": str,
     "actions": float32[chunk_size, 7], "action_is_pad": bool[chunk_size], "task": str}

Tabletop init states are seeds of the task's state sampler: training and evaluation ids are drawn
without replacement from one pool, so they are disjoint, and demos are recorded from a third,
separate seed range (`DEMO_SEED_BASE`), so no held-out state was ever demonstrated. Demos are
recorded with the scripted experts on first use into a LeRobotDataset whose directory name encodes
everything that determines it, so every run with the same settings (and seed) reuses it.

`evaluate(policy, n)` rolls out the first n held-out states greedily and/or sampled at the
policy's training temperature and reports success overall, per task and the mean episode length.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mmrl.envs import TaskBase, register_task

INIT_POOL = 10**6  # train/eval init-state ids are drawn from [0, INIT_POOL)
DEMO_SEED_BASE = 10**7  # demo seeds start here (+ 1000 * seed): never a train or eval state
DEMO_MODES = ("episodes", "per_instruction")
EVAL_MODES = ("greedy", "sampled", "both")


def _check_choice(name: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ValueError(f"task.params.{name}: invalid value {value!r}; valid: {', '.join(valid)}")


# ----------------------------------------------------------------------------- episode metrics


def rollout_episodes(policy, contexts: list[dict], temperature: float | None, samples: int = 1,
                     seed: int = 12345) -> tuple[list[dict], list[dict]]:
    """Run `samples` episodes per context (temperature 0 = greedy; None = the policy's own) with a
    fixed generator, so an evaluation is repeatable. Returns (contexts with "instruction" filled in,
    decoded trajectories: success, frames, length, instruction)."""
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    with torch.no_grad():
        rollout = policy.sample(contexts, samples, generator=gen, temperature=temperature)
    return list(rollout.contexts), policy.decode(rollout)


def episode_metrics(contexts: list[dict], outputs: list[dict], key: str = "task") -> dict[str, float]:
    """Success rate overall and per `contexts[i][key]`, mean episode length (env steps) overall and
    over successes only."""
    success = np.array([bool(o["success"]) for o in outputs], bool)
    length = np.array([int(o["length"]) for o in outputs], float)
    out = {"success": float(success.mean()) if len(success) else float("nan"),
           "episode_len": float(length.mean()) if len(length) else float("nan"),
           "episodes": float(len(success))}
    if success.any():
        out["episode_len_success"] = float(length[success].mean())
    groups = [str(c.get(key, "")) for c in contexts]
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        out[f"success/{g}"] = float(success[idx].mean())
    return out


class _RobotTask(TaskBase):
    """What the robot tasks share: a training stream over `self.train` (a fresh seeded permutation
    each epoch, so the cursor alone fixes the stream and resume is exact), the fixed held-out list
    `self.test`, and `evaluate(policy, n)`: greedy and/or sampled success on the first n held-out
    contexts. The trainer already logs greedy success as `eval/success` (its own greedy pass over
    `eval_batch`), so the tabletop default is "sampled": the rate the policy earns at its training
    temperature, `eval_samples` episodes per state."""

    seed: int
    train: list[dict]
    test: list[dict]
    cursor: int
    eval_mode: str
    eval_samples: int
    eval_envs: int = 64  # episodes run at once in `evaluate` (bounds env count and frame memory)
    group_key: str = "task"
    num_workers: int
    prefetch_resets: bool = True
    _last_batch: list[dict] | None = None  # the latest `next_batch`, for `upcoming_rows`

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 17, epoch]).permutation(len(self.train))

    def _peek(self, start: int, n: int) -> list[dict]:
        out = []
        for pos in range(start, start + n):
            epoch, k = divmod(pos, len(self.train))
            out.append(dict(self.train[int(self._epoch_order(epoch)[k])]))
        return out

    def next_batch(self, n: int) -> list[dict]:
        out = self._peek(self.cursor, n)
        self.cursor += n
        self._last_batch = [dict(c) for c in out]
        return out

    def upcoming_rows(self, rows: list[dict]) -> list[dict] | None:
        """If `rows` are G copies of each context of the latest `next_batch` (a training rollout),
        the rows of the next one (the stream is a pure function of the cursor); else None."""
        last = self._last_batch
        if not last or len(rows) % len(last):
            return None
        G = len(rows) // len(last)
        key = lambda c: tuple(c.get(k) for k in ("task", "suite", "task_id", "init_state_id"))  # noqa: E731
        if [key(r) for r in rows] != [key(c) for c in last for _ in range(G)]:
            return None
        return [c for c in self._peek(self.cursor, len(last)) for _ in range(G)]

    def make_vector_env(self, rows: list[dict]):
        """The vector env for a batch of contexts (the policy's env hook; see `env_factory`)."""
        return self.env_factory(rows)

    def _upcoming(self):
        """The factory's `upcoming` hook: only worker processes can reset while the policy trains."""
        return self.upcoming_rows if self.prefetch_resets and self.num_workers > 0 else None

    def eval_batch(self, n: int) -> list[dict]:
        return [dict(c) for c in self.test[: min(n, len(self.test))]]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    def rollouts(self, policy, contexts: list[dict], mode: str) -> tuple[list[dict], list[dict]]:
        """Episodes of `contexts` in `mode` (greedy: 1 per state; sampled: `eval_samples` per state),
        at most `eval_envs` at a time."""
        temperature, k = (0.0, 1) if mode == "greedy" else (None, self.eval_samples)
        per = max(1, self.eval_envs // k)
        rows, outputs = [], []
        for i in range(0, len(contexts), per):
            r, o = rollout_episodes(policy, contexts[i:i + per], temperature, k, seed=12345 + i)
            rows += r
            outputs += o
        return rows, outputs

    def evaluate(self, policy, n: int) -> dict[str, float]:
        contexts = self.eval_batch(n)
        out: dict[str, float] = {}
        for mode in (("greedy", "sampled") if self.eval_mode == "both" else (self.eval_mode,)):
            rows, outputs = self.rollouts(policy, contexts, mode)
            # "sampled/success", "sampled/success/reach", "greedy/episode_len", ...: the trainer logs
            # them as eval/<key>, apart from its own eval/<reward> and eval/sampled_<reward>.
            out.update({f"{mode}/{name}": v for name, v in episode_metrics(rows, outputs, self.group_key).items()})
        return out


# ----------------------------------------------------------------------------- demos


@contextlib.contextmanager
def _quiet_lerobot() -> Iterator[None]:
    """lerobot logs a long torchcodec traceback on import where FFmpeg is missing (our image-mode
    datasets never decode video) and `datasets` draws a progress bar per episode: mute both."""
    log = logging.getLogger("lerobot")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import datasets

        bars = datasets.utils.logging.is_progress_bar_enabled()
        datasets.disable_progress_bars()
    except ImportError:
        bars = False
    try:
        yield
    finally:
        log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


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
    with _quiet_lerobot():
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


def load_sft_frames(root: Path, chunk_size: int, cameras: Sequence[str], task_of: dict[str, str] | None = None
                    ) -> list[dict[str, Any]]:
    """Every frame of the LeRobotDataset at `root` as an SFT context (uint8 HWC images), read once
    into memory: a few hundred small frames, and `sft_batch` then costs nothing per step."""
    from mmrl.envs.tabletop.demos import load_demos

    with _quiet_lerobot():
        ds = load_demos(root, chunk_size=chunk_size)
    missing = [c for c in cameras if f"observation.images.{c}" not in ds.features]
    if missing:
        have = [k[len("observation.images."):] for k in ds.features if k.startswith("observation.images.")]
        raise KeyError(f"demos at {root} lack camera(s) {missing}; they have {have}")
    frames = []
    with _quiet_lerobot():
        items = [ds[i] for i in range(len(ds))]
    for item in items:
        images = {c: (item[f"observation.images.{c}"].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
                  for c in cameras}
        actions = item["action"].numpy().astype(np.float32).reshape(chunk_size, -1)
        pad = item["action_is_pad"].numpy().astype(bool).reshape(chunk_size) if "action_is_pad" in item \
            else np.zeros(chunk_size, bool)
        instruction = str(item["task"])
        frames.append({"images": images, "state": item["observation.state"].numpy().astype(np.float32),
                       "instruction": instruction, "actions": actions, "action_is_pad": pad,
                       "task": (task_of or {}).get(instruction, ""), "episode_index": int(item["episode_index"])})
    if not frames:
        raise ValueError(f"the demo dataset at {root} is empty")
    return frames


# ----------------------------------------------------------------------------- tabletop


def _instructions(task: str) -> list[str]:
    from mmrl.envs.tabletop import get_task_def

    td = get_task_def(task)
    return [td.instruction(obj, zone) for obj, zone in td.instruction_variants()]



@register_task("tabletop")
class TabletopTask(_RobotTask):
    """Trajectory contexts on the MuJoCo tabletop tasks, with scripted-expert SFT demos.

    tasks: tabletop task names (reach, push, pick_place); n_train / n_eval: initial states per task
    (disjoint); demos_per_task with demo_mode "episodes" (that many demos per task) or
    "per_instruction" (that many per language instruction, the one-demo-per-task setting of
    SimpleVLA-RL); demo_root: where the demos live (default: a cache dir under the system temp dir
    named by the settings); image_size / cameras: what the env renders and the demos hold;
    num_workers: env worker processes (0 = in this process); eval_mode greedy | sampled | both and
    eval_samples episodes per held-out state when sampled; prefetch_resets: with workers, reset
    them to the next training batch's states while the policy update runs.

    position_jitter: null (default) draws every scene uniformly; a number j in metres makes the
    scenes LIBERO-like: each language instruction has one fixed layout (from layout_seed) and each
    init-state id (train, eval and demo alike) moves its objects and the gripper start by up to +-j
    (see `sample_init_state`)."""

    def __init__(self, seed: int = 0, tasks: Sequence[str] = ("reach",), n_train: int = 64, n_eval: int = 16,
                 demos_per_task: int = 10, demo_mode: str = "episodes", demo_root: str | None = None,
                 image_size: int = 64, cameras: Sequence[str] = ("front",), chunk_size: int = 8,
                 num_workers: int = 0, max_episode_steps: int | None = None, eval_mode: str = "sampled",
                 eval_samples: int = 4, prefetch_resets: bool = True, position_jitter: float | None = None,
                 layout_seed: int = 0):
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
        _check_choice("demo_mode", demo_mode, DEMO_MODES)
        _check_choice("eval_mode", eval_mode, EVAL_MODES)
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
            from mmrl.policies.action_vla import VectorEnvFactory

            extra = {"max_episode_steps": self.max_episode_steps} if self.max_episode_steps else {}
            if self.position_jitter is not None:
                extra.update(position_jitter=self.position_jitter, layout_seed=self.layout_seed)
            # Training, greedy eval and sampled eval batches differ in size: keep one env set for each.
            self._env_factory = VectorEnvFactory("tabletop", num_workers=self.num_workers, image_size=self.image_size,
                                                 cameras=self.cameras, cache_size=4, upcoming=self._upcoming(),
                                                 **extra)
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


# ----------------------------------------------------------------------------- LIBERO


@register_task("libero")
class LiberoTask(_RobotTask):
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
                 prefetch_resets: bool = True):
        from mmrl.envs.libero_env import CAMERAS, suite_name

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
        _check_choice("eval_mode", eval_mode, EVAL_MODES)
        self.seed, self.task_ids, self.cameras = seed, task_ids, list(cameras)
        self.image_size, self.chunk_size, self.num_workers = image_size, chunk_size, num_workers
        self.prefetch_resets = bool(prefetch_resets)
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
            from mmrl.envs.libero_env import task_names

            names = task_names(self.suite, self.assets_dir)
            self._instructions = [names[t] for t in self.task_ids]
        return list(self._instructions)

    @property
    def env_factory(self):
        if self._env_factory is None:
            from mmrl.policies.action_vla import VectorEnvFactory

            extra = {k: v for k, v in (("assets_dir", self.assets_dir), ("max_episode_steps", self.max_episode_steps))
                     if v is not None}
            self._env_factory = VectorEnvFactory("libero", num_workers=self.num_workers, image_size=self.image_size,
                                                 cameras=self.cameras, cache_size=4, upcoming=self._upcoming(),
                                                 **extra)
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
