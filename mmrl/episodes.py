"""The episode loop every VLA policy rolls out with: a vector env per batch of contexts (the task's
env factory), reset at each context's initial state and stepped chunk by chunk with the policy's
`act` until done. Core, like mmrl.rollout: the tasks build the env factory (mmrl.envs.episodes),
the policies act, and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmrl.rollout import NonFiniteSampling


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
        raise RuntimeError("this policy has no env to roll out episodes in: its task offers none (a robot task's "
                           "env_factory or make_vector_env), and no env_factory was passed")
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
        check_finite_actions(actions)
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


def check_finite_actions(actions: np.ndarray) -> None:
    """Refuse NaN / inf actions [B, n, A] before they reach a simulator (a policy whose weights
    diverged samples them; MuJoCo would take them)."""
    finite = np.isfinite(actions).reshape(len(actions), -1).all(1)
    if not finite.all():
        raise NonFiniteSampling(f"the policy's actions are not finite: NaN/inf in {int((~finite).sum())} of "
                                f"{len(actions)} action chunks it sampled (its weights have diverged)")


def image_hwc(x) -> np.ndarray:
    """A uint8 HxWx3 image from lerobot's float CxHxW in [0, 1] or an HxWx3 uint8 array."""
    a = as_numpy(x)
    if a.ndim == 3 and a.shape[0] == 3 and a.shape[-1] != 3:
        a = a.transpose(1, 2, 0)
    if a.dtype != np.uint8:
        a = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
    return a


__all__ = ["Episodes", "as_numpy", "episode_slices", "image_hwc", "init_ids", "run_episodes", "task_env_factory"]
