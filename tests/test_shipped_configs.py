"""Every shipped config builds: its task, its policy and its rewards (not only its YAML), and the
rewards score a greedy rollout of the policy on one held-out context."""

from pathlib import Path

import pytest
import torch

import mmrl
from mmrl.config import load_config
from mmrl.rewards import build_reward

torch.set_num_threads(1)

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
GPU_SIZED = 512  # configs whose tiny model is at least this wide are built, not rolled out, on a CPU


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_builds_and_its_rewards_score_a_rollout(path, tmp_path, local_inputs, request):
    # A GPU config's checkpoint and data folders are the user's: tiny ones written here stand in.
    cfg = load_config(path, [f"train.output_dir={tmp_path}", "train.device=cpu", *local_inputs(path)])
    if cfg.task.name == "libero":  # LIBERO's assets are in no package: skipped, with the reason, without them
        pytest.importorskip("libero", reason="hf-libero is not installed (pip install 'mmrl[libero]')")
        request.getfixturevalue("libero_assets")
    task, policy = mmrl.build(cfg)
    rewards = [build_reward(r.name, r.params) for r in cfg.rewards]
    assert sum(p.numel() for p in policy.model.parameters() if p.requires_grad) > 0
    contexts = task.eval_batch(1)
    assert len(contexts) == 1
    if cfg.model.tiny.get("hidden_size", 0) >= GPU_SIZED:
        return  # a GPU-sized model: built and wired; a rollout on this CPU would take minutes
    rollout = policy.sample(contexts, 2, generator=torch.Generator().manual_seed(0)).stamp_groups(2)
    assert len(rollout) == 2 and rollout.max_units >= rollout.units.shape[1]
    outputs = policy.decode(rollout)
    for reward in rewards:
        scores = torch.as_tensor(reward(rollout.contexts, outputs), dtype=torch.float32)
        assert scores.shape == (2,) and torch.isfinite(scores).all(), (reward, scores)
