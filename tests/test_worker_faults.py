"""Faults never lose a run: an env worker killed mid-training is restarted without leaving
garbage that crashes the interpreter, the weights and a checkpoint are on disk before the final
evaluation, and results.json and the terminal say that a worker was restarted."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from mmrl.checkpoint import find_latest
from mmrl.envs.vector import VectorEnv
from mmrl.trainer import Trainer
from safetensors.torch import load_file
from test_trainer import build, make_cfg, weights
from test_vector_env import CRASH_SEED, ToyEnv, _right

REPO = Path(__file__).resolve().parent.parent
HAS_PROC = Path("/proc/self/comm").is_file()


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _wait_dead(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = _proc_stat(pid)
        if stat is None or stat[0] in "ZX":
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not die")


def _env_workers(parent: int) -> list[int]:
    """Pids of the env worker processes whose parent is `parent`, oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        stat = _proc_stat(int(entry.name))
        if name == "mmrl-env-worker" and stat and int(stat[1]) == parent and stat[0] not in "ZX":
            found.append((int(stat[19]), int(entry.name)))  # (start time in clock ticks, pid)
    return [pid for _, pid in sorted(found)]


@pytest.mark.skipif(not HAS_PROC, reason="needs Linux /proc to name and watch worker processes")
@pytest.mark.parametrize("when", ["idle", "mid-step"])
def test_a_killed_worker_leaves_no_cyclic_garbage(when):
    # The crash of the issue: a dead worker's error kept the frames of Connection.send, one holding a
    # memoryview of a BytesIO, in a reference cycle; CPython 3.12.1's GC freed the BytesIO first
    # ("deallocated BytesIO object has exported buffers") and segfaulted. Saving the garbage instead
    # of freeing it shows what a crash leaves behind: nothing now.
    fns = [partial(ToyEnv, goal=5, max_episode_steps=8, mode="kill") for _ in range(4)]
    with VectorEnv(fns, num_workers=2, start_timeout_s=60) as vec:
        pids = vec.worker_pids
        assert [Path(f"/proc/{p}/comm").read_text().strip() for p in pids] == ["mmrl-env-worker"] * 2
        vec.reset(seeds=[0, 1, 2, CRASH_SEED if when == "mid-step" else 3])  # env 3 kills its worker at step 2
        vec.step(_right(4))
        if when == "idle":  # killed between commands: the next send finds a broken pipe
            os.kill(pids[1], signal.SIGKILL)
            _wait_dead(pids[1])
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            out = vec.step(_right(4))
            gc.collect()
            left = list(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert out.done[2:].all() and all(out.info[g]["crashed"] for g in (2, 3)) and not out.done[:2].any()
        assert vec.restarts == 1 and vec.worker_pids[1] != pids[1]
        views = [o for o in left if isinstance(o, memoryview)]
        frames = sorted({o.f_code.co_filename for o in left if type(o).__name__ == "frame"})
        assert not views and not frames, (views, frames)
        vec.reset(seeds=[10, 11, 12, 13])  # the restarted worker serves again
        assert vec.step(_right(4)).obs.state[:, 0].tolist() == [1, 1, 1, 1]
    assert vec.restarts == 1  # still counted after close


# A few minutes of the shipped VLA config, cut to seconds: short episodes, few SFT / RL steps, a
# 2-state evaluation; 2 worker processes as in the issue.
FAST = ["sft.steps=5", "train.steps=3", "train.prompts_per_step=2", "sampling.group_size=4", "train.eval_every=0",
        "train.eval_size=2", "task.params.max_episode_steps=24", "task.params.num_workers=2", "train.progress=false",
        "train.threads=1"]


@pytest.mark.skipif(not HAS_PROC, reason="needs Linux /proc to find the worker processes")
@pytest.mark.robot  # the tabletop's env workers
def test_a_worker_killed_mid_rl_costs_no_run(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "vla_tabletop_grpo.yaml"), *FAST,
           f"train.output_dir={run}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    victim, deadline = None, time.monotonic() + 300
    metrics = run / "metrics.jsonl"
    while victim is None and proc.poll() is None and time.monotonic() < deadline:
        rows = metrics.read_text().splitlines() if metrics.is_file() else []
        if any('"reward/total"' in r and '"step": 1,' in r for r in rows):  # RL step 1 is done, 2 of 3 to go
            workers = _env_workers(proc.pid)
            victim = workers[-1]  # the newest: the training batch's env set, built at RL step 1
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    assert victim is not None, f"the run ended before RL step 1 was logged:\n{err[-3000:]}"
    assert proc.returncode == 0, err[-3000:]
    assert "SystemError" not in err and "Traceback" not in err, err[-3000:]
    assert "restarted" in err  # the vector env's warning when it found the dead worker

    results = json.loads((run / "results.json").read_text())
    restarts = results["run_health"]["env_worker_restarts"]
    assert restarts >= 1 and results["run_health"]["notes"]
    notes = [line for line in err.splitlines() if line.startswith("mmrl: note:") and "env worker restart" in line]
    assert notes == [f"mmrl: note: {results['run_health']['notes'][0]}"]
    ckpt = Path(results["checkpoint"])
    assert ckpt.parent == run / "checkpoints" and ckpt.name == "step_000003"
    # The checkpoint holds the final evaluation too, so a longer train.steps extends this run.
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert [e["step"] for e in state["eval_history"]] == [e["step"] for e in results["eval_history"]] == [0, 3]
    assert load_file(str(run / "final" / "model.safetensors")) and (run / "final" / "config.json").is_file()


def test_a_crash_in_the_final_evaluation_loses_no_training(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, train={"steps": 2, "eval_size": 4})
    trainer = build(cfg)

    def crash(self):  # the step-0 evaluation runs; the final one dies (as a segfault would)
        if self.step:
            raise RuntimeError("killed in the final evaluation")
        return original(self)

    original = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate", crash)
    with pytest.raises(RuntimeError, match="final evaluation"):
        trainer.train()
    monkeypatch.undo()
    run = tmp_path / "run"
    assert find_latest(run).name == "step_000002" and (run / "final" / "model.safetensors").is_file()
    assert not (run / "results.json").exists()  # written last: a crash leaves no results naming the missing eval

    # The same command again only evaluates, and the checkpoint then holds the evaluation.
    resumed = build(make_cfg(tmp_path, train={"steps": 2, "eval_size": 4}))
    results = resumed.train()
    assert resumed.step == 2 and [e["step"] for e in results["eval_history"]] == [0, 2]
    assert all(torch.equal(v, weights(trainer)[k]) for k, v in weights(resumed).items())
    state = torch.load(find_latest(run) / "trainer_state.pt", weights_only=True)
    assert [e["step"] for e in state["eval_history"]] == [0, 2]
    assert json.loads((run / "results.json").read_text())["checkpoint"] == str(find_latest(run))
    # A longer train.steps extends the finished run from there.
    longer = build(make_cfg(tmp_path, train={"steps": 3, "eval_size": 4}))
    assert [e["step"] for e in longer.train()["eval_history"]] == [0, 2, 3]
