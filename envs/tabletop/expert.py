"""Scripted experts: closed-loop state machines over privileged state (tcp, object and zone poses).

Each expert turns a waypoint into an action with a proportional step toward it, and re-plans from
the current state every step, so a block that slips or rotates is simply re-approached.
"""

from __future__ import annotations

import numpy as np

from .env import TabletopEnv
from .scene import BALL_RADIUS, BLOCK_HALF, FINGER_OPEN

OPEN, CLOSED = -1.0, 1.0
_SAFE_Z = 0.1  # travel height: fingertips clear every object


def _toward(env: TabletopEnv, target: np.ndarray, gripper: float, gain: float = 1.0,
            origin: np.ndarray | None = None) -> np.ndarray:
    """A proportional step from `origin` (default: the measured tcp) toward `target`."""
    delta = (np.asarray(target) - (env.tcp_pos if origin is None else origin)) / env.max_delta
    action = np.zeros(7, np.float32)
    action[:3] = np.clip(gain * delta, -1.0, 1.0)
    action[6] = gripper
    return action


class Expert:
    def reset(self) -> None:
        """Forget the phase (call after env.reset)."""

    def act(self, env: TabletopEnv) -> np.ndarray:
        raise NotImplementedError


class ReachExpert(Expert):
    """Above the ball, then straight down with a closed gripper until the fingertips touch it.

    It plans from the commanded (servo target) position, not the measured tcp, which lags it: so
    once the command is over the ball its x/y actions are exactly 0, not small corrections of the
    lag. Demonstrations then show a clear choice (move toward the ball or not) that a policy can
    read from the image, instead of lag noise it cannot predict."""

    def act(self, env: TabletopEnv) -> np.ndarray:
        ball, cmd = env.object_pos[0], env.servo_target
        if np.linalg.norm(cmd[:2] - ball[:2]) > 0.012:
            return _toward(env, [*ball[:2], max(cmd[2], _SAFE_Z)], CLOSED, origin=cmd)
        return _toward(env, [*ball[:2], 2 * BALL_RADIUS], CLOSED, origin=cmd)  # fingertips 2 cm into the ball


class PushExpert(Expert):
    """Stand behind the block on the block->zone line, then drive through it; whenever the tcp
    drifts off that line, lift, go round and line up again."""

    _BEHIND = BLOCK_HALF + 0.025  # tcp distance behind the block centre before a push
    _PUSH_Z = 0.022

    def __init__(self) -> None:
        self.pushing = False

    def reset(self) -> None:
        self.pushing = False

    def act(self, env: TabletopEnv) -> np.ndarray:
        block, goal, tcp = env.object_pos[0][:2], env.zone_xy[0], env.tcp_pos
        to_goal = goal - block
        direction = to_goal / max(np.linalg.norm(to_goal), 1e-9)
        rel = tcp[:2] - block
        along = float(rel @ direction)  # < 0: behind the block
        lateral = abs(float(rel @ np.array([-direction[1], direction[0]])))
        if self.pushing and (lateral > 0.015 or along > -BLOCK_HALF):
            self.pushing = False  # lost the block: re-approach
        if self.pushing:
            # Aim a little past the block's centre, on the line: this also steers lateral drift back.
            aim = block + direction * 0.03
            return _toward(env, [*aim, self._PUSH_Z], CLOSED, gain=0.6)
        start = block - direction * self._BEHIND
        gap = float(np.linalg.norm(tcp[:2] - start))
        if gap > 0.01:
            if gap > 0.03 and tcp[2] < _SAFE_Z - 0.02:
                return _toward(env, [*tcp[:2], _SAFE_Z], CLOSED)  # lift before going round the block
            return _toward(env, [*start, _SAFE_Z if gap > 0.03 else tcp[2]], CLOSED)
        if tcp[2] > self._PUSH_Z + 0.01:
            return _toward(env, [*start, self._PUSH_Z], CLOSED)
        self.pushing = True
        return _toward(env, [*start, self._PUSH_Z], CLOSED)


class PickPlaceExpert(Expert):
    """Open above the block, descend, close, lift, carry over the zone, lower, open, lift."""

    _GRASP_Z = 0.022
    _RELEASE_Z = BLOCK_HALF + 0.028

    def __init__(self) -> None:
        self.phase, self.timer = "approach", 0

    def reset(self) -> None:
        self.phase, self.timer = "approach", 0

    def act(self, env: TabletopEnv) -> np.ndarray:
        block, goal, tcp = env.object_pos[0], env.zone_xy[0], env.tcp_pos
        xy_err = np.linalg.norm(tcp[:2] - block[:2])
        if self.phase == "approach":
            if tcp[2] < _SAFE_Z - 0.02 and xy_err > 0.02:
                return _toward(env, [*tcp[:2], _SAFE_Z], OPEN)
            if xy_err > 0.006:
                return _toward(env, [*block[:2], _SAFE_Z], OPEN)
            self.phase = "descend"
        if self.phase == "descend":
            if xy_err > 0.02:
                self.phase = "approach"
                return _toward(env, [*tcp[:2], _SAFE_Z], OPEN)
            if tcp[2] > self._GRASP_Z + 0.004:
                return _toward(env, [*block[:2], self._GRASP_Z], OPEN)
            self.phase, self.timer = "close", 0
        if self.phase == "close":
            self.timer += 1
            if self.timer < 5:
                return _toward(env, [*tcp[:2], self._GRASP_Z], CLOSED)
            self.phase = "lift"
        if self.phase == "lift":
            if env.finger_q.mean() < 0.3 * BLOCK_HALF or env.finger_q.mean() > FINGER_OPEN * 0.95:
                self.phase = "approach"  # missed the block: fingers closed on nothing
                return _toward(env, [*tcp[:2], _SAFE_Z], OPEN)
            if tcp[2] < _SAFE_Z - 0.01:
                return _toward(env, [*tcp[:2], _SAFE_Z], CLOSED)
            self.phase = "carry"
        if self.phase == "carry":
            if block[2] < BLOCK_HALF + 0.02:
                self.phase = "approach"  # dropped it on the way
                return _toward(env, [*tcp[:2], _SAFE_Z], OPEN)
            if np.linalg.norm(tcp[:2] - goal) > 0.008:
                return _toward(env, [*goal, _SAFE_Z], CLOSED)
            self.phase = "lower"
        if self.phase == "lower":
            if tcp[2] > self._RELEASE_Z + 0.004:
                return _toward(env, [*goal, self._RELEASE_Z], CLOSED)
            self.phase, self.timer = "release", 0
        if self.phase == "release":
            self.timer += 1
            if self.timer < 4:
                return _toward(env, [*tcp[:2], tcp[2]], OPEN)
            self.phase = "retreat"
        return _toward(env, [*tcp[:2], _SAFE_Z], OPEN)


EXPERTS: dict[str, type[Expert]] = {"reach": ReachExpert, "push": PushExpert, "pick_place": PickPlaceExpert}


def make_expert(task: str) -> Expert:
    if task not in EXPERTS:
        raise ValueError(f"no scripted expert for {task!r}; valid: {', '.join(EXPERTS)}")
    return EXPERTS[task]()


def run_expert(env: TabletopEnv, seed: int, expert: Expert | None = None, **reset_options) -> tuple[bool, int]:
    """Roll the expert out from `seed`'s initial state without rendering; returns (success, steps)."""
    expert = expert or make_expert(env.task)
    env.reset(seed=seed, options=reset_options or None)
    expert.reset()
    for t in range(env.max_episode_steps):
        env.apply_action(expert.act(env))  # physics only: no camera work when nobody looks
        if env.success:
            return True, t + 1
    return False, env.max_episode_steps
