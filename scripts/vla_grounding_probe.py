"""Probe the SFT warm start of a VLA demo config: does the policy use the image, and how often
does it succeed on held-out states? Usage:

    .venv/bin/python scripts/vla_grounding_probe.py configs/vla_tabletop_grpo.yaml [key=value ...]

Prints SFT loss and token accuracy on demo frames with their own vs shuffled images (a grounded
policy is clearly worse with shuffled images), then greedy and sampled held-out success, and the
process CPU seconds (num_workers=0 keeps every env in this process)."""

import json
import sys
import time

import numpy as np
import torch

from mmrl import build
from mmrl.config import load_config
from mmrl.trainer import Trainer


def token_stats(policy, frames, shuffle: bool, seed: int = 0) -> tuple[float, list[float]]:
    """Mean NLL per action token of the expert chunks, and the mean NLL of each action dimension
    (the position dims 0-2 are the ones a reach needs the image for; the mean hides them among the
    constant dims)."""
    from mmrl.policies.vla.processor import parse_sft_context

    rng = np.random.default_rng(seed)
    frames = [dict(f) for f in frames]
    if shuffle:
        perm = rng.permutation(len(frames))
        imgs = [frames[i]["images"] for i in perm]
        for f, im in zip(frames, imgs):
            f["images"] = im
    with torch.no_grad():
        policy.model.eval()
        loss = float(policy.sft_loss(frames))
        p, A = policy, policy.action_dim
        ex = [parse_sft_context(c, i, p.cameras, A, p.chunk_size) for i, c in enumerate(frames)]
        tokens = p.actions_to_tokens(torch.stack([e.actions for e in ex]))
        valid = torch.stack([e.valid for e in ex])  # [B, K] chunk steps that exist
        enc = p.encode(p._vl_contexts([e.images for e in ex], [e.instruction for e in ex]))
        logp, _ = p._chunk_logprobs(p.model, enc, tokens, False, temperature=1.0)
        nll = -logp.reshape(len(ex), -1, A)  # [B, K, A]
        by_dim = (nll * valid[..., None]).sum((0, 1)) / valid.sum().clamp_min(1)
    return loss, [round(float(x), 5) for x in by_dim]


def main() -> None:
    cfg = load_config(sys.argv[1], ["task.params.num_workers=0", "train.progress=false", "train.eval_every=0",
                                    "train.output_dir=runs/grounding_probe", *sys.argv[2:]])
    t0, c0 = time.time(), time.process_time()
    task, policy = build(cfg)
    trainer = Trainer(cfg, policy, task)
    trainer.sft()
    sft_cpu = time.process_time() - c0
    frames = task.demo_frames()
    sample = [frames[i] for i in np.random.default_rng(1).choice(len(frames), min(128, len(frames)), replace=False)]
    (own, own_dims), (shuffled, shuffled_dims) = token_stats(policy, sample, False), token_stats(policy, sample, True)
    out = {"sft_cpu_s": round(sft_cpu, 1), "frames": len(frames), "loss_own": own, "loss_shuffled": shuffled,
           "loss_own_by_dim": own_dims, "loss_shuffled_by_dim": shuffled_dims}
    n = cfg.train.eval_size
    task.eval_mode = "both"
    res = task.evaluate(policy, n)
    out.update({k: round(v, 3) for k, v in res.items() if k.endswith("/success") or k.endswith("episode_len")})
    out["cpu_s"] = round(time.process_time() - c0, 1)
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
