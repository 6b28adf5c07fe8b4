"""Crash points of a training run: count its filesystem steps, kill it with SIGKILL after the k-th
(tests/fault_injection/sitecustomize.py), start the same command again, and compare the folder with
an uninterrupted run's. Used by tests/test_crash_points.py (a few points of each kind) and
scripts/crash_sweep.py (every point)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
INJECTOR = Path(__file__).resolve().parent / "fault_injection"
# The digit-sort demo, short: SFT, 8 RL steps, a checkpoint every 2 (rotation keeps 2), evaluations
# at 0, 4 and 8, final/ and the second save of the last step. About 12 s a run on 2 cores.
COMMAND = ["train", str(REPO / "configs/digit_sort_grpo.yaml"), "train.steps=8", "train.save_every=2",
           "train.eval_every=4", "train.eval_size=100", "sft.steps=40", "train.progress=false"]
# Under torchrun (2 gloo ranks), shorter: a rank's start costs more.
SHARDED_COMMAND = [*COMMAND[:2], "train.steps=4", "train.save_every=2", "train.eval_every=2", "train.eval_size=32",
                   "sft.steps=10", "train.progress=false"]


def is_timing(key: str) -> bool:
    return key.startswith("time/") or key.endswith(("per_s", "cpu_s"))


@dataclass
class Step:
    index: int  # 1-based: killing "after k" leaves steps 1..k done
    event: str
    path: str


def run(run_dir: Path, command: list[str] = COMMAND, *, crash_after: int | None = None, trace: Path | None = None,
        nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """`mmrl COMMAND train.output_dir=RUN_DIR` in a subprocess; with `crash_after` or `trace`, under the
    injector. Under torchrun (`nproc` > 1) rank 0's steps count: it makes every change but the shards."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(INJECTOR), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "MMRL_CRASH_DIR": str(run_dir)}
    env.pop("MMRL_CRASH_AFTER", None)
    env.pop("MMRL_CRASH_TRACE", None)
    if crash_after is not None:
        env["MMRL_CRASH_AFTER"] = str(crash_after)
    if trace is not None:
        env["MMRL_CRASH_TRACE"] = str(trace)
    if crash_after is None and trace is None:
        env.pop("MMRL_CRASH_DIR")
    args = [*command, f"train.output_dir={run_dir}", *(["--nproc", str(nproc)] if nproc > 1 else [])]
    return subprocess.run([sys.executable, "-m", "mmrl.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=run_dir.parent)


def steps_of(trace: Path) -> list[Step]:
    lines = trace.read_text().splitlines() if trace.is_file() else []
    return [Step(i + 1, *line.split("\t", 1)) for i, line in enumerate(lines)]


def reference(work: Path, command: list[str] = COMMAND, nproc: int = 1) -> tuple[Path, list[Step]]:
    """An uninterrupted run's folder and its filesystem steps."""
    ref, trace = work / "reference", work / "reference.trace"
    done = run(ref, command, trace=trace, nproc=nproc)
    if done.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{done.stderr[-3000:]}")
    return ref, steps_of(trace)


def crash_and_resume(ref: Path, work: Path, k: int, command: list[str] = COMMAND, nproc: int = 1,
                     said: list[str] | None = None) -> list[str]:
    """Kill a run after its k-th step, run the same command again, and return how the folder differs
    from the uninterrupted `ref` ([] when it resumed whole); the second run's stderr is appended to
    `said`."""
    run_dir = work / f"crash_{k:03d}"
    shutil.rmtree(run_dir, ignore_errors=True)
    killed = run(run_dir, command, crash_after=k, nproc=nproc)
    if nproc == 1 and killed.returncode != -signal.SIGKILL:
        return [f"the run was not killed after step {k} (exit {killed.returncode}): {killed.stderr[-500:]}"]
    again = run(run_dir, command, nproc=nproc)
    if said is not None:
        said.append(again.stderr)
    if again.returncode != 0:
        return [f"the command after the kill failed (exit {again.returncode}): {again.stderr[-2000:]}"]
    differences = compare(ref, run_dir)
    if not differences:
        shutil.rmtree(run_dir)
    return differences


# ----------------------------------------------------------------------------- comparing folders


def files_of(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def plain(obj, folder: Path):
    """A state with timings removed, tensors as lists and the run folder's path as "RUN", for equality."""
    if isinstance(obj, dict):
        return {k: plain(v, folder) for k, v in obj.items() if not (isinstance(k, str) and is_timing(k))}
    if isinstance(obj, (list, tuple)):
        return [plain(v, folder) for v in obj]
    if isinstance(obj, torch.Tensor):
        return (str(obj.dtype), obj.tolist())
    if isinstance(obj, str):
        return obj.replace(str(folder), "RUN")
    return obj


def metric_rows(folder: Path) -> list[dict]:
    return [plain(json.loads(line), folder) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def compare(ref: Path, got: Path) -> list[str]:
    """What differs between two run folders: the same files (no leftovers), final/ and config.yaml
    byte for byte (the folder's own path apart), each checkpoint's weights and trainer state,
    results.json's evaluations and metrics.jsonl's rows, timings apart."""
    out = []
    want, have = files_of(ref), files_of(got)
    if want != have:
        out.append(f"files: missing {sorted(want - have)}, extra {sorted(have - want)}")
    both = want & have
    same_bytes = [f for f in both if (f.startswith("final/") or f == "checkpoints/latest"
                                      or f.endswith("model.safetensors")) and (ref / f).is_file()]
    out += [f"{f} differs" for f in sorted(same_bytes) if (ref / f).read_bytes() != (got / f).read_bytes()]
    if "config.yaml" in both and (ref / "config.yaml").read_text().replace(str(ref), "RUN") != \
            (got / "config.yaml").read_text().replace(str(got), "RUN"):
        out.append("config.yaml differs")
    for f in sorted(f for f in both if f.endswith(".pt")):
        a, b = (plain(torch.load(d / f, weights_only=True), d) for d in (ref, got))
        if a != b:
            out.append(f"{f}: trainer state differs in {sorted(k for k in a if a.get(k) != b.get(k))}")
    if "results.json" in both:
        a, b = (plain(json.loads((d / "results.json").read_text()), d) for d in (ref, got))
        out += [f"results.json: {key} differs" for key in ("eval_history", "eval_before", "eval_after", "checkpoint")
                if a.get(key) != b.get(key)]
    if "metrics.jsonl" in both:
        a, b = metric_rows(ref), metric_rows(got)
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(f"metrics.jsonl: {len(b)} rows, {len(a)} expected; first difference at row {first + 1}")
    return out


def kind_of(step: Step, steps: list[Step]) -> str:
    """The kind of a step, for choosing a few points of each."""
    path = step.path
    if path.startswith(".tmp_final") or path.endswith("-> final"):
        return "final/"
    if "/.tmp_step_" in path.split(" -> ")[0] and step.event == "os.mkdir":
        return "temporary folder made"
    if "-> checkpoints/latest" in path:
        return "latest replaced"
    if ".old_step_" in path:
        last = max(s.path.split(" -> ")[-1] for s in steps if s.path.startswith("checkpoints/.tmp_step_")
                   and " -> " in s.path)
        return "second save of the last step" if last.split("/")[-1] in path else "rotation"
    if " -> checkpoints/step_" in path:
        return "rename into place"
    return "other"
