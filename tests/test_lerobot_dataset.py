"""Scripted demos written as a local LeRobotDataset (v3, image mode) and read back with action chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

pytest.importorskip("lerobot")

from mmrl.envs.tabletop import get_task_def, make_expert, make_tabletop_env  # noqa: E402
from mmrl.envs.tabletop.demos import load_demos, record_demos  # noqa: E402

CHUNK = 8


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("lerobot") / "reach_demos"
    info = record_demos("reach", n_episodes=2, root=root, seed=0, fps=20, image_size=32)
    return info, load_demos(root, chunk_size=CHUNK)


def _replay(seed: int):
    """The expert's episode from `seed` again, keeping observations and actions."""
    env, expert = make_tabletop_env("reach", image_size=32), make_expert("reach")
    obs, _ = env.reset(seed=seed)
    frames = []
    while True:
        a = expert.act(env).astype(np.float32)
        frames.append((obs, a))
        obs, _, terminated, truncated, _ = env.step(a)
        if terminated or truncated:
            return frames, env.instruction


def test_two_episodes_read_back_with_shapes_values_and_tasks(demos):
    info, ds = demos
    assert len(info.episodes) == 2 and not info.failed_seeds
    assert ds.meta.total_episodes == 2 and len(ds) == sum(e.length for e in info.episodes)
    assert ds.fps == 20
    start = 0
    for ep in info.episodes:
        frames, instruction = _replay(ep.seed)
        assert len(frames) == ep.length and instruction == ep.instruction
        for t in (0, ep.length - 1):
            item = ds[start + t]
            obs, action = frames[t]
            assert item["task"] == instruction
            assert item["observation.images.front"].shape == (3, 32, 32)
            assert item["observation.images.front"].dtype == torch.float32
            # Image mode stores PNGs: lossless, so pixels come back exactly (as floats in [0, 1]).
            expect = torch.from_numpy(obs["images"]["front"]).permute(2, 0, 1).float() / 255
            torch.testing.assert_close(item["observation.images.front"], expect, atol=1e-6, rtol=0)
            torch.testing.assert_close(item["observation.state"], torch.from_numpy(obs["state"]))
            assert item["action"].shape == (CHUNK, 7) and item["action_is_pad"].shape == (CHUNK,)
            torch.testing.assert_close(item["action"][0], torch.from_numpy(action))
        start += ep.length


def test_action_chunks_pad_past_the_episode_end(demos):
    info, ds = demos
    first = info.episodes[0]
    for back in range(1, CHUNK + 1):  # the last CHUNK frames of episode 0
        item = ds[first.length - back]
        pad = item["action_is_pad"]
        assert pad.tolist() == [False] * back + [True] * (CHUNK - back)
        # Padded steps repeat the episode's last action, never the next episode's first.
        last = ds[first.length - 1]["action"][0]
        assert torch.equal(item["action"][pad], last.expand(int(pad.sum()), 7))
    mid = ds[0]
    assert not mid["action_is_pad"].any()
    for k in range(CHUNK):  # a chunk is the next CHUNK recorded actions
        torch.testing.assert_close(mid["action"][k], ds[k]["action"][0])
    # Frame-level reading (chunk_size=1) works too.
    flat = load_demos(info.root, chunk_size=1)
    assert flat[0]["action"].shape == (7,)


def test_one_demo_per_language_task(tmp_path):
    info = record_demos("reach", root=tmp_path / "one_shot", n_per_task=1, image_size=16)
    variants = get_task_def("reach").instruction_variants()
    assert len(info.episodes) == len(variants)
    assert sorted(e.instruction for e in info.episodes) == sorted(f"touch the {c} ball" for c, _ in variants)
    ds = load_demos(tmp_path / "one_shot")
    assert ds.meta.total_tasks == len(variants)


def test_record_demos_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        record_demos("reach", n_episodes=1, n_per_task=1, root=tmp_path / "x")
    with pytest.raises(ValueError, match="valid: reach, push, pick_place"):
        record_demos("stack", n_episodes=1, root=tmp_path / "y")
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError):
        record_demos("reach", n_episodes=1, root=tmp_path / "exists")
    with pytest.raises(FileNotFoundError, match="no LeRobotDataset"):
        load_demos(tmp_path / "missing")
    # Failed expert episodes are discarded; too many in a row is an error naming the task.
    with pytest.raises(RuntimeError, match="'reach' expert failed 2 times"):
        record_demos("reach", n_episodes=1, root=tmp_path / "short", image_size=16, max_episode_steps=2,
                     max_tries_per_episode=2)
