"""SRPO's progress reward: successes get exactly 1, failures stay below 1, a failure nearer the
successes earns more, clusters are counted; the encoders and the registered reward adapters."""

import numpy as np
import pytest
import torch

from mmrl.rewards import get_reward
from mmrl.rewards.srpo import PixelTrajectoryEncoder, PretrainedVideoEncoder, srpo_progress_reward

torch.set_num_threads(1)


def _batch():
    """Two tight success clusters, far apart, and failures at growing distances from cluster A."""
    rng = np.random.default_rng(0)
    a = rng.normal(0.0, 0.05, (4, 6))
    b = rng.normal(0.0, 0.05, (3, 6)) + 10.0
    fails = np.zeros((5, 6))
    fails[:, 0] = [0.5, 1.0, 2.0, 3.0, 4.0]
    emb = np.concatenate([a, b, fails])
    success = np.array([True] * 7 + [False] * 5)
    return emb, success


def test_successes_one_failures_ordered_and_below_one():
    emb, success = _batch()
    r, info = srpo_progress_reward(torch.tensor(emb), torch.tensor(success))
    assert r.shape == (12,) and r.dtype == torch.float32
    assert torch.equal(r[:7], torch.ones(7))
    fail = r[7:]
    assert bool((fail < 0.8).all()) and bool((fail > 0).all())
    assert bool((fail[:-1] > fail[1:]).all()), fail  # nearer earns more
    assert info["n_clusters"] == 2 and info["n_noise"] == 0 and info["n_success"] == 7


def test_alpha_caps_and_standardisation():
    emb, success = _batch()
    r1, _ = srpo_progress_reward(emb, success, alpha=0.5)
    r2, _ = srpo_progress_reward(emb * 100.0, success, alpha=0.5)  # scale-free: auto eps + z-scores
    assert torch.allclose(r1, r2, atol=1e-5)
    assert bool((r1[7:] < 0.5).all())
    with pytest.raises(ValueError, match="alpha"):
        srpo_progress_reward(emb, success, alpha=1.0)


def test_no_success_gives_zero_and_singleton_noise():
    emb, _ = _batch()
    r, info = srpo_progress_reward(emb[7:], np.zeros(5, bool))
    assert torch.equal(r, torch.zeros(5)) and info["n_groups_without_success"] == 1
    # One success (DBSCAN noise with min_samples=2) is still a reference.
    r, info = srpo_progress_reward(emb[[0, 7, 8, 11]], np.array([True, False, False, False]))
    assert info["n_clusters"] == 0 and info["n_noise"] == 1
    assert r[0] == 1.0 and r[1] > r[2] > r[3]


def test_groups_are_scored_separately():
    emb, success = _batch()
    groups = ["a"] * 12 + ["b"] * 3
    emb2 = np.concatenate([emb, np.zeros((3, 6))])
    success2 = np.concatenate([success, [False] * 3])
    r, info = srpo_progress_reward(emb2, success2, groups=groups)
    assert torch.equal(r[-3:], torch.zeros(3))  # group b has no success
    assert torch.allclose(r[:12], srpo_progress_reward(emb, success)[0])
    assert info["n_groups"] == 2 and info["n_groups_without_success"] == 1


def _video(block_x: int, T: int = 6, size: int = 32) -> np.ndarray:
    """A white block sliding right on a black table from x=2 to `block_x`."""
    v = np.zeros((T, size, size, 3), np.uint8)
    for t, x in enumerate(np.linspace(2, block_x, T).round().astype(int)):
        v[t, 12:20, x:x + 6] = 255
    return v


def test_pixel_encoder_and_adapters():
    enc = PixelTrajectoryEncoder(num_frames=3, size=4)
    videos = [_video(24), _video(24), _video(23), _video(16), _video(4)]
    emb = enc.encode(videos)
    assert emb.shape == (5, enc.dim) and torch.equal(emb, enc.encode(videos))  # deterministic
    with pytest.raises(ValueError, match="uint8"):
        enc.encode([videos[0].astype(np.float32)])
    outputs = [{"success": s, "frames": v, "length": len(v)} for s, v in zip([1, 1, 1, 0, 0], videos)]
    contexts = [{"task": "push"}] * 5
    assert torch.equal(get_reward("success")(contexts, outputs), torch.tensor([1.0, 1, 1, 0, 0]))
    fn = get_reward("srpo_progress")
    r = fn(contexts, outputs, encoder_params={"num_frames": 3, "size": 4})
    assert torch.equal(r[:3], torch.ones(3)) and 0.8 > r[3] > r[4] > 0  # pushed further -> more
    assert fn.last_info["n_clusters"] >= 1
    with pytest.raises(TypeError, match="trajectory dict"):
        get_reward("success")(contexts, ["text"])


def test_pretrained_video_encoder_from_a_local_dir(tmp_path):
    from transformers import VJEPA2Config, VJEPA2Model, VJEPA2VideoProcessor

    cfg = VJEPA2Config(crop_size=32, patch_size=8, frames_per_clip=4, tubelet_size=2, hidden_size=32,
                       num_attention_heads=2, num_hidden_layers=1, pred_hidden_size=16, pred_num_attention_heads=2,
                       pred_num_hidden_layers=1, num_pooler_layers=1)
    torch.manual_seed(0)
    VJEPA2Model(cfg).save_pretrained(tmp_path)
    VJEPA2VideoProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    enc = PretrainedVideoEncoder(tmp_path, batch_size=2)
    assert enc.num_frames == 4
    emb = enc.encode([_video(24, T=7), _video(10, T=3), _video(4, T=5)])
    assert emb.shape == (3, 32) and torch.isfinite(emb).all()
    with pytest.raises(FileNotFoundError, match="config.json"):
        PretrainedVideoEncoder(tmp_path / "missing")
