"""Runs a user can trust: one run per folder, interrupts that save and resume exactly, damaged
checkpoints named in one line with a fallback to the previous whole one."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmrl.checkpoint import CheckpointError, find_latest, load_checkpoint
from mmrl.cli import main
from mmrl.config import load_config

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "arithmetic_grpo.yaml"
# A tiny, quick version of the shipped arithmetic config (the same overrides in every run below).
TINY = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=1", "task.params.max_operand=20", "sampling.group_size=4",
        "sampling.max_new_tokens=4", "train.prompts_per_step=4", "train.eval_size=8", "train.eval_every=0",
        "train.progress=false", "train.threads=1"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(find_latest(run) / "model.safetensors"))


def _one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- one run per folder


def test_default_output_dir_names_the_config_and_the_overrides_that_change_the_run():
    assert load_config(CONFIG).train.output_dir == "runs/arithmetic_grpo"
    cfg = load_config(CONFIG, ["train.steps=7", "algo.loss=gspo", "sampling.temperature=0.7", "train.progress=false"])
    assert cfg.train.output_dir == "runs/arithmetic_grpo+algo.loss=gspo+sampling.temperature=0.7"
    assert load_config(CONFIG, ["train.output_dir=elsewhere/x", "algo.loss=gspo"]).train.output_dir == "elsewhere/x"


def test_resume_with_another_loss_is_refused_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    base = [*TINY, "sft.steps=2", "train.steps=2", f"train.output_dir={run}"]
    assert main(["train", str(CONFIG), *base]) == 0
    first = _weights(run)
    capsys.readouterr()
    assert main(["train", str(CONFIG), *base, "algo.loss=gspo"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "algo.loss: 'grpo' -> 'gspo'" in line and "train.output_dir=" in line and "--no-resume" in line
    assert all(torch.equal(first[k], v) for k, v in _weights(run).items())  # nothing was touched
    assert "loss: grpo" in (run / "config.yaml").read_text()
    # A longer run of the same config resumes, and says so.
    assert main(["train", str(CONFIG), *base[:-2], "train.steps=3", f"train.output_dir={run}"]) == 0
    assert "resuming from step 2 of 3" in capsys.readouterr().err
    # --no-resume discards the old run and trains the new method from scratch.
    assert main(["train", str(CONFIG), *base, "algo.loss=gspo", "--no-resume"]) == 0
    assert "discarded the previous run" in capsys.readouterr().err
    assert "loss: gspo" in (run / "config.yaml").read_text()
    assert find_latest(run).name == "step_000002"


# ----------------------------------------------------------------------------- interrupts


def _sigint_when(cmd: list[str], metrics: Path, ready) -> subprocess.CompletedProcess:
    """Run `cmd`, send SIGINT once a row of `metrics` satisfies `ready`, and wait for it to exit."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        rows = metrics.read_text().splitlines() if metrics.is_file() else []
        if any(ready(r) for r in rows):
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("phase", ["rl", "sft"])
def test_sigint_saves_a_checkpoint_and_the_same_command_finishes_like_an_uninterrupted_run(tmp_path, phase):
    steps = ["sft.steps=2", "train.steps=60"] if phase == "rl" else ["sft.steps=300", "train.steps=3"]
    straight = tmp_path / "straight"
    assert main(["train", str(CONFIG), *TINY, *steps, f"train.output_dir={straight}"]) == 0

    run = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(CONFIG), *TINY, *steps, f"train.output_dir={run}"]
    if phase == "rl":
        ready = lambda row: '"reward/total"' in row and '"step": 3,' in row  # noqa: E731
    else:
        ready = lambda row: '"sft_step": 20,' in row  # noqa: E731
    stopped = _sigint_when(cmd, run / "metrics.jsonl", ready)
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr
    assert "checkpoint saved to" in stopped.stderr and "Resume with the same command: mmrl train" in stopped.stderr
    assert find_latest(run) is not None and not (run / "results.json").exists()

    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert ("resuming from SFT step" if phase == "sft" else "resuming from step") in resumed.stderr
    a, b = _weights(straight), _weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- damaged checkpoints


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run with checkpoints at steps 2 and 3 (kept: the last two)."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(["train", str(CONFIG), *TINY, "sft.steps=0", "train.steps=3", "train.save_every=1",
                 f"train.output_dir={run}"]) == 0
    return run


@pytest.mark.parametrize("name, damage", [("model.safetensors", _truncate), ("trainer_state.pt", _truncate),
                                          ("meta.json", _truncate), ("model.safetensors", _flip_last_byte)])
def test_a_damaged_checkpoint_file_is_named_and_resume_falls_back(two_checkpoints, tmp_path, capsys, caplog,
                                                                 name, damage):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    newest = run / "checkpoints" / "step_000003"
    damage(newest / name)
    # Loading that checkpoint: one line naming the file.
    assert main(["eval", str(CONFIG), *TINY, "sft.steps=0", "--checkpoint", str(newest)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mmrl: error:") and str(newest / name) in line and "damaged" in line
    model = torch.nn.Linear(1, 1)
    with pytest.raises(CheckpointError, match=name):
        load_checkpoint(newest, model)
    # Resuming the run: a warning that names it, then the previous whole checkpoint.
    assert find_latest(run).name == "step_000002"
    assert any(str(newest / name) in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert main(["train", str(CONFIG), *TINY, "sft.steps=0", "train.steps=4", "train.save_every=1",
                 f"train.output_dir={run}"]) == 0
    assert "resuming from step 2 of 4" in capsys.readouterr().err
    assert find_latest(run).name == "step_000004"


def test_eval_labels_results_with_the_checkpoint_step(two_checkpoints, tmp_path):
    import json

    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(two_checkpoints), "--output", str(out)]) == 0  # the run's own config
    assert json.loads(out.read_text())["step"] == 3


# ----------------------------------------------------------------------------- console output


def test_a_recurring_warning_is_shown_once_and_counted(tmp_path, capsys):
    from mmrl.logger import MetricsLogger

    log = MetricsLogger(tmp_path)
    for step in range(5):
        log.warn(f"step {step}: no group left after filtering", kind="no group left")
    log.warn("something else")
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err
    assert "step 0" in err[0] and "something else" in err[1] and "no group left: 4 more time(s)" in err[2]
    assert (tmp_path / "metrics.jsonl").read_text().count('"warning"') == 6


# ----------------------------------------------------------------------------- seed tables


def test_seed_summary_reports_mean_sd_and_range():
    import importlib.util

    spec = importlib.util.spec_from_file_location("seeds", REPO / "scripts" / "seeds.py")
    seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seeds)
    results = {s: {"eval_before": {"eval/em": b}, "eval_after": {"eval/em": a}}
               for s, b, a in ((0, 0.5, 0.7), (1, 0.6, 0.9), (2, 0.7, 0.8))}
    table = seeds.summarize(results, ["eval/em"])
    after = table["eval/em"]["after"]
    assert after["mean"] == pytest.approx(0.8) and after["sd"] == pytest.approx(0.1)
    assert (after["min"], after["max"]) == (0.7, 0.9) and after["by_seed"] == {0: 0.7, 1: 0.9, 2: 0.8}
    assert "| eval/em | after | 80.0 +- 10.0 | 70.0-90.0 | 0: 70.0, 1: 90.0, 2: 80.0 |" in seeds.markdown(table, 100.0)
