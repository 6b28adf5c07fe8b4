"""VPRL text mode: the VLM sees the frame and writes the whole plan as action words.

A plan such as ``"up, up, right"`` is parsed to actions, simulated from the context's state with
the planning dynamics (:mod:`mmrl.envs.planning.text_plan`) and the resulting state sequence is
scored by the same pure functions as the visual mode (:func:`mmrl.envs.planning.judge.plan_step_rewards`
and :func:`plan_reward`): +1 per step that makes progress, 0 per valid step without, -5 for the
first invalid step (blocked, a hole, off the grid, an action the task does not have), nothing
after the goal or the first invalid step. Text that is not a plan scores the invalid reward.
"""

from __future__ import annotations

from typing import Literal

import torch

from mmrl.envs.planning.judge import REWARD_INVALID, REWARD_NO_PROGRESS, REWARD_PROGRESS, plan_reward, plan_step_rewards
from mmrl.envs.planning.text_plan import text_plans
from mmrl.rewards import register_reward

@register_reward("vprl_text_plan")
def vprl_text_plan(contexts: list[dict], outputs: list[str], reduce: Literal["sum", "mean"] = "sum",
                   strict: bool = True, max_steps: int | None = None, progress_reward: float = REWARD_PROGRESS,
                   no_progress_reward: float = REWARD_NO_PROGRESS,
                   invalid_reward: float = REWARD_INVALID) -> torch.Tensor:
    """VPRL progress reward of text plans, reduced over each plan's scored steps (`reduce`)."""
    if reduce not in ("sum", "mean"):
        raise ValueError(f"vprl_text_plan: unknown reduce {reduce!r}; valid: 'sum', 'mean'")
    plans = text_plans(contexts, outputs, strict, max_steps)
    scores = plan_step_rewards(plans, [c["layout"] for c in contexts], progress_reward=progress_reward,
                               no_progress_reward=no_progress_reward, invalid_reward=invalid_reward)
    return torch.from_numpy(plan_reward(scores.rewards, scores.mask, reduce=reduce))
