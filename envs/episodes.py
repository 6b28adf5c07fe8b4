"""The robot tasks' env factory: a vector env (tabletop or LIBERO) per batch of contexts, cached,
with its images shuffled across rows on request (the grounding check). The episode loop that
steps it with a policy's `act` is `mmrl.episodes.run_episodes`, below the policies: the task hands
its factory to the policy (`env_factory`), and neither imports the other.
"""

from __future__ import annotations

import atexit
import contextlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mmrl.episodes import as_numpy, init_ids


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


__all__ = ["ShuffledImages", "VectorEnvFactory", "shuffle_partners"]
