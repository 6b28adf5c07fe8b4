"""Robot rollout throughput: env steps per second with 1 worker process vs N, on the MuJoCo
tabletop task and on LIBERO, driven by random 8-step action chunks (`VectorEnv.step_chunk`).

    python bench/vla_rollout.py                 # 8 tabletop envs, 3 x 88 steps; 4 LIBERO envs, 16 steps
    python bench/vla_rollout.py --smoke         # small and quick (a CI test runs it)
    python bench/vla_rollout.py --no-libero

The last line printed is JSON: for each backend, steps/s with 1 worker and with N, their ratio
(`speedup`), plus tabletop steps/s with single-step IPC (`step`) for comparison with chunks.
Env construction and reset are not timed (LIBERO builds in seconds); only stepping is.

`overlap` times training-step-shaped rounds (reset, a few chunks, then `--update-s` seconds
standing in for the policy update) with and without `reset_async` (the next round's reset started
right after the rollout, so the workers reset while the update runs), and reports the seconds a
step saves. `--update-kind busy` (default) keeps this process's CPU busy, as a CPU update does;
`idle` sleeps, as the host does while a GPU runs the update.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import numpy as np
from mmrl.envs.vector import VectorEnv


def _run(env_fns: list, workers: int, steps: int, chunk: int, seed: int, rounds: int = 1,
         single_step: bool = False) -> float:
    """Env steps per second over `rounds` episodes of `steps` steps per env (resets not timed),
    after one warm-up chunk per episode."""
    rng = np.random.default_rng(seed)
    n = len(env_fns)
    executed, elapsed = 0, 0.0
    with VectorEnv(env_fns, num_workers=workers, start_timeout_s=600, reset_timeout_s=600) as vec:
        for r in range(rounds):
            vec.reset(seeds=[r * n + i for i in range(n)], init_state_ids=[r * n + i for i in range(n)])
            vec.step_chunk(rng.uniform(-1, 1, (n, chunk, 7)))  # warm-up: lazy renderers, caches
            t0 = time.perf_counter()
            for _ in range(max(steps // chunk, 1)):
                if single_step:
                    for _ in range(chunk):
                        executed += int((~vec.done).sum())  # finished envs are not stepped
                        out = vec.step(rng.uniform(-1, 1, (n, 7)))
                else:
                    out = vec.step_chunk(rng.uniform(-1, 1, (n, chunk, 7)))
                    executed += sum(i.get("steps_executed", 0) for i in out.info)
                if out.done.all():
                    break
            elapsed += time.perf_counter() - t0
    return executed / elapsed


def _busy(seconds: float) -> None:
    """CPU work in this process (like a policy update on the CPU): the workers compete with it."""
    a = np.random.default_rng(0).standard_normal((64, 64))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = np.tanh(a @ a.T * 0.01)


def _rounds(vec, rounds: int, chunks: int, chunk: int, update, prefetch: bool, seed: int) -> float:
    """Mean wall seconds of a round: reset + `chunks` step_chunks + the update."""
    rng = np.random.default_rng(seed)
    n = vec.num_envs
    ids = lambda r: [1000 * seed + r * n + i for i in range(n)]  # noqa: E731
    t0 = time.perf_counter()
    for r in range(rounds):
        vec.reset(init_state_ids=ids(r))
        for _ in range(chunks):
            vec.step_chunk(rng.uniform(-1, 1, (n, chunk, 7)))
        if prefetch:
            vec.reset_async(init_state_ids=ids(r + 1))
        update()
    return (time.perf_counter() - t0) / rounds


def bench_overlap(name: str, env_fns: list, workers: int, rounds: int, chunks: int, chunk: int, update_s: float,
                  seed: int, update_kind: str = "busy") -> dict:
    update = partial(_busy if update_kind == "busy" else time.sleep, update_s)
    with VectorEnv(env_fns, num_workers=workers, start_timeout_s=600, reset_timeout_s=600) as vec:
        vec.reset(init_state_ids=list(range(vec.num_envs)))
        vec.step_chunk(np.zeros((vec.num_envs, chunk, 7)))  # warm-up: lazy renderers
        t = time.perf_counter()
        vec.reset(init_state_ids=list(range(vec.num_envs)))
        reset_s = time.perf_counter() - t
        serial = _rounds(vec, rounds, chunks, chunk, update, False, seed)
        overlapped = _rounds(vec, rounds, chunks, chunk, update, True, seed + 1)
    out = {"envs": len(env_fns), "workers": workers, "rounds": rounds, "chunks": chunks, "update_s": update_s,
           "update_kind": update_kind,
           "reset_s": round(reset_s, 3), "step_s_serial": round(serial, 3), "step_s_overlapped": round(overlapped, 3),
           "saved_s_per_step": round(serial - overlapped, 3)}
    print(f"{name} overlap: {json.dumps(out)}", flush=True)
    return out


def bench_backend(name: str, env_fns: list, workers: int, steps: int, chunk: int, seed: int, rounds: int = 1,
                  with_single_step: bool = False) -> dict:
    one = _run(env_fns, 1, steps, chunk, seed, rounds)
    many = _run(env_fns, workers, steps, chunk, seed, rounds)
    out = {"envs": len(env_fns), "workers": workers, "steps": steps, "chunk": chunk, "rounds": rounds,
           "steps_per_s_1w": round(one, 2), "steps_per_s_nw": round(many, 2), "speedup": round(many / one, 3)}
    if with_single_step:
        out["steps_per_s_nw_single_step"] = round(_run(env_fns, workers, steps, chunk, seed, rounds, True), 2)
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small sizes for a quick check")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--task", default="pick_place", help="tabletop task (pick_place has the longest budget)")
    p.add_argument("--envs", type=int, default=None, help="tabletop envs (default 8, smoke 2)")
    p.add_argument("--steps", type=int, default=None, help="tabletop steps per env and episode (default 88, smoke 16)")
    p.add_argument("--rounds", type=int, default=None, help="tabletop episodes per measurement (default 3, smoke 1)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--no-libero", action="store_true")
    p.add_argument("--libero-envs", type=int, default=None, help="LIBERO envs (default 4, smoke 2)")
    p.add_argument("--libero-steps", type=int, default=None, help="LIBERO steps per env (default 16, smoke 8)")
    p.add_argument("--libero-image-size", type=int, default=None, help="default 128, smoke 64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--update-s", type=float, default=None, help="the stand-in update per step (default 1.0, smoke 0.2)")
    p.add_argument("--overlap-rounds", type=int, default=None, help="steps per overlap measurement (default 4, smoke 2)")
    p.add_argument("--update-kind", choices=("busy", "idle"), default="busy",
                   help="the stand-in update: busy CPU (a CPU update) or a sleep (a GPU update)")
    p.add_argument("--no-throughput", action="store_true", help="only the overlap measurement")
    args = p.parse_args(argv)
    smoke = args.smoke
    envs = args.envs or (2 if smoke else 8)
    steps = args.steps or (16 if smoke else 88)  # pick_place truncates at 96 = warm-up chunk + 88
    rounds = args.rounds or (1 if smoke else 3)

    from mmrl.envs.tabletop import make_tabletop_env

    result: dict = {"smoke": smoke, "cpu_count": os.cpu_count()}
    fns = [partial(make_tabletop_env, args.task, image_size=args.image_size)] * envs
    result["mujoco"] = {"task": args.task, "image_size": args.image_size}
    if not args.no_throughput:
        result["mujoco"].update(bench_backend("mujoco", fns, args.workers, steps, args.chunk, args.seed, rounds,
                                              with_single_step=True))
    update_s = args.update_s if args.update_s is not None else (0.2 if smoke else 1.0)
    o_rounds = args.overlap_rounds or (2 if smoke else 4)
    result["mujoco"]["overlap"] = bench_overlap("mujoco", fns, args.workers, o_rounds, 2, args.chunk, update_s,
                                                args.seed, args.update_kind)

    if args.no_libero:
        result["libero"] = {"skipped": "--no-libero"}
    else:
        try:
            from mmrl.envs.libero.env import default_assets_dir, make_libero_env

            if not (default_assets_dir() / "scenes").is_dir():
                raise FileNotFoundError(f"LIBERO assets not at {default_assets_dir()}")
        except (ImportError, FileNotFoundError) as exc:
            result["libero"] = {"skipped": f"{type(exc).__name__}: {exc}"}
        else:
            n = args.libero_envs or (2 if smoke else 4)
            size = args.libero_image_size or (64 if smoke else 128)
            lsteps = args.libero_steps or (8 if smoke else 16)
            lfns = [partial(make_libero_env, "libero_spatial", i % 10, image_size=size, settle_steps=0)
                    for i in range(n)]
            result["libero"] = {"suite": "libero_spatial", "image_size": size}
            if not args.no_throughput:
                result["libero"].update(bench_backend("libero", lfns, args.workers, lsteps, args.chunk, args.seed))
            if not smoke or args.no_throughput:  # LIBERO resets take seconds: not in the CI smoke run
                result["libero"]["overlap"] = bench_overlap("libero", lfns, args.workers, o_rounds, 1, args.chunk,
                                                            update_s, args.seed, args.update_kind)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
