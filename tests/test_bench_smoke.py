"""The advantage benchmark runs end to end (small N) and its results match the loop."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]


def test_advantages_bench_smoke():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "advantages.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    result = json.loads(last)
    assert result["n"] == 4096
    assert result["match"] is True
    for key in ("vectorised_s", "loop_s", "speedup", "sparse64_vectorised_s", "sparse64_speedup"):
        assert result[key] > 0


def test_grpo_vs_trl_bench_smoke():
    """Both trainers run the same tiny model for a few steps; the JSON line carries every field."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("trl")
    script = Path(__file__).parent.parent / "bench" / "grpo_vs_trl.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("mmrl_step_s", "trl_step_s", "speedup", "mmrl_tokens_per_step", "trl_tokens_per_step",
                "mmrl_peak_rss_mib", "trl_peak_rss_mib", "mmrl_cpu_step_s", "trl_cpu_step_s", "cpu_speedup"):
        assert result[key] > 0, key
    assert result["speedup"] == pytest.approx(result["trl_step_s"] / result["mmrl_step_s"], rel=0.01)
    assert result["cpu_speedup"] == pytest.approx(result["trl_cpu_step_s"] / result["mmrl_cpu_step_s"], rel=0.01)


def test_gpu_planning_bench_smoke(tmp_path):
    """The GPU planning benchmark's whole path (build, SFT, GRPO, EM/PR eval) on a tiny CPU model."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_planning.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["env"] for r in result["results"]] == ["frozenlake", "maze"]
    for r in result["results"]:
        assert r["sft_steps"] >= 1 and r["rl_steps"] >= 1 and r["sample_tokens_per_s"] > 0
        for stage in ("before", "after"):
            assert 0.0 <= r[stage]["exact_match"] <= r[stage]["progress_rate"] + 1e-9 <= 1.0 + 1e-9
