"""The VPRL paper's comparison: the VPRL main job (stage-1 SFT + GRPO) against VPFT (SFT on optimal moves
alone, cosine learning rate) given the same training CPU-seconds, over several seeds.

    python bench/vprl_equal_cpu.py --seeds 0 1 2 3 4      # ~9 CPU-min per seed, one thread each
    python bench/vprl_equal_cpu.py --smoke                # tiny run of the same path (CI)
    python bench/vprl_equal_cpu.py --seeds 0 train.steps=100   # key=value: overrides of the main job only
    python bench/vprl_equal_cpu.py --config configs/vprl_maze_grpo.yaml --seeds 0   # another task

For each seed it runs the main config (`--config`) as `mmrl train` does, reads how many CPU-s its
stage 1 took, and converts the whole run's training CPU-s (evaluations excluded) into SFT steps at
that measured rate: VPFT steps = stage-1 steps x total CPU-s / stage-1 CPU-s. Both arms' SFT steps
cost the same (same model, batch, data), so the conversion does not depend on how loaded the machine
is, as long as the load stays the same through one run. VPFT (the main config's SFT stage on
optimal moves without GRPO, or `--vpft-config`) then trains for that many steps with its learning
rate decayed to the end (an annealed baseline is the stronger one).
Writes `equal_cpu.md` (per-seed EM / PR table and means) and `equal_cpu.json` (the same, plus
whether GRPO ended above both its stage 1 and VPFT, per seed) to `--out`; the last line printed is
the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from mmrl.checkpoint import atomic_write_text
from mmrl.cli import run_training
from mmrl.config import RunConfig, load_config

SMOKE = ["sft.steps=20", "train.steps=2", "train.eval_size=12", "train.eval_every=0", "train.prompts_per_step=4",
         "model.params.vq_steps=20", "model.params.vq_layouts=10", "task.params.n_train=30", "task.params.n_test=4"]


def _run(config: str, overrides: list[str]) -> tuple[RunConfig, dict, float, float]:
    """Train like `mmrl train`; returns (config, results, training CPU-s without evaluations, stage-1 CPU-s)."""
    cfg = load_config(config, overrides)
    task, results, cpu_s, _ = run_training(cfg, resume=False)
    rows = [json.loads(line) for line in (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()]
    sft_cpu = next((r["sft/cpu_s"] for r in rows if "sft/cpu_s" in r), 0.0)
    return cfg, results, task.training_cpu_s(cpu_s), sft_cpu


def _em_pr(evaluation: dict) -> tuple[float, float]:
    return 100 * evaluation["eval/exact_match"], 100 * evaluation["eval/progress_rate"]


def compare_seed(seed: int, config: str, vpft_config: str | None, out: Path, extra: list[str],
                 main_overrides: list[str]) -> dict:
    common = [f"train.seed={seed}", "train.progress=false"] + extra
    main_cfg, main, main_cpu, sft_cpu = _run(config, common + main_overrides + [f"train.output_dir={out / f'grpo_s{seed}'}"])
    sft_steps = main_cfg.sft.steps
    if sft_steps <= 0 or sft_cpu <= 0:
        raise ValueError(f"{config}: the main job needs a stage 1 (sft.steps > 0) to measure the SFT rate")
    vpft_steps = max(1, round(sft_steps * main_cpu / sft_cpu))
    # Without a VPFT config of its own, VPFT is the main config's SFT stage on optimal moves alone.
    pure = [] if vpft_config else ["task.params.sft_mode=optimal", "task.params.sft_random_move_prob=0.0"]
    _, vpft, vpft_cpu, _ = _run(vpft_config or config, common + pure + [
        f"sft.steps={vpft_steps}", "sft.lr_schedule=cosine", "train.steps=0", f"train.output_dir={out / f'vpft_s{seed}'}"])
    return {
        "seed": seed, "stage1": _em_pr(main["eval_before"]), "grpo": _em_pr(main["eval_after"]),
        "vpft": _em_pr(vpft["eval_after"]), "grpo_cpu_s": main_cpu, "stage1_cpu_s": sft_cpu,
        "vpft_cpu_s": vpft_cpu, "vpft_steps": vpft_steps, "grpo_steps": main["eval_after"]["step"],
    }


def markdown(rows: list[dict], mean: dict[str, list[float]]) -> str:
    lines = ["| seed | stage 1 EM / PR | stage 1 + GRPO EM / PR | VPFT (cosine) EM / PR | CPU-s GRPO run / VPFT | VPFT steps |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['stage1'][0]:.1f} / {r['stage1'][1]:.1f} | {r['grpo'][0]:.1f} / {r['grpo'][1]:.1f} | "
                     f"{r['vpft'][0]:.1f} / {r['vpft'][1]:.1f} | {r['grpo_cpu_s']:.0f} / {r['vpft_cpu_s']:.0f} | {r['vpft_steps']} |")
    lines.append(f"| mean of {len(rows)} | {mean['stage1'][0]:.1f} / {mean['stage1'][1]:.1f} | "
                 f"{mean['grpo'][0]:.1f} / {mean['grpo'][1]:.1f} | {mean['vpft'][0]:.1f} / {mean['vpft'][1]:.1f} | | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/vprl_frozenlake_grpo.yaml")
    ap.add_argument("--vpft-config", default=None,
                    help="VPFT's own config (default: --config's SFT stage on optimal moves, without GRPO)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default="runs/vprl_equal_cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny models and budgets: checks the path, not the result")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the main job (not of VPFT)")
    args = ap.parse_args()
    out = Path(args.out)
    extra = SMOKE if args.smoke else []
    rows = [compare_seed(s, args.config, args.vpft_config, out, extra, args.overrides) for s in args.seeds]
    above = {k: [r["grpo"][i] > max(r["stage1"][i], r["vpft"][i]) for r in rows] for i, k in enumerate(("em", "pr"))}
    mean = {k: np.mean([r[k] for r in rows], axis=0).tolist() for k in ("stage1", "grpo", "vpft")}
    result = {"rows": rows, "grpo_above_both_em": above["em"], "grpo_above_both_pr": above["pr"], "mean": mean}
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, mean)
    atomic_write_text(out / "equal_cpu.md", table)
    atomic_write_text(out / "equal_cpu.json", json.dumps(result, indent=2))
    print(table, end="")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
