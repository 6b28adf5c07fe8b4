"""Streaming video generator throughput on a GPU: a Wan2.1-1.3B-sized `CausalWan` (random weights,
bf16) generating and training chunk by chunk, as the `video_gen` policy does.

Sizes (Wan2.1-T2V-1.3B's transformer config): 30 layers, 12 heads of 128 (width 1536), FFN 8960,
16 latent channels, patch (1, 2, 2), text width 4096 (random prompt embeddings of 64 tokens). The
latent video is `--frames` latent frames of `--height` x `--width` (default 21 x 30 x 52, Wan's VAE
at 240 x 416), in chunks of 3 latent frames (Self-Forcing's), `--steps` denoising steps per chunk.

* rollout: the cached chunk loop (`forward_chunk` per step, one cache write per chunk);
  `rollout_chunks_per_s` and `rollout_latent_frames_per_s`.
* update: one Flow-GRPO step's backward, one denoising step at a time (`train.unit_chunk`-style):
  `forward_teacher_forced` over [clean ; noisy] for the whole video with the gradient, a loss on
  the velocity, backward, AdamW; `update_steps_per_s` = denoising steps trained per second.
* `peak_mem_gib`: the largest allocated CUDA memory.

Medians over `--repeats` after one warm-up. The last line is JSON.

    python bench/gpu_video.py            # on a GPU machine
    python bench/gpu_video.py --smoke    # tiny sizes on the CPU (CI runs this)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mmrl.flow import flow_timesteps
from mmrl.policies.video.causal_wan import CausalWan, stream_ode

LARGE = dict(num_layers=30, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, in_channels=16,
             out_channels=16, text_dim=4096, freq_dim=256, patch_size=(1, 2, 2))
SMOKE = dict(num_layers=1, num_attention_heads=2, attention_head_dim=8, ffn_dim=32, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=16, patch_size=(1, 2, 2))


def build(sizes: dict, chunk_frames: int, device, dtype) -> CausalWan:
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel(cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                                        rope_max_seq_len=1024, **sizes)
    return CausalWan(transformer, chunk_frames).to(device=device, dtype=dtype)


def update(model, opt, video, noise, text, ts):
    opt.zero_grad(set_to_none=True)
    for j in range(len(ts) - 1):  # one denoising step's graph alive at a time
        x_t = (1 - ts[j]) * video + ts[j] * noise
        v = model.forward_teacher_forced(video, x_t, ts[j], text)
        v.float().pow(2).mean().backward()
    opt.step()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--frames", type=int, default=21)
    p.add_argument("--height", type=int, default=30)
    p.add_argument("--width", type=int, default=52)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = SMOKE if args.smoke else LARGE
    if args.smoke:
        args.frames, args.height, args.width, args.steps, args.repeats = 6, 8, 8, 2, 1
        torch.set_num_threads(1)
    cf = 3
    torch.manual_seed(0)
    model = build(sizes, cf, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    noise = torch.randn(args.batch, sizes["in_channels"], args.frames, args.height, args.width, device=device, dtype=dtype)
    text = torch.randn(args.batch, 64, sizes["text_dim"], device=device, dtype=dtype)
    ts = flow_timesteps(args.steps).tolist()

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    with torch.no_grad():
        _, video = timed(lambda: stream_ode(model, noise, text, ts))  # warm-up
        roll = [timed(lambda: stream_ode(model, noise, text, ts))[0] for _ in range(args.repeats)]
    timed(lambda: update(model, opt, video, noise, text, ts))  # warm-up
    upd = [timed(lambda: update(model, opt, video, noise, text, ts))[0] for _ in range(args.repeats)]
    chunks = args.frames // cf
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "params": params,
              "latent": [args.frames, args.height, args.width], "chunk_frames": cf, "steps": args.steps,
              "batch": args.batch, "rollout_s": statistics.median(roll), "update_s": statistics.median(upd),
              "rollout_chunks_per_s": args.batch * chunks / statistics.median(roll),
              "rollout_latent_frames_per_s": args.batch * args.frames / statistics.median(roll),
              "update_steps_per_s": args.batch * args.steps / statistics.median(upd),
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else 0.0}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
