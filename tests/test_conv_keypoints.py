"""The conv keypoint vision tower of the action-token VLA (`model.params.vision: conv_keypoints`):
soft-argmax finds a peak, the processor's patches rebuild the image exactly, random shifts stay
within their pad, one LM token per keypoint fills the placeholders of 1 and 2 cameras, sampled
log-probs equal teacher-forced ones in train mode (no augmentation there) while `sft_loss` does
augment, checkpoints round-trip, and a bad `vision` value is refused."""

import json

import numpy as np
import pytest
import torch
from test_action_vla import DotTask, _obs, dot_envs

from mmrl.config import config_from_dict
from mmrl.policies.vla.configuration import ActionTokenVLAConfig
from mmrl.policies.vla.conv_keypoints import (
    ConvKeypointsEncoder,
    conv_encoder,
    image_token_count,
    install_conv_keypoints,
    patches_to_images,
    random_shift,
    spatial_soft_argmax,
)
from mmrl.policies.vla.modeling_action_tokens import ActionTokenVLAPolicy
from mmrl.policies.vla.processor import add_action_tokens
from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer

torch.set_num_threads(1)

INSTRUCTION = "move the dot to the centre"


@pytest.fixture(scope="module")
def tokenizer():
    return add_action_tokens(build_tokenizer([f"What action should the robot take to {INSTRUCTION} 0 1?"],
                                             vocab_size=300), 256)


def conv_model(tokenizer, n_keypoints: int = 4, seed: int = 0, arch: str = "qwen2_5_vl"):
    model = build_tiny_qwen_vl(tokenizer, arch, seed=seed).eval()
    install_conv_keypoints(model, n_keypoints, seed=seed)
    return model


def conv_policy(tokenizer, model=None, **kw):
    """32 px DotEnv images -> 56 px at 4 image tokens -> 4 keypoints."""
    kw = {"action_dim": 3, "chunk_size": 2, "temperature": 1.6, "env_factory": dot_envs, "max_chunks": 5,
          "vision": "conv_keypoints", **kw}
    processor = build_qwen_vl_processor(tokenizer, "qwen2_5_vl", 4, 4)
    return ActionTokenVLAPolicy(model if model is not None else conv_model(tokenizer), processor, **kw)


# ----------------------------------------------------------------------------- building blocks


def test_soft_argmax_finds_the_peak():
    H, W = 15, 21
    heat = torch.zeros(1, 3, H, W)
    peaks = [(3, 17), (11, 2), (7, 10)]  # (row, col): x != y, so swapped axes would fail
    for k, (r, c) in enumerate(peaks):
        heat[0, k, r, c] = 1.0
    xy, attn = spatial_soft_argmax(heat, 0.01)
    want = torch.tensor([[-1 + 2 * c / (W - 1), -1 + 2 * r / (H - 1)] for r, c in peaks])
    assert xy.shape == (1, 3, 2) and attn.shape == (1, 3, H * W)
    assert (xy[0] - want).abs().max() < 1e-2
    assert torch.allclose(attn.sum(-1), torch.ones(1, 3))
    # A high temperature spreads the softmax: the expectation falls back to the centre.
    assert spatial_soft_argmax(heat, 1e4)[0].abs().max() < 1e-3


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])  # patch 14 and 16
def test_patches_rebuild_the_processor_images(tokenizer, arch):
    ip = build_qwen_vl_processor(tokenizer, arch, 4, 16).image_processor
    unit = ip.patch_size * ip.merge_size
    rng = np.random.default_rng(0)
    # Sizes the processor keeps (multiples of patch * merge, within the token bounds): no resize;
    # non-square, so a swapped height and width would not rebuild it.
    imgs = [rng.integers(0, 256, (2 * unit, 4 * unit, 3), dtype=np.uint8),
            rng.integers(0, 256, (4 * unit, 2 * unit, 3), dtype=np.uint8)]
    out = ip(images=imgs, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 8], [1, 8, 4]]  # in patches: 8 LM tokens each
    rebuilt = patches_to_images(out["pixel_values"], out["image_grid_thw"], ip.patch_size, ip.temporal_patch_size,
                                ip.merge_size)
    mean = torch.tensor(ip.image_mean).view(3, 1, 1)
    std = torch.tensor(ip.image_std).view(3, 1, 1)
    for img, x in zip(imgs, rebuilt):
        assert x.shape == (3, *img.shape[:2])
        pixels = (x * std + mean) * 255  # undo the processor's rescale and normalisation
        assert (pixels - torch.from_numpy(img).permute(2, 0, 1).float()).abs().max() < 1e-3


def test_random_shift():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(6, 3, 16, 20, generator=gen)
    assert torch.equal(random_shift(x, 0, gen), x)
    pad = 3
    y = random_shift(x, pad, torch.Generator().manual_seed(1))
    assert y.shape == x.shape
    assert torch.equal(y, random_shift(x, pad, torch.Generator().manual_seed(1)))  # reproducible
    # Each image is its own content moved by one (dy, dx) within +-pad: the interior matches exactly.
    H, W = x.shape[-2:]
    shifts = []
    for i in range(len(x)):
        inner = y[i, :, pad:H - pad, pad:W - pad]
        found = [(dy, dx) for dy in range(-pad, pad + 1) for dx in range(-pad, pad + 1)
                 if torch.equal(inner, x[i, :, pad + dy:H - pad + dy, pad + dx:W - pad + dx])]
        assert len(found) == 1, (i, found)
        shifts.append(found[0])
    # One generator, one shift per image: copies of one image move differently.
    same = x[:1].expand(8, -1, -1, -1)
    z = random_shift(same, 4, torch.Generator().manual_seed(2))
    assert len({tuple(z[i].flatten()[:50].tolist()) for i in range(8)}) > 1
    assert len(set(shifts)) > 1


# ----------------------------------------------------------------------------- in the model


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_one_token_per_keypoint_for_one_and_two_cameras(tokenizer, arch):
    model = conv_model(tokenizer, 4, arch=arch)
    policy = ActionTokenVLAPolicy(model, build_qwen_vl_processor(tokenizer, arch, 4, 4), action_dim=3, chunk_size=2,
                                  vision="conv_keypoints", temperature=1.6)
    image_id = model.config.image_token_id
    rng = np.random.default_rng(0)
    for n_cams in (1, 2):
        imgs = [[rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(n_cams)] for _ in range(2)]
        enc = policy.encode(policy._vl_contexts(imgs, ["a", "b"]))
        grid = torch.cat(enc["image_grid_thw"])
        with torch.no_grad():
            out = model.model.visual(torch.cat(enc["pixel_values"]), grid_thw=grid)
            feats = model.get_image_features(torch.cat(enc["pixel_values"]), grid).pooler_output
        assert len(feats) == 2 * n_cams
        # Per image: as many embeddings as the processor put placeholders, = the 4 keypoints.
        assert [f.shape for f in feats] == [(4, model.config.get_text_config().hidden_size)] * (2 * n_cams)
        assert (enc["prompt_ids"] == image_id).sum(1).tolist() == [4 * n_cams] * 2
        assert out.keypoints.shape == (2 * n_cams, 4, 2) and out.keypoints.abs().max() <= 1
        # The whole forward places them (it checks placeholder and feature counts).
        out = policy.act({"images": {f"c{i}": np.stack([im[i] for im in imgs]) for i in range(n_cams)}}, ["a", "b"],
                         generator=torch.Generator().manual_seed(0))
        assert out.tokens.shape == (2, 6)
    # Another image size gives another token count: refused, not padded or cut.
    big = build_qwen_vl_processor(tokenizer, arch, 16, 16)
    unit = big.image_processor.patch_size * 2
    assert image_token_count(big.image_processor, 4 * unit, 4 * unit) == 16
    enc = big.image_processor(images=[np.zeros((4 * unit, 4 * unit, 3), np.uint8)], return_tensors="pt")
    with pytest.raises(ValueError, match="one token per keypoint"):
        model.model.visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"])


def test_rollout_logprobs_match_the_sampler_in_train_mode(tokenizer):
    policy = conv_policy(tokenizer, shift_pad=4)
    contexts = [{"task": "dot", "init_state_id": 3}, {"task": "dot", "init_state_id": 8, "max_steps": 3}]
    ro = policy.sample(contexts, 2, generator=torch.Generator().manual_seed(0))
    assert bool(ro.mask.any())
    policy.model.train()  # the trainer's mode during RL updates: the recompute must still not augment
    with torch.no_grad():
        logp = policy.logprobs(ro)[0]
    assert torch.where(ro.mask, logp - ro.logp_old, 0.0).abs().max().item() < 1e-5
    # The image matters to these log-probs (a blank image changes them), so the parity is not vacuous.
    obs = _obs(2)
    out = policy.act(obs, ["a", "b"], generator=torch.Generator().manual_seed(0))
    blank = {"images": {"front": np.zeros_like(obs["images"]["front"])}}
    with torch.no_grad():
        assert (policy.logprobs_of(obs, ["a", "b"], out.tokens)[0] - out.logp).abs().max() < 1e-5
        assert (policy.logprobs_of(blank, ["a", "b"], out.tokens)[0] - out.logp).abs().max() > 1e-4


def _sft_contexts(n: int = 3):
    rng = np.random.default_rng(0)
    return [{"images": {"front": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)}, "instruction": INSTRUCTION,
             "actions": rng.uniform(-1, 1, (2, 3)).astype(np.float32)} for _ in range(n)]


def test_sft_loss_augments_only_in_train_mode_with_a_shift(tokenizer):
    model = conv_model(tokenizer)
    shifted, plain = conv_policy(tokenizer, model, shift_pad=4), conv_policy(tokenizer, model, shift_pad=0)
    ctx = _sft_contexts()

    def loss(policy, seed):
        with torch.no_grad():
            return policy.sft_loss(ctx, generator=torch.Generator().manual_seed(seed)).item()

    model.train()
    assert loss(shifted, 0) == loss(shifted, 0)  # reproducible from the generator
    assert abs(loss(shifted, 0) - loss(shifted, 1)) > 1e-6  # the shift is on
    assert loss(plain, 0) == loss(plain, 1)  # shift_pad 0: off
    model.eval()  # e.g. the grounding probe's own- vs shuffled-image losses: no augmentation
    assert loss(shifted, 0) == loss(shifted, 1) == loss(plain, 0)
    # And sft_loss trains the tower (gradients reach the conv weights and the temperature).
    model.train()
    shifted.sft_loss(ctx, generator=torch.Generator().manual_seed(0)).backward()
    enc = conv_encoder(model)
    assert enc.convs[0][0].weight.grad.abs().sum() > 0 and enc.log_temperature.grad is not None


def test_checkpoint_round_trip(tokenizer, tmp_path):
    policy = conv_policy(tokenizer, model=conv_model(tokenizer, seed=3), shift_pad=2)
    policy.save(tmp_path)
    saved = json.loads((tmp_path / "action_vla.json").read_text())
    assert (saved["vision"], saved["n_keypoints"], saved["shift_pad"]) == ("conv_keypoints", 4, 2)
    back = ActionTokenVLAPolicy.from_pretrained(tmp_path, temperature=1.6)
    assert isinstance(conv_encoder(back.model), ConvKeypointsEncoder) and back.config.shift_pad == 2
    a, b = policy.model.state_dict(), back.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = policy.act(_obs(2), ["a", "b"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back.logprobs_of(_obs(2), ["a", "b"], out.tokens)[0] - out.logp).abs().max() < 1e-5
    with pytest.raises(ValueError, match="conv_keypoints vision tower"):
        ActionTokenVLAPolicy.from_pretrained(tmp_path, vision="qwen_vl")


class SizedDotTask(DotTask):
    image_size = 32  # what from_config reads to size a fresh conv tower


def test_from_config_builds_a_conv_tower(tmp_path):
    from mmrl.policies import build_policy

    def cfg(**params):
        return config_from_dict({
            "model": {"policy": "action_vla", "params": {"action_dim": 3, "chunk_size": 2, "max_chunks": 2,
                                                         "min_image_tokens": 4, "max_image_tokens": 4, **params}},
            "sampling": {"temperature": 1.6}, "train": {"device": "cpu", "output_dir": str(tmp_path)},
        })

    policy = build_policy(cfg(vision="conv_keypoints"), SizedDotTask(), "cpu")
    enc = conv_encoder(policy.model)
    assert enc is not None and enc.n_keypoints == policy.config.n_keypoints == 4  # 32 px -> 56 px -> 4 tokens
    ro = policy.sample(SizedDotTask().eval_batch(1), 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.where(ro.mask, policy.logprobs(ro)[0] - ro.logp_old, 0.0).abs().max() < 1e-5
    with pytest.raises(ValueError, match="n_keypoints"):  # no image size to count tokens from
        build_policy(cfg(vision="conv_keypoints"), DotTask(), "cpu")


def test_vision_values_are_checked(tokenizer):
    with pytest.raises(ValueError, match="unknown vision 'vit'; valid: qwen_vl, conv_keypoints"):
        ActionTokenVLAConfig(vision="vit")
    with pytest.raises(ValueError, match="shift_pad"):
        ActionTokenVLAConfig(vision="conv_keypoints", shift_pad=-1)
    processor = build_qwen_vl_processor(tokenizer, "qwen2_5_vl", 4, 4)
    with pytest.raises(ValueError, match="Qwen-VL vision tower"):  # the config must name the model's tower
        ActionTokenVLAPolicy(build_tiny_qwen_vl(tokenizer, "qwen2_5_vl"), processor, vision="conv_keypoints")
    with pytest.raises(ValueError, match="conv_keypoints vision tower"):
        ActionTokenVLAPolicy(conv_model(tokenizer), processor)


def test_aux_action_loss_adds_the_heads_regression_in_train_mode_only(tokenizer, tmp_path):
    model = build_tiny_qwen_vl(tokenizer, "qwen2_5_vl", seed=0).eval()
    install_conv_keypoints(model, 4, seed=0, aux_dim=2 * 3)  # one chunk: chunk_size 2 x action_dim 3
    policy = conv_policy(tokenizer, model, shift_pad=0, aux_action_loss=0.5)
    ctx = _sft_contexts()
    with torch.no_grad():
        model.eval()
        cross_entropy = policy.sft_loss(ctx).item()
        model.train()
        total = policy.sft_loss(ctx).item()
        enc = policy.encode(policy._vl_contexts([[c["images"]["front"]] for c in ctx], [INSTRUCTION] * 3))
        pred = conv_encoder(model).aux_head(conv_encoder(model)(torch.cat(enc["pixel_values"]),
                                                                torch.cat(enc["image_grid_thw"])).pooler_output.view(3, -1))
        target = torch.tensor(np.stack([c["actions"] for c in ctx])).flatten(1)  # already in [-1, 1] = [low, high]
        by_hand = ((pred - target) ** 2).mean().item()
    assert total == pytest.approx(cross_entropy + 0.5 * by_hand, rel=1e-5)
    policy.sft_loss(ctx).backward()
    assert conv_encoder(model).aux_head[0].weight.grad.abs().sum() > 0
    policy.save(tmp_path)
    back = ActionTokenVLAPolicy.from_pretrained(tmp_path, temperature=1.6)
    assert back.config.aux_action_loss == 0.5
    a, b = policy.model.state_dict(), back.model.state_dict()
    assert any("aux_head" in k for k in a) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="aux_action_loss must be >= 0 and needs vision: conv_keypoints"):
        ActionTokenVLAConfig(aux_action_loss=1.0)


def film_policy(tokenizer, **kw):
    model = build_tiny_qwen_vl(tokenizer, "qwen2_5_vl", seed=0).eval()
    install_conv_keypoints(model, 4, seed=0, aux_dim=2 * 3, film=True)
    return conv_policy(tokenizer, model, film=True, aux_action_loss=0.5, **kw)


def test_film_conditions_the_tower_on_the_instruction(tokenizer, tmp_path):
    policy = film_policy(tokenizer, shift_pad=0)
    enc = conv_encoder(policy.model)
    assert enc.film is not None and enc.film.weight.abs().sum() == 0  # starts unconditioned
    with torch.no_grad():
        enc.film.weight.normal_(0, 0.5)
    # Two instructions over the same image give other keypoints, so the tower reads the instruction.
    obs = _obs(1)
    e = policy.encode(policy._vl_contexts([[obs["images"]["front"][0]]] * 2, [INSTRUCTION, "move the dot to 0"]))
    vision = {"pixel_values": torch.cat(e["pixel_values"]), "grid_thw": torch.cat(e["image_grid_thw"])}
    with torch.no_grad(), policy._instruction_film(e):
        points = enc(vision["pixel_values"], vision["grid_thw"]).keypoints
    assert (points[0] - points[1]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="one conditioning row per image"):  # called without its instruction
        enc(vision["pixel_values"], vision["grid_thw"])
    # Sampled log-probs equal teacher-forced ones (rollouts, in train mode), and gradients reach FiLM
    # and, through the conditioning, the token embeddings.
    contexts = [{"task": "dot", "init_state_id": 3}, {"task": "dot", "init_state_id": 8, "max_steps": 3}]
    ro = policy.sample(contexts, 2, generator=torch.Generator().manual_seed(0))
    policy.model.train()
    logp = policy.logprobs(ro)[0]
    assert torch.where(ro.mask, logp - ro.logp_old, 0.0).abs().max().item() < 1e-5
    policy.sft_loss(_sft_contexts()).backward()
    assert enc.film.weight.grad.abs().sum() > 0
    # The setting round-trips through a checkpoint.
    policy.save(tmp_path)
    back = ActionTokenVLAPolicy.from_pretrained(tmp_path, temperature=1.6)
    assert back.config.film and conv_encoder(back.model).film is not None
    a, b = policy.model.state_dict(), back.model.state_dict()
    assert any("film" in k for k in a) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.where(ro.mask, back.logprobs(ro)[0] - ro.logp_old, 0.0).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="film conditions the conv_keypoints tower"):
        ActionTokenVLAConfig(film=True)
    with pytest.raises(ValueError, match="film is True but the model's conv tower was built without FiLM"):
        conv_policy(tokenizer, conv_model(tokenizer), film=True)
