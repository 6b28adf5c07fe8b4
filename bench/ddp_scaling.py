"""Multi-process training throughput: training steps per second at 1 and 2 ranks under torchrun.

The tiny text task of configs/digit_sort_grpo.yaml (GRPO on sorting 5 digits, a 2-layer Qwen2 of
hidden size 128), no SFT and no evaluation, one thread per rank. For each world size N in (1, 2)
the script launches itself as N processes:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node N \\
        bench/ddp_scaling.py --worker ...

(world size 1 too, so both sides pay the same launcher and process start; neither is timed, and a
world of 1 is the single-process trainer: no process group, nothing to all-reduce). Each rank
builds the trainer as `mmrl train` does (`mmrl.distributed.setup`, then `mmrl.build`, then
`Trainer(..., dist=...)`), runs `--warmup` steps, then, after a barrier, times `--steps` steps of
the training loop (`train_step()` and the metrics reduction `Trainer.train` does after each) up to a
final barrier, on rank 0's `time.perf_counter()`; each rank also sums its `time.process_time()`.

Each rank samples `train.prompts_per_step` prompts x `sampling.group_size` completions per step, so
N ranks train on N times the batch per step (weak scaling). Hence:

* `samples_per_s` = steps x world x prompts_per_step x group_size / seconds: the throughput;
  `rows_per_step` is the number of completions the ranks actually trained on per step (summed
  over ranks), which must equal world x prompts_per_step x group_size;
* `samples_per_s_ratio_2_vs_1`: how much more the run learns from per second with 2 ranks;
* `steps_per_s_ratio_2_vs_1`: how much slower each step gets with 2 ranks.

How to read it: with one core per rank (a 2-core machine and 2 ranks: each rank gets one core),
the ideal samples/s ratio is 2 and the ideal steps/s ratio is 1, since each rank does the same
per-step work as the single process. The gap from the ideal is the all-reduce of the gradients
(with `--fsdp`: FSDP2's all-gathers of the parameters and reduce-scatter of the gradients), the
gathers for the advantages and the metrics, ranks waiting for the slowest one's sampling (the
completions differ in length), and the ranks sharing the machine (memory bandwidth, and any other
job: `cpu_count` and `load_avg_1min` are reported; on a machine with fewer free cores than ranks the
ratios say little). `cpu_s_per_step` is a rank's process CPU time per step (the mean over ranks): at
2 ranks, what it costs above the 1-rank figure is the communication's CPU work.

    python bench/ddp_scaling.py                  # 10 timed steps per world size, replicated policy
    python bench/ddp_scaling.py --fsdp           # the policy sharded with FSDP2 instead
    python bench/ddp_scaling.py --fsdp --device cuda   # 2 GPUs, nccl
    python bench/ddp_scaling.py --smoke          # 2 steps of 2 prompts, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "digit_sort_grpo.yaml"


def overrides(args, out_dir: str) -> list[str]:
    o = ["sft.steps=0", "train.eval_every=0", "train.progress=false", f"train.device={args.device}",
         "train.threads=1", f"train.output_dir={out_dir}", f"train.fsdp={'true' if args.fsdp else 'false'}"]
    if args.prompts:
        o.append(f"train.prompts_per_step={args.prompts}")
    return o


def worker(args) -> None:
    """One rank: build the trainer as `mmrl train` does, warm up, time the steps; rank 0 writes the result."""
    import torch

    import mmrl
    from mmrl import distributed
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(CONFIG, overrides(args, tmp))
        d = distributed.setup(args.device, 600, args.fsdp)
        task, policy = mmrl.build(cfg)
        trainer = Trainer(cfg, policy, task, dist=d)
        rows: list[int] = []
        collect = trainer.collect

        def counting_collect():
            rollout, stats = collect()
            rows.append(len(rollout))
            return rollout, stats

        trainer.collect = counting_collect

        def step() -> None:  # one iteration of Trainer._train_loop, without logging or evaluation
            distributed.reduce_metrics(d, trainer.train_step())
            trainer.step += 1

        for _ in range(args.warmup):
            step()
        rows.clear()
        distributed.barrier(d)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        cpu_s = time.process_time() - c0
        distributed.barrier(d)
        seconds = time.perf_counter() - t0
        cpu_per_rank = [c[0] / 1e6 for c in distributed.all_gather_ints(d, [round(cpu_s * 1e6)])]
        rows_total = sum(r[0] for r in distributed.all_gather_ints(d, [sum(rows)]))
        if d.is_main:
            P, G = cfg.train.prompts_per_step, cfg.sampling.group_size
            result = {
                "world": d.world, "fsdp": args.fsdp, "device": args.device, "steps": len(rows),
                "warmup": args.warmup, "prompts_per_step": P, "group_size": G, "seconds": round(seconds, 4),
                "steps_per_s": round(len(rows) / seconds, 6),
                "samples_per_s": round(len(rows) * d.world * P * G / seconds, 4),
                "rows_per_step": rows_total / max(len(rows), 1),
                "cpu_s_per_step": round(sum(cpu_per_rank) / len(cpu_per_rank) / max(len(rows), 1), 5),
            }
            Path(args.result).write_text(json.dumps(result))
        if d.active:
            import torch.distributed as tdist

            # Every rank done before any tears gloo down: a rank destroying its group while its peer's
            # connection is still live aborted ("terminate called without an active exception") once in CI.
            distributed.barrier(d)
            tdist.destroy_process_group()


def run_world(args, world: int) -> dict:
    """Launch `world` ranks of this script under torchrun; returns rank 0's result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "--max-restarts=0", str(Path(__file__).resolve()), "--worker", "--result", str(result),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
               *(["--prompts", str(args.prompts)] if args.prompts else []), *(["--fsdp"] if args.fsdp else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0 or not result.exists():
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"{world}-rank run failed (exit {proc.returncode})")
        return json.loads(result.read_text())


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="2 timed steps of 2 prompts per rank")
    p.add_argument("--fsdp", action="store_true", help="shard the policy with FSDP2 instead of replicating it")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo ranks; cuda: one GPU per rank, nccl (needs 2 GPUs)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per world size")
    p.add_argument("--warmup", type=int, default=1, help="untimed training steps first")
    p.add_argument("--prompts", type=int, default=0, help="train.prompts_per_step per rank (default: the config's)")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.prompts = 2, args.prompts or 2
    if args.worker:
        worker(args)
        return None

    res = {w: run_world(args, w) for w in (1, 2)}
    one, two = res[1], res[2]
    summary = {
        "world_1": one, "world_2": two,
        "samples_per_s_ratio_2_vs_1": round(two["samples_per_s"] / one["samples_per_s"], 6),
        "steps_per_s_ratio_2_vs_1": round(two["steps_per_s"] / one["steps_per_s"], 6),
        "cpu_count": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2),
        "fsdp": args.fsdp, "device": args.device, "config": str(CONFIG.relative_to(ROOT)),
    }
    for w in (1, 2):
        print(f"{w} rank{'s' if w > 1 else ''}: {res[w]['steps_per_s']:.3f} steps/s, "
              f"{res[w]['samples_per_s']:.1f} samples/s, {res[w]['cpu_s_per_step']:.3f} CPU-s/step per rank")
    print(f"2 vs 1 ranks: samples/s x{summary['samples_per_s_ratio_2_vs_1']:.2f} (ideal 2), "
          f"steps/s x{summary['steps_per_s_ratio_2_vs_1']:.2f} (ideal 1); {summary['cpu_count']} CPUs, "
          f"load {summary['load_avg_1min']}")
    line = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return summary


if __name__ == "__main__":
    main()
