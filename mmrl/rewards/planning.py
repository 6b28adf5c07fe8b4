"""VPRL's progress reward of a generated next frame (`vprl_progress`): the frame parsed against its
context's layout and judged by the planning domain's step judge (mmrl.envs.planning.judge, where
the rule and its differences from the paper's code are written down)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mmrl.envs.planning.grid import STATE_DIM
from mmrl.envs.planning.judge import REWARD_INVALID, REWARD_NO_PROGRESS, REWARD_PROGRESS, step_rewards_from_frames
from mmrl.rewards import register_reward



@register_reward("vprl_progress")
def vprl_progress(contexts: Sequence[dict], outputs: Sequence[np.ndarray], *,
                  progress_reward: float = REWARD_PROGRESS, no_progress_reward: float = REWARD_NO_PROGRESS,
                  invalid_reward: float = REWARD_INVALID):
    """Adapter for the trainer: each output is a generated next frame (uint8 [H, W, 3]); it is
    parsed against its context's layout and scored against the context's `state` (+1 / 0 / -5 by
    default; the config's reward params may change the three values)."""
    import torch

    if len(contexts) != len(outputs):
        raise ValueError(f"{len(outputs)} frames for {len(contexts)} contexts")
    layouts = [c["layout"] for c in contexts]
    prev = np.stack([np.asarray(c["state"], np.int64) for c in contexts]) if contexts else np.zeros((0, STATE_DIM),
                                                                                                   np.int64)
    return torch.from_numpy(step_rewards_from_frames(prev, list(outputs), layouts, progress_reward=progress_reward,
                                                     no_progress_reward=no_progress_reward,
                                                     invalid_reward=invalid_reward))
