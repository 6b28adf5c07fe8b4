"""Kill a training run with SIGKILL after each of its filesystem steps in turn, start the same command
again, and check that the folder ends as an uninterrupted run's (final/ byte for byte, the same
checkpoints, evaluations and metric rows, no leftovers): the method of Pillai et al., "All File
Systems Are Not Created Equal" (OSDI 2014). Prints a line per crash point and, last,
"N of N crash points resumed whole". tests/test_crash_points.py runs a few points of each kind.

    .venv/bin/python scripts/crash_sweep.py              # the digit-sort demo, one process (~10 min on 2 cores)
    .venv/bin/python scripts/crash_sweep.py --nproc 2    # sharded checkpoints under torchrun, 2 gloo ranks
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from crash_points import COMMAND, SHARDED_COMMAND, crash_and_resume, kind_of, reference  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) of the run; 2 sweeps sharded checkpoints")
    parser.add_argument("--points", help="comma-separated step numbers to kill after (default: every step)")
    parser.add_argument("--work", help="folder for the runs (default: a new temporary one, removed at the end)")
    parser.add_argument("--json", help="write the per-point results here")
    args = parser.parse_args()
    command = SHARDED_COMMAND if args.nproc > 1 else COMMAND
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="mmrl_crash_sweep_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"command: mmrl {' '.join(command)}" + (f" --nproc {args.nproc}" if args.nproc > 1 else ""), flush=True)
    ref, steps = reference(work, command, nproc=args.nproc)
    chosen = [steps[int(k) - 1] for k in args.points.split(",")] if args.points else steps
    print(f"the uninterrupted run makes {len(steps)} filesystem steps under its folder; killing after each of "
          f"{len(chosen)}", flush=True)
    results = []
    for step in chosen:
        differences = crash_and_resume(ref, work, step.index, command, nproc=args.nproc)
        results.append({"after": step.index, "kind": kind_of(step, steps), "event": step.event, "path": step.path,
                        "differences": differences})
        verdict = "resumed whole" if not differences else "DIFFERS: " + "; ".join(differences)
        print(f"{step.index:3d}  {kind_of(step, steps):<30} {step.event:<10} {step.path}: {verdict}", flush=True)
    whole = sum(not r["differences"] for r in results)
    print(f"{whole} of {len(results)} crash points resumed whole")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "nproc": args.nproc, "points": results}, indent=1))
    if not args.work and whole == len(results):
        shutil.rmtree(work)
    return 0 if whole == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
