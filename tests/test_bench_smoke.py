"""The advantage benchmark runs end to end (small N) and its results match the loop."""

import json
import subprocess
import sys
from pathlib import Path

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
