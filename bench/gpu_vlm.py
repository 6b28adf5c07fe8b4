"""VLM GRPO throughput at 3B scale on a GPU: a Qwen2.5-VL-3B-sized model (random weights, bf16).

The model is built from a config with Qwen2.5-VL-3B's sizes (LM: hidden 2048, 36 layers, 16 heads,
2 KV heads, MLP 11008, vocabulary 151936, tied embeddings; vision: depth 32, width 1280, 16 heads),
the tokenizer is trained locally (ids past it are suppressed, as for any padded vocabulary), and
the inputs are synthetic VQA records (`mmrl.envs.vqa.synthetic.generate`) at 448 px: 256 LM image
tokens each, in `configs/vqa_grpo.yaml`'s prompt. Each timed step, through mmrl's own code paths:

* rollout: `Collector.sample` (the `qwen_vl` policy's sampler: one prefill per prompt, its KV cache
  repeated for the G samples), G samples per prompt, every one forced to the full `--max-new-tokens`
  (EOS suppressed); `rollout_tokens_per_s` = generated tokens / sampling time.
* update: `Trainer.score` + `Trainer.update` (teacher-forced log-probs with the images, GRPO loss,
  backward in micro-batches of `--micro-batch` rows, grad clip, AdamW step);
  `update_tokens_per_s` = tokens trained on (each row's prompt incl. image tokens + completion) / update
  time, and `update_completion_tokens_per_s` counts completion tokens only.

Model FLOP utilisation: `mfu` = 6 x params x update tokens / update time / peak, and `rollout_mfu` =
2 x params x (generated tokens + prompt tokens of one prefill per prompt) / sampling time / peak,
with params = all parameters (LM + vision; a close stand-in for the vision tower's own FLOPs, which
run on 1024 patches per 448 px image) and peak = `--peak-tflops` (H200 bf16 dense: 989). Decoding
is memory-bound, so rollout MFU is expected to be low; update MFU says how well the trainer feeds
the GPU. Medians over `--steps` timed steps after `--warmup`. The last line is JSON.

    python bench/gpu_vlm.py                   # on a GPU machine (~2-3 min incl. the build)
    python bench/gpu_vlm.py --smoke           # tiny sizes, CPU, one step (CI runs this)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Qwen2.5-VL-3B-Instruct's config.json sizes.
LARGE = {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
         "num_key_value_heads": 2, "head_dim": 128, "mrope_section": [16, 24, 24], "rope_theta": 1e6,
         "vocab_size": 151936, "vision_depth": 32, "vision_width": 1280, "vision_intermediate": 3420,
         "vision_heads": 16, "fullatt_block_indexes": [7, 15, 23, 31]}
SMOKE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16, "mrope_section": [4, 2, 2], "rope_theta": 1e4,
         "vocab_size": 0, "vision_depth": 2, "vision_width": 32, "vision_intermediate": 64,
         "vision_heads": 2, "fullatt_block_indexes": [1]}


def build_model(tokenizer, s: dict, device: torch.device, dtype: torch.dtype):
    """A Qwen2.5-VL with random weights from a config of sizes `s`, created on `device` in `dtype`."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = tokenizer.get_vocab()
    text = dict(vocab_size=max(len(tokenizer), s["vocab_size"]), hidden_size=s["hidden_size"],
                intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_hidden_layers"],
                num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
                head_dim=s["head_dim"], max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"],
                                 "mrope_section": list(s["mrope_section"])},
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=s["vision_depth"], hidden_size=s["vision_width"], intermediate_size=s["vision_intermediate"],
                  num_heads=s["vision_heads"], out_hidden_size=s["hidden_size"], patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=list(s["fullatt_block_indexes"]))
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                              image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                              vision_start_token_id=vocab["<|vision_start|>"],
                              vision_end_token_id=vocab["<|vision_end|>"])
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="completion length (generated in full)")
    p.add_argument("--image-size", type=int, default=448, help="synthetic image side in px (448: 256 LM tokens)")
    p.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward in the update")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="accelerator bf16 dense peak (H200: 989)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave the default)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="model weights (default: bfloat16, float32 with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, one step (CI)")
    a = p.parse_args(argv)
    if a.smoke:
        a.prompts, a.group, a.max_new_tokens, a.image_size, a.micro_batch, a.steps, a.warmup = 2, 2, 8, 56, 2, 1, 0
        a.threads = a.threads or 1
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_vlm.py needs a GPU (use --smoke for a CPU check)")
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = getattr(torch, a.dtype or ("float32" if a.smoke else "bfloat16"))

    import mmrl
    from mmrl.envs.vqa.synthetic import generate
    from mmrl.envs.vqa.task import PROMPTS
    from mmrl.policies.qwen_vl import QwenVLPolicy
    from mmrl.tiny import build_qwen_vl_processor, build_tokenizer
    from mmrl.trainer import Trainer

    steps = a.warmup + a.steps
    records = generate(a.prompts * steps, seed=0, difficulties=(1, 2), image_size=a.image_size)
    contexts = [{**r, "prompt": PROMPTS["tag"].format(problem=r["problem"])} for r in records]
    tok = build_tokenizer([c["prompt"] + " " + c["solution"] for c in contexts], vocab_size=400)
    image_tokens = (a.image_size // 28) ** 2
    processor = build_qwen_vl_processor(tok, "qwen2_5_vl", image_tokens, image_tokens)
    t0 = time.perf_counter()
    model = build_model(tok, SMOKE if a.smoke else LARGE, device, dtype)
    build_s = time.perf_counter() - t0
    policy = QwenVLPolicy(model, processor, temperature=1.0, max_new_tokens=a.max_new_tokens, image_key="images")
    policy.suppress_token_ids = sorted(set(policy.suppress_token_ids) | set(policy.eos_token_ids))  # full length
    n_params = sum(p.numel() for p in model.parameters())
    n_vision = sum(p.numel() for p in model.model.visual.parameters())

    out_dir = Path(tempfile.mkdtemp(prefix="gpu_vlm_"))
    cfg = mmrl.load_config(str(ROOT / "configs" / "vqa_grpo.yaml"), [
        f"sampling.group_size={a.group}", f"sampling.max_new_tokens={a.max_new_tokens}", "sft.steps=0",
        f"train.prompts_per_step={a.prompts}", f"train.micro_batch_size={a.micro_batch}", f"train.steps={steps}",
        "train.warmup_steps=0", "train.eval_every=0", "train.progress=false", f"train.device={device.type}",
        "train.bf16=true", f"train.threads={a.threads}", f"train.output_dir={out_dir}"])
    trainer = Trainer(cfg, policy, task=None)  # the task is only read by collect(); contexts are given here
    gen = torch.Generator(device=device).manual_seed(0)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    rows = []
    for i in range(steps):
        batch = contexts[i * a.prompts:(i + 1) * a.prompts]
        sync()
        t0 = time.perf_counter()
        rollout = trainer.collector.sample(batch, a.group, gen, first_group=i * a.prompts)
        sync()
        t1 = time.perf_counter()
        trainer.collector.score(rollout)
        metrics = trainer.update(rollout)
        sync()
        t2 = time.perf_counter()
        prompt_tokens = int(rollout.extras["prompt_mask"].sum())  # all N rows
        gen_tokens = int(rollout.mask.sum())
        rows.append({"sample_s": t1 - t0, "update_s": t2 - t1, "gen_tokens": gen_tokens,
                     "prefill_tokens": prompt_tokens // a.group, "update_tokens": prompt_tokens + gen_tokens,
                     "loss": metrics.get("train/loss", float("nan"))})
    timed = rows[a.warmup:]
    med = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
    peak = a.peak_tflops * 1e12
    gen_tokens, update_tokens, sample_s, update_s = med("gen_tokens"), med("update_tokens"), med("sample_s"), med("update_s")
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "smoke": a.smoke,
        "dtype": str(dtype).removeprefix("torch."), "params": n_params, "vision_params": n_vision,
        "prompts": a.prompts, "group": a.group, "max_new_tokens": a.max_new_tokens, "image_size": a.image_size,
        "image_tokens": image_tokens, "micro_batch": a.micro_batch, "steps": a.steps, "warmup": a.warmup,
        "build_s": round(build_s, 2),
        "sample_s": round(sample_s, 3), "update_s": round(update_s, 3),
        "gen_tokens_per_step": gen_tokens, "update_tokens_per_step": update_tokens,
        "rollout_tokens_per_s": round(gen_tokens / sample_s, 1),
        "update_tokens_per_s": round(update_tokens / update_s, 1),
        "update_completion_tokens_per_s": round(gen_tokens / update_s, 1),
        "mfu": round(6 * n_params * update_tokens / update_s / peak, 4),
        "rollout_mfu": round(2 * n_params * (gen_tokens + med("prefill_tokens")) / sample_s / peak, 5),
        "peak_tflops": a.peak_tflops,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "step_s": [round(r["sample_s"] + r["update_s"], 3) for r in timed],
    }
    print(f"{n_params / 1e9:.2f}B params: rollout {result['rollout_tokens_per_s']:.0f} tok/s "
          f"(MFU {result['rollout_mfu']:.2%}), update {result['update_tokens_per_s']:.0f} tok/s "
          f"(MFU {result['mfu']:.1%}), {sample_s:.1f} + {update_s:.1f} s/step")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
