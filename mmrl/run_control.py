"""How a run stops: at a step boundary on SIGINT / SIGTERM, or on a fault it cannot train through,
each time with a checkpoint to resume from."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from mmrl.logger import say


class TrainingInterrupted(Exception):
    """SIGINT / SIGTERM stopped training at a step boundary after saving `checkpoint`."""

    def __init__(self, signal_name: str, where: str, checkpoint: Path):
        super().__init__(f"{signal_name} {where}: checkpoint {checkpoint}")
        self.signal_name, self.where, self.checkpoint = signal_name, where, checkpoint


class TrainingFailed(Exception):
    """A fault training cannot go on through (a reward's judge that is down) ended it `where`, after
    saving `checkpoint` (resuming from it re-runs the step the fault stopped)."""

    def __init__(self, reason: str, where: str, checkpoint: Path):
        super().__init__(f"{reason}; stopped {where}; checkpoint saved to {checkpoint}")
        self.reason, self.where, self.checkpoint = reason, where, checkpoint


class TrainingDiverged(TrainingFailed):
    """The policy's loss, gradient or outputs stopped being finite (mmrl.rollout.Diverged) `where`.
    Nothing is saved (those weights are the diverged ones): `checkpoint` is the newest whole one
    from before, or None."""

    def __init__(self, reason: str, where: str, checkpoint: Path | None):
        newest = checkpoint or "none yet (train.save_every: N saves one every N steps)"
        Exception.__init__(self, f"{reason}; stopped {where}: the run has diverged (lower train.lr or raise "
                                 f"train.warmup_steps, and train again); newest checkpoint: {newest}")
        self.reason, self.where, self.checkpoint = reason, where, checkpoint


class StopRequest:
    """While entered (main thread only), SIGINT and SIGTERM ask the training loop to stop at its next
    step boundary, where it saves a checkpoint; a second SIGINT stops at once, without one."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        self.signal_name = None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        say(f"{self.signal_name}: stopping at the end of this step with a checkpoint "
            "(Ctrl-C again stops at once, without one)")

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
