"""Step N robot envs together: in worker processes (`VectorEnv`) or in-process (`SyncVectorEnv`).

An env is anything gymnasium-like with `reset(seed=, options={"init_state_id": i}) -> (obs, info)`,
`step(a) -> (obs, reward, terminated, truncated, info)`, a `success` flag, an `instruction` string,
and optionally `step_chunk(actions[K, A])` (one render per chunk). Observations are
`{"images": {camera: HxWx3 uint8}, "state": float vector}`; batches come back as `ObsBatch`.

Episodes do not auto-reset: once an env is done it is no longer stepped, and it keeps returning its
last observation with done=True and its final success flag until the next `reset`. That is the
shape trajectory-level GRPO wants: G rollouts per initial state, one 0/1 reward each.

A worker that dies (segfault, `os._exit`, kill -9) or does not answer within the timeout marks
the unfinished trajectories of all its envs failed (done, success=False, info["crashed"]=True),
is restarted in the background, and the run goes on; `restarts` counts it. An exception inside one
env's `step` fails only that env's trajectory; the worker rebuilds that env in place. Workers show
in `ps` / `pgrep` as `mmrl-env-worker` (Linux keeps 15 characters of a process name).

`reset_async(seeds, init_state_ids)` starts a reset in the workers and returns at once; the next
`reset` with the same arguments only collects it. A trainer calls it right after a rollout, so the
workers reset to the next batch's initial states while the policy update runs (LIBERO resets take
seconds). A reset once started is done: any other command (a `reset` to other states, a `step`)
first completes the pending one.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import numpy as np

logger = logging.getLogger(__name__)

EnvFn = Callable[[], Any]


@dataclass
class ObsBatch:
    images: dict[str, np.ndarray]  # camera -> uint8 [N, H, W, 3]
    state: np.ndarray  # float32 [N, D]
    instruction: list[str]

    def __len__(self) -> int:
        return len(self.instruction)


class StepBatch(NamedTuple):
    obs: ObsBatch
    reward: np.ndarray  # float32 [N], summed over the executed sub-steps of a chunk
    done: np.ndarray  # bool [N], terminated or truncated or crashed (sticky until reset)
    success: np.ndarray  # bool [N]
    info: list[dict[str, Any]]


# One env's answer, as sent over the pipe: (obs, reward, done, success, info).
_EnvResult = tuple[dict[str, Any] | None, float, bool, bool, dict[str, Any]]


class _EnvRunner:
    """Holds one env in whichever process steps it; an exception in `step` becomes a failed,
    crashed result and the env is rebuilt, so one bad env does not take its neighbours down."""

    def __init__(self, env_fn: EnvFn):
        self.env_fn = env_fn
        self.env = env_fn()

    def reset(self, seed: int | None, init_state_id: int | None) -> dict[str, Any]:
        options = None if init_state_id is None else {"init_state_id": int(init_state_id)}
        try:
            obs, _ = self.env.reset(seed=seed, options=options)
        except Exception:
            # Retry once on a fresh env; a second failure is a real bug and propagates.
            self.rebuild()
            obs, _ = self.env.reset(seed=seed, options=options)
        return self._entry(obs)

    def step(self, actions: np.ndarray) -> _EnvResult:
        """`actions` is [K, A]: K sub-steps, stopping early when the episode ends."""
        try:
            if len(actions) > 1 and hasattr(self.env, "step_chunk"):
                obs, reward, term, trunc, info = self.env.step_chunk(actions)
            else:
                reward, info = 0.0, {}
                for k, a in enumerate(actions):
                    obs, r, term, trunc, info = self.env.step(a)
                    reward += float(r)
                    if term or trunc:
                        break
                info = {**info, "steps_executed": k + 1}
            success = getattr(self.env, "success", info.get("success", False))
            return self._entry(obs), float(reward), bool(term or trunc), bool(success), info
        except Exception as exc:
            tb = traceback.format_exc()
            self.rebuild()
            return None, 0.0, True, False, {"crashed": True, "error": f"{type(exc).__name__}: {exc}", "traceback": tb}

    def rebuild(self) -> None:
        try:
            self.env.close()
        except Exception:
            pass
        self.env = self.env_fn()

    def _entry(self, obs: dict[str, Any]) -> dict[str, Any]:
        return {"images": obs.get("images", {}), "state": np.asarray(obs["state"], np.float32),
                "instruction": str(getattr(self.env, "instruction", ""))}

    def close(self) -> None:
        try:
            self.env.close()
        except Exception:
            pass


def _send_msg(conn: Connection, obj: Any) -> None:
    """`conn.send(obj)` without its memoryview: `Connection.send` pickles into a BytesIO and sends
    `getbuffer()` of it, so when the pipe is broken the error's traceback holds a frame with a view
    of that BytesIO. Once that traceback is in a reference cycle, the garbage collector of CPython
    3.12 (3.12.1 here) can free the BytesIO before the view: "SystemError: deallocated BytesIO object
    has exported buffers", then a segfault (python/cpython#111049, #111331). Bytes export nothing."""
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    conn.send_bytes(buf.getvalue())


def _recv_msg(conn: Connection) -> Any:
    """`conn.recv()` without a view of a BytesIO (see `_send_msg`)."""
    return ForkingPickler.loads(conn.recv_bytes())


def _name_process(name: str) -> None:
    """Show this process as `name` in ps, top and pgrep (Linux; elsewhere it keeps python's name)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])  # the kernel's limit
    except OSError:
        pass


def _worker_main(conn: Connection, env_fns: list[EnvFn]) -> None:
    """One worker process: answer the parent until it says "close" or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _name_process(mp.current_process().name)
    try:
        _serve(conn, env_fns)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent exited or gave up on this worker: there is no one to answer


def _serve(conn: Connection, env_fns: list[EnvFn]) -> None:
    """Build the envs, then answer commands until "close"."""
    try:
        runners = [_EnvRunner(fn) for fn in env_fns]
        _send_msg(conn, ("ready", None))
    except Exception:
        _send_msg(conn, ("error", traceback.format_exc()))
        return
    while True:
        try:
            cmd, payload = _recv_msg(conn)
        except (EOFError, OSError):
            break  # parent went away
        try:
            if cmd == "reset":
                out: Any = [(i, runners[i].reset(seed, sid)) for i, seed, sid in payload]
            elif cmd == "step":
                out = [(i, runners[i].step(a)) for i, a in payload]
            elif cmd == "get_attr":
                out = [getattr(r.env, payload) for r in runners]
            elif cmd == "close":
                for r in runners:
                    r.close()
                _send_msg(conn, ("ok", None))
                break
            else:
                raise ValueError(f"unknown worker command {cmd!r}")
            _send_msg(conn, ("ok", out))
        except Exception:
            _send_msg(conn, ("error", traceback.format_exc()))


class _WorkerDied(Exception):
    """A worker is dead or late. Raised outside `except` blocks (no chained pipe error) and kept
    without traceback (`_died`): the replies dict that holds it is a local of the frames that
    traceback would hold, a cycle that would keep frames, pipes and buffers alive until a GC pass."""


def _died(exc: _WorkerDied) -> _WorkerDied:
    return exc.with_traceback(None)


class _Worker:
    """Parent-side handle of one worker process and its pipe."""

    def __init__(self, ctx, env_fns: list[EnvFn], env_ids: list[int], index: int):
        self.ctx, self.env_fns, self.env_ids, self.index = ctx, env_fns, env_ids, index
        self.start()

    def start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker_main, args=(child, self.env_fns), daemon=True,
                                     name=f"mmrl-env-worker-{self.index}")
        try:
            self.proc.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise TypeError("env functions must be picklable for worker processes (module-level functions, "
                            f"classes or functools.partial of them; not lambdas or closures): {exc}") from exc
        child.close()
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        if not self.ready:
            status, payload = self.recv(timeout)
            if status != "ready":
                raise _WorkerDied(f"env construction failed:\n{payload}")
            self.ready = True

    def send(self, cmd: str, payload: Any) -> None:
        try:
            _send_msg(self.conn, (cmd, payload))
            return
        except (BrokenPipeError, EOFError, OSError) as exc:
            reason = f"pipe broken on send ({exc})"
        raise _WorkerDied(reason)  # not chained to the pipe error (see _WorkerDied)

    def recv(self, timeout: float) -> tuple[str, Any]:
        try:
            if self.conn.poll(max(timeout, 0.0)):
                return _recv_msg(self.conn)
            reason = f"no reply within {timeout:.1f}s"
        except (EOFError, OSError) as exc:
            self.proc.join(timeout=0.5)  # a worker that closed its pipe is exiting: read its exit code
            code = self.proc.exitcode
            reason = f"process exited (exit code {code})" if code is not None else f"pipe closed ({exc})"
        raise _WorkerDied(reason)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()
        try:
            self.proc.close()  # its sentinel fd now, not whenever the Process object is collected
        except ValueError:
            pass  # still running after 5 s in an uninterruptible kernel call: leave it to the OS

    def restart(self) -> None:
        self.kill()
        self.start()  # does not wait: construction overlaps with the other workers' stepping

    @property
    def pid(self) -> int | None:
        return self.proc.pid


def _as_env_fns(env_fns, factory, specs) -> list[EnvFn]:
    if isinstance(env_fns, tuple) and len(env_fns) == 2 and callable(env_fns[0]) and not callable(env_fns[1]):
        factory, specs, env_fns = env_fns[0], env_fns[1], None
    if env_fns is not None:
        fns = list(env_fns)
    elif factory is not None and specs is not None:
        fns = [partial(factory, **s) if isinstance(s, dict) else partial(factory, s) for s in specs]
    else:
        raise ValueError("pass env_fns (a list of zero-argument env constructors) or factory and specs")
    if not fns:
        raise ValueError("no envs: env_fns / specs is empty")
    bad = [i for i, f in enumerate(fns) if not callable(f)]
    if bad:
        raise TypeError(f"env_fns[{bad[0]}] is not callable: {fns[bad[0]]!r}")
    return fns


class _VectorBase:
    """Bookkeeping shared by both vector envs: per-env done/success flags and the last observation,
    so finished or crashed envs answer from cache without a round trip."""

    num_envs: int

    def _init_state(self, n: int) -> None:
        self.num_envs = n
        self._last: list[dict[str, Any] | None] = [None] * n
        self._done = np.ones(n, bool)
        self._success = np.zeros(n, bool)
        self._has_reset = False

    def reset(self, seeds: Sequence[int | None] | int | None = None,
              init_state_ids: Sequence[int | None] | None = None) -> ObsBatch:
        """Reset every env. `seeds` (int = base seed, env i gets base + i) seeds each env;
        `init_state_ids` picks each env's initial state (e.g. LIBERO's official states; for tabletop
        tasks the id is the seed of the state sampler). Repeat an id G times for a GRPO group."""
        self._apply_reset(self._reset_envs(self._reset_requests(seeds, init_state_ids)))
        return self._obs_batch()

    def _apply_reset(self, entries: dict[int, dict]) -> None:
        for g, entry in entries.items():
            self._last[g] = entry
        self._done[:] = False
        self._success[:] = False
        self._has_reset = True

    def reset_async(self, seeds: Sequence[int | None] | int | None = None,
                    init_state_ids: Sequence[int | None] | None = None) -> None:
        """Start `reset(seeds, init_state_ids)` without waiting for it (see the module docstring).
        In-process envs cannot overlap, so here it does nothing and `reset` does the work."""
        self._reset_requests(seeds, init_state_ids)  # validate now, where the caller can see it

    def _reset_requests(self, seeds, init_state_ids) -> list[tuple[int, int | None, int | None]]:
        n = self.num_envs
        if isinstance(seeds, (int, np.integer)):
            seeds = [int(seeds) + i for i in range(n)]
        seeds = self._per_env(seeds, "seeds")
        ids = self._per_env(init_state_ids, "init_state_ids")
        return [(g, seeds[g], ids[g]) for g in range(n)]

    def step(self, actions) -> StepBatch:
        """One action per env, `[N, A]`."""
        actions = np.asarray(actions, np.float32)
        if actions.ndim != 2 or actions.shape[0] != self.num_envs:
            raise ValueError(f"actions must be [num_envs={self.num_envs}, A], got shape {actions.shape}")
        return self._step(actions[:, None])

    def step_chunk(self, actions) -> StepBatch:
        """K actions per env, `[N, K, A]`, run in the worker; returns the obs after the last executed
        sub-step, the summed reward and whether the episode ended within the chunk."""
        actions = np.asarray(actions, np.float32)
        if actions.ndim != 3 or actions.shape[0] != self.num_envs or actions.shape[1] < 1:
            raise ValueError(f"actions must be [num_envs={self.num_envs}, K>=1, A], got shape {actions.shape}")
        return self._step(actions)

    @property
    def done(self) -> np.ndarray:
        return self._done.copy()

    @property
    def success(self) -> np.ndarray:
        return self._success.copy()

    def _step(self, actions: np.ndarray) -> StepBatch:
        if not self._has_reset:
            raise RuntimeError("call reset() before step()")
        n = self.num_envs
        reward = np.zeros(n, np.float32)
        infos: list[dict[str, Any]] = [{} for _ in range(n)]
        active = [g for g in range(n) if not self._done[g]]
        results = self._step_envs({g: actions[g] for g in active}) if active else {}
        for g, (entry, r, done, success, info) in results.items():
            if entry is not None:
                self._last[g] = entry
            crashed = bool(info.get("crashed"))
            if crashed and not info.pop("logged", False):
                logger.warning("env %d crashed mid-episode, trajectory marked failed: %s", g, info.get("error"))
            reward[g] = r
            self._done[g] = done or crashed
            self._success[g] = success and not crashed
            infos[g] = info
        return StepBatch(self._obs_batch(), reward, self._done.copy(), self._success.copy(), infos)

    def _per_env(self, values, name: str) -> list:
        if values is None:
            return [None] * self.num_envs
        values = list(values)
        if len(values) != self.num_envs:
            raise ValueError(f"{name} has {len(values)} entries, expected num_envs={self.num_envs}")
        return [None if v is None else int(v) for v in values]

    def _obs_batch(self) -> ObsBatch:
        entries = self._last
        if any(e is None for e in entries):
            raise RuntimeError("some envs have no observation yet; call reset()")
        cams = list(entries[0]["images"])
        for g, e in enumerate(entries):
            if list(e["images"]) != cams:
                raise ValueError(f"env {g} has cameras {list(e['images'])}, env 0 has {cams}; batch envs must match")
        return ObsBatch(images={c: np.stack([e["images"][c] for e in entries]) for c in cams},
                        state=np.stack([e["state"] for e in entries]),
                        instruction=[e["instruction"] for e in entries])

    def _reset_envs(self, requests: list[tuple[int, int | None, int | None]]) -> dict[int, dict]:
        raise NotImplementedError

    def _step_envs(self, actions: dict[int, np.ndarray]) -> dict[int, _EnvResult]:
        raise NotImplementedError


class SyncVectorEnv(_VectorBase):
    """The same API, all envs in this process (tests, debugging, single-core runs)."""

    def __init__(self, env_fns: Sequence[EnvFn] | tuple | None = None, *, factory: Callable | None = None,
                 specs: Sequence[Any] | None = None):
        self._runners = [_EnvRunner(fn) for fn in _as_env_fns(env_fns, factory, specs)]
        self._init_state(len(self._runners))

    def _reset_envs(self, requests):
        return {g: self._runners[g].reset(seed, sid) for g, seed, sid in requests}

    def _step_envs(self, actions):
        return {g: self._runners[g].step(a) for g, a in actions.items()}

    def get_attr(self, name: str) -> list[Any]:
        return [getattr(r.env, name) for r in self._runners]

    @property
    def envs(self) -> list[Any]:
        return [r.env for r in self._runners]

    def close(self) -> None:
        for r in self._runners:
            r.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VectorEnv(_VectorBase):
    """N envs in `num_workers` processes (contiguous blocks, so a GRPO group shares a worker).

    `VectorEnv(env_fns, num_workers=2)` or `VectorEnv((factory, specs), num_workers=2)` where each spec
    is a kwargs dict (or a single argument) for `factory`. Constructors must be picklable: the default
    "spawn" context starts clean interpreters, which GL contexts and MuJoCo need.
    `step_timeout_s` bounds each step/step_chunk reply, `reset_timeout_s` each reset reply,
    `start_timeout_s` a worker's env construction; a timeout counts as a crash.
    """

    def __init__(self, env_fns: Sequence[EnvFn] | tuple | None = None, num_workers: int = 2, *,
                 factory: Callable | None = None, specs: Sequence[Any] | None = None,
                 step_timeout_s: float = 120.0, reset_timeout_s: float = 300.0, start_timeout_s: float = 300.0,
                 context: str = "spawn"):
        fns = _as_env_fns(env_fns, factory, specs)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        valid = mp.get_all_start_methods()
        if context not in valid:
            raise ValueError(f"unknown multiprocessing context {context!r}; valid here: {', '.join(valid)}")
        self._init_state(len(fns))
        self.step_timeout_s, self.reset_timeout_s, self.start_timeout_s = step_timeout_s, reset_timeout_s, start_timeout_s
        num_workers = min(num_workers, len(fns))
        bounds = np.linspace(0, len(fns), num_workers + 1).round().astype(int)
        ctx = mp.get_context(context)
        self._workers: list[_Worker] = []
        self._pending_reset: tuple[list, list[int], dict[int, Any]] | None = None  # requests, sent, early replies
        self._restarts = 0
        self._owner = np.zeros(len(fns), int)  # env -> worker index
        self._local = np.zeros(len(fns), int)  # env -> index inside its worker
        try:
            for w in range(num_workers):
                ids = list(range(bounds[w], bounds[w + 1]))
                self._owner[ids], self._local[ids] = w, np.arange(len(ids))
                self._workers.append(_Worker(ctx, [fns[g] for g in ids], ids, w))
            for worker in self._workers:
                worker.wait_ready(start_timeout_s)
        except _WorkerDied as exc:
            self.close()
            raise RuntimeError(f"an env worker failed to start: {exc}") from None

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def restarts(self) -> int:
        """How many times any worker has been restarted after a crash (still counted after `close`)."""
        return self._restarts

    @property
    def worker_pids(self) -> list[int | None]:
        return [w.pid for w in self._workers]

    def get_attr(self, name: str) -> list[Any]:
        out: list[Any] = []
        for worker, reply in self._exchange("get_attr", {w.index: name for w in self._workers},
                                            self.reset_timeout_s).items():
            if isinstance(reply, _WorkerDied):
                raise RuntimeError(f"worker {worker} died answering get_attr({name!r}): {reply}")
            out.extend(reply)
        return out

    # ------------------------------------------------------------------ internals
    def _exchange(self, cmd: str, payloads: dict[int, Any], timeout: float) -> dict[int, Any]:
        """Send `cmd` to the workers in `payloads` at once, then gather replies under one deadline.
        A worker that is dead or late comes back as a `_WorkerDied` (and is restarted)."""
        self._complete_pending_reset()
        sent, replies = self._send(cmd, payloads)
        return self._gather(cmd, sent, replies, timeout)

    def _send(self, cmd: str, payloads: dict[int, Any]) -> tuple[list[int], dict[int, Any]]:
        replies: dict[int, Any] = {}
        sent: list[int] = []
        for w, payload in payloads.items():
            worker = self._workers[w]
            try:
                worker.wait_ready(self.start_timeout_s)
                worker.send(cmd, payload)
                sent.append(w)
            except _WorkerDied as exc:
                replies[w] = _died(exc)
        return sent, replies

    def _gather(self, cmd: str, sent: list[int], replies: dict[int, Any], timeout: float) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        for w in sent:
            try:
                status, out = self._workers[w].recv(deadline - time.monotonic())
                # An exception the worker could not contain leaves it in an unknown state: restart it too.
                replies[w] = _WorkerDied(f"raised:\n{out}") if status == "error" else out
            except _WorkerDied as exc:
                replies[w] = _died(exc)
        for w, reply in replies.items():
            if isinstance(reply, _WorkerDied):
                worker = self._workers[w]
                logger.warning("env worker %d (envs %d-%d, pid %s) crashed during %s: %s; its unfinished "
                               "trajectories are marked failed and the worker is restarted",
                               w, worker.env_ids[0], worker.env_ids[-1], worker.pid, cmd, reply)
                worker.restart()
                self._restarts += 1
        return replies

    def _reset_payloads(self, requests) -> dict[int, list]:
        payloads: dict[int, list] = {}
        for g, seed, sid in requests:
            payloads.setdefault(int(self._owner[g]), []).append((int(self._local[g]), seed, sid))
        return payloads

    def _store_resets(self, replies: dict[int, Any], out: dict[int, dict], failed: list[str]) -> None:
        for w, reply in replies.items():
            if isinstance(reply, _WorkerDied):
                failed.append(f"worker {w}: {reply}")
                continue
            ids = self._workers[w].env_ids
            for i, entry in reply:
                out[ids[i]] = entry

    def reset_async(self, seeds=None, init_state_ids=None) -> None:
        requests = self._reset_requests(seeds, init_state_ids)
        self._complete_pending_reset()
        sent, replies = self._send("reset", self._reset_payloads(requests))
        self._pending_reset = (requests, sent, replies)

    def _collect_pending_reset(self, failed: list[str]) -> tuple[list, dict[int, dict]]:
        """The requests of the reset `reset_async` started and the observations it produced."""
        requests, sent, replies = self._pending_reset
        self._pending_reset = None
        out: dict[int, dict] = {}
        self._store_resets(self._gather("reset", sent, replies, self.reset_timeout_s), out, failed)
        return requests, out

    def _complete_pending_reset(self) -> None:
        """Before any other command: the workers ran the pending reset, so record its result (envs
        of a worker that crashed during it count as done, their trajectories failed)."""
        if self._pending_reset is None:
            return
        requests, out = self._collect_pending_reset([])
        self._apply_reset(out)
        self._done[[g for g, _, _ in requests if g not in out]] = True

    def _reset_envs(self, requests):
        out: dict[int, dict] = {}
        failed: list[str] = []
        if self._pending_reset is not None:
            # Started by reset_async while the caller did other work: only collect it when it asked
            # for these states (else it is overwritten by the reset below).
            started, collected = self._collect_pending_reset(failed)
            if started == requests:
                out = collected
        pending = [r for r in requests if r[0] not in out]
        for attempt in range(2):  # a worker that crashes during reset gets one fresh try
            if not pending:
                return out
            self._store_resets(self._exchange("reset", self._reset_payloads(pending), self.reset_timeout_s),
                               out, failed)
            pending = [r for r in pending if r[0] not in out]
        if not pending:
            return out
        raise RuntimeError(f"reset failed for envs {[r[0] for r in pending]}: {'; '.join(failed)}")

    def _step_envs(self, actions):
        payloads: dict[int, list] = {}
        for g, a in actions.items():
            payloads.setdefault(int(self._owner[g]), []).append((int(self._local[g]), a))
        results: dict[int, _EnvResult] = {}
        for w, reply in self._exchange("step", payloads, self.step_timeout_s).items():
            ids = self._workers[w].env_ids
            if isinstance(reply, _WorkerDied):
                for i, _ in payloads[w]:
                    # Already logged per worker; the restarted worker needs a reset before stepping.
                    results[ids[i]] = (None, 0.0, True, False, {"crashed": True, "error": str(reply), "logged": True})
                continue
            for i, res in reply:
                results[ids[i]] = res
        return results

    def close(self) -> None:
        self._pending_reset = None  # the workers are told to close; their queued replies go with them
        for worker in getattr(self, "_workers", []):
            try:
                if worker.ready and worker.proc.is_alive():
                    worker.send("close", None)
                    worker.recv(5.0)
            except (_WorkerDied, RuntimeError):
                pass
            worker.kill()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
