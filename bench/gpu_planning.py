"""Visual planning at scale on a GPU: a ~100M-parameter visual planner, bf16, FrozenLake and Maze.

For each environment it warm-starts the policy with random-walk SFT, then runs GRPO, each for a
share of a wall-clock budget, and reports sampling and training tokens/s, model FLOP utilisation
(MFU: 6·P·trained tokens + 2·P·generated tokens, over wall time and the GPU's bf16 peak) and
held-out EM/PR per grid size 3x3..6x6. The last line is JSON.

    python bench/gpu_planning.py --minutes 4          # on a GPU machine
    python bench/gpu_planning.py --smoke              # tiny, CPU, a few steps (CI runs this)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# ~100M parameters: Llama-style, 14 layers of width 768 with grouped-query attention.
LARGE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 14, "num_attention_heads": 12,
         "num_key_value_heads": 4}
SMOKE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1}
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def run_env(env: str, args) -> dict:
    from mmrl.config import load_config
    from mmrl.envs import make_task
    from mmrl.policies import build_policy
    from mmrl.distributed import resolve_device
    from mmrl.trainer import Trainer

    sizes = [3, 4] if args.smoke else [3, 4, 5, 6]
    overrides = [
        f"task.params.env={env}", f"task.params.sizes={sizes}", "task.params.ood_sizes=[]",
        f"task.params.n_train={50 if args.smoke else 1000}", f"task.params.n_test={8 if args.smoke else 100}",
        f"model.tiny={json.dumps(SMOKE if args.smoke else LARGE)}",
        f"model.params.vq_steps={5 if args.smoke else 1500}", f"model.params.vq_layouts={10 if args.smoke else 300}",
        f"sampling.max_new_tokens={max(sizes) ** 2}",
        f"sft.batch_size={8 if args.smoke else 128}", f"train.prompts_per_step={2 if args.smoke else 64}",
        f"train.eval_size={8 if args.smoke else 200}", "train.eval_every=0", "train.progress=false",
        f"train.device={'cpu' if args.smoke else 'auto'}", "train.threads=0", "train.bf16=true",
        f"train.output_dir={args.out}/{env}",
    ]
    cfg = load_config(ROOT / "configs" / "vprl_frozenlake_grpo.yaml", overrides)
    device = resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    task = make_task(cfg.task.name, seed=cfg.train.seed, **cfg.task.params)
    policy = build_policy(cfg, task, device)
    trainer = Trainer(cfg, policy, task)
    n_params = sum(p.numel() for p in policy.model.parameters())
    budget = args.minutes * 60.0
    sft_deadline = time.perf_counter() + 0.4 * budget

    # Stage 1: SFT (the config's sft_mode), as many steps as 40% of the budget allows.
    import numpy as np

    rng = np.random.default_rng(0)
    opt = torch.optim.AdamW(trainer.updater.params, lr=cfg.sft.lr)
    sft_steps, sft_tokens, t0 = 0, 0, time.perf_counter()
    while (sft_steps < args.max_sft_steps) and (time.perf_counter() < sft_deadline or sft_steps == 0):
        batch = task.sft_batch(cfg.sft.batch_size, rng)
        with trainer.autocast:
            loss = policy.sft_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sft_steps += 1
        sft_tokens += cfg.sft.batch_size * cfg.sampling.max_new_tokens * 2  # prompt frame + target frame
    _sync()
    sft_time = time.perf_counter() - t0
    before = trainer.evaluate()

    # Stage 2: GRPO for the rest of the budget.
    rl_deadline = time.perf_counter() + 0.6 * budget
    rl_steps, gen_tokens, train_tokens, sample_s, update_s, t0 = 0, 0.0, 0.0, 0.0, 0.0, time.perf_counter()
    while rl_steps < args.max_rl_steps and (time.perf_counter() < rl_deadline or rl_steps == 0):
        m = trainer.train_step()
        rl_steps += 1
        trainer.step += 1
        # with dynamic sampling a step can keep no group: it then samples but makes no update
        gen = m["gen_tokens"] if "gen_tokens" in m else m["tokens_per_s"] * m["time/sample"]
        gen_tokens += gen
        train_tokens += gen * cfg.train.ppo_epochs if "time/update" in m else 0.0
        sample_s += m["time/sample"]
        update_s += m.get("time/update", 0.0)
    _sync()
    rl_time = time.perf_counter() - t0
    after = trainer.evaluate()

    flops = 6 * n_params * (sft_tokens + train_tokens) + 2 * n_params * gen_tokens
    peak = peak_flops()
    return {
        "env": env, "params_m": round(n_params / 1e6, 1), "sft_steps": sft_steps, "rl_steps": rl_steps,
        "sft_s": round(sft_time, 1), "rl_s": round(rl_time, 1),
        "sample_tokens_per_s": round(gen_tokens / max(sample_s, 1e-9), 1),
        "train_tokens_per_s": round(train_tokens / max(update_s, 1e-9), 1),
        "mfu": round(flops / (sft_time + rl_time) / peak, 4) if peak else None,
        "before": _metrics(before), "after": _metrics(after),
    }


def _metrics(result: dict) -> dict:
    keep = ("exact_match", "progress_rate", "success")
    return {k.removeprefix("eval/"): round(v, 4) for k, v in result.items()
            if isinstance(v, float) and any(x in k for x in keep)}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget per environment")
    ap.add_argument("--envs", nargs="+", default=["frozenlake", "maze"])
    ap.add_argument("--max-sft-steps", type=int, default=10**9)
    ap.add_argument("--max-rl-steps", type=int, default=10**9)
    ap.add_argument("--out", default="runs/gpu_planning")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.max_sft_steps, args.max_rl_steps = 0.0, 3, 2
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("bench/gpu_planning.py needs a GPU (use --smoke for a CPU check)")
    results = [run_env(env, args) for env in args.envs]
    for r in results:
        print(f"{r['env']}: {r['params_m']}M params, sample {r['sample_tokens_per_s']} tok/s, "
              f"train {r['train_tokens_per_s']} tok/s, MFU {r['mfu']}, before {r['before']} after {r['after']}")
    print(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "results": results}))


if __name__ == "__main__":
    main()
