"""bench/ddp_scaling.py runs end to end at 1 and 2 gloo ranks (small N) and its figures add up."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]


def test_ddp_scaling_bench_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ddp_scaling.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = result["world_1"], result["world_2"]
    assert (one["world"], two["world"]) == (1, 2)
    for r in (one, two):
        assert r["steps"] == 2  # the smoke's timed steps, on every world size
        assert r["steps_per_s"] > 0 and r["samples_per_s"] > 0 and r["cpu_s_per_step"] > 0
        assert r["prompts_per_step"] == 2
        # the completions trained on per step, counted over the ranks: each rank its own whole batch
        assert r["rows_per_step"] == r["world"] * r["prompts_per_step"] * r["group_size"]
    # samples per step, from the reported rates: 2 ranks account for twice the prompts of 1
    per_step_1 = one["samples_per_s"] / one["steps_per_s"]
    per_step_2 = two["samples_per_s"] / two["steps_per_s"]
    assert per_step_1 == pytest.approx(one["prompts_per_step"] * one["group_size"], rel=1e-3)
    assert per_step_2 == pytest.approx(2 * per_step_1, rel=1e-3)
    assert result["samples_per_s_ratio_2_vs_1"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"], rel=1e-3)
    assert result["steps_per_s_ratio_2_vs_1"] == pytest.approx(two["steps_per_s"] / one["steps_per_s"], rel=1e-3)
    assert result["cpu_count"] >= 1
