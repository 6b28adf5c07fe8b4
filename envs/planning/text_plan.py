"""Plans written as action words (VPRL's text mode): parsed to actions and simulated from a state
with the planning dynamics, giving the state sequence the step judge scores."""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from .grid import INVALID_STATE, Action, Layout, state_array, step_state

ACTION_OF_WORD: dict[str, int] = {
    "left": Action.LEFT, "down": Action.DOWN, "right": Action.RIGHT, "up": Action.UP,
    "pick": Action.PICK, "pickup": Action.PICK, "drop": Action.DROP,
}
_TOKEN = re.compile(r"[a-z0-9]+")


def parse_actions(text: str, strict: bool = True) -> list[int] | None:
    """Action indices of a plan written in words, or None if it is not a plan.

    Case and punctuation are ignored (``"Up, RIGHT."`` parses). With `strict`, any other word or
    number makes the whole text unparseable; otherwise other words are skipped. A text without
    a single action word is never a plan.
    """
    words = _TOKEN.findall(text.lower())
    if strict and any(w not in ACTION_OF_WORD for w in words):
        return None
    actions = [int(ACTION_OF_WORD[w]) for w in words if w in ACTION_OF_WORD]
    return actions or None


def simulate_plan(layout: Layout, state: Any, actions: Sequence[int] | None,
                  max_steps: int | None = None) -> np.ndarray:
    """States [T+1, 5] visited by `actions` from `state` (the start first).

    Simulation stops after the first step that is not executed (its state repeats, which the
    scorer calls a no-op, -5) or that ends the episode (goal, hole). An action the task does not
    have (PICK on FrozenLake) and an unparseable plan (None) yield the unparseable state (-5).
    """
    s = state_array(state, layout)
    states = [s]
    if actions is None:
        return np.stack([s, INVALID_STATE])
    for a in list(actions)[:max_steps]:
        if not 0 <= a < layout.n_actions:
            states.append(INVALID_STATE.copy())
            break
        s, valid, done = step_state(layout, s, a)
        states.append(s)
        if not valid or done:
            break
    return np.stack(states)


def text_plans(contexts: Sequence[dict], outputs: Sequence[str], strict: bool = True,
               max_steps: int | None = None) -> list[np.ndarray]:
    """Parse and simulate one text plan per context (which carries "layout" and "state")."""
    return [simulate_plan(c["layout"], c["state"], parse_actions(t, strict), max_steps)
            for c, t in zip(contexts, outputs, strict=True)]
