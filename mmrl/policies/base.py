"""The contracts between the trainer and a domain. Structural (Protocols): nothing to subclass.

A domain is an env/task (contexts) + a policy adapter (model) + reward adapters + an eval,
joined by config. The trainer calls only what is written here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from mmrl.rollout import Rollout


class Policy(Protocol):
    model: nn.Module  # the trainable module (optimizer, checkpoints)
    reference: nn.Module | None  # set by enable_reference() when algo.beta > 0

    @property
    def device(self) -> torch.device: ...

    def sample(self, contexts: list[Any], group_size: int, generator: torch.Generator | None = None,
               group_offset: int = 0, temperature: float | None = None) -> Rollout:
        """G samples per context. Rows of one context are adjacent and share group id
        `group_offset + index`. `logp_old` is the sampler's log-prob of each unit under the same
        distribution `logprobs` recomputes (temperature 0 = greedy)."""

    def logprobs(self, rollout: Rollout, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced `[N, T]` log-probs of `rollout.units` (with gradient), and per-unit
        entropy when asked."""

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor: ...

    def enable_reference(self) -> None: ...

    def decode(self, rollout: Rollout) -> list[Any]:
        """What reward adapters read: text, frames, trajectories."""

    def sft_loss(self, contexts: list[Any]) -> torch.Tensor:
        """Supervised loss on the contexts' targets (warm start, VPFT-style baselines)."""

    def save(self, directory: str | Path) -> None:
        """`save_pretrained`-style export that `from_pretrained(directory)` loads back."""


class Task(Protocol):
    def next_batch(self, n: int) -> list[Any]: ...  # training contexts; advances the cursor

    def eval_batch(self, n: int) -> list[Any]: ...  # fixed held-out contexts

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[Any]: ...  # contexts with targets

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    # Optional: `corpus() -> list[str]` to train a tiny local tokenizer, and
    # `evaluate(policy, n) -> dict[str, float]` for a domain metric beyond the mean reward.
