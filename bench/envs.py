"""Benchmark the planning envs: vectorised batch steps vs a per-env Python loop, and the batched
frame parser vs a per-frame loop.

    python bench/envs.py            # B = 1024
    python bench/envs.py --smoke    # quick run (B = 64)

The last line printed is JSON: env_steps_per_s_{batched,loop}, env_speedup,
parser_fps_{batched,loop}, parser_speedup.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from mmrl.envs.planning import BatchPlanningEnv, generate_layouts, parse, parse_batch, render_state, step_state

TASK_MIX = (("frozenlake", 6), ("maze", 6), ("minibehavior", 6))


def make_layouts(batch: int, seed: int) -> list:
    per = -(-batch // len(TASK_MIX))
    pools = [generate_layouts(t, s, min(per, 200), seed=seed) for t, s in TASK_MIX]
    return [pools[i % len(pools)][(i // len(pools)) % len(pools[i % len(pools)])] for i in range(batch)]


def _timed(fn, min_time: float) -> tuple[float, int]:
    """Run fn repeatedly for at least min_time seconds; returns (seconds, calls)."""
    fn()  # warm-up (caches, lazy distance maps)
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= min_time:
            return dt, calls


def bench_env(layouts: list, steps: int, min_time: float, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    n_act = np.array([lay.n_actions for lay in layouts])
    actions = (rng.random((steps, len(layouts))) * n_act).astype(np.int64)
    env = BatchPlanningEnv(layouts, auto_reset=True)

    def batched() -> None:
        for a in actions:
            env.step(a)

    states = [lay.start_state() for lay in layouts]

    def loop() -> None:
        for a in actions:
            for i, lay in enumerate(layouts):
                s, _, done = step_state(lay, states[i], int(a[i]))
                states[i] = lay.start_state() if done else s

    tb, cb = _timed(batched, min_time)
    tl, cl = _timed(loop, min_time)
    n = steps * len(layouts)
    return n * cb / tb, n * cl / tl


def bench_parser(layouts: list, min_time: float) -> tuple[float, float]:
    frames = [render_state(lay) for lay in layouts]
    by_shape: dict = {}
    for f, lay in zip(frames, layouts):
        by_shape.setdefault(f.shape, ([], []))
        by_shape[f.shape][0].append(f)
        by_shape[f.shape][1].append(lay)
    groups = [(np.stack(fs), lays) for fs, lays in by_shape.values()]

    def batched() -> None:
        for fs, lays in groups:
            out = parse_batch(fs, lays)
            assert all(out), "bench frames must parse"

    def loop() -> None:
        for f, lay in zip(frames, layouts):
            parse(f, lay)

    tb, cb = _timed(batched, min_time)
    tl, cl = _timed(loop, min_time)
    return len(frames) * cb / tb, len(frames) * cl / tl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="quick run for tests")
    ap.add_argument("--batch", type=int, default=None, help="envs / frames per batch (default 1024; smoke 64)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed call (default 20; smoke 4)")
    ap.add_argument("--min-time", type=float, default=None, help="seconds per measurement (default 1; smoke 0.05)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    batch = args.batch or (64 if args.smoke else 1024)
    steps = args.steps or (4 if args.smoke else 20)
    min_time = args.min_time if args.min_time is not None else (0.05 if args.smoke else 1.0)

    layouts = make_layouts(batch, args.seed)
    sb, sl = bench_env(layouts, steps, min_time, args.seed)
    print(f"env steps/s  batched {sb:,.0f}  loop {sl:,.0f}  speedup {sb / sl:.1f}x  (B={batch})")
    pb, pl = bench_parser(layouts, min_time)
    print(f"parser fps   batched {pb:,.0f}  loop {pl:,.0f}  speedup {pb / pl:.1f}x  (B={batch})")
    print(json.dumps({
        "env_steps_per_s_batched": round(sb, 1),
        "env_steps_per_s_loop": round(sl, 1),
        "env_speedup": round(sb / sl, 2),
        "parser_fps_batched": round(pb, 1),
        "parser_fps_loop": round(pl, 1),
        "parser_speedup": round(pb / pl, 2),
    }))


if __name__ == "__main__":
    main()
