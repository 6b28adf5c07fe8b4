"""LIBERO through hf-libero + robosuite 1.4, offline, with the official initial states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

pytest.importorskip("libero", reason="hf-libero is not installed (pip install 'mmrl[libero]')")

from mmrl.envs.libero.env import LiberoEnv, configure_libero, suite_name  # noqa: E402


def test_suite_names_and_missing_assets_are_clear(tmp_path):
    assert suite_name("spatial") == "libero_spatial" and suite_name("long") == "libero_10"
    with pytest.raises(ValueError, match="valid: .*libero_goal"):
        suite_name("libero_100")
    # The error says where the assets come from (the hub dataset, LIBERO's repository) and how to point at them.
    with pytest.raises(FileNotFoundError, match=r"nowhere \(assets_dir\) does not exist\. .*mmrl fetch-assets libero"
                       r".*lerobot/libero-assets.*MMRL_LIBERO_ASSETS=DIR.*Lifelong-Robot-Learning/LIBERO"):
        configure_libero(tmp_path / "nowhere")


def test_spatial_task0_official_init_state_and_a_few_steps(libero_assets):
    env = LiberoEnv("libero_spatial", task_id=0, image_size=128, settle_steps=2, assets_dir=libero_assets)
    try:
        assert env.instruction == "pick up the black bowl between the plate and the ramekin and place it on the plate"
        assert env.num_init_states == 50 and env.max_episode_steps == 220
        obs, info = env.reset(seed=0, options={"init_state_id": 0})
        assert info["init_state_id"] == 0 and not env.success
        assert {k: v.shape for k, v in obs["images"].items()} == {"agentview": (128, 128, 3), "wrist": (128, 128, 3)}
        assert all(v.dtype == np.uint8 and v.std() > 5 for v in obs["images"].values())
        assert obs["state"].shape == (8,) and obs["state"].dtype == np.float32 and np.isfinite(obs["state"]).all()
        rng = np.random.default_rng(0)
        actions = np.concatenate([np.zeros((1, 7)), rng.uniform(-0.5, 0.5, (2, 7))]).astype(np.float32)
        for a in actions:
            obs_step, reward, terminated, truncated, info = env.step(a)
            assert reward == 0.0 and not terminated and not truncated and not info["success"]
        assert not env.success and info["elapsed_steps"] == 3
        # Same official state and seed again, the actions as one chunk (cameras off in between):
        # the observation is the same as after the single steps.
        env.reset(seed=0, options={"init_state_id": 0})
        obs_chunk, total, terminated, truncated, info = env.step_chunk(actions)
        assert info["steps_executed"] == 3 and total == 0.0 and not terminated
        np.testing.assert_array_equal(obs_chunk["state"], obs_step["state"])
        for cam in ("agentview", "wrist"):
            np.testing.assert_array_equal(obs_chunk["images"][cam], obs_step["images"][cam])
    finally:
        env.close()


def test_vla_eval_on_libero_writes_the_per_task_and_suite_table_and_videos(tmp_path, libero_assets):
    """`python -m mmrl.evals.vla_eval` on the LIBERO config, as SimpleVLA-RL / SRPO tabulate it: a
    few episodes (2 tasks x 1 official initial state, 2 chunks each) of an untrained tiny policy."""
    import json

    from mmrl.evals.vla_eval import main

    out = tmp_path / "eval"
    rc = main(["configs/vla_libero_grpo.yaml", "model.tiny={hidden_size: 64, intermediate_size: 128, "
               "num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 1, head_dim: 32, "
               "mrope_section: [8, 4, 4]}", "model.params.max_chunks=2", "model.params.max_image_tokens=4",
               "task.params.image_size=64", "task.params.num_workers=0", "task.params.task_ids=[0, 1]",
               "train.device=cpu", "train.bf16=false", f"train.output_dir={tmp_path / 'run'}",
               f"task.params.assets_dir={libero_assets}",
               "--suite", "spatial", "--trials", "1", "--videos", "2", "--out", str(out)])
    assert rc == 0
    record = json.loads((out / "vla_eval.json").read_text())
    greedy = record["modes"]["greedy"]
    assert list(greedy["columns"]) == ["libero_spatial"] and greedy["episodes"] == 2
    assert sorted(greedy["per_task"]) == ["libero_spatial/0", "libero_spatial/1"]
    assert 0.0 <= greedy["shuffled"] <= 1.0, "the grounding check runs by default"
    md = (out / "vla_eval.md").read_text()
    assert "| Method | Spatial | Avg | Shuffled imgs | Ep. len |" in md
    assert len(list((out / "videos").glob("*.gif"))) == 2
