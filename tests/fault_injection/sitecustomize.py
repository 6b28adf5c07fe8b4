"""A crash-point injector (the method of Pillai et al., "All File Systems Are Not Created Equal",
OSDI 2014): counts a process's filesystem steps under one folder and kills the process with SIGKILL
right after the k-th, so that a test can start the same command again and compare the folder with
an uninterrupted run's.

Python imports `sitecustomize` at start-up from the first folder of `sys.path` that holds one, so
putting this folder on PYTHONPATH arms every Python process of a command: torchrun's ranks too. It
does nothing unless MMRL_CRASH_DIR is set:
- MMRL_CRASH_DIR: the folder whose steps count (a run folder);
- MMRL_CRASH_AFTER: kill after this many steps (unset or -1: count only);
- MMRL_CRASH_TRACE: a file to which each counted step is appended as "event<TAB>relative path";
- MMRL_CRASH_RANK: the torchrun rank whose steps count (default 0; a process without RANK is rank 0).

A step is one change of the folder's namespace: mkdir, rename / replace, unlink, rmdir (Python's
audit events os.mkdir, os.rename, os.remove, os.rmdir; os.replace raises os.rename); a mkdir of a
folder that exists changes nothing and is not counted. The hook runs
before the step, so "after the k-th" is the moment step k+1 is about to run, or the process's exit
when there are only k.
"""

import os

_ROOT = os.environ.get("MMRL_CRASH_DIR")

if _ROOT and os.environ.get("RANK", "0") == os.environ.get("MMRL_CRASH_RANK", "0"):
    import atexit
    import signal
    import sys

    _root = os.path.realpath(_ROOT)
    _after = int(os.environ.get("MMRL_CRASH_AFTER", "-1"))
    _trace_path = os.environ.get("MMRL_CRASH_TRACE")
    _trace = open(_trace_path, "a", buffering=1) if _trace_path else None  # opened before the hook is armed
    _count = 0
    _DIR_FD = {"os.mkdir": 2, "os.rename": 2, "os.remove": 1, "os.rmdir": 1}  # event -> where its dir_fd is

    def _kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def _inside(path, dir_fd) -> str | None:
        """`path` relative to the folder, or None when it lies outside."""
        path = os.fsdecode(path)
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):  # shutil.rmtree's fd-relative steps
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        path = os.path.realpath(path)
        return os.path.relpath(path, _root) if path == _root or path.startswith(_root + os.sep) else None

    def _hook(event: str, args) -> None:
        global _count
        if event not in _DIR_FD:
            return
        where = [_inside(args[0], args[_DIR_FD[event]] if len(args) > _DIR_FD[event] else None)]
        if event == "os.rename":
            where.append(_inside(args[1], args[3] if len(args) > 3 else None))
        if all(w is None for w in where):
            return
        if event == "os.mkdir" and os.path.isdir(os.path.join(_root, where[0])):
            return  # makedirs(exist_ok=True) of a folder that is there: no step
        if _count == _after:  # step `_after` is done and another is about to run
            _kill()
        _count += 1
        if _trace is not None:
            _trace.write(f"{event}\t{' -> '.join(w or '(outside)' for w in where)}\n")

    def _at_exit() -> None:
        if _count == _after:  # the run made exactly `_after` steps: killed after its last
            _kill()

    sys.addaudithook(_hook)
    atexit.register(_at_exit)
