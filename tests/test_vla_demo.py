"""The VLA demo pieces: the tabletop task source, its real recorded demos, a trainer run with the
demo config (SFT then GRPO, shortened) and the GPU benchmark's CPU smoke mode."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

# Checked without importing mujoco: it must first be imported by mmrl.envs.tabletop, which picks
# the headless GL backend (mujoco reads MUJOCO_GL once, at import).
if importlib.util.find_spec("mujoco") is None:
    pytest.skip("the tabletop tasks need mujoco (pip install 'mmrl[robot]')", allow_module_level=True)

from mmrl.envs import make_task, task_names  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory) -> Path:
    """Two real scripted `reach` demos, recorded once for the module (as a TabletopTask does)."""
    root = tmp_path_factory.mktemp("demos") / "reach2"
    task = make_task("tabletop", seed=0, demos_per_task=2, demo_root=str(root))
    task.demo_frames()
    return root


def test_contexts_are_init_states_disjoint_and_seeded():
    assert {"tabletop", "libero"} <= set(task_names())
    task = make_task("tabletop", seed=0, tasks=["reach", "push"], n_train=20, n_eval=6)
    batch = task.next_batch(5)
    assert all(set(c) == {"task", "init_state_id"} for c in batch)
    train = {(c["task"], c["init_state_id"]) for c in task.train}
    test = {(c["task"], c["init_state_id"]) for c in task.test}
    assert len(train) == 40 and len(test) == 12 and not train & test
    # The held-out list interleaves tasks, so a short eval covers both.
    assert [c["task"] for c in task.eval_batch(4)] == ["reach", "push", "reach", "push"]
    assert task.eval_batch(100) == task.eval_batch(12)
    # One epoch of the stream visits every training state once.
    fresh = make_task("tabletop", seed=0, tasks=["reach", "push"], n_train=20, n_eval=6)
    assert {(c["task"], c["init_state_id"]) for c in fresh.next_batch(40)} == train
    assert make_task("tabletop", seed=1, tasks=["reach"]).test != make_task("tabletop", seed=0, tasks=["reach"]).test
    assert set(task.corpus()) >= {"touch the red ball", "push the red block to the green zone"}


def test_libero_contexts_follow_the_paper_protocol():
    task = make_task("libero", seed=0, suite="spatial", task_ids=[0, 3], eval_trials=50, train_states=10)
    assert task.eval_batch(3) == [{"suite": "libero_spatial", "task_id": t, "init_state_id": i}
                                  for i, t in ((0, 0), (0, 3), (1, 0))]
    assert len(task.test) == 100 and len(task.train) == 20
    assert {c["task_id"] for c in task.next_batch(20)} == {0, 3}
    with pytest.raises(ValueError, match="task_ids: 12 out of range"):
        make_task("libero", seed=0, task_ids=[12])
    with pytest.raises(ValueError, match="LIBERO SFT needs task.params.demo_root"):
        task.sft_batch(1, np.random.default_rng(0))


def test_resume_continues_the_stream_exactly():
    a = make_task("tabletop", seed=3, n_train=7)
    a.next_batch(5)
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints store it as plain data
    expected = a.next_batch(12)  # crosses an epoch boundary
    b = make_task("tabletop", seed=3, n_train=7)
    b.load_state_dict(state)
    assert b.next_batch(12) == expected


def test_bad_params_name_the_value():
    with pytest.raises(ValueError, match="unknown tabletop task 'stack'"):
        make_task("tabletop", seed=0, tasks=["stack"])
    with pytest.raises(ValueError, match="eval_mode: invalid value 'best'"):
        make_task("tabletop", seed=0, eval_mode="best")
    with pytest.raises(ValueError, match="unknown camera 'side'"):
        make_task("tabletop", seed=0, cameras=["side"])
    with pytest.raises(ValueError, match="n_eval must be an integer >= 1"):
        make_task("tabletop", seed=0, n_eval=0)


def test_position_jitter_reaches_the_envs_and_keys_the_demo_cache():
    from mmrl.envs.tabletop import sample_init_state

    from mmrl.episodes import init_ids

    with pytest.raises(ValueError, match="task.params.position_jitter"):
        make_task("tabletop", seed=0, position_jitter=0.5)
    with pytest.raises(ValueError, match="task.params.layout_seed"):
        make_task("tabletop", seed=0, position_jitter=0.03, layout_seed=-1)
    uniform = make_task("tabletop", seed=0, n_train=6, n_eval=3, image_size=16)
    jit = make_task("tabletop", seed=0, n_train=6, n_eval=3, image_size=16, position_jitter=0.03)
    # The same disjoint ids; only the states they name differ.
    assert jit.train == uniform.train and jit.test == uniform.test
    assert not {c["init_state_id"] for c in jit.train} & {c["init_state_id"] for c in jit.test}
    # Jittered demos never share a cache dir with uniform ones (or with another jitter / layout).
    names = {make_task("tabletop", seed=0, **kw).demo_root.name
             for kw in ({}, {"position_jitter": 0.03}, {"position_jitter": 0.02},
                        {"position_jitter": 0.03, "layout_seed": 1})}
    assert len(names) == 4
    rows = jit.eval_batch(3)
    env = jit.env_factory(rows)
    env.reset(*init_ids(rows))
    got = [r.env.init_state for r in env._runners]
    want = [sample_init_state("reach", c["init_state_id"], position_jitter=0.03) for c in rows]
    for g, w in zip(got, want):
        assert g.instruction == w.instruction and np.array_equal(g.object_xy, w.object_xy)
    jit.env_factory.close()


def test_next_training_batch_is_reset_while_the_policy_trains():
    """After a training rollout, the task's env factory starts the workers' resets to the next
    batch's states (what the trainer's next `next_batch` returns); eval rollouts prefetch nothing."""
    from mmrl.episodes import init_ids

    task = make_task("tabletop", seed=0, n_train=5, n_eval=2, num_workers=1, image_size=16)
    G = 2
    rows = [c for c in task.next_batch(2) for _ in range(G)]
    factory = task.env_factory
    env = factory(rows)
    env.reset(*init_ids(rows))
    assert task.upcoming_rows([c for c in task.eval_batch(2) for _ in range(G)]) is None
    factory.rollout_done(rows)
    following = [c for c in task.next_batch(2) for _ in range(G)]
    assert env._pending_reset is not None
    assert [sid for _, _, sid in env._pending_reset[0]] == [c["init_state_id"] for c in following]
    obs = env.reset(*init_ids(following))  # collects the prefetched reset
    assert env._pending_reset is None and obs.state.shape == (2 * G, 8)
    assert make_task("tabletop", seed=0, num_workers=1, prefetch_resets=False).env_factory.upcoming is None
    factory.close()


def test_sft_batch_from_recorded_demos(demo_root):
    task = make_task("tabletop", seed=0, demos_per_task=2, demo_root=str(demo_root), chunk_size=8)
    batch = task.sft_batch(6, np.random.default_rng(0))
    assert len(batch) == 6
    for c in batch:
        assert c["images"]["front"].shape == (64, 64, 3) and c["images"]["front"].dtype == np.uint8
        assert c["actions"].shape == (8, 7) and c["action_is_pad"].shape == (8,) and c["state"].shape == (8,)
        assert c["instruction"].startswith("touch the ") and c["task"] == "reach"
        assert np.abs(c["actions"]).max() <= 1.0
    frames = task.demo_frames()
    assert len({f["episode_index"] for f in frames}) == 2
    # The last frame of an episode pads the chunk past the episode's end.
    assert any(f["action_is_pad"].any() for f in frames)
    # Same rng, same batch.
    again = task.sft_batch(6, np.random.default_rng(0))
    assert all(np.array_equal(x["actions"], y["actions"]) for x, y in zip(batch, again))


def test_trainer_smoke_with_the_demo_config(demo_root, tmp_path):
    """configs/vla_tabletop_grpo.yaml shortened: SFT 2 steps, GRPO 2 steps, short episodes."""
    from mmrl import build
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "vla_tabletop_grpo.yaml", [
        f"task.params.demo_root={demo_root}", "task.params.demos_per_task=2", "task.params.n_eval=2",
        "task.params.eval_samples=1", "model.params.max_chunks=2", "model.params.max_image_tokens=4",
        "sft.steps=2", "sft.batch_size=4", "train.steps=2", "train.prompts_per_step=1", "sampling.group_size=2",
        "algo.success_filter=null", "train.eval_every=0", "train.eval_size=2", "train.progress=false",
        f"train.output_dir={tmp_path}"])
    task, policy = build(cfg)
    results = Trainer(cfg, policy, task).train(resume=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sft = [r["sft/loss"] for r in rows if "sft/loss" in r]
    train = [r for r in rows if "train/loss" in r]
    assert len(sft) == 2 and all(math.isfinite(x) for x in sft)
    assert len(train) == 2
    for r in train:
        for k in ("train/loss", "train/entropy", "train/grad_norm", "reward/success"):
            assert math.isfinite(r[k]), (k, r[k])
    after = results["eval_after"]
    assert 0 <= after["eval/success"] <= 1 and 0 <= after["eval/sampled/success"] <= 1
    assert after["eval/sampled/episode_len"] > 0 and "eval/sampled/success/reach" in after


def test_gpu_vla_bench_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_vla.py"), "--smoke"], capture_output=True,
                          text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 2 and result["episodes"] == 4 and result["device"] == "cpu"
    for key in ("rollout_env_steps_per_s", "rollout_action_tokens_per_s", "update_tokens_per_s", "step_s",
                "env_s", "policy_rollout_s", "update_s"):
        assert result[key] > 0, key
    assert result["gpu_share"] + result["env_share"] == pytest.approx(1.0, abs=1e-3)


def test_vla_eval_tables_and_videos(tmp_path):
    """SRPO-style table from eval records and a run's results.json; rollout GIFs."""
    from mmrl.evals.vla_eval import records_from_results, table, write_videos

    run = tmp_path / "grpo_run"
    run.mkdir()
    ev = lambda s, g, x: {"step": s, "eval/success": g, "eval/sampled/success": x,
                          "eval/sampled/success/reach": x, "eval/sampled/episode_len": 30.0}
    (run / "results.json").write_text(json.dumps({"eval_before": ev(0, 0.0, 0.25), "eval_after": ev(50, 0.5, 0.625)}))
    recs = records_from_results(run / "results.json")
    assert [r["method"] for r in recs] == ["grpo_run (start)", "grpo_run"]
    libero = {"method": "grpo_run", "modes": {"sampled": {"columns": {"libero_spatial": 0.9}, "average": 0.9,
                                                          "episode_len": {"libero_spatial": 120.0}}}}
    md = table([*recs, libero], "sampled")
    assert md.splitlines()[0] == "| Method | Reach | Spatial | Avg | Ep. len |"
    assert "| grpo_run (start) | 25.0 | — | 25.0 | 30.0 |" in md
    assert "| grpo_run | 62.5 | 90.0 | 76.2 | 75.0 |" in md
    frames = np.zeros((3, 16, 16, 3), np.uint8)
    outputs = [{"success": True, "frames": frames}, {"success": False, "frames": frames}]
    paths = write_videos([{"task": "reach", "init_state_id": 1}, {"task": "reach", "init_state_id": 2}], outputs,
                         tmp_path / "videos", n=2)
    gifs = sorted(p.name for p in paths if p.suffix == ".gif")
    assert gifs == ["00_reach_1_success.gif", "01_reach_2_failure.gif"]


def test_vla_resume_is_exact(demo_root, tmp_path):
    """The VLA demo stopped after step 2's checkpoint and resumed by a new Trainer (new envs, new
    policy) ends with the weights of a run that never stopped."""
    from mmrl import build
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    def trainer(out):
        cfg = load_config(ROOT / "configs" / "vla_tabletop_grpo.yaml", [
            f"task.params.demo_root={demo_root}", "task.params.demos_per_task=2", "task.params.n_eval=2",
            "task.params.eval_samples=1", "model.params.max_chunks=2", "model.params.max_image_tokens=4",
            "sft.steps=2", "sft.batch_size=4", "train.steps=4", "train.save_every=2", "train.prompts_per_step=1",
            "sampling.group_size=2", "algo.success_filter=null", "train.eval_every=0", "train.eval_size=2",
            "train.progress=false", f"train.output_dir={out}"])
        task, policy = build(cfg)
        return Trainer(cfg, policy, task)

    straight = trainer(tmp_path / "a")
    straight.train(resume=False)
    stopped = trainer(tmp_path / "b")
    stopped.cfg.train.steps = 2  # killed right after step 2's checkpoint
    stopped.train(resume=False)
    resumed = trainer(tmp_path / "b")
    resumed.train()
    assert resumed.step == straight.step == 4
    a, b = straight.policy.model.state_dict(), resumed.policy.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
