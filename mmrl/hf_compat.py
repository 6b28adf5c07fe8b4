"""What changed in transformers between the stacks mmrl supports (5.5 with lerobot, 5.25 newest),
in one place, so that the policies call one name.

* The KV cache argument and output field: `past_key_values` up to 5.2x, `cache` after (the old
  names still work there, with a deprecation warning, until 5.40).
* Gradient checkpointing is "activation checkpointing" from 5.2x (the old names are deprecated).
* A Qwen-VL's `get_image_features`: the per-image features come split into a tuple; Qwen3-VL's
  deepstack features too, one tuple per layer, after 5.2x.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _cache_argument(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """The forward keyword that passes a KV cache to `model` in the installed transformers (a PEFT
    wrapper passes it on to the model it wraps)."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_cache_argument(type(hf)): cache}


def cache_of(output):
    """The KV cache a forward returned (`cache` or `past_key_values`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def checkpointing_on(model) -> bool:
    """Whether the model's activation (gradient) checkpointing is on (transformers 5.2x's name first)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def joined(features) -> torch.Tensor:
    """One tensor from features that are one already or a tuple / list of per-image pieces."""
    return torch.cat(list(features)) if isinstance(features, (tuple, list)) else features
