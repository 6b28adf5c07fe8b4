"""MuJoCo tabletop tasks: seeded initial states, observations, physics-honest success, scripted experts."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from mmrl.envs.tabletop import (
    ACTION_DIM,
    STATE_DIM,
    TASK_NAMES,
    get_task_def,
    make_expert,
    make_tabletop_env,
    run_expert,
    sample_init_state,
)
from mmrl.envs.vector import SyncVectorEnv, VectorEnv


def test_unknown_task_lists_valid_ones():
    with pytest.raises(ValueError, match="valid: reach, push, pick_place"):
        make_tabletop_env("stack")
    with pytest.raises(ValueError, match="unknown camera"):
        make_tabletop_env("reach", cameras=("side",))


@pytest.mark.parametrize("task", TASK_NAMES)
def test_initial_states_are_seeded(task):
    a, b, c = sample_init_state(task, 5), sample_init_state(task, 5), sample_init_state(task, 6)
    assert a.instruction == b.instruction and np.array_equal(a.object_xy, b.object_xy)
    assert not np.array_equal(a.object_xy, c.object_xy)
    assert a.object_colors[0] in a.instruction
    # Pinning the language task: one state per instruction variant.
    variants = get_task_def(task).instruction_variants()
    pinned = [sample_init_state(task, 0, colors=v) for v in variants]
    assert len({s.instruction for s in pinned}) == len(variants)
    with pytest.raises(ValueError, match="not valid"):
        sample_init_state(task, 0, colors=("black", None))


@pytest.mark.parametrize("task", TASK_NAMES)
def test_observations_and_reset_determinism(task):
    env = make_tabletop_env(task, image_size=48)
    obs, info = env.reset(seed=3)
    assert set(obs["images"]) == {"front", "wrist"}
    for img in obs["images"].values():
        assert img.shape == (48, 48, 3) and img.dtype == np.uint8 and img.std() > 5  # not blank
    assert obs["state"].shape == (STATE_DIM,) and obs["state"].dtype == np.float32
    assert env.instruction == info["instruction"] and not env.success
    assert env.observation_space.contains(obs)
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (5, ACTION_DIM)).astype(np.float32)
    for a in actions:
        obs1, *_ = env.step(a)
    # The same seed replays the same trajectory; a chunk equals its single steps.
    env.reset(seed=3)
    obs2, *_, info2 = env.step_chunk(actions)
    assert info2["steps_executed"] == 5
    np.testing.assert_array_equal(obs1["state"], obs2["state"])
    np.testing.assert_array_equal(obs1["images"]["front"], obs2["images"]["front"])
    with pytest.raises(ValueError, match="7 values"):
        env.step(np.zeros(6))
    env.close()


@pytest.mark.parametrize("task", TASK_NAMES)
def test_scripted_expert_succeeds_on_most_seeds(task):
    env = make_tabletop_env(task, render_mode=None)
    results = [run_expert(env, seed) for seed in range(20)]
    rate = np.mean([ok for ok, _ in results])
    assert rate >= 0.8, f"{task} expert success {rate:.2f}"
    assert max(n for ok, n in results if ok) < env.max_episode_steps


def test_success_terminates_with_reward_one_and_random_actions_rarely_succeed():
    env = make_tabletop_env("pick_place", image_size=32)
    expert = make_expert("pick_place")
    env.reset(seed=11)
    total, terminated = 0.0, False
    for _ in range(env.max_episode_steps):
        _, r, terminated, truncated, info = env.step(expert.act(env))
        total += r
        if terminated or truncated:
            break
    assert terminated and env.success and info["success"] and total == 1.0
    # Block really left the table and landed in the goal zone.
    assert np.abs(env.object_pos[0][:2] - env.zone_xy[0]).max() < 0.05
    # A zero policy never succeeds: the episode truncates.
    env.reset(seed=11)
    for _ in range(env.max_episode_steps):
        _, r, terminated, truncated, _ = env.step(np.zeros(ACTION_DIM))
    assert truncated and not terminated and not env.success


def test_tabletop_in_worker_processes_matches_in_process():
    specs = [{"task": t, "image_size": 32} for t in ("reach", "reach", "push", "pick_place")]
    ids = [4, 4, 5, 6]
    actions = np.random.default_rng(1).uniform(-1, 1, (4, 8, ACTION_DIM)).astype(np.float32)
    sync = SyncVectorEnv((make_tabletop_env, specs))
    ref_obs = sync.reset(init_state_ids=ids)
    ref = sync.step_chunk(actions)
    with VectorEnv((make_tabletop_env, specs), num_workers=2, start_timeout_s=120) as vec:
        obs = vec.reset(init_state_ids=ids)
        assert obs.instruction == ref_obs.instruction and obs.instruction[0] == obs.instruction[1]
        assert obs.images["front"].shape == (4, 32, 32, 3) and obs.state.shape == (4, STATE_DIM)
        out = vec.step_chunk(actions)
        np.testing.assert_array_equal(out.obs.state, ref.obs.state)
        np.testing.assert_array_equal(out.obs.images["wrist"], ref.obs.images["wrist"])
        assert vec.get_attr("max_episode_steps") == [40, 40, 80, 96]
    sync.close()


def test_factory_specs_accept_partial():
    vec = SyncVectorEnv([partial(make_tabletop_env, "reach", image_size=16)] * 2)
    obs = vec.reset(seeds=7)  # base seed: env i gets 7 + i
    assert obs.images["front"].shape == (2, 16, 16, 3) and obs.instruction[0] != ""
    vec.close()
