"""Policy adapters: the only code that knows a model. `build_policy` picks one from the config.

Each adapter follows `mmrl.policies.base.Policy` and has a classmethod
`from_config(cfg: RunConfig, task, device)`. Register a new one with `register_policy(name)`;
the import path is resolved lazily so heavy domains cost nothing until used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# name -> "module:Class", imported on first use
POLICIES: dict[str, str] = {
    "causal_lm": "mmrl.policies.causal_lm:CausalLMPolicy",
    "vlm": "mmrl.policies.vlm:VLMPolicy",
    "qwen_vl": "mmrl.policies.qwen_vl:QwenVLPolicy",
    "vprl_text": "mmrl.policies.vprl_text:VPRLTextPolicy",
    "visual_planner": "mmrl.policies.visual_planner.modeling:VisualPlannerPolicy",
    "action_vla": "mmrl.policies.vla.modeling_action_tokens:ActionTokenVLAPolicy",
    "smolvla": "mmrl.policies.vla.modeling_smolvla:SmolVLAPolicy",
    "diffusion": "mmrl.policies.vla.modeling_diffusion:DiffusionActionPolicy",
    "video_gen": "mmrl.policies.video.modeling:VideoGenPolicy",
}


def register_policy(name: str, target: str) -> None:
    if name in POLICIES and POLICIES[name] != target:
        raise ValueError(f"policy {name!r} is already registered as {POLICIES[name]}")
    POLICIES[name] = target


def policy_class(name: str) -> Callable:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(sorted(POLICIES))}")
    module, cls = POLICIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_policy(cfg, task, device):
    return policy_class(cfg.model.policy).from_config(cfg, task, device)
