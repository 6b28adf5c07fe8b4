"""Benchmark: vectorised `compute_advantages('grpo', ...)` vs a straightforward per-group loop.

N = 65,536 responses, G = 8 per group (8,192 groups), one thread. Main case: the group ids are
dataset prompt indices (8,192 distinct ids drawn from 50,000, each repeated 8 times, shuffled),
which is what a trainer passes. Second case: 64-bit ids spread over ~1e9 (the hashing path).
Prints human lines, then (last line) JSON {"n", "vectorised_s", "loop_s", "speedup", "match",
"sparse64_vectorised_s", "sparse64_loop_s", "sparse64_speedup"}. Exits 1 if any result differs
from the loop. `--smoke`: N = 4,096, one repeat (for CI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from mmrl.algos import compute_advantages  # noqa: E402


def loop_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The obvious implementation: dict of group -> member indices, torch statistics per group."""
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids.tolist()):
        members[g].append(i)
    out = torch.zeros_like(rewards)
    for idx in members.values():
        if len(idx) < 2:
            continue
        sel = torch.tensor(idx)
        r = rewards[sel]
        if bool(r.max() == r.min()):
            continue
        out[sel] = (r - r.mean()) / (r.std() + eps)
    return out


def make_batch(
    n: int, group_size: int, seed: int = 0, sparse64: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n_groups = n // group_size
    if sparse64:  # distinct ids spread over ~1e9
        ids = torch.randperm(10 * n_groups, generator=gen)[:n_groups] * 7919 + 123_456_789
    else:  # prompt indices of a dataset of max(50_000, 2 * n_groups) prompts
        ids = torch.randperm(max(50_000, 2 * n_groups), generator=gen)[:n_groups]
    ids = ids.repeat_interleave(group_size)
    ids = ids[torch.randperm(n, generator=gen)]
    rewards = torch.randint(0, 2, (n,), generator=gen).float()
    rewards += 0.5 * torch.rand(n, generator=gen) * (torch.rand(n, generator=gen) < 0.3)
    return rewards, ids


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="N=4096, one repeat")
    ap.add_argument("--n", type=int, default=65_536)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n, repeats = (4096, 1) if args.smoke else (args.n, args.repeats)

    torch.set_num_threads(1)
    result: dict[str, object] = {"n": n}
    all_match = True
    for label, sparse64 in (("dataset-index ids", False), ("sparse 64-bit ids", True)):
        rewards, ids = make_batch(n, args.group_size, sparse64=sparse64)
        compute_advantages("grpo", rewards, ids)  # warm-up (allocator, dispatch caches)
        vec_s, vec = timed(lambda: compute_advantages("grpo", rewards, ids), max(repeats, 3) * 10)
        loop_s, ref = timed(lambda: loop_grpo(rewards, ids), repeats)
        match = bool(torch.allclose(vec, ref, atol=1e-5, rtol=1e-5))
        all_match &= match
        speedup = loop_s / vec_s
        print(
            f"grpo advantages, N={n} ({n // args.group_size} groups of {args.group_size}, {label}), "
            f"1 thread: vectorised {vec_s * 1e3:.3f} ms, per-group loop {loop_s * 1e3:.1f} ms, "
            f"speedup {speedup:.0f}x, results {'match' if match else 'DIFFER'}"
        )
        prefix = "sparse64_" if sparse64 else ""
        result.update({f"{prefix}vectorised_s": vec_s, f"{prefix}loop_s": loop_s, f"{prefix}speedup": speedup})
    result["match"] = all_match
    print(json.dumps(result))
    return 0 if all_match else 1


if __name__ == "__main__":
    raise SystemExit(main())
