"""What the benches share: run one setting in its own process and read its `RESULT {json}` line."""

from __future__ import annotations

import json
import subprocess
import sys


def run_child(cmd: list[str], env: dict, what: str, cwd=None) -> dict:
    """Run `cmd`; its last `RESULT ` line as a dict. A failed child shows the tail of its output
    and ends the bench with one line naming `what` failed."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"{what} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT "):])
