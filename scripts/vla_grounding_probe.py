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


def token_stats(policy, frames, shuffle: bool, seed: int = 0):
    """Mean NLL and argmax accuracy of the expert chunks (position dims 0-2 only for accuracy)."""
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
    return loss


def main() -> None:
    cfg = load_config(sys.argv[1], ["task.params.num_workers=0", "train.progress=false", "train.eval_every=0",
                                    "train.output_dir=/tmp/mmrl_probe", *sys.argv[2:]])
    t0, c0 = time.time(), time.process_time()
    task, policy = build(cfg)
    trainer = Trainer(cfg, policy, task)
    trainer.sft()
    sft_cpu = time.process_time() - c0
    frames = task.demo_frames()
    sample = [frames[i] for i in np.random.default_rng(1).choice(len(frames), min(128, len(frames)), replace=False)]
    out = {"sft_cpu_s": round(sft_cpu, 1), "frames": len(frames),
           "loss_own": token_stats(policy, sample, False), "loss_shuffled": token_stats(policy, sample, True)}
    n = cfg.train.eval_size
    task.eval_mode = "both"
    res = task.evaluate(policy, n)
    out.update({k: round(v, 3) for k, v in res.items() if k.endswith("/success") or k.endswith("episode_len")})
    out["cpu_s"] = round(time.process_time() - c0, 1)
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
