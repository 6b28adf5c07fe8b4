"""GRPO step time: mmrl's Trainer vs TRL's GRPOTrainer on the same tiny Qwen2, prompts and batch.

Both sides get the same model weights (built once, saved to disk, loaded by each), the same
locally built tokenizer, the same prompts, 8 completions per step (2 prompts x 4 generations),
the same completion budget, temperature 1, beta 0, one update per batch, one CPU thread. Each
side runs in its own subprocess so its peak RSS is its own. The last line is JSON:
`mmrl_step_s`, `trl_step_s` (per-step wall-clock medians after warm-up), `speedup` (TRL / mmrl),
the same three for process CPU time per step (`*_cpu_step_s`, `cpu_speedup`: what each side
costs, nearly blind to other jobs on the machine), the generated tokens per step of each, the
peak RSS of each in MiB, and the 1-minute load average at the end.

    python bench/grpo_vs_trl.py            # the measured run
    python bench/grpo_vs_trl.py --smoke    # a few steps, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from child import run_child  # bench/child.py: this folder is on sys.path when a bench runs

PROMPTS = [f"{a}+{b}=" for a in range(10, 40) for b in range(5, 35)]


def build_model(out: Path, hidden: int, layers: int) -> None:
    from mmrl.tiny import build_tiny_qwen2, build_tokenizer

    tok = build_tokenizer([p + "0" for p in PROMPTS] + ["hello world"], vocab_size=400)
    model = build_tiny_qwen2(tok, seed=0, hidden_size=hidden, intermediate_size=3 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def length_reward(completions, **_):
    return [float(len(c)) / 32.0 for c in completions]


def run_trl(model_dir: str, steps: int, max_tokens: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen_tokens: list[int] = []

    def reward(completions, completion_ids=None, **_):
        gen_tokens.append(sum(len(c) for c in completion_ids))
        return [0.1 * (i % 3) for i in range(len(completions))]

    class Timer(TrainerCallback):
        times: list[float] = []

        cpu_times: list[float] = []

        def on_step_begin(self, *a, **k):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)
            self.cpu_times.append(time.process_time() - self.c0)

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=max_tokens, max_steps=steps, learning_rate=1e-4, beta=0.0,
        temperature=1.0, top_k=0, top_p=1.0, bf16=False, gradient_checkpointing=False, use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=10_000, seed=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), callbacks=[timer])
    trainer.train()
    return {"step_times": timer.times, "cpu_step_times": timer.cpu_times, "gen_tokens": gen_tokens}


def run_mmrl(model_dir: str, steps: int, max_tokens: int) -> dict:
    import torch

    from mmrl.config import config_from_dict
    from mmrl.envs import make_task
    from mmrl.policies import build_policy
    from mmrl.rewards import REWARDS, register_reward
    from mmrl.trainer import Trainer

    torch.set_num_threads(1)
    gen_tokens: list[int] = []
    if "bench_constant" not in REWARDS:
        @register_reward("bench_constant")
        def _reward(contexts, outputs):
            return torch.tensor([0.1 * (i % 3) for i in range(len(outputs))])

    cfg = config_from_dict({
        "model": {"source": "pretrained", "path": model_dir},
        "task": {"name": "arithmetic", "params": {"max_operand": 40}},
        "rewards": [{"name": "bench_constant"}],
        "sampling": {"group_size": 4, "max_new_tokens": max_tokens, "temperature": 1.0},
        "algo": {"loss": "grpo"},
        "train": {"steps": steps, "prompts_per_step": 2, "lr": 1e-4, "progress": False, "eval_every": 0,
                  "output_dir": tempfile.mkdtemp(), "device": "cpu"},
    })
    task = make_task("arithmetic", seed=0, max_operand=40)
    trainer = Trainer(cfg, build_policy(cfg, task, torch.device("cpu")), task)
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        rollout_metrics = trainer.train_step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        gen_tokens.append(int(round(rollout_metrics["len/mean"] * 8)))
    return {"step_times": times, "cpu_step_times": cpu_times, "gen_tokens": gen_tokens}


def child(which: str, model_dir: str, steps: int, max_tokens: int) -> None:
    out = (run_trl if which == "trl" else run_mmrl)(model_dir, steps, max_tokens)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--child", choices=["trl", "mmrl"])
    ap.add_argument("--model-dir")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.rounds = 4, 1, 1
    if args.child:
        child(args.child, args.model_dir, args.steps, args.max_tokens)
        return

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as d:
        build_model(Path(d), args.hidden, args.layers)
        # Alternate the two sides over rounds, so load from anything else on the machine hits both.
        res = {side: {"step_times": [], "cpu_step_times": [], "gen_tokens": [], "peak_rss_mib": 0.0}
               for side in ("trl", "mmrl")}
        for _ in range(args.rounds):
            for which in ("trl", "mmrl"):
                cmd = [sys.executable, __file__, "--child", which, "--model-dir", d, "--steps", str(args.steps),
                       "--max-tokens", str(args.max_tokens)]
                one = run_child(cmd, env, f"{which} run")
                res[which]["step_times"] += one["step_times"][args.warmup:]
                res[which]["cpu_step_times"] += one["cpu_step_times"][args.warmup:]
                res[which]["gen_tokens"] += one["gen_tokens"][args.warmup:]
                res[which]["peak_rss_mib"] = max(res[which]["peak_rss_mib"], one["peak_rss_mib"])

    trl_s, mmrl_s = statistics.median(res["trl"]["step_times"]), statistics.median(res["mmrl"]["step_times"])
    # Process CPU time per step: what each side costs, nearly blind to other jobs on the machine
    # (wall time under background load is the noisier figure; both are reported).
    trl_cpu, mmrl_cpu = (statistics.median(res[side]["cpu_step_times"]) for side in ("trl", "mmrl"))
    summary = {
        "mmrl_step_s": round(mmrl_s, 5),
        "trl_step_s": round(trl_s, 5),
        "speedup": round(trl_s / mmrl_s, 3),
        "mmrl_cpu_step_s": round(mmrl_cpu, 5),
        "trl_cpu_step_s": round(trl_cpu, 5),
        "cpu_speedup": round(trl_cpu / mmrl_cpu, 3),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "mmrl_tokens_per_step": statistics.mean(res["mmrl"]["gen_tokens"]),
        "trl_tokens_per_step": statistics.mean(res["trl"]["gen_tokens"]),
        "mmrl_peak_rss_mib": round(res["mmrl"]["peak_rss_mib"], 1),
        "trl_peak_rss_mib": round(res["trl"]["peak_rss_mib"], 1),
        "steps": args.steps, "rounds": args.rounds, "completions_per_step": 8, "max_new_tokens": args.max_tokens,
    }
    print(f"mmrl {mmrl_s * 1000:.1f} ms/step vs TRL {trl_s * 1000:.1f} ms/step: {summary['speedup']:.2f}x "
          f"(CPU time per step: {mmrl_cpu * 1000:.1f} vs {trl_cpu * 1000:.1f} ms, {summary['cpu_speedup']:.2f}x)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
