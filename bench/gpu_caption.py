"""CapRL at GPU scale: GRPO steps of a ~0.5B-parameter Qwen2.5-VL captioner judged by a ~0.4B
Hugging Face causal-LM judge (both random weights, bf16, tokenizer built locally).

Each step samples `prompts x group` captions of synthetic scenes, has the HF judge answer 4
questions per caption by generation (temperature 0.6, first valid letter), and updates the
captioner. With random weights the judge's replies are mostly malformed (reward 0, logged): the
point is throughput. Reported: captions/s (sampling), judged questions/s (the reward phase), and
seconds per step. The last line is JSON.

    python bench/gpu_caption.py --steps 3        # on a GPU machine
    python bench/gpu_caption.py --smoke          # tiny, CPU, one step (CI runs this)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Captioner: a Qwen2.5-0.5B-like text model (24 layers of 896) with a 12-layer 768-wide vision tower.
LARGE_CAPTIONER = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "head_dim": 64, "mrope_section": [16, 8, 8], "vision_depth": 12,
                   "vision_width": 768, "vision_heads": 12}
SMOKE_CAPTIONER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 16, "mrope_section": [4, 2, 2], "vision_depth": 1,
                   "vision_width": 16, "vision_heads": 1}
# Judge: the same text sizes as Qwen2.5-0.5B.
LARGE_JUDGE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
               "num_key_value_heads": 2}
SMOKE_JUDGE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "num_key_value_heads": 1}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed GRPO steps (after one warm-up step)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="weights of both models (default: bfloat16, float32 with --smoke)")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.prompts, a.group = 1, 2, 2

    from mmrl.envs import make_task

    from mmrl.config import load_config
    from mmrl.policies import build_policy
    from mmrl.tiny import build_tiny_qwen2
    from mmrl.distributed import resolve_device
    from mmrl.trainer import Trainer

    device = "cpu" if a.smoke else "auto"
    dtype = a.dtype or ("float32" if a.smoke else "bfloat16")
    out = Path(a.out or tempfile.mkdtemp(prefix="gpu_caption_"))
    judge_dir = out / "judge"
    questions = 4
    base = [f"model.tiny={json.dumps(SMOKE_CAPTIONER if a.smoke else LARGE_CAPTIONER)}", f"model.dtype={dtype}",
            "model.params.max_image_tokens=16", "task.params.cell_px=56", "task.params.n_test=8",
            f"sampling.group_size={a.group}", f"sampling.max_new_tokens={8 if a.smoke else 48}",
            f"train.prompts_per_step={a.prompts}", "sft.steps=0", f"train.steps={a.steps + 1}", "train.eval_every=0",
            "train.progress=false", "train.threads=0", f"train.device={device}", f"train.output_dir={out / 'run'}"]
    cfg = load_config(ROOT / "configs" / "caption_grpo.yaml", base)
    dev = resolve_device(cfg.train.device)
    torch.manual_seed(0)
    task = make_task(cfg.task.name, seed=0, **cfg.task.params)
    policy = build_policy(cfg, task, dev)
    # The judge shares the captioner's locally built tokenizer; saved to disk and loaded like a real one.
    judge_model = build_tiny_qwen2(policy.tokenizer, seed=1, **(SMOKE_JUDGE if a.smoke else LARGE_JUDGE))
    judge_model.to(getattr(torch, dtype)).save_pretrained(judge_dir)
    policy.tokenizer.save_pretrained(judge_dir)
    judge = {"name": "hf", "path": str(judge_dir), "mode": "generate", "temperature": 0.6, "max_new_tokens": 8,
             "batch_size": 512, "device": str(dev), "dtype": dtype}
    # A random judge's replies are mostly malformed: a throughput run, not a judge fault (max_judge_failures 1).
    cfg.rewards[0].params = {**cfg.rewards[0].params, "judge": judge, "questions_per_caption": questions,
                             "max_judge_failures": 1.0}
    trainer = Trainer(cfg, policy, task)
    trainer.train_step()  # warm-up: kernels, the judge's load, allocator
    if dev.type == "cuda":
        torch.cuda.synchronize()
    rows = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        m = trainer.train_step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        rows.append({**m, "step_s": time.perf_counter() - t0})
    n_caps = a.prompts * a.group
    mean = lambda k: sum(r[k] for r in rows) / len(rows)
    from mmrl.rewards.captioning.qa import cached_judge

    result = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "smoke": a.smoke,
        "captioner_params": n_params(policy.model), "judge_params": n_params(cached_judge(judge).model),
        "dtype": dtype, "prompts": a.prompts, "group": a.group, "steps": a.steps,
        "captions_per_s": n_caps / mean("time/sample"), "judged_questions_per_s": n_caps * questions / mean("time/reward"),
        "step_s": mean("step_s"), "update_s": mean("time/update"), "reward_mean": mean("reward/total"),
        "judge_failed_share": (sum(r["reward/caption_qa/judge_failed"] for r in rows)
                               / max(1.0, sum(r["reward/caption_qa/judged"] for r in rows))),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
    }
    print(f"captioner {result['captioner_params'] / 1e6:.0f}M, judge {result['judge_params'] / 1e6:.0f}M params: "
          f"{result['captions_per_s']:.1f} captions/s, {result['judged_questions_per_s']:.1f} judged questions/s, "
          f"{result['step_s']:.2f} s/step")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
