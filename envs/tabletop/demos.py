"""Scripted-expert demonstrations as a local LeRobotDataset (v3, image mode: no video, no FFmpeg).

    info = record_demos("push", n_episodes=50, root="data/push_demos")
    info = record_demos(["reach", "push", "pick_place"], root="data/one_shot", n_per_task=1)
    ds = load_demos("data/push_demos", chunk_size=8)   # ds[i]["action"]: [8, 7], ds[i]["action_is_pad"]: [8]

Each frame pairs the observation at step t with the expert's action at t; the episode ends at the
step that succeeds (failed expert episodes are discarded, not recorded). The language task of a
frame is the env's instruction, so `n_per_task=1` gives one demo per instruction (the one-trajectory
SFT setting of SimpleVLA-RL).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .env import ACTION_DIM, DEFAULT_CAMERAS, STATE_DIM, make_tabletop_env
from .expert import make_expert
from .tasks import get_task_def

STATE_NAMES = ["tcp_x", "tcp_y", "tcp_z", "tcp_vx", "tcp_vy", "tcp_vz", "finger_l", "finger_r"]
ACTION_NAMES = ["dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper"]


@dataclass
class DemoEpisode:
    task: str  # env task name, e.g. "push"
    instruction: str  # the language task stored with every frame
    seed: int  # the initial state: reset(seed=seed) (with `colors` when recorded per instruction)
    colors: tuple[str, str | None] | None
    length: int


@dataclass
class DemoInfo:
    root: Path
    repo_id: str
    fps: int
    episodes: list[DemoEpisode] = field(default_factory=list)
    failed_seeds: list[tuple[str, int]] = field(default_factory=list)  # expert failures, skipped


def demo_features(image_size: int, cameras: Sequence[str] = DEFAULT_CAMERAS) -> dict[str, dict]:
    feats: dict[str, dict] = {
        f"observation.images.{c}": {"dtype": "image", "shape": (image_size, image_size, 3),
                                    "names": ["height", "width", "channels"]}
        for c in cameras
    }
    feats["observation.state"] = {"dtype": "float32", "shape": (STATE_DIM,), "names": STATE_NAMES}
    feats["action"] = {"dtype": "float32", "shape": (ACTION_DIM,), "names": ACTION_NAMES}
    return feats


def record_demos(task: str | Sequence[str], n_episodes: int | None = None, root: str | Path = "demos", seed: int = 0,
                 fps: int = 20, *, n_per_task: int | None = None, image_size: int = 64,
                 cameras: Sequence[str] = DEFAULT_CAMERAS, max_episode_steps: int | None = None,
                 max_tries_per_episode: int = 20, position_jitter: float | None = None,
                 layout_seed: int = 0) -> DemoInfo:
    """Record successful expert episodes of one or more tabletop tasks into `root` (must not exist).

    `n_episodes`: that many episodes per task, initial states from seeds `seed, seed+1, ...`.
    `n_per_task`: instead, that many episodes per language instruction (every colour pairing).
    `position_jitter` / `layout_seed`: the envs' layout distribution (see `sample_init_state`).
    """
    from lerobot.datasets.lerobot_dataset import LeRobotDataset  # heavy (torch); only when recording

    tasks = [task] if isinstance(task, str) else list(task)
    for t in tasks:
        get_task_def(t)  # unknown names fail here, listing the valid ones
    if (n_episodes is None) == (n_per_task is None):
        raise ValueError("pass exactly one of n_episodes and n_per_task")
    count = n_episodes if n_episodes is not None else n_per_task
    if count is None or count < 1:
        raise ValueError(f"the number of episodes must be >= 1, got {count}")
    root = Path(root)
    if root.exists():
        raise FileExistsError(f"{root} already exists; LeRobotDataset.create needs a new directory")
    repo_id = f"local/{root.name}"
    ds = LeRobotDataset.create(repo_id=repo_id, root=root, fps=fps, features=demo_features(image_size, cameras),
                               robot_type="mmrl_floating_gripper", use_videos=False)
    info = DemoInfo(root=root, repo_id=repo_id, fps=fps)
    next_seed = seed
    try:
        for t in tasks:
            env = make_tabletop_env(t, image_size=image_size, cameras=tuple(cameras),
                                    max_episode_steps=max_episode_steps, position_jitter=position_jitter,
                                    layout_seed=layout_seed)
            expert = make_expert(t)
            variants = get_task_def(t).instruction_variants() if n_per_task else [None]
            for colors in variants:
                for _ in range(count):
                    for _attempt in range(max_tries_per_episode):
                        s, next_seed = next_seed, next_seed + 1
                        ep = _record_episode(ds, env, expert, s, colors, cameras)
                        if ep is not None:
                            info.episodes.append(ep)
                            break
                        info.failed_seeds.append((t, s))
                    else:
                        raise RuntimeError(f"the {t!r} expert failed {max_tries_per_episode} times in a row "
                                           f"(colors={colors}); last seed {s}")
            env.close()
    finally:
        ds.finalize()  # without it the parquet footers are missing and the dataset is unreadable
    return info


def _record_episode(ds, env, expert, seed: int, colors, cameras) -> DemoEpisode | None:
    obs, _ = env.reset(seed=seed, options={"colors": colors} if colors else None)
    expert.reset()
    length = 0
    for _ in range(env.max_episode_steps):
        action = expert.act(env).astype(np.float32)
        frame = {f"observation.images.{c}": obs["images"][c] for c in cameras}
        frame["observation.state"] = obs["state"]
        frame["action"] = action
        frame["task"] = env.instruction
        ds.add_frame(frame)
        length += 1
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            break
    if not env.success:
        ds.clear_episode_buffer()
        return None
    ds.save_episode()
    return DemoEpisode(task=env.task, instruction=env.instruction, seed=seed, colors=colors, length=length)


def load_demos(root: str | Path, chunk_size: int = 8, episodes: list[int] | None = None):
    """The dataset at `root`, read offline, with `chunk_size` future actions per frame:
    item["action"] is [chunk_size, 7] and item["action_is_pad"] marks steps past the episode's end
    (their values repeat the last action). chunk_size=1 gives plain per-frame actions."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = Path(root)
    info_path = root / "meta" / "info.json"
    if not info_path.exists():
        raise FileNotFoundError(f"no LeRobotDataset at {root} (missing {info_path})")
    fps = json.loads(info_path.read_text())["fps"]
    delta = {"action": [k / fps for k in range(chunk_size)]} if chunk_size > 1 else None
    return LeRobotDataset(f"local/{root.name}", root=root, episodes=episodes, delta_timestamps=delta)
