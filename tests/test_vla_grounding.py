"""The grounding check of the robot tasks: episodes with images shuffled across initial states,
and the SFT loss on demo frames with their own vs shuffled images (`RobotTask.evaluate` with
`eval_grounding`, which `mmrl eval` turns on, and `mmrl.evals.vla_eval`)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

if importlib.util.find_spec("mujoco") is None:
    pytest.skip("the tabletop tasks need mujoco (pip install 'mmrl[robot]')", allow_module_level=True)

from mmrl.envs import make_task  # noqa: E402
from mmrl.envs.episodes import shuffle_partners  # noqa: E402
from mmrl.envs.robot_task import grounding_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_shuffle_partners_never_show_a_rows_own_initial_state():
    # 3 initial states x G=2 samples, adjacent, as a policy's rollout rows are.
    rows = [{"task": "reach", "init_state_id": i} for i in (4, 4, 9, 9, 2, 2)]
    partners = shuffle_partners(rows)
    assert partners.tolist() == [2, 3, 4, 5, 0, 1]
    assert all(rows[p]["init_state_id"] != r["init_state_id"] for r, p in zip(rows, partners))
    with pytest.raises(ValueError, match="at least 2 initial states"):
        shuffle_partners([{"task": "reach", "init_state_id": 1}] * 3)


def test_shuffled_env_shows_the_partners_images_and_keeps_its_own_state():
    task = make_task("tabletop", seed=0, n_eval=2, cameras=["top"])
    rows = task.eval_batch(2)
    plain = task.env_factory(rows).reset(*zip(*[(None, r["init_state_id"]) for r in rows]))
    with task.env_factory.images_shuffled():
        env = task.env_factory(rows)
        obs = env.reset(*zip(*[(None, r["init_state_id"]) for r in rows]))
        step = env.step_chunk(np.zeros((2, 1, 7), np.float32))
    assert not np.array_equal(plain.images["top"][0], plain.images["top"][1]), "two different scenes"
    assert np.array_equal(obs.images["top"][0], plain.images["top"][1])
    assert np.array_equal(obs.images["top"][1], plain.images["top"][0])
    assert np.array_equal(obs.state, plain.state), "the proprio state stays each env's own"
    assert step.obs.images["top"].shape == plain.images["top"].shape
    assert task.env_factory(rows).__class__.__name__ != "ShuffledImages", "only inside the block"


class PixelMatchPolicy:
    """An SFT loss that is low only when each frame carries its own images (the squared distance of
    each frame's mean pixel to the one recorded for it): the shape of a policy that looks."""

    def __init__(self, frames):
        self.model = torch.nn.Linear(1, 1)
        self.expected = {f["episode_index"]: float(f["images"]["top"].mean()) for f in frames}

    def sft_loss(self, frames):
        d = [(float(f["images"]["top"].mean()) - self.expected[f["episode_index"]]) ** 2 for f in frames]
        return torch.tensor(float(np.mean(d)))


def test_grounding_loss_gap_is_zero_for_a_blind_policy_and_positive_for_a_looking_one():
    rng = np.random.default_rng(0)
    frames = [{"images": {"top": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)}, "episode_index": i}
              for i in range(20)]
    looking = grounding_loss(PixelMatchPolicy(frames), frames, n=16)
    assert looking["sft_loss_own"] == 0.0 and looking["sft_loss_gap"] > 1.0

    class Blind(PixelMatchPolicy):
        def sft_loss(self, frames):
            return torch.tensor(0.25)

    blind = grounding_loss(Blind(frames), frames, n=16)
    assert blind == {"sft_loss_own": 0.25, "sft_loss_shuffled": 0.25, "sft_loss_gap": 0.0}


def test_vla_evaluate_with_grounding_reports_shuffled_success_and_loss_gap(tmp_path):
    from mmrl import build
    from mmrl.config import load_config
    from mmrl.evals.vla_eval import table, write_vla_report

    cfg = load_config(ROOT / "configs" / "vla_tabletop_grpo.yaml", [
        f"task.params.demo_root={tmp_path / 'demos'}", "task.params.demos_per_task=2", "task.params.n_eval=2",
        "task.params.eval_samples=1", "task.params.eval_grounding=true", "model.params.max_chunks=2",
        "model.params.max_image_tokens=4", f"train.output_dir={tmp_path / 'run'}"])
    task, policy = build(cfg)
    out = task.evaluate(policy, 2)
    for key in ("sampled/success", "shuffled_sampled/success", "shuffled_sampled/episode_len",
                "grounding/sft_loss_own", "grounding/sft_loss_shuffled", "grounding/sft_loss_gap"):
        assert key in out and math.isfinite(out[key]), key
    assert out["grounding/sft_loss_gap"] == pytest.approx(out["grounding/sft_loss_shuffled"] -
                                                          out["grounding/sft_loss_own"])
    record = write_vla_report(policy, [(None, task)], tmp_path / "eval", "untrained", ("greedy",), n_videos=0)
    assert 0.0 <= record["modes"]["greedy"]["shuffled"] <= 1.0 and "grounding_loss" in record
    md = table([record], "greedy")
    assert md.splitlines()[0] == "| Method | Reach | Avg | Shuffled imgs | Ep. len |"
    assert "## grounding" in (tmp_path / "eval" / "vla_eval.md").read_text()


def test_mmrl_eval_on_a_robot_config_writes_the_vla_report(tmp_path, capsys):
    import json

    from mmrl.cli import main

    overrides = [f"task.params.demo_root={tmp_path / 'demos'}", "task.params.demos_per_task=2",
                 "task.params.n_eval=2", "task.params.eval_samples=1", "model.params.max_chunks=2",
                 "model.params.max_image_tokens=4", "sft.steps=1", "sft.batch_size=2", "train.steps=1",
                 "train.prompts_per_step=1", "sampling.group_size=2", "algo.success_filter=null",
                 "train.eval_every=0", "train.eval_size=2", "train.progress=false",
                 f"train.output_dir={tmp_path / 'run'}"]
    assert main(["train", str(ROOT / "configs" / "vla_tabletop_grpo.yaml"), *overrides]) == 0
    assert main(["eval", str(ROOT / "configs" / "vla_tabletop_grpo.yaml"), *overrides,
                 "--checkpoint", str(tmp_path / "run")]) == 0
    record = json.loads((tmp_path / "run" / "eval" / "vla_eval.json").read_text())
    assert set(record["modes"]) == {"sampled"} and "shuffled" in record["modes"]["sampled"]
    assert "grounding_loss" in record
    assert "| Method | Reach | Avg | Shuffled imgs | Ep. len |" in capsys.readouterr().out
