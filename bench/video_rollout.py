"""Streaming generation with the KV cache against recomputing the history every chunk.

Both generate the same video the same way (each chunk denoised in K flow steps, attending to the
clean past chunks) with the same `CausalWan`:

* cached: `forward_chunk` against a `KVCache` of the past chunks (each chunk written once at t = 0);
* recompute: every denoising step runs `forward_teacher_forced` over [clean past chunks ; the
  current chunk], i.e. the history is re-encoded at every step of every chunk (what a generator
  without a cache does).

The two videos must agree (checked: `max_abs_diff`); `speedup` = recompute time / cached time.
Full attention over the history (no local window), so the recomputed prefix grows with the chunk
index, as in CausVid / Self-Forcing. The last line is JSON.

    python bench/video_rollout.py            # 12 chunks of 2 frames at 32x32 on the CPU (~1 min)
    python bench/video_rollout.py --smoke    # tiny, a few seconds (CI runs this)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mmrl.flow import flow_timesteps, ode_step
from mmrl.policies.video.causal_wan import build_tiny_wan, stream_ode


def recompute(model, noise, text, ts, cf):
    video = noise.clone()
    for k in range(noise.shape[2] // cf):
        sl = slice(k * cf, (k + 1) * cf)
        x = noise[:, :, sl]
        past = video[:, :, : k * cf]
        for j in range(len(ts) - 1):
            clean = torch.cat([past, x], 2)  # the current chunk's clean slot is masked from itself
            noisy = torch.cat([past, x], 2)
            t = torch.zeros(x.shape[0], k + 1)
            t[:, k] = ts[j]
            v = model.forward_teacher_forced(clean, noisy, t, text)[:, :, sl]
            x = ode_step(x, v, ts[j + 1] - ts[j])
        video[:, :, sl] = x
    return video


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--chunks", type=int, default=12)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args(argv)
    if args.smoke:
        args.chunks, args.size, args.steps, args.batch = 4, 8, 2, 2
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cf = 2
    model = build_tiny_wan(num_layers=2, num_heads=4, head_dim=16, ffn_dim=128, chunk_frames=cf,
                           rope_max_seq_len=max(32, args.chunks * cf)).eval()
    noise = torch.randn(args.batch, 3, args.chunks * cf, args.size, args.size)
    text = torch.randn(args.batch, 8, 32)
    ts = flow_timesteps(args.steps).tolist()
    with torch.no_grad():
        stream_ode(model, noise[:1, :, : 2 * cf], text[:1], ts)  # warm-up
        t0 = time.perf_counter()
        a = stream_ode(model, noise, text, ts)
        t_cached = time.perf_counter() - t0
        t0 = time.perf_counter()
        b = recompute(model, noise, text, ts, cf)
        t_recompute = time.perf_counter() - t0
    result = {"chunks": args.chunks, "frames_per_chunk": cf, "size": args.size, "steps": args.steps,
              "batch": args.batch, "cached_chunks_per_s": args.batch * args.chunks / t_cached,
              "recompute_chunks_per_s": args.batch * args.chunks / t_recompute,
              "speedup": t_recompute / t_cached, "max_abs_diff": float((a - b).abs().max())}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
