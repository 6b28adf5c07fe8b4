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


def test_top_camera_sees_the_target_where_it_lies():
    """The overhead camera is nearly orthographic: the named ball's colour peaks at the pixel its
    table position maps to (x right, y up in the image)."""
    from mmrl.envs.tabletop import COLORS

    env = make_tabletop_env("reach", image_size=64, cameras=("top",))
    obs, _ = env.reset(seed=5)
    img = obs["images"]["top"].astype(float)
    rgb = np.array(COLORS[env.init_state.object_colors[0]][:3]) * 255
    row, col = np.unravel_index(np.abs(img - rgb).sum(-1).argmin(), img.shape[:2])
    x, y = env.object_pos[0][:2]
    half = 2.0 * np.tan(np.radians(14) / 2)  # camera height 2 m, fovy 14 degrees: table half-width seen
    expect_col, expect_row = (x / half + 1) * 32, (1 - y / half) * 32
    assert abs(col - expect_col) < 4 and abs(row - expect_row) < 4, (row, col, expect_row, expect_col)
    env.close()


def test_follow_camera_keeps_the_gripper_at_the_centre():
    env = make_tabletop_env("reach", image_size=64, cameras=("follow",))
    env.reset(seed=5)
    before = env.render_cameras()["follow"]
    for _ in range(6):
        obs, *_ = env.step(np.array([1, 1, 0, 0, 0, 0, 1], np.float32))
    after = obs["images"]["follow"]
    grey = lambda img: (np.ptp(img.astype(int), -1) < 20) & (img.mean(-1) < 200)  # noqa: E731 (not table, not a ball)
    # The grey gripper stays in the centre of the view while it moves; the scene shifts under it.
    for img in (before, after):
        rows, cols = np.nonzero(grey(img))
        assert abs(rows.mean() - 31.5) < 4 and abs(cols.mean() - 31.5) < 4
    assert np.abs(before.astype(int) - after.astype(int)).mean() > 1
    env.close()


def _libero_assets() -> bool:
    try:
        from mmrl.envs.libero.env import default_assets_dir

        return (default_assets_dir() / "scenes").is_dir()
    except ImportError:
        return False


def test_an_env_left_open_exits_without_egl_noise():
    """Renderers still open at interpreter exit are freed before MuJoCo terminates its EGL display."""
    import importlib.util
    import subprocess
    import sys

    code = ("from mmrl.envs.tabletop import make_tabletop_env\n"
            "env = make_tabletop_env('reach', image_size=32)\n"
            "env.reset(seed=1)\n")
    if importlib.util.find_spec("libero") is not None and _libero_assets():
        # robosuite terminates the shared EGL display at exit before our hook runs: still quiet.
        code += ("from mmrl.envs.libero.env import make_libero_env\n"
                 "make_libero_env('libero_spatial', 0, image_size=32).reset(options={'init_state_id': 0})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Exception ignored" not in proc.stderr and "EGL" not in proc.stderr, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- LIBERO-like layouts


@pytest.mark.parametrize("task", TASK_NAMES)
def test_jittered_states_stay_near_their_instructions_template(task):
    from mmrl.envs.tabletop.tasks import layout_template

    j = 0.03
    variants = get_task_def(task).instruction_variants()
    templates = {v: layout_template(task, v, j) for v in variants}
    seen = set()
    for seed in range(60):
        s = sample_init_state(task, seed, position_jitter=j)
        v = next(v for v, t in templates.items() if t.instruction == s.instruction)
        t = templates[v]
        seen.add(v)
        # Same scene identity (distractor colours included), positions within +-j of the template.
        assert s.object_colors == t.object_colors and s.zone_colors == t.zone_colors
        assert np.abs(s.object_xy - t.object_xy).max() <= j + 1e-12
        assert np.abs(s.zone_xy - t.zone_xy).max() <= j + 1e-12 if len(t.zone_xy) else True
        assert np.abs(s.gripper_xyz - t.gripper_xyz).max() <= j + 1e-12
        # The usual solvability rules still hold: objects apart, blocks out of zones.
        d = np.linalg.norm(s.object_xy[:, None] - s.object_xy[None], axis=-1)
        assert d[~np.eye(len(d), dtype=bool)].min() >= 0.09
        if get_task_def(task).object_kind == "block":
            assert all(np.abs(p - z).max() > 0.085 for p in s.object_xy for z in s.zone_xy)
        # Seeded, and the noise is real: a state is not its template.
        assert np.array_equal(s.object_xy, sample_init_state(task, seed, position_jitter=j).object_xy)
        assert not np.allclose(s.object_xy, t.object_xy)
    assert len(seen) == len(variants)  # the seed still draws the language task
    # Different instructions have different layouts; the layout seed changes them all.
    xys = [t.object_xy for t in templates.values()]
    assert all(not np.allclose(a, b) for i, a in enumerate(xys) for b in xys[i + 1:])
    other = layout_template(task, variants[0], j, layout_seed=1)
    assert not np.allclose(other.object_xy, templates[variants[0]].object_xy)
    # Pinned colours give that instruction's template, jittered.
    pinned = sample_init_state(task, 3, colors=variants[-1], position_jitter=j)
    assert pinned.instruction == templates[variants[-1]].instruction
    assert np.abs(pinned.object_xy - templates[variants[-1]].object_xy).max() <= j + 1e-12


def test_uniform_sampling_stays_the_default():
    # position_jitter=None draws layouts uniformly over the table: the template layouts do not.
    a = np.stack([sample_init_state("reach", s).object_xy[0] for s in range(200)])
    b = np.stack([sample_init_state("reach", s, position_jitter=0.02).object_xy[0] for s in range(200)])
    assert a.std(0).min() > 0.07 and b.std(0).max() < a.std(0).min()
    assert np.array_equal(sample_init_state("push", 9).object_xy,
                          sample_init_state("push", 9, position_jitter=None, layout_seed=5).object_xy)


@pytest.mark.parametrize("bad", [-0.01, 0.2, "0.03", True])
def test_bad_position_jitter_names_the_parameter(bad):
    with pytest.raises(ValueError, match="position_jitter"):
        sample_init_state("reach", 0, position_jitter=bad)
    with pytest.raises(ValueError, match="position_jitter"):
        make_tabletop_env("reach", position_jitter=bad)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_scripted_expert_succeeds_on_jittered_states(task):
    env = make_tabletop_env(task, render_mode=None, position_jitter=0.04)
    assert env.reset(seed=4)[1]["instruction"] == sample_init_state(task, 4, position_jitter=0.04).instruction
    np.testing.assert_allclose(env.init_state.object_xy, sample_init_state(task, 4, position_jitter=0.04).object_xy)
    rate = np.mean([run_expert(env, seed)[0] for seed in range(40)])
    assert rate >= 0.95, f"{task} expert success {rate:.2f} on jittered states"
