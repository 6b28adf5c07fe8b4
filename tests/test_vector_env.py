"""VectorEnv / SyncVectorEnv: batching, chunks, sticky done, and surviving worker crashes."""

from __future__ import annotations

import logging
import os
import signal
import time
from functools import partial

import numpy as np
import pytest
from mmrl.envs.vector import ObsBatch, SyncVectorEnv, VectorEnv

CRASH_SEED = 666  # reset with this seed arms the crash: a fresh env after a restart is healthy


class ToyEnv:
    """A 1-D walk with a 2x2 'camera': action[0] > 0 moves right; success at `goal`.
    With seed CRASH_SEED it misbehaves at step `crash_at` in the way `mode` says."""

    def __init__(self, goal: int = 3, max_episode_steps: int = 6, mode: str = "exit", crash_at: int = 2):
        self.goal, self.max_episode_steps, self.mode, self.crash_at = goal, max_episode_steps, mode, crash_at
        self.instruction = ""
        self.pos = self.t = 0
        self.armed = False

    @property
    def success(self) -> bool:
        return self.pos >= self.goal

    def _obs(self):
        img = np.full((2, 2, 3), self.pos, np.uint8)
        return {"images": {"cam": img}, "state": np.array([self.pos, self.t], np.float32)}

    def reset(self, *, seed=None, options=None):
        start = (options or {}).get("init_state_id", 0)
        self.pos, self.t, self.armed = start, 0, seed == CRASH_SEED
        self.instruction = f"walk to {self.goal} from {start}"
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        if self.armed and self.t == self.crash_at:
            if self.mode == "exit":
                os._exit(1)
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "hang":
                time.sleep(30)
            if self.mode == "raise":
                raise ValueError("simulated physics blow-up")
        self.pos += 1 if action[0] > 0 else 0
        done = self.success
        return self._obs(), float(done), done, self.t >= self.max_episode_steps and not done, {}

    def close(self):
        pass


def _right(n, k=None):
    a = np.zeros((n, 7), np.float32)
    a[:, 0] = 1
    return a if k is None else np.repeat(a[:, None], k, 1)


def test_sync_batches_done_is_sticky_and_chunks_stop_at_the_end():
    vec = SyncVectorEnv([partial(ToyEnv, goal=3) for _ in range(3)])
    obs = vec.reset(init_state_ids=[0, 1, 2])
    assert isinstance(obs, ObsBatch) and obs.images["cam"].shape == (3, 2, 2, 3) and obs.state.shape == (3, 2)
    assert obs.instruction == ["walk to 3 from 0", "walk to 3 from 1", "walk to 3 from 2"]
    out = vec.step(_right(3))
    assert out.done.tolist() == [False, False, True] and out.success.tolist() == [False, False, True]
    assert out.reward.tolist() == [0, 0, 1]
    out = vec.step_chunk(_right(3, k=4))  # env 0 needs 2 more steps, env 1 one more; env 2 is finished
    assert out.done.all() and out.success.all()
    assert [i.get("steps_executed") for i in out.info] == [2, 1, None]
    assert out.reward.tolist() == [1, 1, 0]  # a finished env earns nothing more
    assert out.obs.state[:, 0].tolist() == [3, 3, 3]
    with pytest.raises(ValueError, match="num_envs=3"):
        vec.step(np.zeros((2, 7)))
    with pytest.raises(ValueError, match="init_state_ids has 2 entries"):
        vec.reset(init_state_ids=[0, 1])


def test_sync_contains_an_exception_to_its_env():
    vec = SyncVectorEnv((partial(ToyEnv, mode="raise"), [{}, {}]))  # factory + specs form
    vec.reset(seeds=[CRASH_SEED, 0])
    vec.step(_right(2))
    out = vec.step(_right(2))
    assert out.done.tolist() == [True, False] and out.info[0]["crashed"] and "blow-up" in out.info[0]["error"]
    assert not out.success[0]
    vec.reset(seeds=[1, 2])  # the rebuilt env works
    assert not vec.step(_right(2)).done.any()


def test_worker_processes_match_in_process_results():
    fns = [partial(ToyEnv, goal=4) for _ in range(5)]
    with VectorEnv(fns, num_workers=2, start_timeout_s=60) as vec:
        sync = SyncVectorEnv(fns)
        a, b = vec.reset(init_state_ids=[0, 1, 2, 3, 0]), sync.reset(init_state_ids=[0, 1, 2, 3, 0])
        assert a.instruction == b.instruction and np.array_equal(a.state, b.state)
        for step in (vec.step_chunk, vec.step):
            x = step(_right(5, k=2) if step == vec.step_chunk else _right(5))
            y = getattr(sync, step.__name__)(_right(5, k=2) if step == vec.step_chunk else _right(5))
            assert np.array_equal(x.obs.state, y.obs.state) and np.array_equal(x.obs.images["cam"], y.obs.images["cam"])
            assert np.array_equal(x.done, y.done) and np.array_equal(x.success, y.success)
            assert np.array_equal(x.reward, y.reward)
        assert vec.get_attr("goal") == [4] * 5


def test_worker_crash_mid_rollout_fails_its_trajectories_and_the_run_goes_on(caplog):
    # Envs 0-1 live in worker 0, envs 2-3 in worker 1. Each crash kind hits worker 0 at step 2.
    fns = [partial(ToyEnv, goal=5, max_episode_steps=8, mode=m) for m in ("exit", "exit", "kill", "hang")]
    with VectorEnv(fns, num_workers=2, step_timeout_s=3.0, start_timeout_s=60) as vec:
        for crash_env, kind in ((0, "os._exit"), (2, "kill -9"), (3, "timeout")):
            seeds = [0, 1, 2, 3]
            seeds[crash_env] = CRASH_SEED
            vec.reset(seeds=seeds)
            pids = vec.worker_pids
            restarts = vec.restarts
            first = vec.step(_right(4))
            assert not first.done.any()
            with caplog.at_level(logging.WARNING, logger="mmrl.envs.vector"):
                out = vec.step(_right(4))
            hit = [0, 1] if crash_env < 2 else [2, 3]
            spared = [2, 3] if crash_env < 2 else [0, 1]
            assert out.done[hit].all() and not out.success[hit].any(), kind
            assert all(out.info[g]["crashed"] for g in hit), kind
            assert not out.done[spared].any() and not any(out.info[g].get("crashed") for g in spared), kind
            assert out.obs.state[hit, 0].tolist() == [1, 1]  # the last observation seen before the crash
            assert "crashed" in caplog.text and "restarted" in caplog.text
            caplog.clear()
            assert vec.restarts == restarts + 1
            assert vec.worker_pids[hit[0] // 2] != pids[hit[0] // 2]
            # The crashed envs stay done; the others finish their episodes normally.
            out = vec.step_chunk(_right(4, k=8))
            assert out.success[spared].all() and not out.success[hit].any()
            # A following reset + step works on the restarted worker.
            vec.reset(seeds=[10, 11, 12, 13])
            out = vec.step(_right(4))
            assert not out.done.any() and out.obs.state[:, 0].tolist() == [1, 1, 1, 1]


class SlowResetEnv(ToyEnv):
    """A ToyEnv whose reset takes `delay` seconds (as LIBERO's does), to time overlapped resets."""

    def __init__(self, delay: float = 0.4, **kwargs):
        super().__init__(**kwargs)
        self.delay = delay

    def reset(self, **kwargs):
        time.sleep(self.delay)
        return super().reset(**kwargs)


def test_reset_async_overlaps_other_work_and_stale_prefetches_are_dropped():
    with VectorEnv([partial(SlowResetEnv, delay=0.4) for _ in range(2)], num_workers=2) as vec:
        vec.reset_async(init_state_ids=[1, 2])
        time.sleep(0.6)  # the caller's own work (a policy update) while the workers reset
        t0 = time.perf_counter()
        obs = vec.reset(init_state_ids=[1, 2])
        assert time.perf_counter() - t0 < 0.3  # only collected: the 0.4 s resets already ran
        assert obs.state[:, 0].tolist() == [1, 2]
        out = vec.step(_right(2))
        assert out.obs.state[:, 0].tolist() == [2, 3]
        # A reset to other states than the pending one asked for overrides it.
        vec.reset_async(init_state_ids=[0, 0])
        assert vec.reset(init_state_ids=[2, 1]).state[:, 0].tolist() == [2, 1]
        # A step completes a pending reset first: the workers did reset.
        vec.reset_async(init_state_ids=[0, 1])
        out = vec.step(_right(2))
        assert out.obs.state[:, 0].tolist() == [1, 2] and not out.done.any()


def test_vector_env_rejects_unpicklable_env_fns():
    with pytest.raises(TypeError, match="picklable"):
        VectorEnv([lambda: ToyEnv()], num_workers=1)


@pytest.mark.robot  # its VLA part needs lerobot's stack
def test_vla_rollout_bench_smoke():
    """bench/vla_rollout.py --smoke runs end to end and its last line is the JSON result. One LIBERO
    env keeps CI short (the 1-vs-N worker ratio needs more envs than that to mean anything)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "bench" / "vla_rollout.py"), "--smoke", "--libero-envs", "1"],
                          capture_output=True, text=True, timeout=300, cwd=root, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    mj = result["mujoco"]
    for key in ("steps_per_s_1w", "steps_per_s_nw", "speedup", "steps_per_s_nw_single_step"):
        assert mj[key] > 0, key
    assert mj["speedup"] == pytest.approx(mj["steps_per_s_nw"] / mj["steps_per_s_1w"], rel=0.01)
    overlap = mj["overlap"]
    assert overlap["step_s_serial"] > 0 and overlap["step_s_overlapped"] > 0 and overlap["reset_s"] > 0
    assert overlap["saved_s_per_step"] == pytest.approx(overlap["step_s_serial"] - overlap["step_s_overlapped"],
                                                        abs=2e-3)
    lib = result["libero"]
    assert "skipped" in lib or (lib["steps_per_s_1w"] > 0 and lib["steps_per_s_nw"] > 0)
