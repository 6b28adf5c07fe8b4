"""The advantage benchmark runs end to end (small N) and its results match the loop."""

import json
import os
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


@pytest.mark.robot  # its VLA part needs lerobot's stack
def test_gpu_session_smoke(tmp_path):
    """bench/gpu_session.sh, the one prepared command for a GPU machine, runs its sequence of GPU
    benches at tiny sizes and gathers each one's JSON line into results.json; the planning bench's
    whole path (build, SFT, GRPO, EM/PR eval) runs on both environments."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh"), "smoke"], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "exited with" not in proc.stdout, proc.stdout[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results) == ["caption", "planning", "video", "vla_tabletop", "vllm_rollout", "vlm"]
    vllm = results["vllm_rollout"]
    assert vllm["hf"]["tokens_per_s"] > 0 and vllm["hf"]["tokens_per_call"] == 2 * 2 * 8  # full-length rows
    skipped = vllm["vllm"].get("skipped", "")  # vllm absent here, or present without a GPU
    assert "does not import" in skipped or "no CUDA GPU" in skipped or vllm["vllm"]["tokens_per_s"] > 0
    assert results["video"]["rollout_chunks_per_s"] > 0 and results["video"]["update_steps_per_s"] > 0
    assert results["vlm"]["rollout_tokens_per_s"] > 0 and results["vlm"]["update_tokens_per_s"] > 0
    planning = results["planning"]["results"]
    assert [r["env"] for r in planning] == ["frozenlake", "maze"]
    for r in planning:
        assert r["sft_steps"] >= 1 and r["rl_steps"] >= 1 and r["sample_tokens_per_s"] > 0
        for stage in ("before", "after"):
            assert 0.0 <= r[stage]["exact_match"] <= r[stage]["progress_rate"] + 1e-9 <= 1.0 + 1e-9
    assert results["vla_tabletop"]["env_steps"] > 0 and results["vla_tabletop"]["update_tokens_per_s"] > 0
    assert results["caption"]["captions_per_s"] > 0 and results["caption"]["judged_questions_per_s"] > 0


def test_vprl_equal_cpu_bench_smoke(tmp_path):
    """The VPRL paper's comparison end to end on tiny budgets: VPFT gets the GRPO run's CPU-s as SFT steps
    at the rate its stage 1 measured, so it trains for more steps than stage 1 alone."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vprl_equal_cpu.py"), "--smoke", "--seeds", "0",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = result["rows"]
    assert row["grpo_steps"] == 2
    assert row["vpft_steps"] == round(20 * row["grpo_cpu_s"] / row["stage1_cpu_s"])
    assert row["vpft_steps"] > 20 and row["grpo_cpu_s"] > row["stage1_cpu_s"] > 0
    for arm in ("stage1", "grpo", "vpft"):
        assert all(0.0 <= v <= 100.0 for v in row[arm])
    assert json.loads((tmp_path / "equal_cpu.json").read_text())["rows"] == result["rows"]
    body = (tmp_path / "equal_cpu.md").read_text().splitlines()[2:]
    assert [line.split(" | ")[0] for line in body] == ["| 0", "| mean of 1"]


def test_vlm_vs_trl_bench_smoke():
    """mmrl's Trainer and TRL's GRPOTrainer run interleaved GRPO steps on the same tiny Qwen2.5-VL and
    VQA records, both forced to the full completion budget; the JSON line carries both sides."""
    pytest.importorskip("trl")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vlm_vs_trl.py"), "--smoke"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "trl_error" not in result, result.get("trl_error")
    assert result["smoke"] is True and result["repeats"] == 1 and len(result["mmrl_steps_s"]) == 1
    budget = result["completions_per_step"] * result["max_new_tokens"]
    assert result["mmrl_tokens_per_step"] == result["trl_tokens_per_step"] == budget
    for key in ("mmrl_step_s", "trl_step_s", "speedup", "mmrl_cpu_step_s", "trl_cpu_step_s", "cpu_speedup"):
        assert result[key] > 0, key
    assert result["speedup"] == pytest.approx(result["trl_step_s"] / result["mmrl_step_s"], rel=0.01)
    assert result["speedup_min"] <= result["speedup_max"]


def test_gpu_vlm_bench_smoke():
    """The 3B-scale VLM throughput bench at tiny sizes on the CPU: one sampled and updated step."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_vlm.py"), "--smoke"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["smoke"] is True and result["device"] == "cpu" and result["steps"] == 1
    assert result["gen_tokens_per_step"] == result["prompts"] * result["group"] * result["max_new_tokens"]
    assert result["update_tokens_per_step"] > result["gen_tokens_per_step"]
    for key in ("rollout_tokens_per_s", "update_tokens_per_s", "update_completion_tokens_per_s", "sample_s",
                "update_s"):
        assert result[key] > 0, key
    assert 0 <= result["mfu"] < 1 and 0 <= result["rollout_mfu"] < 1


def test_video_rollout_bench_smoke():
    """The cached streaming loop and the history-recomputing loop make the same video; the JSON
    line carries the ratio."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "video_rollout.py"), "--smoke"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_diff"] < 1e-4
    assert result["speedup"] == pytest.approx(result["cached_chunks_per_s"] / result["recompute_chunks_per_s"], rel=1e-6)


def test_memory_bench_smoke():
    """bench/memory.py: one tiny GRPO step each for mmrl (reference and recompute passes on) and
    TRL at Qwen2.5's vocabulary, each side in its own process; the JSON line carries both."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "memory.py"), "--smoke"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["vocab"] == 151_936
    assert {r["side"] for r in result["runs"]} == {"mmrl", "trl"}
    assert all(r["step_mib"] >= 0 and r["tokens"] > 0 for r in result["runs"])


def test_vlm_memory_bench_smoke(tmp_path):
    """bench/vlm_memory.py: the general VLM path's teacher-forced pass and a full-logits pass, each in
    its own process, on a small Gemma 3; the JSON line carries both peaks."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vlm_memory.py"), "--smoke", "--out",
                           str(tmp_path / "m.json")], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["model"]["family"] == "gemma3" and result["mmrl"]["params"] == result["logits"]["params"]
    assert result["mmrl"]["peak_mib"] > 0 and result["logits"]["peak_mib"] > 0
    assert json.loads((tmp_path / "m.json").read_text())["ratio"] == result["ratio"]


@pytest.mark.robot  # its VLA part needs lerobot's stack
def test_real_shapes_bench_smoke():
    """bench/real_shapes.py --smoke: each GPU config's real-shapes path (its module builds the model,
    the config loads it, one steady-state RL step per child process) at tiny widths; every phase has
    its peak. LIBERO's VLA needs the LIBERO assets and is skipped, saying why, where they are not."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "real_shapes.py"), "--smoke"], capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["models"]) == {"qwen2_5_vl_3b", "wan2_1_t2v_1_3b", "smolvla", "libero_action_vla"}
    for name, entry in result["models"].items():
        if "skipped" in entry:
            assert name == "libero_action_vla" and "LIBERO assets" in entry["skipped"]
            continue
        runs = entry["runs"]
        assert [(r["layers"], r["size"]) for r in runs] == [(1, "a"), (2, "b")], name
        for r in runs:
            assert r["static_mib"] > 0 and r["params"] > 0
            for phase in ("sampling", "old_ref", "update"):
                assert r["peak_mib"][phase] >= r["static_mib"] - 1, (name, phase, r)
                assert r["n"][phase] > 0, (name, phase, r)
        assert runs[1]["n"]["sampling"] > runs[0]["n"]["sampling"], name
        assert entry["full_params"]["total"] > 0
