"""Video generation reports: labelled GIF and PNG grids of the same held-out prompts (and the same
initial noise) before and after RL, and `mmrl eval` on a video config.

`mmrl eval CONFIG CHECKPOINT` writes, in the checkpoint's run folder (or `--output`'s folder):
`eval.json` (each held-out reward component and the temporal consistency, the trainer's
evaluation), `videos.gif` and `videos.png` (one labelled column per held-out prompt).
`mmrl train` on a video config writes `videos_before_after.gif` / `.png` beside results.json.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

SCALE = 4  # pixels per generated pixel in the grids: 16 px frames are too small to look at
LABEL_H = 28  # label band under each column (prompt) and before each row (run stage)


def _label_band(text: str, width: int, height: int = LABEL_H) -> np.ndarray:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    lines = textwrap.wrap(text, max(4, width // 6))[: max(1, height // 11)]
    for i, line in enumerate(lines):
        draw.text((2, 1 + 11 * i), line, fill=(0, 0, 0))
    return np.asarray(img)


def grid_frames(rows: dict[str, list[np.ndarray]], prompts: list[str]) -> list[np.ndarray]:
    """One image per video frame: a column per prompt (labelled under it) and a row per stage
    (labelled on its left), each video upscaled SCALE times. rows: stage -> videos [F, H, W, 3]."""
    stages = list(rows)
    if not stages or any(len(v) != len(prompts) for v in rows.values()):
        raise ValueError(f"grid_frames: every row needs one video per prompt ({len(prompts)})")
    F, H, W, _ = rows[stages[0]][0].shape
    cell_w, cell_h = W * SCALE, H * SCALE
    row_label_w = 64
    frames = []
    for f in range(F):
        lines = []
        for stage in stages:
            cells = [np.kron(video[min(f, len(video) - 1)], np.ones((SCALE, SCALE, 1), np.uint8)) for video in rows[stage]]
            gap = np.full((cell_h, 2, 3), 255, np.uint8)
            body = np.concatenate([x for c in cells for x in (c, gap)], 1)
            label = _label_band(stage, row_label_w, cell_h)
            lines.append(np.concatenate([label, body], 1))
        captions = np.concatenate([_label_band("", row_label_w)] +
                                  [x for p in prompts for x in (_label_band(p, cell_w), np.full((LABEL_H, 2, 3), 255,
                                                                                                np.uint8))], 1)
        frames.append(np.concatenate([*lines, captions], 0))
    return frames


def write_grid(path_stem: str | Path, rows: dict[str, list[np.ndarray]], prompts: list[str], fps: int = 4) -> list[Path]:
    """`<stem>.gif` (the grid animated over the frames) and `<stem>.png` (the frames top to bottom)."""
    import imageio.v3 as iio

    frames = grid_frames(rows, prompts)
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    gif, png = stem.with_suffix(".gif"), stem.with_suffix(".png")
    iio.imwrite(gif, np.stack(frames), duration=int(1000 / fps), loop=0)
    strip = [np.concatenate([fr, np.full((6, fr.shape[1], 3), 128, np.uint8)], 0) for fr in frames]
    iio.imwrite(png, np.concatenate(strip, 0))
    return [gif, png]
