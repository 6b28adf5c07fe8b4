"""The episode runner every VLA policy rolls out with: a vector env per batch of contexts
(tabletop or LIBERO), reset at each context's initial state and stepped chunk by chunk until done.

It lives with the envs, not in a policy, so the tasks (which build the env factory) and the
policies (which act) both import it and neither imports the other.
"""

from __future__ import annotations

import atexit
import contextlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch


class VectorEnvFactory:
    """Builds the vector env for a list of per-trajectory contexts and caches the last
    `cache_size` of them (worker processes and MuJoCo models are slow to start), keyed by the env
    each row needs. `kind` "tabletop" (context "task") or "libero" (context "suite", "task_id");
    `num_workers` 0 steps the envs in this process (SyncVectorEnv), > 0 in worker processes.
    `max_envs` bounds the envs of one batch: a policy runs a larger batch slice by slice
    (`episode_slices`), since each env holds its own MuJoCo model and renderer (about 33 MB for a
    64 px tabletop env), so memory would otherwise grow with the evaluation set.

    `upcoming(rows)`, if given, names the rows of the rollout that will follow one of `rows` (or
    None): `rollout_done` then starts those envs' reset at once, so the worker processes reset while
    the policy trains, and the next rollout finds its first observations ready."""

    def __init__(self, kind: str = "tabletop", num_workers: int = 0, image_size: int = 64,
                 cameras: Sequence[str] | None = None, cache_size: int = 2,
                 upcoming: Callable[[list[dict]], list[dict] | None] | None = None, max_envs: int = 64,
                 **env_kwargs):
        if kind not in ("tabletop", "libero"):
            raise ValueError(f"unknown env kind {kind!r}; valid: tabletop, libero")
        if not isinstance(max_envs, int) or max_envs < 1:
            raise ValueError(f"max_envs must be an integer >= 1, got {max_envs!r}")
        self.kind, self.num_workers, self.cache_size, self.upcoming = kind, num_workers, cache_size, upcoming
        self.max_envs = max_envs
        self.env_kwargs = {"image_size": image_size, **({"cameras": tuple(cameras)} if cameras else {}), **env_kwargs}
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._closed_restarts = 0  # worker restarts of the env sets already closed
        self.shuffle_images = False  # set inside `images_shuffled()`
        # Close cached envs before interpreter teardown: renderers freed after their GL module is
        # gone raise noisy errors, and worker processes should not outlive the run.
        atexit.register(self.close)

    def spec(self, context: dict, i: int) -> dict[str, Any]:
        need = ("task",) if self.kind == "tabletop" else ("suite", "task_id")
        missing = [k for k in need if k not in context]
        if missing:
            raise KeyError(f"context {i} lacks {missing} for a {self.kind} env; its keys: {sorted(context)}")
        return {**{k: context[k] for k in need}, **self.env_kwargs}

    @contextlib.contextmanager
    def images_shuffled(self) -> Iterator[None]:
        """Inside the block, each env built for a batch shows another initial state's camera images
        (`ShuffledImages`): the grounding check of the robot tasks' evaluation."""
        saved, self.shuffle_images = self.shuffle_images, True
        try:
            yield
        finally:
            self.shuffle_images = saved

    def __call__(self, rows: list[dict]):
        env = self._env(rows)
        return ShuffledImages(env, shuffle_partners(rows)) if self.shuffle_images else env

    def _env(self, rows: list[dict]):
        from mmrl.envs.vector import SyncVectorEnv, VectorEnv

        specs = [self.spec(c, i) for i, c in enumerate(rows)]
        key = json.dumps(specs, sort_keys=True, default=str)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if self.kind == "tabletop":
            from mmrl.envs.tabletop import make_tabletop_env as factory
        else:
            from mmrl.envs.libero.env import make_libero_env as factory
        env = (VectorEnv(factory=factory, specs=specs, num_workers=self.num_workers) if self.num_workers > 0
               else SyncVectorEnv(factory=factory, specs=specs))
        self._cache[key] = env
        while len(self._cache) > self.cache_size:
            self._retire(self._cache.popitem(last=False)[1])
        return env

    def _retire(self, env) -> None:
        self._closed_restarts += getattr(env, "restarts", 0)
        env.close()

    @property
    def restarts(self) -> int:
        """Env worker restarts (a worker died or hung) over every env set this factory has built."""
        return self._closed_restarts + sum(getattr(env, "restarts", 0) for env in self._cache.values())

    def prefetch(self, rows: list[dict]) -> None:
        """Start resetting the env set of `rows` to their initial states without waiting."""
        self._env(rows).reset_async(*init_ids(rows))

    def rollout_done(self, rows: list[dict]) -> None:
        """`run_episodes` calls this when the episodes of `rows` have ended."""
        following = self.upcoming(rows) if self.upcoming is not None else None
        if following:
            self.prefetch(following)

    def close(self) -> None:
        while self._cache:
            self._retire(self._cache.popitem()[1])


def shuffle_partners(rows: list[dict]) -> np.ndarray:
    """For each row, the row whose images it is shown in a shuffled-image episode: the same sample
    index of the next initial state in order (cyclically), so no row sees its own scene, nor that of
    a row sharing its initial state (the G samples of a context start from one scene)."""
    keys = [tuple(str(r.get(k)) for k in ("task", "suite", "task_id", "init_state_id", "init_id", "seed"))
            for r in rows]
    states = list(dict.fromkeys(keys))
    if len(states) < 2:
        raise ValueError(f"shuffled images need episodes of at least 2 initial states; these {len(rows)} rows "
                         "share one (evaluate more held-out states)")
    members = {k: [i for i, x in enumerate(keys) if x == k] for k in states}
    partners = np.empty(len(rows), np.int64)
    for j, k in enumerate(states):
        others = members[states[(j + 1) % len(states)]]
        for m, i in enumerate(members[k]):
            partners[i] = others[m % len(others)]
    return partners


class ShuffledImages:
    """A vector env whose observations carry other episodes' camera images (env i shows env
    `partners[i]`'s), everything else its own: state, instruction, reward and success. A policy
    that uses its images acts on the wrong scene here; one that ignores them does as well as with
    its own (docs/vla_experiments.md)."""

    def __init__(self, env, partners: np.ndarray):
        self.env, self.partners = env, partners

    def __getattr__(self, name: str):
        return getattr(self.env, name)

    def _swap(self, obs):
        return replace(obs, images={c: as_numpy(v)[self.partners] for c, v in obs.images.items()})

    def reset(self, *args, **kwargs):
        return self._swap(self.env.reset(*args, **kwargs))

    def step_chunk(self, actions):
        step = self.env.step_chunk(actions)
        return step._replace(obs=self._swap(step.obs))


def task_env_factory(task) -> Callable[[list[dict]], Any] | None:
    """The env hook a task offers policies: its `env_factory` (a VectorEnvFactory that can also
    prefetch resets), else its `make_vector_env(rows)` method, else None."""
    return getattr(task, "env_factory", None) or getattr(task, "make_vector_env", None)


def init_ids(rows: list[dict]) -> tuple[list[int | None], list[int | None]]:
    """(seeds, initial-state ids) of `rows`, the arguments of a vector env's `reset`."""
    seeds = [c.get("seed") for c in rows]
    ids = [c.get("init_state_id", c.get("init_id")) for c in rows]
    return seeds, ids


def as_numpy(x) -> np.ndarray:
    """Envs and datasets hand over tensors or arrays alike."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@dataclass
class Episodes:
    """What `run_episodes` recorded: per chunk step s, `steps[s] = (rows that acted, the act output,
    env sub-steps each ran)`; per trajectory the camera images and proprio state at every decision
    step plus the final one."""

    rows: list[dict]  # one context per trajectory, "instruction" filled in from the env
    steps: list[tuple[np.ndarray, Any, np.ndarray]]
    images: list[np.ndarray]  # N x uint8 [S_i + 1, C, H, W, 3]
    states: list[np.ndarray]  # N x float32 [S_i + 1, D]
    done: np.ndarray  # bool [N]
    success: np.ndarray  # bool [N]
    env_steps: np.ndarray  # int [N]

    def extras(self, device) -> dict[str, Any]:
        """Rollout extras: ragged per-trajectory observations as lists (concat never pads them)."""
        return {"obs_images": [torch.from_numpy(x) for x in self.images],
                "obs_state": [torch.from_numpy(x) for x in self.states],
                "success": torch.as_tensor(self.success, device=device),
                "env_steps": torch.as_tensor(self.env_steps, device=device)}


def episode_slices(contexts: list[dict], group_size: int, env_factory: Any) -> list[list[dict]]:
    """`contexts` in consecutive slices whose `group_size` episodes each fit the factory's
    `max_envs` (whole groups, at least one context a slice): one slice when the batch fits."""
    max_envs = getattr(env_factory, "max_envs", None)
    per = max(1, max_envs // group_size) if max_envs else max(1, len(contexts))
    return [contexts[i:i + per] for i in range(0, len(contexts), per)]


def run_episodes(env_factory: Callable[[list[dict]], Any] | None, rows: list[dict],
                 act: Callable[[np.ndarray, np.ndarray, list[str]], tuple[Any, Any]], max_chunks: int,
                 cameras: Sequence[str] | None = None) -> Episodes:
    """Roll out one episode per row: reset the vector env at each row's initial state, then
    `act(images [B, C, H, W, 3] uint8, states [B, D], instructions) -> (actions [B, n, A], out)` on the
    rows still running and `step_chunk` until every env is done or `max_chunks` chunks have run.
    Done envs are not stepped again (the vector env keeps their last observation)."""
    if env_factory is None:
        raise RuntimeError("this policy has no env_factory: pass one (e.g. VectorEnvFactory()) to roll out episodes")
    N = len(rows)
    env = env_factory(rows)
    if env.num_envs != N:
        raise ValueError(f"env_factory gave {env.num_envs} envs for {N} trajectories")
    obs = env.reset(*init_ids(rows))
    cams = list(cameras) if cameras else list(obs.images)
    missing = [c for c in cams if c not in obs.images]
    if missing:
        raise KeyError(f"the env renders cameras {list(obs.images)}, not {missing}")
    for r, ins in zip(rows, obs.instruction):
        r["instruction"] = ins or r.get("instruction", "")
    instructions = [r["instruction"] for r in rows]

    def snapshot(o) -> tuple[np.ndarray, np.ndarray]:
        return (np.stack([as_numpy(o.images[c]) for c in cams], 1).astype(np.uint8, copy=False),
                np.asarray(o.state, np.float32))

    images, states = snapshot(obs)
    hist_img = [[images[i]] for i in range(N)]
    hist_state = [[states[i]] for i in range(N)]
    done, success, env_steps = np.zeros(N, bool), np.zeros(N, bool), np.zeros(N, np.int64)
    steps: list[tuple[np.ndarray, Any, np.ndarray]] = []
    while len(steps) < max_chunks and not done.all():
        idx = np.nonzero(~done)[0]
        actions, out = act(images[idx], states[idx], [instructions[i] for i in idx])
        actions = as_numpy(actions).astype(np.float32)
        full = np.zeros((N, *actions.shape[1:]), np.float32)
        full[idx] = actions
        step = env.step_chunk(full)
        executed = np.array([int(step.info[i].get("steps_executed", actions.shape[1])) for i in idx])
        steps.append((idx, out, executed))
        env_steps[idx] += executed
        images, states = snapshot(step.obs)
        for i in idx:
            hist_img[i].append(images[i])
            hist_state[i].append(states[i])
        done, success = np.asarray(step.done, bool), np.asarray(step.success, bool)
    hook = getattr(env_factory, "rollout_done", None)
    if hook is not None:  # e.g. start the next batch's resets, to overlap the policy update
        hook(rows)
    return Episodes(rows=rows, steps=steps, images=[np.stack(h) for h in hist_img],
                    states=[np.stack(h) for h in hist_state], done=done, success=success, env_steps=env_steps)


def image_hwc(x) -> np.ndarray:
    """A uint8 HxWx3 image from lerobot's float CxHxW in [0, 1] or an HxWx3 uint8 array."""
    a = as_numpy(x)
    if a.ndim == 3 and a.shape[0] == 3 and a.shape[-1] != 3:
        a = a.transpose(1, 2, 0)
    if a.dtype != np.uint8:
        a = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
    return a


__all__ = ["Episodes", "VectorEnvFactory", "as_numpy", "image_hwc", "init_ids", "run_episodes", "task_env_factory"]
