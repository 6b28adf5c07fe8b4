"""VPRL progress reward and planning metrics (EM, PR, success, invalid share)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from mmrl.envs.planning import (
    UNPARSEABLE,
    Action,
    Layout,
    load_paper_test_split,
    render_batch,
    shortest_path,
    state_array,
)
from mmrl.envs.planning import frozenlake, minibehavior
from mmrl.envs.planning.grid import WALL_BITS
from mmrl.envs.planning.metrics import breakdown_by, evaluate_plans, evaluate_plans_by_level, plan_outcomes
from mmrl.envs.planning.judge import (
    StepKind,
    classify_steps,
    plan_reward,
    plan_step_rewards,
    step_rewards,
    step_rewards_from_frames,
)

if "torch" in sys.modules:  # keep any torch pulled in by mmrl imports to one thread
    sys.modules["torch"].set_num_threads(1)



@pytest.fixture
def paper_dir(shared_input) -> Path:
    """The VPRL paper's test-split metadata (../shared/vprl): skipped with the reason where it is absent."""
    return shared_input("vprl")

FL = frozenlake.from_text(["SFH", "FFF", "HFG"])  # dist: (0,0)=4, (0,1)=3, (1,1)=2, (1,2)=1
FL_CUT = frozenlake.from_text(["SFH", "HHF", "FFG"])  # the start's region cannot reach the goal
OPEN = frozenlake.from_text(["SFF", "FFF", "FFG"])


def _maze() -> Layout:
    walls = np.zeros((2, 2), np.uint8)
    walls[0, 1] |= WALL_BITS[Action.DOWN]
    walls[1, 1] |= WALL_BITS[Action.UP]
    return Layout("maze", np.array([[0, 0], [0, 1]], np.uint8), (0, 1), (1, 1), walls=walls)


MAZE = _maze()
# paper record 504 (interior coords): start (2, 4), printer (1, 1), table rows 3-4 x cols 1-3;
# in full-grid coords: start (3, 5), printer (2, 2), table rows 4-5 x cols 2-4
MINI = minibehavior.make_layout(5, (2, 4), (1, 1), [(r, c) for r in (3, 4) for c in (1, 2, 3)])

CASES = [  # (layout, prev, next, expected kind, expected reward)
    (FL, (0, 0), (0, 1), StepKind.PROGRESS, 1.0),
    (FL, (0, 1), (0, 0), StepKind.NO_PROGRESS, 0.0),
    (FL, (1, 2), (2, 2), StepKind.PROGRESS, 1.0),  # reaches the goal
    (FL, (0, 1), (0, 2), StepKind.HOLE, -5.0),
    (FL, (0, 0), (-1, 0), StepKind.OUT_OF_GRID, -5.0),
    (FL, (0, 0), (1, 1), StepKind.TELEPORT, -5.0),  # diagonal
    (FL, (0, 0), (2, 1), StepKind.TELEPORT, -5.0),
    (FL, (0, 0), (0, 0), StepKind.NOOP, -5.0),  # a bump into the border shows as no change
    (FL, (0, 0), UNPARSEABLE, StepKind.UNPARSEABLE, -5.0),
    (FL, (0, 0), (0, 1, 1), StepKind.ILLEGAL_PHASE, -5.0),
    (FL, (2, 2), (2, 1), StepKind.AFTER_END, 0.0),
    (FL_CUT, (0, 0), (0, 1), StepKind.NO_PROGRESS, 0.0),  # valid, but no way to the goal
    (MAZE, (0, 1), (1, 1), StepKind.BLOCKED, -5.0),  # through a maze wall
    (MAZE, (0, 1), (0, 0), StepKind.PROGRESS, 1.0),
    (MINI, (3, 5, 0), (3, 4, 0), StepKind.PROGRESS, 1.0),
    (MINI, (3, 5, 0), (2, 5, 0), StepKind.NO_PROGRESS, 0.0),  # sideways: as far as before
    (MINI, (3, 5, 0), (3, 6, 0), StepKind.BLOCKED, -5.0),  # the wall ring
    (MINI, (3, 2, 0), (2, 2, 0), StepKind.BLOCKED, -5.0),  # onto the printer
    (MINI, (3, 2, 0), (4, 2, 0), StepKind.BLOCKED, -5.0),  # onto the table
    (MINI, (3, 2, 0), (3, 2, 1), StepKind.PROGRESS, 1.0),  # legal pick
    (MINI, (3, 4, 0), (3, 4, 1), StepKind.ILLEGAL_PICK, -5.0),  # not next to the printer
    (MINI, (3, 3, 0), (3, 2, 1), StepKind.ILLEGAL_PHASE, -5.0),  # moved while picking
    (MINI, (3, 2, 1), (3, 2, 0), StepKind.ILLEGAL_PHASE, -5.0),  # un-picked
    (MINI, (3, 2, 1), (3, 2, 2), StepKind.PROGRESS, 1.0),  # legal drop: task done
    (MINI, (2, 3, 1), (2, 3, 2), StepKind.ILLEGAL_DROP, -5.0),  # not next to the table
    (MINI, (3, 2, 1), (3, 2, 2, 5, 4), StepKind.ILLEGAL_DROP, -5.0),  # printer on a far table cell
    (MINI, (3, 2, 1), (2, 2, 1), StepKind.NO_PROGRESS, 0.0),  # the printer's old cell is free now
    (MINI, (3, 2, 2), (3, 3, 2), StepKind.AFTER_END, 0.0),
]


def _ids() -> list[str]:
    return [f"{lay.task}-{StepKind(k).name}-{i}" for i, (lay, _, _, k, _) in enumerate(CASES)]


@pytest.mark.parametrize("case", CASES, ids=_ids())
def test_step_reward_cases(case) -> None:
    lay, prev, nxt, kind, reward = case
    j = classify_steps([prev], [nxt], [lay])
    assert StepKind(int(j.kind[0])) == kind
    assert float(j.reward[0]) == reward
    assert float(step_rewards([prev], [nxt], [lay])[0]) == reward


def test_step_rewards_vectorised_matches_single() -> None:
    lays = [c[0] for c in CASES]
    prev = np.stack([state_array(c[1], c[0]) for c in CASES])
    nxt = np.stack([state_array(c[2], c[0]) for c in CASES])
    j = classify_steps(prev, nxt, lays)
    assert j.kind.tolist() == [int(c[3]) for c in CASES]
    assert j.reward.tolist() == [c[4] for c in CASES]
    assert j.reward.dtype == np.float32
    assert (j.invalid == (j.reward == -5.0)).all()
    custom = step_rewards(prev, nxt, lays, invalid_reward=-1.0, progress_reward=2.0)
    assert set(custom.tolist()) <= {-1.0, 0.0, 2.0}
    with pytest.raises(ValueError, match="states for"):
        step_rewards(prev[:3], nxt[:3], lays)


def test_pick_and_drop_rewards_follow_the_paper() -> None:
    # a legal pick/drop always lowers the distance by exactly one (the paper gives them +1)
    for lay in [MINI] + [minibehavior.generate(np.random.default_rng(i), 6) for i in range(20)]:
        plan = shortest_path(lay)
        j = classify_steps(plan[:-1], plan[1:], [lay] * (len(plan) - 1))
        assert (j.kind == StepKind.PROGRESS).all() and (j.dist_next == j.dist_prev - 1).all()


def test_rewards_from_frames_round_trip() -> None:
    plan = shortest_path(MINI)
    lays = [MINI] * (len(plan) - 1)
    frames = render_batch(lays, plan[1:])
    assert step_rewards_from_frames(plan[:-1], frames, lays).tolist() == [1.0] * len(lays)
    garbage = np.random.default_rng(0).integers(0, 256, frames.shape, dtype=np.uint8)
    assert step_rewards_from_frames(plan[:-1], garbage, lays).tolist() == [-5.0] * len(lays)


def test_plan_step_rewards_masks_after_goal_and_invalid() -> None:
    plans = [
        [(0, 0), (0, 1), (1, 1), (1, 2), (2, 2), (2, 1), (2, 2)],  # reaches the goal, then wanders
        [(0, 0), (0, 1), (0, 2), (0, 1), (1, 1)],  # falls in a hole at step 2
        [(0, 0), (0, 1), (0, 0)],  # short, valid, no goal
    ]
    sc = plan_step_rewards(plans, [FL] * 3)
    assert sc.rewards.shape == (3, 6) and sc.n_steps.tolist() == [6, 4, 2]
    assert sc.mask[0].tolist() == [True] * 4 + [False] * 2
    assert sc.rewards[0].tolist() == [1, 1, 1, 1, 0, 0]
    assert sc.mask[1].tolist() == [True, True, False, False, False, False]
    assert sc.rewards[1].tolist() == [1, -5, 0, 0, 0, 0]
    assert sc.kinds[1, 1] == StepKind.HOLE
    assert sc.mask[2].tolist() == [True, True, False, False, False, False]
    assert plan_reward(sc.rewards, sc.mask).tolist() == [4.0, -4.0, 1.0]
    assert plan_reward(sc.rewards, sc.mask, reduce="mean").tolist() == [1.0, -2.0, 0.5]
    with pytest.raises(ValueError, match="reduce"):
        plan_reward(sc.rewards, sc.mask, reduce="max")


def test_metrics_on_hand_made_plans() -> None:
    optimal = [(0, 0), (0, 1), (0, 2), (1, 2), (2, 2)]
    suboptimal = [(0, 0), (0, 1), (0, 0), (1, 0), (2, 0), (2, 1), (2, 2)]  # detour, still succeeds
    invalid_mid = [(0, 0), (0, 1), (1, 2), (2, 2)]  # diagonal jump at step 2
    incomplete = [(0, 0), (0, 1), (0, 2)]  # valid but stops early
    o = plan_outcomes([optimal, suboptimal, invalid_mid, incomplete], [OPEN] * 4)
    assert o.exact_match.tolist() == [True, False, False, False]
    assert o.success.tolist() == [True, True, False, False]
    assert o.progress.tolist() == [1.0, 0.25, 0.25, 0.5]
    assert o.has_invalid.tolist() == [False, False, True, False]
    assert o.steps_to_goal.tolist() == [4, 6, -1, -1]
    m = evaluate_plans([optimal, suboptimal, invalid_mid, incomplete], [OPEN] * 4)
    assert m["n"] == 4 and m["exact_match"] == 0.25 and m["success_rate"] == 0.5
    assert m["progress_rate"] == pytest.approx(0.5)
    assert m["invalid_share_of_failures"] == pytest.approx(1 / 3) and m["n_failed"] == 3
    # steps after the goal are ignored; an unparseable first frame scores no progress
    assert evaluate_plans([optimal + [(2, 1)]], [OPEN])["exact_match"] == 1.0
    u = plan_outcomes([[(0, 0), UNPARSEABLE, (0, 2)], [(0, 0)]], [OPEN] * 2)
    assert u.progress.tolist() == [0.0, 0.0] and u.has_invalid.tolist() == [True, False]


def test_start_only_plans_score_zero_without_error() -> None:
    """Every plan of a call with zero moves (a start-only plan scored alone) is a failure, not a crash."""
    o = plan_outcomes([[(0, 0)], [(0, 0)]], [OPEN] * 2)
    assert o.success.tolist() == [False, False] and o.steps_to_goal.tolist() == [-1, -1]
    assert o.progress.tolist() == [0.0, 0.0] and o.exact_match.tolist() == [False, False]
    assert evaluate_plans([[(0, 0)]], [OPEN])["exact_match"] == 0.0


def test_metrics_minibehavior_and_levels() -> None:
    plan = shortest_path(MINI)
    detour = np.concatenate([plan[:1], [state_array((2, 5, 0), MINI)], [state_array((3, 5, 0), MINI)], plan[1:]])
    big = frozenlake.from_text(["SFFF", "FFFF", "FFFF", "FFFG"])
    plans = [plan, detour, shortest_path(OPEN), shortest_path(big)[:-1]]
    lays = [MINI, MINI, OPEN, big]
    o = plan_outcomes(plans, lays)
    assert o.exact_match.tolist() == [True, False, True, False]
    assert o.success.tolist() == [True, True, True, False]
    assert o.progress.tolist() == [1.0, 0.0, 1.0, 5 / 6]
    by_level = evaluate_plans_by_level(plans, lays)
    assert sorted(by_level) == [3, 4, 5]
    assert by_level[5]["n"] == 2 and by_level[5]["exact_match"] == 0.5
    assert by_level[4]["exact_match"] == 0.0 and by_level[4]["invalid_share_of_failures"] == 0.0
    by_task = breakdown_by(o, [lay.task for lay in lays])
    assert by_task["minibehavior"]["success_rate"] == 1.0 and by_task["frozenlake"]["n"] == 2


@pytest.mark.parametrize("task", ["frozenlake", "minibehavior"])
def test_paper_reference_plans_score_perfectly(paper_dir: Path, task: str) -> None:
    sp = load_paper_test_split(paper_dir, task)
    m = evaluate_plans(sp.plans, sp.layouts)
    assert m["n"] == len(sp) and m["exact_match"] == 1.0 and m["progress_rate"] == 1.0
    assert m["success_rate"] == 1.0 and m["n_failed"] == 0
    for level, lm in evaluate_plans_by_level(sp.plans, sp.layouts).items():
        assert lm["exact_match"] == 1.0 and lm["progress_rate"] == 1.0, level
    # every reference step earns +1
    sc = plan_step_rewards(sp.plans, sp.layouts)
    assert (sc.rewards[sc.mask] == 1.0).all() and (sc.mask.sum(1) == sc.n_steps).all()
    # dropping the last step: not an exact match, PR = (L - 1) / L
    cut = plan_outcomes([p[:-1] for p in sp.plans], sp.layouts)
    lengths = np.array([len(p) - 1 for p in sp.plans])
    assert not cut.exact_match.any() and np.allclose(cut.progress, (lengths - 1) / lengths)
