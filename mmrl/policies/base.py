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


class PolicyBase:
    """What every adapter shares: device, the frozen reference for the KL term, LoRA wrapping."""

    model: nn.Module
    reference: nn.Module | None = None
    PARAMS: frozenset[str] = frozenset()  # the model.params keys this adapter reads

    @classmethod
    def check_params(cls, params: dict) -> None:
        """Raise ValueError naming a `model.params` key this adapter does not read (at config load)."""
        check_model_params(params, set(cls.PARAMS), cls.__name__)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def enable_reference(self) -> None:
        """A frozen copy of the current weights for the KL term; under LoRA the model with its
        adapter disabled is the reference, so nothing is copied."""
        if hasattr(self.model, "disable_adapter"):
            return
        import copy

        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    def reference_module(self):
        """A context manager yielding the module to run for reference log-probs."""
        import contextlib

        if self.reference is not None:
            return contextlib.nullcontext(self.reference)
        if not hasattr(self.model, "disable_adapter"):
            raise RuntimeError("reference log-probs need enable_reference() first (algo.beta > 0 calls it)")

        @contextlib.contextmanager
        def disabled():
            with self.model.disable_adapter():
                yield self.model

        return disabled()


def check_model_params(params: dict, valid: set[str], policy: str) -> None:
    """`model.params` keys a policy does not know are an error naming them and the valid ones."""
    unknown = set(params) - valid
    if unknown:
        raise ValueError(f"model.params: unknown key(s) {sorted(unknown)} for {policy}; valid: "
                         f"{', '.join(sorted(valid)) or '(none)'}")


def apply_lora(model: nn.Module, model_cfg) -> nn.Module:
    """Wrap `model` with LoRA adapters when `model.lora_rank > 0` (peft); otherwise return it."""
    if model_cfg.lora_rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha,
                                            target_modules=model_cfg.lora_target_modules))
