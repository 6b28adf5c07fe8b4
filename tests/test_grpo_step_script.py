"""scripts/grpo_step.py: one GRPO step with mmrl.algos alone, run on the tiny local Qwen2."""

import math
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from mmrl.tiny import build_tiny_qwen2

torch.set_num_threads(1)

SCRIPT = Path(__file__).parent.parent / "scripts" / "grpo_step.py"


def run_script(monkeypatch, capsys, *argv: str) -> tuple[dict, list[dict[str, float]]]:
    """The script's globals and, per printed line, its key=value numbers."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--lr", "1e-3", *argv])
    script_globals = runpy.run_path(str(SCRIPT), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if "=" in line]
    return script_globals, [{k: float(v.split("/")[0]) for k, v in re.findall(r"(\w+)=(\S+)", line)} for line in lines]


def test_one_step_prints_finite_metrics_and_moves_the_weights(monkeypatch, capsys):
    script_globals, (rollout, first, second) = run_script(monkeypatch, capsys)
    assert all(math.isfinite(v) for line in (rollout, first, second) for v in line.values())
    assert 0 < rollout["reward_mean"] < 1 and rollout["groups_with_signal"] > 0
    # The first pass is on-policy: the recomputed log-probs are the old ones exactly.
    assert first["approx_kl"] == 0 and first["clip_frac"] == 0 and first["grad_norm"] > 0
    # The second pass sees the policy the first step made.
    assert second["approx_kl"] > 0 and second["loss"] != 0
    initial = build_tiny_qwen2(script_globals["tokenizer"], seed=0)  # seeded: the script's starting weights
    trained = dict(script_globals["model"].named_parameters())
    moved = [name for name, p in initial.named_parameters() if not torch.equal(p, trained[name].detach().cpu())]
    assert len(moved) == len(trained)


def test_micro_batches_do_not_change_the_loss(monkeypatch, capsys):
    """One global denominator: per-micro-batch losses sum to the whole batch's."""
    _, (_, _, whole) = run_script(monkeypatch, capsys, "--prompts", "2", "--micro-batch", "16")
    _, (_, _, split) = run_script(monkeypatch, capsys, "--prompts", "2", "--micro-batch", "3")
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-4, abs=1e-7)
    assert split["approx_kl"] == pytest.approx(whole["approx_kl"], rel=1e-3)


def test_a_saved_model_runs_through_the_auto_classes(monkeypatch, capsys, tmp_path):
    """--model loads with AutoModelForCausalLM / AutoTokenizer: the saved tiny model gives the same step."""
    built, built_lines = run_script(monkeypatch, capsys, "--prompts", "2")
    initial = build_tiny_qwen2(built["tokenizer"], seed=0)
    initial.save_pretrained(tmp_path)
    built["tokenizer"].save_pretrained(tmp_path)
    _, loaded_lines = run_script(monkeypatch, capsys, "--prompts", "2", "--model", str(tmp_path))
    assert len(loaded_lines) == len(built_lines) == 3
    for loaded, built_line in zip(loaded_lines, built_lines):
        assert loaded == pytest.approx(built_line, rel=1e-4, abs=1e-7)
