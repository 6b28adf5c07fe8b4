"""The text-to-video clip generator and prompt set (mmrl.envs.video.clips)."""

import math
import time
from collections import Counter

import numpy as np
import pytest
import torch

from mmrl.envs.video.clips import (
    BACKGROUND,
    COLOURS,
    DIRECTIONS,
    PALETTE,
    SHAPES,
    SPEEDS,
    ClipSpec,
    all_specs,
    check_fits,
    make_clip,
    make_dataset,
    shape_area,
    shape_px,
    speed_px,
    split_specs,
)

torch.set_num_threads(1)
BG = np.asarray(BACKGROUND, float)


def coverage(frames: np.ndarray, colour: str) -> np.ndarray:
    """Per-pixel coverage [F, H, W] of `colour` (projection on the bg -> colour segment)."""
    u = np.asarray(PALETTE[colour], float) - BG
    return np.clip((frames.astype(float) - BG) @ u / (u @ u), 0, 1)


def pixel_centroids(frames: np.ndarray, colour: str) -> tuple[np.ndarray, np.ndarray]:
    a = coverage(frames, colour)
    centres = np.arange(frames.shape[1]) + 0.5
    area = a.sum((1, 2))
    return area, np.stack([(a.sum(1) * centres).sum(-1) / area, (a.sum(2) * centres).sum(-1) / area], -1)


# --------------------------------------------------------------------------------------------- prompts


def test_vocabulary_and_geometry_constants():
    assert COLOURS == ("red", "green", "blue", "yellow") and set(SHAPES) == {"square", "circle", "triangle"}
    assert set(DIRECTIONS) == {"left", "right", "up", "down"} and set(SPEEDS) == {"slowly", "quickly"}
    # palette colours are saturated and far apart from each other and from the background
    cols = [np.asarray(PALETTE[c], float) for c in COLOURS]
    dists = [np.linalg.norm(a - b) for i, a in enumerate(cols + [BG]) for b in (cols + [BG])[i + 1:]]
    assert min(dists) > 150
    assert shape_px(16) == 4.0 and shape_px(32) == 8.0
    assert (speed_px("slowly", 16), speed_px("quickly", 16)) == (0.75, 1.5)
    assert (speed_px("slowly", 32), speed_px("quickly", 32)) == (1.5, 3.0)
    assert shape_area("square", 16) == 16 and shape_area("triangle", 16) == 8
    assert shape_area("circle", 16) == pytest.approx(4 * math.pi)


def test_prompts_parse_back():
    specs = all_specs()
    assert len(specs) == 4 * 3 * 4 * 2 == len({s.prompt for s in specs})
    assert specs[0] == ClipSpec("red", "square", "left", "slowly") and specs == all_specs()  # fixed order
    assert ClipSpec("red", "square", "right", "quickly").prompt == "a red square moves right quickly"
    for s in specs:
        assert ClipSpec.from_prompt(s.prompt) == s
    assert ClipSpec.from_prompt("  A Blue  Circle moves UP slowly. ") == ClipSpec("blue", "circle", "up", "slowly")


@pytest.mark.parametrize("text, match", [
    ("a purple square moves right quickly", r"unknown colour 'purple'; accepted: red, green, blue, yellow"),
    ("a red hexagon moves right quickly", r"unknown shape 'hexagon'; accepted: square, circle, triangle"),
    ("a red square moves sideways quickly", r"unknown direction 'sideways'; accepted: left, right, up, down"),
    ("a red square moves right fast", r"unknown speed 'fast'; accepted: slowly, quickly"),
    ("a red square jumps right quickly", r"cannot parse prompt .*expected the form 'a <colour> <shape> moves"),
    ("red square moves right", r"cannot parse prompt"),
])
def test_from_prompt_errors_name_the_word(text, match):
    with pytest.raises(ValueError, match=match):
        ClipSpec.from_prompt(text)


def test_clipspec_rejects_unknown_words():
    with pytest.raises(ValueError, match=r"unknown colour 'teal'; accepted: red"):
        ClipSpec("teal", "square", "left", "slowly")


# --------------------------------------------------------------------------------------------- splits


@pytest.mark.parametrize("holdout, count", [(16, 16), (0.25, 24), (0, 0)])
def test_split_is_disjoint_complete_and_deterministic(holdout, count):
    train, held = split_specs(holdout, seed=3)
    assert len(held) == count and len(train) + len(held) == 96
    assert not set(train) & set(held) and set(train) | set(held) == set(all_specs())
    assert (train, held) == split_specs(holdout, seed=3)
    order = {s: i for i, s in enumerate(all_specs())}
    assert [order[s] for s in held] == sorted(order[s] for s in held)  # all_specs order kept
    for field, values in (("colour", COLOURS), ("shape", SHAPES), ("direction", DIRECTIONS), ("speed", SPEEDS)):
        assert {getattr(s, field) for s in train} == set(values)  # every word is seen in training


def test_split_depends_on_seed():
    assert split_specs(16, seed=0)[1] != split_specs(16, seed=1)[1]


def test_split_keeps_words_in_training_even_when_large():
    train, held = split_specs(90, seed=0)  # 6 train combinations must still cover both speeds etc.
    assert len(train) == 6 and {s.speed for s in train} == set(SPEEDS) and {s.colour for s in train} == set(COLOURS)


@pytest.mark.parametrize("holdout, match", [
    (96, r"holdout count must be in \[0, 96\)"), (-1, r"holdout count"), (1.0, r"holdout fraction must be in \[0, 1\)"),
    ("3", r"holdout must be an int count or a float fraction"), (True, r"holdout must be an int"),
    (93, r"cannot hold out 93 combinations and keep every word in training"),
])
def test_split_errors(holdout, match):
    with pytest.raises(ValueError, match=match):
        split_specs(holdout, seed=0)


# --------------------------------------------------------------------------------------------- clips


@pytest.mark.parametrize("spec", all_specs()[::5] + [ClipSpec("yellow", "triangle", "up", "quickly")])
def test_clip_moves_exactly_speed_per_frame_inside_the_frame(spec):
    frames, centres = make_clip(spec, np.random.default_rng(7), return_track=True)
    assert frames.shape == (8, 16, 16, 3) and frames.dtype == np.uint8 and centres.shape == (8, 2)
    step = np.asarray(DIRECTIONS[spec.direction]) * speed_px(spec.speed, 16)
    np.testing.assert_allclose(np.diff(centres, axis=0), np.tile(step, (7, 1)), atol=1e-12)  # the track: exact
    half = shape_px(16) / 2
    assert (centres - half).min() >= 0 and (centres + half).max() <= 16
    # the pixels: the coverage area stays the full shape (nothing leaves the frame) ...
    area, cen = pixel_centroids(frames, spec.colour)
    np.testing.assert_allclose(area, shape_area(spec.shape, 16), rtol=0.01)
    # ... and its centroid moves by the step every frame: exactly for a square (its coverage centroid
    # is its centre), to within the box filter's sub-pixel bias (< 0.07 px) for a circle or triangle
    np.testing.assert_allclose(np.diff(cen, axis=0), np.tile(step, (7, 1)), atol=0.08)
    if spec.shape == "square":
        np.testing.assert_allclose(cen, centres, atol=0.01)


def test_clip_pixels_are_background_or_the_prompted_colour():
    spec = ClipSpec("green", "circle", "down", "slowly")
    frames = make_clip(spec, np.random.default_rng(0)).astype(float)
    u = np.asarray(PALETTE["green"], float) - BG
    a = coverage(frames, "green")
    resid = np.linalg.norm(frames - BG - a[..., None] * u, axis=-1)
    assert resid.max() <= 1.0  # every pixel is a blend of bg and green, up to uint8 rounding
    assert (a > 0.99).sum(axis=(1, 2)).min() >= 4  # a solid core in every frame
    far = a == 0
    assert far.mean() > 0.8 and (frames[far] == BG).all()  # the background is exactly the constant grey


def test_start_position_is_the_randomness():
    spec = ClipSpec("red", "square", "right", "slowly")
    a = make_clip(spec, np.random.default_rng(1), return_track=True)
    b = make_clip(spec, np.random.default_rng(1), return_track=True)
    np.testing.assert_array_equal(a[0], b[0])
    starts = np.stack([make_clip(spec, np.random.default_rng(s), return_track=True)[1][0] for s in range(200)])
    # x0 in [0, 16 - 4 - 5.25] on a 1/4 px grid -> centre x in [2, 8.75]; y centre in [2, 14]
    assert starts[:, 0].min() == 2.0 and starts[:, 0].max() == 8.75
    assert starts[:, 1].min() == 2.0 and starts[:, 1].max() == 14.0
    assert len({tuple(s) for s in starts}) > 100


def test_sizes_scale_and_long_clips_fit_when_slow():
    frames, centres = make_clip(ClipSpec("blue", "square", "left", "quickly"), np.random.default_rng(0),
                                num_frames=6, size=32, return_track=True)
    assert frames.shape == (6, 32, 32, 3)
    np.testing.assert_allclose(np.diff(centres[:, 0]), -3.0)
    area, cen = pixel_centroids(frames, "blue")
    np.testing.assert_allclose(area, 64, rtol=0.01)
    np.testing.assert_allclose(np.diff(cen[:, 0]), -3.0, atol=0.01)
    make_clip(ClipSpec("red", "square", "up", "slowly"), np.random.default_rng(0), num_frames=17)  # 4 + 12 = 16 px
    make_clip(ClipSpec("red", "square", "up", "quickly"), np.random.default_rng(0), num_frames=9)  # 4 + 12 = 16 px


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_frames=1), r"num_frames must be an int >= 2, got 1"),
    (dict(size=4), r"size must be an int >= 8 px"),
    (dict(size=16.0), r"size must be an int"),
    (dict(num_frames=10), r"'quickly' clip of num_frames=10 does not fit a 16 px frame: shape 4 px \+ travel "
                          r"1.5 px/frame x 9 = 17.5 px > 16 px; use num_frames <= 9"),
    (dict(rng=0), r"rng must be a numpy.random.Generator"),
    (dict(spec="a red square moves up quickly"), r"spec must be a ClipSpec"),
])
def test_make_clip_errors(kwargs, match):
    args = dict(spec=ClipSpec("red", "square", "up", "quickly"), rng=np.random.default_rng(0)) | kwargs
    with pytest.raises(ValueError, match=match):
        make_clip(**args)


def test_check_fits_slow():
    check_fits("slowly", 17, 16)
    with pytest.raises(ValueError, match=r"use num_frames <= 17"):
        check_fits("slowly", 18, 64)


def test_make_dataset_is_seeded_balanced_and_fast():
    specs = all_specs()
    start = time.perf_counter()
    clips, chosen = make_dataset(specs, 2000, seed=0)
    elapsed = time.perf_counter() - start
    assert clips.shape == (2000, 8, 16, 16, 3) and clips.dtype == np.uint8 and len(chosen) == 2000
    assert elapsed < 3.0, elapsed
    counts = Counter(chosen)
    assert set(counts) == set(specs) and set(counts.values()) == {20, 21}  # 2000 = 96 * 20 + 80
    again, chosen_again = make_dataset(specs, 2000, seed=0)
    assert chosen_again == chosen and np.array_equal(again, clips)
    other, chosen_other = make_dataset(specs, 2000, seed=1)
    assert chosen_other != chosen and not np.array_equal(other, clips)
    # each clip shows its spec, moving as the spec says
    _, some, tracks = make_dataset(specs[:8], 16, seed=5, return_tracks=True)
    clips16, _ = make_dataset(specs[:8], 16, seed=5)
    for frames, spec, track in zip(clips16, some, tracks):
        area, cen = pixel_centroids(frames, spec.colour)
        np.testing.assert_allclose(area, shape_area(spec.shape, 16), rtol=0.01)
        step = np.asarray(DIRECTIONS[spec.direction]) * speed_px(spec.speed, 16)
        np.testing.assert_allclose(np.diff(cen, axis=0), np.tile(step, (7, 1)), atol=0.08)
        np.testing.assert_allclose(np.diff(track, axis=0), np.tile(step, (7, 1)))


@pytest.mark.parametrize("args, match", [
    (([], 4, 0), r"specs is empty"), ((None, 0, 0), None), ((["x"], 4, 0), r"spec must be a ClipSpec"),
])
def test_make_dataset_errors(args, match):
    specs, n, seed = args
    specs = all_specs() if specs is None else specs
    with pytest.raises(ValueError, match=match or r"n must be an int >= 1, got 0"):
        make_dataset(specs, n, seed)


def test_recoloured_pretraining_clips_show_the_next_colour_under_the_same_prompt():
    """sft_recolour: about that share of the clips is repainted in the palette's next colour with the
    shape and motion untouched (every reward scores it as a clip of the next colour) and the
    prompt unchanged; the others stay bit-identical; a bad share is one line."""
    from dataclasses import replace

    from mmrl.envs.video.clips import COLOURS, all_specs, make_dataset
    from mmrl.envs.video.task import VideoTask, recolour_clips
    from mmrl.rewards.video import video_colour, video_motion, video_smoothness

    clips, specs = make_dataset(list(all_specs()), 200, 0)
    original = clips.copy()
    picked = recolour_clips(clips, specs, 0.6, np.random.default_rng(0))
    assert 0.5 < picked.mean() < 0.7
    assert np.array_equal(clips[~picked], original[~picked])
    prompted = [{"spec": s} for s in specs]
    shown = [{"spec": replace(s, colour=COLOURS[(COLOURS.index(s.colour) + 1) % len(COLOURS)])} for s in specs]
    assert video_colour(prompted, clips)[picked].max() == 0.0
    assert video_colour(prompted, clips)[~picked].min() > 0.99
    for reward in (video_colour, video_motion):
        assert reward(shown, clips)[picked].min() > 0.99
    assert np.allclose(video_smoothness(shown, clips)[picked], video_smoothness(prompted, original)[picked], atol=0.02)
    red = next(i for i in np.flatnonzero(picked) if specs[i].colour == "red")
    assert (clips[red].reshape(-1, 3) == (40, 200, 60)).all(1).any()  # solid red pixels became solid green

    task = VideoTask(n_sft=40, sft_recolour=1.0)
    batch = task.sft_batch(8, np.random.default_rng(0))
    assert video_colour(batch, np.stack([c["target"] for c in batch])).max() == 0.0
    with pytest.raises(ValueError, match="sft_recolour must be a share in \\[0, 1\\], got 1.5"):
        VideoTask(sft_recolour=1.5)
