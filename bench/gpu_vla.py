"""Trajectory-level GRPO throughput of the action-token VLA: LIBERO on a GPU, or a CPU smoke run.

    python bench/gpu_vla.py                       # ~0.5B Qwen2.5-VL (random weights), LIBERO-Spatial
    python bench/gpu_vla.py --contexts 8 --group-size 8 --steps 3 --num-workers 16
    python bench/gpu_vla.py --smoke               # tiny model, tabletop reach, 2 steps, CPU

Each step is one GRPO step of the trainer: `collect` (G episodes per initial state, whole
episodes of action chunks) then `update` (teacher-forced log-probs of every executed chunk,
clipped loss, backward, AdamW). Timed separately:

* rollout: env steps/s and action tokens/s over the whole `collect`;
* policy vs env inside the rollout: building (or fetching cached) vector envs and their
  reset/step_chunk calls are timed by a proxy; the rest of `collect` is the policy (image
  encoding, prefill, token decoding). LIBERO envs are cached per set of task ids, so a step whose
  contexts need another set of tasks rebuilds them (`env_build_s`; `--task-ids 0` avoids it);
* update: trained action tokens/s (tokens x PPO epochs over the update time);
* the accelerator's share: (policy time in the rollout + update time) / step time, against the
  env's share (CPU physics and rendering).

The model is built from a config, never downloaded: Qwen2.5-VL's architecture at about 0.5B
parameters (Qwen2.5-0.5B's text tower, a 16-layer 1024-wide vision tower) with a local tokenizer
plus 256 action tokens, weights in fp32 under bf16 autocast (the trainer's GPU path). The last line
printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# ~0.5B: text 24 x (attention 1.8M + MLP 13.1M) = 358M, vision 16 x 8.4M = 134M (tiny vocabulary).
SIZES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, mrope_section=[8, 12, 12], max_position_embeddings=4096,
                 vision_depth=16, vision_width=1024, vision_heads=16),
    "tiny": dict(hidden_size=64, intermediate_size=128, head_dim=16, mrope_section=[4, 2, 2]),
}


class TimedEnv:
    """A vector env proxy that adds the wall time of its reset / step_chunk calls to `clock`."""

    def __init__(self, env, clock: dict[str, float]):
        self._env, self._clock = env, clock

    def __getattr__(self, name: str):
        return getattr(self._env, name)

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._clock["env"] += time.perf_counter() - t0

    def reset(self, *args, **kwargs):
        return self._timed(self._env.reset, *args, **kwargs)

    def step_chunk(self, *args, **kwargs):
        return self._timed(self._env.step_chunk, *args, **kwargs)


def build_config(args) -> dict[str, Any]:
    if args.env == "libero":
        task = {"name": "libero", "params": {"suite": args.suite, "task_ids": args.task_ids,
                                             "image_size": args.image_size, "cameras": ["agentview"],
                                             "num_workers": args.num_workers, "chunk_size": args.chunk_size}}
    else:
        task = {"name": "tabletop", "params": {"tasks": ["reach"], "image_size": args.image_size, "cameras": ["front"],
                                               "num_workers": args.num_workers, "chunk_size": args.chunk_size,
                                               "demos_per_task": 0}}
    return {
        "model": {"policy": "action_vla", "source": "tiny", "tiny": SIZES[args.size],
                  "params": {"chunk_size": args.chunk_size, "action_dim": 7, "max_chunks": args.max_chunks,
                             "min_image_tokens": 4, "max_image_tokens": args.max_image_tokens,
                             "cameras": task["params"]["cameras"]}},
        "task": task,
        "rewards": [{"name": "success"}],
        "sampling": {"group_size": args.group_size, "temperature": 1.6},
        "algo": {"loss": "grpo", "loss_params": {"eps_low": 0.2, "eps_high": 0.28}},
        "train": {"steps": args.steps, "prompts_per_step": args.contexts, "lr": 1e-5, "device": args.device,
                  "bf16": True, "micro_batch_size": args.micro_batch, "output_dir": args.output_dir,
                  "progress": False, "eval_every": 0, "threads": args.threads},
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args) -> dict[str, Any]:
    from mmrl import build
    from mmrl.config import config_from_dict
    from mmrl.logger import MetricsLogger
    from mmrl.trainer import Trainer

    cfg = config_from_dict(build_config(args))
    t0 = time.perf_counter()
    task, policy = build(cfg)
    build_s = time.perf_counter() - t0
    clock = {"env": 0.0, "env_build": 0.0}
    inner = policy.env_factory

    def timed_factory(rows):  # building (or fetching cached) envs counts as env time too
        t = time.perf_counter()
        env = inner(rows)
        clock["env_build"] += time.perf_counter() - t
        return TimedEnv(env, clock)

    policy.env_factory = timed_factory
    n_params = sum(p.numel() for p in policy.model.parameters())
    trainer = Trainer(cfg, policy, task, log=MetricsLogger(Path(args.output_dir)))
    dev = policy.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    steps = []
    for step in range(args.warmup + args.steps):
        clock["env"] = clock["env_build"] = 0.0
        _sync(dev)
        t0 = time.perf_counter()
        with trainer.autocast:
            rollout, _ = trainer.collect()
        _sync(dev)
        t1 = time.perf_counter()
        update = trainer.update(rollout) if len(rollout) else {}
        _sync(dev)
        t2 = time.perf_counter()
        if step < args.warmup:  # first step: lazy renderers, CUDA kernels, allocator growth
            continue
        tokens = int(rollout.mask.sum())
        steps.append({"rollout_s": t1 - t0, "update_s": t2 - t1, "env_s": clock["env"] + clock["env_build"],
                      "env_build_s": clock["env_build"],
                      "env_steps": int(rollout.extras["env_steps"].sum()), "tokens": tokens,
                      "episodes": len(rollout), "success": float(rollout.extras["success"].float().mean()),
                      "loss": float(update.get("train/loss", float("nan")))})
        print(f"step {step - args.warmup}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                                            for k, v in steps[-1].items()}), flush=True)
    tot = {k: sum(s[k] for s in steps)
           for k in ("rollout_s", "update_s", "env_s", "env_build_s", "env_steps", "tokens", "episodes")}
    policy_s = tot["rollout_s"] - tot["env_s"]
    step_s = tot["rollout_s"] + tot["update_s"]
    epochs = cfg.train.ppo_epochs
    out = {
        "env": args.env, "suite": args.suite if args.env == "libero" else "reach", "size": args.size,
        "params_m": round(n_params / 1e6, 2), "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "contexts": args.contexts, "group_size": args.group_size, "steps": len(steps), "build_s": round(build_s, 2),
        "step_s": round(step_s / max(len(steps), 1), 3),
        "rollout_env_steps_per_s": round(tot["env_steps"] / max(tot["rollout_s"], 1e-9), 2),
        "rollout_action_tokens_per_s": round(tot["tokens"] / max(tot["rollout_s"], 1e-9), 2),
        "policy_action_tokens_per_s": round(tot["tokens"] / max(policy_s, 1e-9), 2),
        "update_tokens_per_s": round(tot["tokens"] * epochs / max(tot["update_s"], 1e-9), 2),
        "rollout_s": round(tot["rollout_s"], 3), "update_s": round(tot["update_s"], 3),
        "env_s": round(tot["env_s"], 3), "env_build_s": round(tot["env_build_s"], 3), "policy_rollout_s": round(policy_s, 3),
        "gpu_share": round((policy_s + tot["update_s"]) / max(step_s, 1e-9), 4),
        "env_share": round(tot["env_s"] / max(step_s, 1e-9), 4),
        "episodes": tot["episodes"], "env_steps": tot["env_steps"], "action_tokens": tot["tokens"],
        "success": round(sum(s["success"] for s in steps) / max(len(steps), 1), 4),
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None,
    }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, tabletop reach, 2 short steps on CPU")
    p.add_argument("--env", choices=["libero", "tabletop"], default=None, help="default libero (smoke: tabletop)")
    p.add_argument("--suite", default="spatial")
    p.add_argument("--task-ids", type=int, nargs="+", default=None, help="LIBERO task ids cycled over (default 0-9)")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="default 0.5b (smoke: tiny)")
    p.add_argument("--contexts", type=int, default=None, help="initial states per step (default 4, smoke 1)")
    p.add_argument("--group-size", type=int, default=None, help="rollouts per state (default 8, smoke 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 3, smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 1, smoke 0)")
    p.add_argument("--max-chunks", type=int, default=None, help="chunks per episode (default 28 = 224 steps, smoke 2)")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=None, help="default 224 (smoke 64)")
    p.add_argument("--max-image-tokens", type=int, default=None, help="default 64 (smoke 4)")
    p.add_argument("--num-workers", type=int, default=None, help="env worker processes (default 8, smoke 0)")
    p.add_argument("--micro-batch", type=int, default=0, help="rows per forward/backward in the update (0 = all)")
    p.add_argument("--device", default=None, help="default auto (smoke: cpu)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = {"env": "tabletop" if smoke else "libero", "size": "tiny" if smoke else "0.5b",
                "contexts": 1 if smoke else 4, "group_size": 2 if smoke else 8, "steps": 2 if smoke else 3,
                "warmup": 0 if smoke else 1, "max_chunks": 2 if smoke else 28, "image_size": 64 if smoke else 224,
                "max_image_tokens": 4 if smoke else 64, "num_workers": 0 if smoke else 8,
                "device": "cpu" if smoke else "auto", "threads": 1 if smoke else 0}
    for k, v in defaults.items():
        if getattr(args, k) in (None, 0) and not (k == "threads" and args.threads):
            setattr(args, k, v)
    if args.steps < 1 or args.contexts < 1 or args.group_size < 1:
        p.error(f"--steps, --contexts, --group-size must be >= 1; got {args.steps}, {args.contexts}, {args.group_size}")
    with tempfile.TemporaryDirectory(prefix="gpu_vla_") as tmp:
        args.output_dir = args.output_dir or tmp
        result = run(args)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
