"""Video rewards (mmrl.rewards.video): verifiable components, the report metric and clip_score."""

import math

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError
from mmrl.envs.video.clips import BACKGROUND, COLOURS, PALETTE, ClipSpec, all_specs, make_clip, make_dataset
from mmrl.rewards import REWARDS, build_reward
from mmrl.rewards.video import temporal_consistency

torch.set_num_threads(1)
NAMES = ("video_colour", "video_motion", "video_smoothness")
SHUFFLE = [3, 0, 6, 1, 7, 2, 5, 4]


def score(name, specs, videos, **params):
    return build_reward(name, params)([{"prompt": s.prompt, "spec": s} for s in specs], videos).numpy()


def crisp(top_lefts, colour="red", side=(4, 4), size=16, frames=None):
    """A hand-built clip: a solid w x h rectangle with the given integer top-left (x, y) per frame
    (None: an empty frame)."""
    out = np.empty((len(top_lefts), size, size, 3), np.uint8)
    out[:] = BACKGROUND
    w, h = side
    for t, xy in enumerate(top_lefts):
        if xy is not None:
            out[t, xy[1]:xy[1] + h, xy[0]:xy[0] + w] = PALETTE[colour]
    return out


@pytest.fixture(scope="module")
def data():
    clips, specs = make_dataset(all_specs(), 96, seed=0)
    return clips, specs


def test_registered():
    assert set(NAMES) | {"clip_score"} <= set(REWARDS)
    with pytest.raises(ConfigError, match=r"unknown parameter 'sigmaa'; valid: sigma, min_area"):
        build_reward("video_motion", {"sigmaa": 1.0})


# --------------------------------------------------------------------------------------------- true clips


@pytest.mark.parametrize("name, floor", [("video_colour", 0.999), ("video_motion", 0.999), ("video_smoothness", 0.97)])
def test_true_clips_score_about_one(data, name, floor):
    clips, specs = data
    r = score(name, specs, clips)
    assert r.shape == (96,) and r.dtype == np.float32
    assert r.min() >= floor and r.max() <= 1.0


# --------------------------------------------------------------------------------------------- colour


def test_colour_low_for_recoloured_clip(data):
    clips, specs = data
    recoloured = [make_clip(ClipSpec(COLOURS[(COLOURS.index(s.colour) + 1) % 4], s.shape, s.direction, s.speed),
                            np.random.default_rng(i)) for i, s in enumerate(specs)]
    assert score("video_colour", specs, recoloured).max() == 0.0
    # half the frames recoloured: half the reward
    spec = ClipSpec("red", "square", "right", "slowly")
    good = make_clip(spec, np.random.default_rng(0))
    bad = make_clip(ClipSpec("blue", "square", "right", "slowly"), np.random.default_rng(0))
    half = np.concatenate([good[:4], bad[4:]])
    assert score("video_colour", [spec], [half])[0] == pytest.approx(0.5, abs=1e-3)


def test_colour_hand_computed_share_and_presence():
    spec = ClipSpec("red", "square", "right", "slowly")  # expected area 16 px
    # twice the area (8 x 4 = 32 px): share 1, presence exp(-0.5 (ln 2 / ln 2)^2)
    big = crisp([(1 + t, 2) for t in range(8)], side=(8, 4))
    assert score("video_colour", [spec], [big])[0] == pytest.approx(math.exp(-0.5), abs=1e-6)
    # half red, half blue (4 x 2 each): share 1/2, red area 8 = half -> presence exp(-0.5)
    mixed = crisp([(1 + t, 2) for t in range(8)], side=(4, 2))
    mixed[:, 4:6] = crisp([(1 + t, 4) for t in range(8)], colour="blue", side=(4, 2))[:, 4:6]
    assert score("video_colour", [spec], [mixed])[0] == pytest.approx(0.5 * math.exp(-0.5), abs=1e-6)
    # a looser tolerance forgives the size: presence exp(-0.5 (ln 2 / ln 4)^2) = exp(-1/8)
    assert score("video_colour", [spec], [big], area_tolerance=4.0)[0] == pytest.approx(math.exp(-0.125), abs=1e-6)
    # an empty clip scores 0; a clip empty in 2 of 8 frames loses 2/8
    assert score("video_colour", [spec], [crisp([None] * 8)])[0] == 0.0
    gaps = crisp([(1 + t, 2) if t not in (3, 5) else None for t in range(8)])
    assert score("video_colour", [spec], [gaps])[0] == pytest.approx(0.75, abs=1e-6)


# --------------------------------------------------------------------------------------------- motion


def test_motion_low_for_reversed_and_static_clips(data):
    clips, specs = data
    assert score("video_motion", specs, clips[:, ::-1]).max() < 1e-4
    assert score("video_motion", specs, np.repeat(clips[:, :1], 8, axis=1)).max() < 0.05  # also for "slowly"
    # a clip of the right colour that moves at the other speed scores low too
    swapped = [ClipSpec(s.colour, s.shape, s.direction, "slowly" if s.speed == "quickly" else "quickly") for s in specs]
    assert score("video_motion", swapped, clips).max() < 0.05


def test_motion_hand_computed():
    # a 4 px square moving exactly 1 px/frame right; "slowly" wants 0.75 px/frame: d = 7, target 5.25
    right = crisp([(1 + t, 6) for t in range(8)])
    sig2 = 2.0 ** 2  # sigma 0.5 shape sizes = 2 px at 16 px
    expect = math.exp(-(7 - 5.25) ** 2 / (2 * sig2))
    spec = ClipSpec("red", "square", "right", "slowly")
    assert score("video_motion", [spec], [right])[0] == pytest.approx(expect, abs=1e-6)
    assert score("video_motion", [spec], [right], sigma=1.0)[0] == pytest.approx(
        math.exp(-(1.75 ** 2) / (2 * 16)), abs=1e-6)
    # drift across the direction costs by the same norm: 1 px/frame down as well
    diagonal = crisp([(1 + t, 1 + t) for t in range(8)])
    assert score("video_motion", [spec], [diagonal])[0] == pytest.approx(math.exp(-(1.75 ** 2 + 7 ** 2) / (2 * sig2)),
                                                                        rel=1e-4)
    # a missing frame is a failure: 7/8 of the same (the velocity is fitted on the present frames)
    gap = crisp([(1 + t, 6) if t != 4 else None for t in range(8)])
    assert score("video_motion", [spec], [gap])[0] == pytest.approx(7 / 8 * expect, abs=1e-6)
    # a wrong-colour object does not count at all; fewer than 2 present frames score 0
    assert score("video_motion", [spec], [crisp([(1 + t, 6) for t in range(8)], colour="green")])[0] == 0.0
    assert score("video_motion", [spec], [crisp([(1, 6)] + [None] * 7)])[0] == 0.0
    # "up" is towards row 0: moving up 1 px/frame for "up slowly" gives the same as `right` above
    up = crisp([(6, 9 - t) for t in range(8)])
    up_spec = ClipSpec("red", "square", "up", "slowly")
    assert score("video_motion", [up_spec], [up])[0] == pytest.approx(expect, abs=1e-6)


# --------------------------------------------------------------------------------------------- smoothness


def test_smoothness_lower_for_shuffled_frames(data):
    clips, specs = data
    true = score("video_smoothness", specs, clips)
    shuffled = score("video_smoothness", specs, clips[:, SHUFFLE])
    assert (shuffled < true - 0.5).all(), shuffled.max()
    assert score("video_smoothness", specs, np.repeat(clips[:, :1], 8, axis=1)).min() == pytest.approx(1.0)


def test_smoothness_flicker_terms():
    spec = ClipSpec("red", "square", "right", "slowly")
    clean = crisp([(1 + t, 6) for t in range(8)])
    assert score("video_smoothness", [spec], [clean])[0] == pytest.approx(1.0)
    # the object vanishes in one frame: area changes 16 -> 0 -> 16 (G = 32 / 7 / 14 = 0.327) and the
    # jerk triples through that frame are skipped (the others are 0): exp(-0.327 / 0.25)
    vanish = crisp([(1 + t, 6) if t != 4 else None for t in range(8)])
    g = (2 * 16 / 7) / (16 * 7 / 8)
    assert score("video_smoothness", [spec], [vanish])[0] == pytest.approx(math.exp(-g / 0.25), rel=1e-4)
    # background flicker: every other frame, the bottom 4 rows (away from the object) are 10 levels
    # brighter (below the 20 level background tolerance): on every pair of frames, 64 of the 236
    # pixels that are background in both frames (256 minus the 4 x 5 the square covers) change by 10
    flicker = clean.copy()
    flicker[1::2, 12:] += 10
    b = 64 * 10 / 236 / 255
    assert score("video_smoothness", [spec], [flicker])[0] == pytest.approx(math.exp(-b / 0.02), rel=1e-4)
    # a jump: the square jumps 3 px at one step -> second differences of 3 px twice over 6 triples
    jump = crisp([(1 + t + (3 if t >= 4 else 0), 6) for t in range(8)])
    j = 2 * max(0.0, 3 / 4 - 1 / 16) / 6
    assert score("video_smoothness", [spec], [jump])[0] == pytest.approx(math.exp(-j / 0.25), rel=1e-4)
    assert score("video_smoothness", [spec], [crisp([None] * 8)])[0] == 0.0


# --------------------------------------------------------------------------------------------- inputs


def test_rewards_are_batch_independent_and_accept_float_and_tensors(data):
    clips, specs = data
    big, big_specs = make_dataset(all_specs()[:4], 3, seed=1, num_frames=6, size=32)
    videos = [clips[0], big[0], clips[1][SHUFFLE], clips[2][::-1], big[1], clips[3]]
    vspecs = [specs[0], big_specs[0], specs[1], specs[2], big_specs[1], specs[3]]
    for name in NAMES:
        batch = score(name, vspecs, videos)
        alone = np.array([score(name, [s], [v])[0] for s, v in zip(vspecs, videos)])
        np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-6)
        as_float = score(name, vspecs, [v.astype(np.float32) / 255 for v in videos])
        np.testing.assert_allclose(as_float, batch, atol=1e-5)
        as_tensor = score(name, vspecs, [torch.from_numpy(np.ascontiguousarray(v)) for v in videos])
        np.testing.assert_array_equal(as_tensor, batch)
        stacked = score(name, specs[:8], clips[:8])
        np.testing.assert_allclose(stacked, score(name, specs[:8], list(clips[:8])), rtol=0, atol=1e-6)
        # a context with only a prompt (or a spec dict) is the same
        from_prompt = build_reward(name)([{"prompt": s.prompt} for s in vspecs], videos).numpy()
        from_dict = build_reward(name)([{"spec": s.to_dict()} for s in vspecs], videos).numpy()
        np.testing.assert_array_equal(from_prompt, batch)
        np.testing.assert_array_equal(from_dict, batch)


@pytest.mark.parametrize("contexts, videos, match", [
    ([{"text": "x"}], [np.zeros((8, 16, 16, 3), np.uint8)],
     r"context 0 has neither 'spec' \(a ClipSpec\) nor a 'prompt'"),
    (["a red square moves up slowly"], [np.zeros((8, 16, 16, 3), np.uint8)], r"context 0 is a str; expected a dict"),
    ([{"prompt": "a red blob moves up slowly"}], [np.zeros((8, 16, 16, 3), np.uint8)], r"unknown shape 'blob'"),
    ([{"prompt": "a red square moves up slowly"}], [np.zeros((16, 16, 3), np.uint8)],
     r"video 0 has shape \(16, 16, 3\); expected \[F, H, W, 3\]"),
    ([{"prompt": "a red square moves up slowly"}], [np.zeros((8, 16, 16, 1), np.uint8)],
     r"video 0 has shape \(8, 16, 16, 1\); expected \[F, H, W, 3\]"),
    ([{"prompt": "a red square moves up slowly"}], [np.zeros((8, 16, 12, 3), np.uint8)], r"square frames"),
    ([{"prompt": "a red square moves up slowly"}], [np.zeros((1, 16, 16, 3), np.uint8)], r"F >= 2"),
    ([{"prompt": "a red square moves up slowly"}], [np.full((8, 16, 16, 3), 40.0)],
     r"video 0 is float with max 40; float videos must be in \[0, 1\]"),
    ([{"prompt": "a red square moves up slowly"}], [np.zeros((8, 16, 16, 3), np.int64)], r"dtype int64"),
    ([{"prompt": "a red square moves up slowly"}] * 2, [np.zeros((8, 16, 16, 3), np.uint8)],
     r"2 contexts for 1 videos"),
])
def test_bad_inputs(contexts, videos, match):
    for name in NAMES:
        with pytest.raises(ValueError, match=match):
            build_reward(name)(contexts, videos)


def test_bad_params():
    with pytest.raises(ValueError, match=r"sigma must be > 0"):
        build_reward("video_motion", {"sigma": 0})([], [])
    with pytest.raises(ValueError, match=r"area_tolerance must be > 1"):
        build_reward("video_colour", {"area_tolerance": 1.0})([], [])


# --------------------------------------------------------------------------------------------- report metric


def test_temporal_consistency(data):
    clips = data[0][::2]  # 48 clips, every shape, colour, direction and speed
    tc = temporal_consistency(clips)
    assert tc.shape == (48,) and tc.min() >= 0.75 and tc.max() <= 1.0
    assert (temporal_consistency(clips[:, SHUFFLE]) < tc).all()
    assert temporal_consistency(np.repeat(clips[:, :1], 8, axis=1)) == pytest.approx(np.ones(48))
    # exact integer translates: 1; an object that jumps beyond max_shift: that pair scores 0
    assert temporal_consistency([crisp([(1 + t, 6) for t in range(8)])])[0] == pytest.approx(1.0)
    assert temporal_consistency([crisp([(0, 0), (10, 10)])])[0] == pytest.approx(0.0)
    two = crisp([(0, 0), (10, 10), (11, 10)])  # pairs: 0 and 1
    assert temporal_consistency([two])[0] == pytest.approx(0.5)
    assert temporal_consistency([two], max_shift=12)[0] == pytest.approx(1.0)
    assert temporal_consistency([crisp([None, None])])[0] == 1.0


# --------------------------------------------------------------------------------------------- clip_score


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny random-weight CLIP with a word-level tokenizer over the prompt vocabulary, saved to disk."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, PreTrainedTokenizerFast

    from mmrl.envs.video.clips import DIRECTIONS, SHAPES, SPEEDS

    words = ["a", "moves", *COLOURS, *SHAPES, *DIRECTIONS, *SPEEDS]
    vocab = {"<pad>": 0, "<unk>": 1, "<bos>": 2, "<eos>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                       special_tokens=[("<bos>", 2), ("<eos>", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<bos>", eos_token="<eos>", model_max_length=16)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=2, eos_token_id=3,
                         pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_clip")
    CLIPModel(config).save_pretrained(path)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
                  tokenizer=tokenizer).save_pretrained(path)
    return str(path)


def test_clip_score_round_trip(clip_dir, data):
    clips, specs = data
    reward = build_reward("clip_score", {"path": clip_dir})
    ctx = [{"prompt": s.prompt, "spec": s} for s in specs[:6]]
    r = reward(ctx, clips[:6])
    assert r.shape == (6,) and r.dtype == torch.float32 and ((r >= 0) & (r <= 1)).all()
    assert torch.equal(reward(ctx, clips[:6]), r)  # deterministic
    m = reward.metrics()
    assert set(m) == {"cosine_mean", "cosine_min", "cosine_max"} and -1 <= m["cosine_min"] <= m["cosine_max"] <= 1
    np.testing.assert_allclose(m["cosine_mean"], (2 * r.double() - 1).mean().item(), atol=1e-6)
    # batch independent; identical inputs give identical values
    alone = torch.cat([reward([c], [v]) for c, v in zip(ctx, clips[:6])])
    torch.testing.assert_close(alone, r, atol=1e-5, rtol=0)
    dup = reward([ctx[0], ctx[0]], [clips[0], clips[0]])
    assert dup[0] == dup[1]
    torch.testing.assert_close(dup[0], r[0], atol=1e-5, rtol=0)
    # two different prompts for the same video score differently
    other = reward([{"prompt": "a blue circle moves up quickly"}, {"prompt": "a red square moves left slowly"}],
                   [clips[0], clips[0]])
    assert abs(other[0].item() - other[1].item()) > 1e-4
    # the prompt comes from the spec when the context has none
    torch.testing.assert_close(reward([{"spec": specs[0]}], clips[:1]), r[:1], atol=1e-5, rtol=0)


def test_clip_score_frames_and_scale(clip_dir, data):
    clips, specs = data
    ctx = [{"spec": s} for s in specs[:3]]
    middle = build_reward("clip_score", {"path": clip_dir, "frames": "middle"})(ctx, clips[:3])
    held = build_reward("clip_score", {"path": clip_dir})(ctx, np.repeat(clips[:3, 4:5], 8, axis=1))
    torch.testing.assert_close(middle, held, atol=1e-5, rtol=0)  # "middle" = frame F // 2
    base = build_reward("clip_score", {"path": clip_dir})(ctx, clips[:3])
    scaled = build_reward("clip_score", {"path": clip_dir, "scale": 2.0})(ctx, clips[:3])
    torch.testing.assert_close(scaled - 0.5, (2 * (base - 0.5)).clamp(-0.5, 0.5), atol=1e-5, rtol=0)


def test_clip_score_errors(tmp_path, clip_dir):
    missing = tmp_path / "no_such_clip"
    with pytest.raises(FileNotFoundError, match=r"clip_score: no CLIP checkpoint at '.*no_such_clip'"):
        build_reward("clip_score", {"path": str(missing)})
    with pytest.raises(ValueError, match=r"frames must be 'all' or 'middle', got 'first'"):
        build_reward("clip_score", {"path": clip_dir, "frames": "first"})
    reward = build_reward("clip_score", {"path": clip_dir})
    with pytest.raises(ValueError, match=r"video 0 has shape \(16, 16, 3\); expected \[F, H, W, 3\]"):
        reward([{"prompt": "a red square moves up slowly"}], [np.zeros((16, 16, 3), np.uint8)])
    with pytest.raises(ValueError, match=r"context 0 has neither 'spec'"):
        reward([{}], [np.zeros((8, 16, 16, 3), np.uint8)])
