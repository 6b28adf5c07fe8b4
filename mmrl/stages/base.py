"""The stage kinds, their registry and the typed-config builder (see mmrl.stages)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from mmrl import algos
from mmrl.config_checks import ConfigError, build_dataclass
from mmrl.rollout import Rollout


class Stage:
    """Base of every stage: `name` is its registry key; its kind is the base class it subclasses."""

    name: ClassVar[str]

    def setup(self, seed: int) -> None:
        """Called once when the trainer is built, with this rank's seed (for a stage's own stream)."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the stage (None: nothing)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @property
    def needs_masked_images(self) -> bool:
        """Whether the update must score the rollout again with its images masked (PAPO, VL-Calibration)."""
        return False


class RolloutStage(Stage):
    """Collect: every round of sampling asks `replayed` for contexts to sample first, hands each
    scored batch to `observe`, and keeps the rows every filter's `keep` keeps; with a filter, rounds
    go on until `train.prompts_per_step` groups are kept or `algo.max_sampling_tries` is reached."""

    is_filter: ClassVar[bool] = False

    def begin(self) -> None:
        """A step's collect starts."""

    def replayed(self, n: int) -> list[Any]:
        """Contexts to sample again this round, at most its share of the `n` the round draws."""
        return []

    def observe(self, rollout: Rollout, replayed: int, stats: dict[str, float]) -> None:
        """See one round's scored rollout (`replayed`: how many of its contexts came from `replayed`)
        and add to the collect's metrics `stats` (a defaultdict of floats)."""

    def keep(self, rollout: Rollout) -> torch.Tensor:
        """bool [N], the same for every member of a group: the rows the update may use (filters only)."""
        raise NotImplementedError

    def summary(self) -> dict[str, float]:
        """Metrics of the whole collect."""
        return {}


class RewardShaper(Stage):
    """Score: the weighted total reward [N] of the collected batch, shaped before the advantages."""

    def shape(self, rewards: torch.Tensor, rollout: Rollout, unit_budget: int,
              generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class AdvantageInputs:
    """What an advantage transform reads: the rollout, its shaped rewards [N], the loss mask [N, T],
    and for transforms that need them (`needs_policy_scores`) the rollout with its images masked and
    `policy_scores()`: the policy's per-unit "logp", "entropy" and "logp_masked" [N, T] without graph."""

    rollout: Rollout
    rewards: torch.Tensor
    mask: torch.Tensor | None = None
    policy_scores: typing.Callable[[], dict[str, torch.Tensor]] | None = None


class AdvantageTransform(Stage):
    """Advantages [N] (or [N, T]) -> new advantages. A transform that reads only rewards runs right
    after the estimator, on this rank's rows; one with `needs_policy_scores` runs in the update,
    after the rows are padded for FSDP and the images masked."""

    needs_policy_scores: ClassVar[bool] = False

    def transform(self, adv: torch.Tensor, x: AdvantageInputs) -> torch.Tensor:
        raise NotImplementedError


class AuxiliaryLoss(Stage):
    """Update: a loss of its own (not per unit of the rollout), back-propagated in every optimizer
    step of the update, after the policy loss's micro-batches, or with `first_step_only` before
    them and only in the first (then also in a step that kept no rows). `metric` names its log."""

    first_step_only: ClassVar[bool] = False
    metric: ClassVar[str]

    def pending(self) -> int:
        """How many items the loss has this step (first_step_only losses)."""
        return 0

    def loss(self, policy, task) -> tuple[torch.Tensor, float] | None:
        """(the tensor to back-propagate, the value to log), or None for nothing this step."""
        raise NotImplementedError


STAGES: dict[str, type[Stage]] = {}


def register_stage(name: str):
    """Class decorator: register a dataclass stage under `name` (unique across kinds)."""
    def wrap(cls: type[Stage]) -> type[Stage]:
        if name in STAGES:
            raise ValueError(f"stage {name!r} is registered twice")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"stage {name!r}: {cls.__name__} must be a dataclass (its fields are its config)")
        cls.name = name
        STAGES[name] = cls
        return cls
    return wrap


def build_stage(spec: Any, key: str = "algo.stages") -> Stage:
    """A stage from {"name": <registered>, **its fields}; a ConfigError of one line naming the bad
    name, field or value and what is accepted."""
    if not isinstance(spec, dict):
        raise ConfigError(f"{key}: {spec!r} is not a mapping; accepted: {{name: <stage>, <its fields>}}")
    fields = dict(spec)
    name = fields.pop("name", None)
    if name not in STAGES:
        raise ConfigError(f"{key}.name: unknown stage {name!r}; registered: {', '.join(sorted(STAGES))}")
    try:
        return build_dataclass(STAGES[name], fields, key)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (stage {name!r})") from None
    except ValueError as exc:  # the stage's own value checks (__post_init__)
        raise ConfigError(f"{key}: {exc} (stage {name!r})") from None


@dataclass
class Stages:
    """The stages of one run in the order they were configured; each hook runs its kind's stages in
    that order (a stage may be of two kinds: guidance observes the rollout and adds a loss)."""

    items: list[Stage] = field(default_factory=list)

    def of(self, kind: type) -> list:
        return [s for s in self.items if isinstance(s, kind)]

    @property
    def rollout(self) -> list[RolloutStage]:
        return self.of(RolloutStage)

    @property
    def filters(self) -> list[RolloutStage]:
        return [s for s in self.rollout if s.is_filter]

    @property
    def reward_shapers(self) -> list[RewardShaper]:
        return self.of(RewardShaper)

    @property
    def advantage_transforms(self) -> list[AdvantageTransform]:
        return self.of(AdvantageTransform)

    @property
    def auxiliary_losses(self) -> list[AuxiliaryLoss]:
        return self.of(AuxiliaryLoss)

    @property
    def needs_masked_images(self) -> bool:
        return any(s.needs_masked_images for s in self.items)

    def find(self, cls: type) -> Any:
        """The run's first stage of class `cls`, or None."""
        return next(iter(self.of(cls)), None)

    def state_dict(self) -> dict[str, Any]:
        return {s.name: state for s in self.items if (state := s.state_dict()) is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s in self.items:
            if s.name in state:
                s.load_state_dict(state[s.name])


def group_contexts(rollout: Rollout, rows: torch.Tensor) -> list[Any]:
    """The context of each group whose members `rows` (bool [N], one value per group) selects, once."""
    pick = (rows & algos.one_row_per_group(rollout.group_ids)).nonzero().squeeze(1).tolist()
    return [rollout.contexts[i] for i in pick]
