"""A save that fails for space or I/O ends in one line naming the folder, the bytes it needs and the
bytes free; the previous checkpoint stays the newest whole one and the same command goes on once
there is room. The faults are real: a file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored, so a write
past it fails with EFBIG as on a full disk), not a patched exception."""

import contextlib
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.checkpoint import CheckpointWriteError, find_latest
from test_trainer import build, make_cfg

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes fail in this process, as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_failed_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    trainer = build(make_cfg(tmp_path))
    trainer.train_step()
    trainer.step = 1
    first = trainer.save()
    trainer.train_step()
    trainer.step = 2
    size = (first / "model.safetensors").stat().st_size
    with file_size_limit(size // 2), pytest.raises(CheckpointWriteError) as failure:
        trainer.save()
    message = str(failure.value)
    assert "\n" not in message
    assert f"could not write checkpoint step_000002 in {trainer.out_dir / 'checkpoints'}" in message
    assert "File too large" in message and "free there" in message and "step_000001" in message
    assert find_latest(trainer.out_dir) == first
    assert sorted(p.name for p in (trainer.out_dir / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert trainer.save().name == "step_000002"  # room again: the same save goes through


def limited(limit: int):
    def arm():  # in the child, before exec: both survive it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return arm


def test_the_cli_under_a_1_mib_file_limit_says_one_line_and_the_same_command_then_finishes(tmp_path):
    """The digit-sort demo's checkpoint (weights and Adam state, ~5.6 MB) cannot be written under a
    1 MiB limit: one line, no traceback; without the limit the same command trains to the end."""
    command = [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs/digit_sort_grpo.yaml"),
               "train.steps=4", "train.save_every=2", "train.eval_every=0", "train.eval_size=16", "sft.steps=5",
               "train.progress=false", f"train.output_dir={tmp_path / 'run'}"]
    failed = subprocess.run(command, capture_output=True, text=True, preexec_fn=limited(MIB), timeout=300)
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mmrl: error: could not write checkpoint step_000002 in {tmp_path / 'run' / 'checkpoints'}: ")
    assert "File too large" in last and "It needs about 5." in last and "free there" in last
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # no half checkpoint, no temporary folder
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "results.json").is_file() and find_latest(tmp_path / "run").name == "step_000004"


def test_a_log_write_that_fails_names_the_file_in_one_line(tmp_path):
    from mmrl.cli import write_error_line
    from mmrl.logger import MetricsLogger

    log = MetricsLogger(tmp_path)
    log.reset()
    log.log({"a": 1.0}, step=0)
    with file_size_limit(log.path.stat().st_size + 10), pytest.raises(OSError) as failure:
        log.log({"b": "x" * 100}, step=1)
    line = write_error_line(failure.value)
    assert line.startswith(f"could not write {log.path}: File too large; ") and "\n" not in line


def test_non_finite_weights_are_never_saved_as_a_checkpoint(tmp_path):
    import torch

    from mmrl.checkpoint import NonFiniteWeightsError

    trainer = build(make_cfg(tmp_path))
    trainer.step = 1
    first = trainer.save()
    trainer.step = 2
    with torch.no_grad():
        next(trainer.policy.model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=r"step 2: \d+ of \d+ weight tensors hold NaN or inf .*step_000001"):
        trainer.save()
    assert sorted(p.name for p in (trainer.out_dir / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert find_latest(trainer.out_dir) == first


def test_a_failed_final_export_is_one_line_and_leaves_no_half_folder(tmp_path):
    trainer = build(make_cfg(tmp_path))
    trainer.step = 1
    first = trainer.save()
    with file_size_limit((first / "model.safetensors").stat().st_size // 2), \
            pytest.raises(CheckpointWriteError) as failure:
        trainer.export_final()
    message = str(failure.value)
    assert message.startswith(f"could not write the final weights (final/) in {trainer.out_dir}: ")
    assert "the newest checkpoint is still step_000001" in message and "\n" not in message
    assert not (trainer.out_dir / "final").exists() and not (trainer.out_dir / ".tmp_final").exists()
    trainer.export_final()  # room again
    assert (trainer.out_dir / "final" / "model.safetensors").is_file()
