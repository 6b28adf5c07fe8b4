"""Reward adapters: `fn(contexts, outputs, **params) -> float Tensor[N]`.

`outputs` is what the policy adapter decodes from a rollout (text for LMs, frames for the visual
planner, trajectories for VLAs). Several rewards are weighted in the config; each is logged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RewardFn = Callable[..., torch.Tensor]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn

    return wrap


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


from mmrl.rewards import text  # noqa: E402,F401  (registers the text rewards)
from mmrl.rewards import planning_text  # noqa: E402,F401  (registers the VPRL text-mode reward)
from mmrl.rewards import planning  # noqa: E402,F401  (registers the VPRL visual-mode reward)
from mmrl.rewards import srpo  # noqa: E402,F401  (registers the robot rewards: success, srpo_progress)
from mmrl.rewards import caption_qa  # noqa: E402,F401  (registers the CapRL reward)
