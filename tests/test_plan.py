"""`mmrl plan`: the per-phase fit, the static memory, the token budget it solves for, its CLI errors,
and the bench's 4-layer prediction from 1 and 2 layers (small widths, measured here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.config import ConfigError
from mmrl.plan import GIB, HEADROOM, MIB, RUNTIME_GIB, PhaseFit, format_plan, linear_in_layers, plan

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/vqa_geometry3k_gpu.yaml"


def test_phase_fit_recovers_a_linear_model():
    truth = PhaseFit(c0=100.0, c1=50.0, d0=0.25, d1=0.125)
    na, nb = 1000, 3000
    fit = PhaseFit.from_points(truth(1, na), truth(2, na), truth(1, nb), truth(2, nb), na, nb)
    for L, n in [(36, 16384), (4, 700), (1, 1)]:
        assert fit(L, n) == pytest.approx(truth(L, n))
    assert linear_in_layers(10.0, 13.0, 4) == 19.0


def _measurements(tmp_path: Path, d1: float = 0.01) -> Path:
    """A stored measurement of the Geometry3K config: dyn = 100 + 10 L + (0.02 + d1 L) n MiB."""
    f = PhaseFit(100.0, 10.0, 0.02, d1)
    runs = []
    for L, size, n_s, n_m in [(1, "a", 2000, 700), (2, "a", 2000, 700), (1, "b", 5000, 2000), (2, "b", 5000, 2000)]:
        runs.append({"layers": L, "size": size, "prompt_tokens": 300,
                     "n": {"sampling": n_s, "old_ref": n_m, "update": n_m},
                     "dyn_mib": {"sampling": f(L, n_s), "old_ref": f(L, n_m), "update": f(L, n_m)}})
    data = {"models": {"qwen": {"config": CONFIG, "shapes": "x.json", "smoke": False, "runs": runs,
                                "full_params": {"total": 3_000_000_000, "trainable": 3_000_000_000,
                                                "largest_block": 80_000_000, "layers": 36}}}}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    return path


def test_plan_static_and_token_budget(tmp_path):
    m = _measurements(tmp_path)
    p = plan(ROOT / CONFIG, 8, 80.0, m)
    rep, fs = p["modes"]["replicated"], p["modes"]["fsdp"]
    # bf16 weights + reference + grads + 2 AdamW states (torch keeps them in the parameter dtype): 10 bytes
    assert rep["static_gib"]["update"] == pytest.approx(3e9 * 10 / GIB)
    assert fs["static_gib"]["update"] == pytest.approx(3e9 * 10 / GIB / 8 + 2 * 80e6 * 2 / GIB)
    assert fs["static_gib"]["sampling"] == pytest.approx(3e9 * 10 / GIB / 8 + 3e9 * 4 / GIB)  # weights unsharded
    # The config's micro-batch: its 16,384-token budget (8 rows x (300 + 2048) tokens is more)
    assert p["tokens"]["update"] == 16384
    assert p["tokens"]["sampling"] == 160 * (300 + 2048)  # rollout.batch_size rows a sampler call
    dyn = 100 + 10 * 36 + (0.02 + 0.01 * 36) * 16384
    assert rep["peak_gib"]["update"] == pytest.approx(rep["static_gib"]["update"] + dyn * MIB / GIB + RUNTIME_GIB)
    # The largest token budget puts the update's peak at the budget (rounded down to 1024 tokens).
    tok = fs["max_micro"]
    room = 80 * (1 - HEADROOM) - fs["static_gib"]["update"] - RUNTIME_GIB
    assert tok == int(((room * GIB / MIB) - 460) / (0.02 + 0.36)) // 1024 * 1024
    assert fs["max_gib"] < rep["max_gib"]


def test_plan_counts_rows_where_the_config_fixes_a_row(tmp_path):
    """A video / VLA measurement counts rows (a video of the config's frames, an episode): n is the
    rows of a sampler call and of a micro-batch, the answer is a `train.micro_batch_size`, and no
    per-token KV cache is added."""
    config = "configs/video_wan_gpu.yaml"
    f = PhaseFit(200.0, 300.0, 50.0, 40.0)  # MiB; n in rows
    runs = [{"layers": L, "size": size, "prompt_tokens": 0, "n": {"sampling": n_s, "old_ref": n_m, "update": n_m},
             "dyn_mib": {"sampling": f(L, n_s), "old_ref": f(L, n_m), "update": f(L, n_m)}}
            for L, size, n_s, n_m in [(1, "a", 2, 1), (2, "a", 2, 1), (1, "b", 4, 2), (2, "b", 4, 2)]]
    params = {"total": 1_400_000_000, "trainable": 1_400_000_000, "largest_block": 46_000_000, "layers": 30,
              "frozen_extra_bytes": 2 * GIB, "kv_values_per_token_layer": 10**6}
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"models": {"wan": {"config": config, "shapes": "x.json", "smoke": False,
                                                   "unit": "rows", "runs": runs, "full_params": params}}}))
    p = plan(ROOT / config, 1, 80.0, path)
    rep = p["modes"]["replicated"]
    assert p["tokens"] == {"sampling": 8, "old_ref": 4, "update": 4}  # rollout.batch_size 8 a call; micro_batch_size 4
    static = (1.4e9 * 2 + 1.4e9 * 2 + 1.4e9 * 2 * 3 + 2 * GIB) / GIB  # weights, reference (beta > 0), grads, Adam, frozen
    assert rep["static_gib"]["sampling"] == pytest.approx(static)
    assert rep["peak_gib"]["sampling"] == pytest.approx(static + f(30, 8) * MIB / GIB + RUNTIME_GIB)
    room = (80 * (1 - HEADROOM) - static - RUNTIME_GIB) * GIB / MIB - (200 + 300 * 30)
    assert rep["max_micro"] == int(room / (50 + 40 * 30))
    assert "largest train.micro_batch_size that fits" in format_plan(p)


def test_plan_says_when_nothing_fits(tmp_path):
    p = plan(ROOT / CONFIG, 1, 24.0, _measurements(tmp_path))
    rep = p["modes"]["replicated"]
    assert not rep["fits"] and rep["max_micro"] == 0


@pytest.mark.parametrize("args, message", [
    (["configs/does_not_exist.yaml"], "config file not found"),
    ([CONFIG, "--gpus", "0"], "--gpus must be >= 1"),
    ([CONFIG, "--gpu-memory", "0"], "--gpu-memory must be > 0"),
    (["configs/digit_sort_grpo.yaml"], "no real-width measurement"),
])
def test_plan_cli_errors_in_one_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", "plan", *args], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_plan_rejects_bad_numbers_in_python(tmp_path):
    with pytest.raises(ConfigError, match="--gpus"):
        plan(ROOT / CONFIG, 0, 80.0, _measurements(tmp_path))


def test_four_layer_prediction_within_15_percent():
    """The bench's children at small widths (hidden 512, MLP 2048: each layer ~75 MiB of weights,
    reference, grads and Adam states) for 1, 2 and 4 layers, run side by side: the 4-layer peak of each
    phase predicted from 1 and 2 layers, m1 + 3 (m2 - m1), is within 15 % of the measured one."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "BENCH_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    script = ROOT / "bench" / "real_shapes.py"
    procs = {L: subprocess.Popen([sys.executable, str(script), "--child", "qwen2_5_vl_3b", "--layers", str(L),
                                  "--size", "a", "--width", "small"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env, cwd=ROOT) for L in (1, 2, 4)}
    peaks = {}
    for L, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        result = json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
        assert result["exact_hwm"] or result["peak_mib"]["update"] > 0
        peaks[L] = result["peak_mib"]
    for phase in ("sampling", "old_ref", "update"):
        predicted = linear_in_layers(peaks[1][phase], peaks[2][phase], 4)
        assert abs(predicted / peaks[4][phase] - 1) < 0.15, (phase, predicted, peaks[4][phase])
    assert peaks[4]["update"] > peaks[1]["update"] + 100  # the layers do weigh
