"""Policy adapters: the only code that knows a model. `build_policy` picks one from the config."""

from __future__ import annotations

from mmrl.config import RunConfig


def build_policy(cfg: RunConfig, task, device):
    from mmrl.policies.causal_lm import CausalLMPolicy

    corpus = task.corpus() if cfg.model.source == "tiny" else None
    return CausalLMPolicy.from_config(cfg.model, cfg.sampling, corpus=corpus, seed=cfg.train.seed, device=device)
