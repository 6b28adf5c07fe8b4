"""VPRL's text baseline: a Qwen-VL policy that sees the frame and writes the whole plan in words.

Training needs nothing beyond `QwenVLPolicy` (the reward `vprl_text_plan` parses and simulates the
text). This subclass only adds `plan`, which `PlanningTask.evaluate` calls for its closed-loop
metrics (exact match, progress rate): one greedy plan per context, parsed and simulated.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.policies.qwen_vl import QwenVLPolicy
from mmrl.envs.planning.text_plan import parse_actions, simulate_plan


class VPRLTextPolicy(QwenVLPolicy):
    strict_parse: bool = True  # as the reward's default: any non-action word makes a plan unparseable

    @torch.no_grad()
    def plan(self, contexts: list[dict], max_steps: int | list[int]) -> list[dict[str, Any]]:
        """Greedy text plans simulated from each context's state: [{"states": int [T+1, 5], "text": str}]."""
        limits = [max_steps] * len(contexts) if isinstance(max_steps, int) else list(max_steps)
        if len(limits) != len(contexts):
            raise ValueError(f"{len(limits)} max_steps for {len(contexts)} contexts")
        texts = self.decode(self.sample(contexts, 1, temperature=0.0))
        return [{"states": simulate_plan(c["layout"], c["state"], parse_actions(t, self.strict_parse), k), "text": t}
                for c, t, k in zip(contexts, texts, limits)]
