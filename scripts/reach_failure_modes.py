"""Where a tabletop `reach` policy goes when it fails: for held-out states, which ball the gripper came
closest to (the named one, or a distractor), and whether that was the ball nearest the gripper's
start. Tells a policy that cannot find balls from one that finds them but not the named one.

    python scripts/reach_failure_modes.py RUN_DIR/final [--config CONFIG] [--episodes 64] [--temperature 0]

Prints one JSON object: success, reached_named (the named ball was the closest one the gripper came
to), reached_nearest_at_start, failure distances, and success and reach choice per named colour."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np
import torch

from mmrl import build, load_config
from mmrl.envs.tabletop.env import make_tabletop_env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--config", default="configs/vla_tabletop_random_grpo.yaml")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="train.seed: picks the held-out states")
    args = ap.parse_args()
    cfg = load_config(args.config, ["model.source=pretrained", f"model.path={args.checkpoint}", "sft.steps=0",
                                    f"train.seed={args.seed}"])
    task, policy = build(cfg)
    if list(task.tasks) != ["reach"]:
        raise SystemExit(f"this probe reads reach episodes; the config's tasks are {task.tasks}")
    generator = torch.Generator().manual_seed(0)
    p = cfg.task.params
    rows = []
    for ctx in task.test[:args.episodes]:
        env = make_tabletop_env("reach", image_size=p["image_size"], cameras=tuple(policy.cameras),
                                position_jitter=p.get("position_jitter"), layout_seed=p.get("layout_seed", 0))
        obs, info = env.reset(options={"init_state_id": ctx["init_state_id"]})
        colours = list(env.init_state.object_colors)  # ball 0 is the named one
        nearest_at_start = int(np.argmin(np.linalg.norm(env.object_pos - env.tcp_pos, axis=1)))
        closest = np.full(len(colours), np.inf)
        done = False
        for _ in range(policy.max_chunks):
            batch = {"images": {c: obs["images"][c][None] for c in policy.cameras}}
            actions = policy.act(batch, [info["instruction"]], generator, args.temperature).actions[0]
            for a in actions.numpy():
                obs, _, terminated, truncated, info = env.step(a)
                closest = np.minimum(closest, np.linalg.norm(env.object_pos - env.tcp_pos, axis=1))
                done = terminated or truncated
                if done:
                    break
            if done:
                break
        rows.append({"success": bool(info["success"]), "reached": int(np.argmin(closest)),
                     "nearest_at_start": nearest_at_start, "colours": colours,
                     "d_named": float(closest[0]), "d_distractor": float(closest[1:].min())})
        env.close()
    success = np.array([r["success"] for r in rows])
    reached = np.array([r["reached"] for r in rows])
    fail = ~success
    named = sorted({r["colours"][0] for r in rows})
    out = {
        "checkpoint": args.checkpoint, "episodes": len(rows), "temperature": args.temperature,
        "success": float(success.mean()),
        "reached_named": float((reached == 0).mean()),
        "reached_nearest_at_start": float((reached == np.array([r["nearest_at_start"] for r in rows])).mean()),
        "named_nearest_at_start": float(np.mean([r["nearest_at_start"] == 0 for r in rows])),
        "failures_closer_to_a_distractor": float(np.mean([r["d_distractor"] < r["d_named"] for r in rows if not r["success"]]))
        if fail.any() else None,
        "failure_median_distance_named": float(np.median([r["d_named"] for r in rows if not r["success"]]))
        if fail.any() else None,
        "success_by_named_colour": {c: float(np.mean([r["success"] for r in rows if r["colours"][0] == c])) for c in named},
        "reached_colour_counts": dict(Counter(r["colours"][r["reached"]] for r in rows)),
        "named_colour_counts": dict(Counter(r["colours"][0] for r in rows)),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
