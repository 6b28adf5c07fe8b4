"""Step memory at a real vocabulary: mmrl's Trainer vs TRL's GRPOTrainer, one GRPO step each.

The model is a Qwen2-architecture LM with Qwen2.5's vocabulary (151,936 tokens), hidden 64, one
layer, random weights, saved to disk and loaded by each side: a CPU-sized stand-in whose output
head is a real model's (the head dominates the memory of the log-probs). Both sides draw G = 8
completions per prompt of up to T tokens (temperature 1), score them with the same rewards, and run
one optimizer step over micro-batches of 4 completions, with a KL term to the reference when beta
> 0. Each setting runs in its own process; its figure is the peak RSS during the step above the RSS
once the model, tokenizer and trainer are built (`ru_maxrss`). The last line is JSON.

    python bench/memory.py             # the grid README.md reports (about 30 minutes on one core)
    python bench/memory.py --side trl  # one side's settings only
    python bench/memory.py --smoke     # two tiny settings, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from child import run_child  # bench/child.py: this folder is on sys.path when a bench runs

VOCAB = 151_936  # Qwen2.5's
MICRO = 4  # completions per micro-batch, both sides
GROUP = 8
PROMPTS = [f"{a}{b}{c}{d}" for a in range(10) for b in range(10) for c in range(3) for d in range(3)]


def build_model(out: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mmrl.tiny import build_tokenizer

    tok = build_tokenizer([p + " " + "".join(sorted(p)) for p in PROMPTS], vocab_size=300)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                      tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_mmrl(model_dir: str, rows: int, T: int, beta: float, recompute: bool, chunk: int) -> dict:
    import torch

    from mmrl.config import config_from_dict
    from mmrl.envs import make_task
    from mmrl.policies import build_policy
    from mmrl.rewards import REWARDS, register_reward
    from mmrl.trainer import Trainer

    torch.set_num_threads(1)
    if "bench_spread" not in REWARDS:
        @register_reward("bench_spread")
        def _reward(contexts, outputs):  # rewards that differ in every group: every row trains
            return torch.tensor([0.1 * (i % 3) for i in range(len(outputs))])

    cfg = config_from_dict({
        "model": {"source": "pretrained", "path": model_dir},
        "task": {"name": "digit_sort", "params": {}},
        "rewards": [{"name": "bench_spread"}],
        "sampling": {"group_size": GROUP, "max_new_tokens": T, "temperature": 1.0},
        "algo": {"loss": "grpo", "beta": beta},
        "train": {"steps": 1, "prompts_per_step": rows // GROUP, "micro_batch_size": MICRO, "lr": 1e-4,
                  "recompute_old_logp": recompute, "logprob_chunk": chunk, "progress": False, "eval_every": 0,
                  "output_dir": tempfile.mkdtemp(), "device": "cpu"},
    })
    task = make_task("digit_sort", seed=0)
    policy = build_policy(cfg, task, torch.device("cpu"))
    policy.logprob_chunk = chunk
    trainer = Trainer(cfg, policy, task)
    base = rss_mib()
    t0 = time.perf_counter()
    metrics = trainer.train_step()
    return {"base_mib": base, "step_mib": rss_mib() - base, "step_s": time.perf_counter() - t0,
            "tokens": int(round(metrics["len/mean"] * rows))}


def run_trl(model_dir: str, rows: int, T: int, beta: float) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    seen: dict = {}

    def reward(completions, completion_ids=None, **_):
        seen["tokens"] = sum(len(c) for c in completion_ids)
        return [0.1 * (i % 3) for i in range(len(completions))]

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            seen["t0"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            seen["step_s"] = time.perf_counter() - seen["t0"]

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=MICRO, gradient_accumulation_steps=rows // MICRO,
        num_generations=GROUP, max_completion_length=T, max_steps=1, learning_rate=1e-4, beta=beta,
        temperature=1.0, top_k=0, top_p=1.0, bf16=False, gradient_checkpointing=False, use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=10_000, seed=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), callbacks=[Clock()])
    base = rss_mib()
    trainer.train()
    return {"base_mib": base, "step_mib": rss_mib() - base, "step_s": seen.get("step_s"), "tokens": seen.get("tokens")}


def child(args) -> None:
    if args.child == "trl":
        out = run_trl(args.model_dir, args.rows, args.T, args.beta)
    else:
        out = run_mmrl(args.model_dir, args.rows, args.T, args.beta, args.recompute, args.chunk)
    print("RESULT " + json.dumps(out))


# (side, rows, T, beta, recompute): README's table; the issue that asked for it measured the old code's
# 16 / 32 rows at T 128.
GRID = [("mmrl", r, T, b, False) for T in (128, 1024) for r in (16, 64) for b in (0.0, 0.01)] + \
       [("mmrl", r, T, 0.0, True) for T in (128, 1024) for r in (16, 64)] + \
       [("trl", 16, 128, 0.0, False), ("trl", 16, 128, 0.01, False), ("trl", 64, 128, 0.01, False),
        ("trl", 16, 1024, 0.01, False)]
SMOKE = [("mmrl", 8, 8, 0.01, True), ("trl", 8, 8, 0.01, False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--side", choices=["trl", "mmrl"], help="run only this side's settings of the grid")
    ap.add_argument("--chunk", type=int, default=0, help="mmrl's train.logprob_chunk (0: sized to the vocabulary)")
    ap.add_argument("--child", choices=["trl", "mmrl"])
    ap.add_argument("--model-dir")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--T", type=int)
    ap.add_argument("--beta", type=float)
    ap.add_argument("--recompute", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    rows_out = []
    with tempfile.TemporaryDirectory() as d:
        build_model(Path(d))
        for side, rows, T, beta, recompute in (SMOKE if args.smoke else GRID):
            if args.side and side != args.side:
                continue
            cmd = [sys.executable, __file__, "--child", side, "--model-dir", d, "--rows", str(rows), "--T", str(T),
                   "--beta", str(beta), "--chunk", str(args.chunk), *(["--recompute"] if recompute else [])]
            one = run_child(cmd, env, f"{side} rows={rows} T={T} beta={beta}")
            row = {"side": side, "rows": rows, "T": T, "beta": beta, "recompute": recompute,
                   "step_mib": round(one["step_mib"], 1), "step_s": round(one["step_s"] or 0.0, 2),
                   "tokens": one["tokens"]}
            rows_out.append(row)
            print(f"{side:>4} rows {rows:>3} T {T:>5} beta {beta:<4} recompute {str(recompute):<5}: "
                  f"{row['step_mib']:>8.1f} MiB above the loaded model, {row['step_s']:.1f} s, {row['tokens']} tokens",
                  flush=True)
    print(json.dumps({"vocab": VOCAB, "micro_batch": MICRO, "group": GROUP, "logprob_chunk": args.chunk,
                      "runs": rows_out}))


if __name__ == "__main__":
    main()
