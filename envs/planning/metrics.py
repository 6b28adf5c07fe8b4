"""VPRL planning metrics: Exact Match, Progress Rate, success and the invalid-move share.

A plan is the sequence of states from the start (parsed from generated frames, or symbolic), the
start state first. Steps are judged by :func:`.judge.plan_step_rewards`; a plan ends
at the step that reaches the goal or at its first invalid step.

* **Exact Match (EM)**: the plan reaches the goal with all steps valid in exactly the optimal
  number of steps, i.e. it is one of the shortest plans (steps after the goal are ignored, like
  the paper's evaluator, which only looks at the first optimal-length steps).
* **Progress Rate (PR)**: the number of consecutive correct steps from the start (each valid and
  lowering the BFS distance by exactly one, i.e. on some optimal path) over the optimal length.
* **success**: reaches the goal before any invalid step, at any length.
* **invalid_share_of_failures**: among plans that are not an exact match, the share containing an
  invalid step (the paper's "any actions invalid" ratio among incomplete plans).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from mmrl.envs.planning.grid import Layout
from .judge import StepKind, plan_reward, plan_step_rewards


@dataclass(frozen=True)
class PlanOutcomes:
    exact_match: np.ndarray  # bool [B]
    success: np.ndarray  # bool [B]
    progress: np.ndarray  # float [B] in [0, 1]
    correct_prefix: np.ndarray  # int [B]: consecutive correct steps from the start
    has_invalid: np.ndarray  # bool [B]
    steps_to_goal: np.ndarray  # int [B] (-1 when the goal is not reached)
    optimal_length: np.ndarray  # int [B]
    plan_reward: np.ndarray  # float [B]: summed VPRL reward over scored steps
    levels: np.ndarray  # int [B]


def plan_outcomes(plans: Sequence[Any], layouts: Sequence[Layout]) -> PlanOutcomes:
    """Per-plan outcomes (vectorised over plans and steps)."""
    layouts = list(layouts)
    sc = plan_step_rewards(plans, layouts)
    opt = np.array([lay.optimal_length for lay in layouts], np.int64)
    kinds, mask = sc.kinds, sc.mask
    reached = mask & (kinds == StepKind.PROGRESS) & (sc.dist_next == 0)
    success = reached.any(1)
    # argmax of a [B, 0] array (every plan start-only) raises; no step means no goal reached
    first_goal = reached.argmax(1) if reached.shape[1] else np.zeros(len(layouts), np.int64)
    steps_to_goal = np.where(success, first_goal + 1, -1)
    invalid = mask & (kinds >= StepKind.UNPARSEABLE)
    correct = mask & (kinds == StepKind.PROGRESS) & (sc.dist_next == sc.dist_prev - 1)
    prefix = np.cumprod(correct, axis=1).sum(1) if correct.shape[1] else np.zeros(len(layouts), np.int64)
    progress = np.minimum(prefix, opt) / np.maximum(opt, 1)
    em = success & (steps_to_goal == opt)
    return PlanOutcomes(em, success, progress.astype(np.float64), prefix.astype(np.int64), invalid.any(1),
                        steps_to_goal.astype(np.int64), opt, plan_reward(sc.rewards, mask),
                        np.array([lay.level for lay in layouts], np.int64))


def _summary(o: PlanOutcomes, idx: np.ndarray | slice = slice(None)) -> dict[str, float]:
    em, ok, pr, inv = o.exact_match[idx], o.success[idx], o.progress[idx], o.has_invalid[idx]
    n = int(len(em))
    failed = ~em
    n_failed = int(failed.sum())
    return {
        "n": n,
        "exact_match": float(em.mean()) if n else 0.0,
        "progress_rate": float(pr.mean()) if n else 0.0,
        "success_rate": float(ok.mean()) if n else 0.0,
        "invalid_share_of_failures": float(inv[failed].mean()) if n_failed else 0.0,
        "n_failed": n_failed,
        "mean_plan_reward": float(o.plan_reward[idx].mean()) if n else 0.0,
    }


def evaluate_plans(plans: Sequence[Any], layouts: Sequence[Layout]) -> dict[str, float]:
    """Aggregate metrics over plans; rates are fractions in [0, 1].

    Keys: n, exact_match, progress_rate, success_rate, invalid_share_of_failures, n_failed,
    mean_plan_reward.
    """
    return _summary(plan_outcomes(plans, layouts))


def evaluate_plans_by_level(plans: Sequence[Any], layouts: Sequence[Layout]) -> dict[int, dict[str, float]]:
    """The metrics of :func:`evaluate_plans` per level (grid side; MiniBehavior: interior side)."""
    o = plan_outcomes(plans, layouts)
    return {int(lv): _summary(o, np.flatnonzero(o.levels == lv)) for lv in np.unique(o.levels)}


def breakdown_by(outcomes: PlanOutcomes, groups: Sequence[Any]) -> dict[Any, dict[str, float]]:
    """Metrics per arbitrary group label (e.g. task name), from precomputed outcomes."""
    g = np.asarray(groups)
    return {k: _summary(outcomes, np.flatnonzero(g == k)) for k in dict.fromkeys(g.tolist())}
