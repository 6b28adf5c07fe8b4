"""Reward adapters: `Reward` objects called as `reward(contexts, outputs) -> float Tensor[N]`.

`outputs` is what the policy adapter decodes from a rollout (text for LMs, frames for the visual
planner, trajectories for VLAs). Several rewards are weighted in the config; each is logged, with
the metrics its object reports. A stateless reward is a function `fn(contexts, outputs, **params)`
registered as it is; a reward with state (e.g. the caption reward's question draws) subclasses
`Reward`, and the trainer saves that state in its checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmrl.config_checks import check_params

RewardFn = Callable[..., torch.Tensor]


class RewardFailure(RuntimeError):
    """A reward cannot score this call at all (its judge is down or broken): training on its zeros
    would teach nothing, so the trainer stops the step with a checkpoint and says why."""


class NonFiniteReward(RewardFailure):
    """A reward returned NaN / inf: a bug in the reward (not a flaky judge), so the run stops at once."""


def check_finite_reward(name: str, scores: torch.Tensor, contexts: list[Any], outputs: list[Any]) -> None:
    """Raise `NonFiniteReward` naming reward `name`, its bad value and one sample it scored so, when
    any of `scores` [N] (of `outputs` for `contexts`) is NaN / inf."""
    bad = ~torch.isfinite(scores)
    if not bad.any():
        return
    rows = bad.nonzero().flatten().tolist()
    i = rows[0]
    raise NonFiniteReward(f"reward {name!r} returned {scores[i].item()} for {len(rows)} of {len(scores)} samples, "
                          f"e.g. for {describe_sample(contexts[i], outputs[i])}: a reward must return finite "
                          f"numbers; fix it, then the same command resumes this step")


def describe_sample(context: Any, output: Any, width: int = 60) -> str:
    """One sample in a few words for an error line: a text completion and the context's prompt or
    instruction, each cut to `width` characters; another output by its type and shape."""
    def clip(text: str) -> str:
        return repr(text if len(text) <= width else text[:width] + "...")

    if isinstance(output, str):
        what = f"the completion {clip(output)}"
    else:
        shape = getattr(output, "shape", None)
        what = f"an output of type {type(output).__name__}" + (f" {tuple(shape)}" if shape is not None else "")
    prompt = context.get("prompt", context.get("instruction")) if isinstance(context, dict) else None
    return what + (f" of prompt {clip(prompt)}" if isinstance(prompt, str) else "")


class Reward:
    """A reward adapter with state the trainer checkpoints and metrics it logs."""

    def __call__(self, contexts: list[Any], outputs: list[Any]) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        """Numbers about the last call (logged as reward/<name>/<key>)."""
        return {}

    def counted_metrics(self) -> tuple[str, ...]:
        """The keys of `metrics` that count the call's items (summed over ranks; the rest are means)."""
        return ()

    def metric_weights(self) -> dict[str, float]:
        """How many items each mean in `metrics` is over (ranks' means are weighted by it; default 1)."""
        return {}


class FunctionReward(Reward):
    """A stateless reward function with its config parameters bound."""

    def __init__(self, fn: RewardFn, **params: Any):
        self.fn, self.params = fn, params

    def __call__(self, contexts: list[Any], outputs: list[Any]) -> torch.Tensor:
        return self.fn(contexts, outputs, **self.params)


REWARDS: dict[str, RewardFn | type[Reward]] = {}


def register_reward(name: str):
    """Register a reward function or a `Reward` subclass under `name`."""
    def wrap(entry):
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = entry
        return entry

    return wrap


def get_reward(name: str) -> RewardFn | type[Reward]:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


def build_reward(name: str, params: dict[str, Any] | None = None) -> Reward:
    """A fresh `Reward` for the registry entry `name` with its config parameters."""
    entry, params = get_reward(name), dict(params or {})
    if isinstance(entry, type) and issubclass(entry, Reward):
        check_params(entry.__init__, params, f"reward {name!r}", skip=1)
        return entry(**params)
    check_params(entry, params, f"reward {name!r}", skip=2)
    return FunctionReward(entry, **params)


from mmrl.rewards import text  # noqa: E402,F401  (registers the text rewards)
from mmrl.rewards import planning_text  # noqa: E402,F401  (registers the VPRL text-mode reward)
from mmrl.rewards import planning  # noqa: E402,F401  (registers the VPRL visual-mode reward)
from mmrl.rewards import srpo  # noqa: E402,F401  (registers the robot rewards: success, srpo_progress)
from mmrl.rewards.captioning import qa  # noqa: E402,F401  (registers the CapRL reward, caption_qa)
from mmrl.rewards import vqa  # noqa: E402,F401  (registers the VQA rewards: answer_accuracy, format, iou, length, step_*)
from mmrl.rewards import calibration  # noqa: E402,F401  (registers vl_calibration, VL-Calibration's decoupled confidence reward)
from mmrl.rewards import video  # noqa: E402,F401  (registers the video rewards: video_colour, video_motion, video_smoothness, clip_score)
