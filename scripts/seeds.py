"""Run one config over several seeds and report each held-out metric as mean +- spread.

    python scripts/seeds.py CONFIG --seeds 0 1 2 3 4 [--jobs 2] [--metrics eval/exact_match ...] [key=value ...]

Each seed is its own `mmrl train CONFIG train.seed=S train.output_dir=OUT/sS` process (a fresh
process per run, as a user runs it), `--jobs` at a time; a seed whose folder already holds a
finished run is read, not run again. Writes OUT/seeds.json and OUT/seeds.md (default OUT:
runs/seeds/<config name>): per metric, before RL (after SFT) and after it, the mean, the sample
standard deviation and the range over seeds, and every seed's value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_seed(config: str, seed: int, out: Path, overrides: list[str]) -> dict:
    run = out / f"s{seed}"
    if not (run / "results.json").is_file():
        cmd = [sys.executable, "-m", "mmrl.cli", "train", config, *overrides, f"train.seed={seed}",
               f"train.output_dir={run}", "train.progress=false"]
        run.mkdir(parents=True, exist_ok=True)
        with (out / f"s{seed}.log").open("w") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"seed {seed} failed (exit {done.returncode}); see {out / f's{seed}.log'}")
    return json.loads((run / "results.json").read_text())


def summarize(results: dict[int, dict], metrics: list[str]) -> dict:
    """{metric: {stage: {mean, sd, min, max, by_seed}}} for stage in before / after."""
    table: dict = {}
    for metric in metrics:
        for stage, key in (("before", "eval_before"), ("after", "eval_after")):
            vals = {s: r[key][metric] for s, r in results.items() if isinstance(r[key].get(metric), (int, float))}
            if not vals:
                continue
            v = list(vals.values())
            table.setdefault(metric, {})[stage] = {
                "mean": statistics.fmean(v), "sd": statistics.stdev(v) if len(v) > 1 else 0.0,
                "min": min(v), "max": max(v), "by_seed": vals}
    return table


def markdown(table: dict, scale: float) -> str:
    def f(x: float) -> str:
        return f"{scale * x:.1f}" if scale != 1 else f"{x:.3f}"

    lines = ["| metric | stage | mean +- sd | range | by seed |", "| --- | --- | ---: | ---: | --- |"]
    for metric, stages in table.items():
        for stage, s in stages.items():
            seeds = ", ".join(f"{k}: {f(v)}" for k, v in s["by_seed"].items())
            lines.append(f"| {metric} | {stage} | {f(s['mean'])} +- {f(s['sd'])} | {f(s['min'])}-{f(s['max'])} | {seeds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value, applied to every seed")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each with train.threads=1)")
    p.add_argument("--metrics", nargs="+", default=None, help="eval/* keys (default: every numeric one)")
    p.add_argument("--percent", action="store_true", help="print values x100")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    out = Path(a.out or Path("runs") / "seeds" / Path(a.config).stem)
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        runs = list(pool.map(lambda s: run_seed(a.config, s, out, a.overrides), a.seeds))
    results = dict(zip(a.seeds, runs))
    metrics = a.metrics or sorted(k for k, v in runs[0]["eval_after"].items()
                                  if k.startswith("eval/") and isinstance(v, (int, float)))
    table = summarize(results, metrics)
    (out / "seeds.json").write_text(json.dumps({"config": a.config, "overrides": a.overrides, "seeds": a.seeds,
                                                "metrics": table}, indent=2))
    md = markdown(table, 100.0 if a.percent else 1.0)
    (out / "seeds.md").write_text(md)
    print(md, end="")
    print(f"written: {out / 'seeds.json'}, {out / 'seeds.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
