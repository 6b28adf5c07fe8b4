"""Task `video`: text-to-video prompts of a moving coloured shape, with verifiable rewards.

A context is `{"prompt", "spec"}` (a `ClipSpec`: colour, shape, direction, speed); SFT contexts
also carry `"target"`, a clip of that prompt (uint8 [F, H, W, 3]) from `make_clip`, for the
generator's flow-matching pretraining. The reward adapters (`mmrl.rewards.video`) check the
prompted colour, the prompted motion and temporal smoothness on the decoded frames.

`prompt_file` (a text file, one prompt per line, `#` comments) replaces the generated prompt set,
e.g. for a real generator scored by `clip_score`; the last `eval_prompts` lines are held out. The
verifiable rewards and the pretraining clips need prompts in the procedural form ("a red square
moves left quickly"): other prompts get `spec: None` and those rewards say so.

`sft_recolour` gives the pretraining data a systematic colour confusion: that share of the clips
shows the shape in the palette's next colour (red -> green -> blue -> yellow -> red) under the
prompt's colour word (`recolour_clips`), as text-to-video models bind attributes to the wrong
object or word. Above 1/2 the wrong colour becomes the pretrained generator's most likely one, an
error only the verifiable colour reward can correct (the rewards always check the prompt).

Held-out prompts: with `holdout` > 0 that many prompt specs (or that share of them) never appear in
training (SFT or RL); with `holdout: 0` the held-out set is the training prompts under fixed,
separate initial noise (the evaluation seeds its sampler), which is what "held-out" means for a
generator that is asked for the same prompts again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mmrl.envs import TaskBase, register_task
from mmrl.envs.base import Headline, headline_rows

# Held-out keys that are not reward components: the weighted total, the response length and the
# task's own metric (`evaluate_outputs`).
NOT_REWARDS = ("eval/total", "eval/len_mean", "eval/temporal_consistency")


@register_task("video")
class VideoTask(TaskBase):
    REPORT = "video"

    def __init__(self, seed: int = 0, data_seed: int = 0, num_frames: int = 8, image_size: int = 16,
                 holdout: int | float = 0, n_sft: int = 2000, eval_repeats: int = 2, prompt_file: str | None = None,
                 eval_prompts: int = 8, sft_recolour: float = 0.0):
        from mmrl.envs.video.clips import all_specs, split_specs

        if n_sft < 1:
            raise ValueError(f"task.params.n_sft must be >= 1 (the pretraining clips), got {n_sft}")
        if eval_repeats < 1:
            raise ValueError(f"task.params.eval_repeats must be >= 1 (held-out samples per prompt), got {eval_repeats}")
        self.num_frames, self.image_size, self.data_seed = int(num_frames), int(image_size), int(data_seed)
        if prompt_file is not None:
            self.train_specs, self.test_specs = read_prompt_file(prompt_file, eval_prompts)
        elif holdout:
            self.train_specs, self.test_specs = split_specs(holdout, data_seed)
        else:
            self.train_specs = self.test_specs = list(all_specs())
        if not self.train_specs or not self.test_specs:
            raise ValueError(f"task.params.holdout={holdout!r} leaves no {'training' if not self.train_specs else 'held-out'} "
                             f"prompts out of {len(all_specs())}")
        if not 0.0 <= sft_recolour <= 1.0:
            raise ValueError(f"task.params.sft_recolour must be a share in [0, 1], got {sft_recolour!r}")
        self.n_sft, self.eval_repeats, self.sft_recolour = int(n_sft), int(eval_repeats), float(sft_recolour)
        self._sft_clips: np.ndarray | None = None  # built on first use: RL-only runs never pay for it
        self._sft_specs: list = []
        self.rng = np.random.default_rng([int(seed), 71])
        self.eval_videos: list[list[np.ndarray]] = []  # each evaluation's videos (same prompts and noise)
        self.shown = 8  # videos per evaluation kept for the before / after grid ...
        self.shown_prompts: list[str] = []  # ... and their prompts
        self.cursor, self._order = 0, self.rng.permutation(len(self.train_specs))

    @staticmethod
    def context(spec) -> dict[str, Any]:
        """A prompt spec (`ClipSpec`) or a free prompt (str, from a prompt file) as a context."""
        if isinstance(spec, str):
            return {"prompt": spec, "spec": None}
        return {"prompt": spec.prompt, "spec": spec}

    def corpus(self) -> list[str]:
        return sorted({self.context(s)["prompt"] for s in self.train_specs + self.test_specs})

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        """Training prompts, every prompt once per pass in a fresh random order."""
        out = []
        for _ in range(n):
            if self.cursor == len(self._order):
                self.cursor, self._order = 0, self.rng.permutation(len(self.train_specs))
            out.append(self.context(self.train_specs[self._order[self.cursor]]))
            self.cursor += 1
        return out

    def eval_batch(self, n: int) -> list[dict[str, Any]]:
        """The held-out prompts, each `eval_repeats` times (the sampler's seeded noise differs per row),
        cut or cycled to n."""
        pool = [self.context(s) for _ in range(self.eval_repeats) for s in self.test_specs]
        return [pool[i % len(pool)] for i in range(n)]

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
        """Contexts with a target clip of their prompt, drawn from a fixed set of `n_sft` clips."""
        if self._sft_clips is None:
            from mmrl.envs.video.clips import make_dataset

            free = [s for s in self.train_specs if isinstance(s, str)]
            if free:
                raise ValueError(f"sft: the pretraining clips are generated from procedural prompts; {free[0]!r} (from "
                                 f"task.params.prompt_file) is not one (form: 'a red square moves left quickly')")
            self._sft_clips, self._sft_specs = make_dataset(self.train_specs, self.n_sft, self.data_seed,
                                                            self.num_frames, self.image_size)
            if self.sft_recolour > 0:
                recolour_clips(self._sft_clips, self._sft_specs, self.sft_recolour,
                               np.random.default_rng([self.data_seed, 73]))
        idx = rng.integers(len(self._sft_specs), size=n)
        return [{**self.context(self._sft_specs[i]), "target": self._sft_clips[i]} for i in idx]

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "cursor": self.cursor, "order": self._order.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.cursor, self._order = int(state["cursor"]), np.asarray(state["order"])

    def evaluate_outputs(self, contexts: list, outputs: list) -> dict[str, float]:
        """Temporal consistency of the held-out videos the trainer's evaluation generated (its mean
        rewards are the trainer's); `shown_rows` of them are kept for the before/after grid."""
        from mmrl.rewards.video import temporal_consistency

        rows = self.shown_rows(len(outputs))
        self.eval_videos.append([outputs[i] for i in rows])
        self.shown_prompts = [contexts[i]["prompt"] for i in rows]
        return {"temporal_consistency": float(np.mean(temporal_consistency(outputs)))}

    def shown_rows(self, n: int) -> list[int]:
        """The rows of an n-video evaluation the grid shows: `shown` spread evenly over the prompt list
        (neighbouring prompts differ only in direction or speed)."""
        return sorted(set(np.linspace(0, n - 1, min(self.shown, n)).round().astype(int).tolist()))

    def headline(self, before: dict[str, Any], after: dict[str, Any]) -> list[Headline]:
        """The held-out reward (its weighted total, e.g. colour + motion), then each reward component
        (eval/<reward>, each in [0, 1] for the verifiable ones)."""
        components = sorted(k for k in after if k.startswith("eval/") and k not in NOT_REWARDS
                            and not k.startswith("eval/sampled_") and isinstance(after[k], float))
        return headline_rows(before, after, [("held-out reward (total)", "eval/total", ".3f")]
                             + [(f"{k[5:].removeprefix('video_')} reward", k, ".3f") for k in components])

def recolour_clips(clips: np.ndarray, specs: list, share: float, rng: np.random.Generator) -> np.ndarray:
    """Repaint about `share` of the clips (uint8 [N, F, H, W, 3], in place) in the palette colour
    after their spec's: each pixel bg + a (c - bg) becomes bg + a (c' - bg), so the anti-aliased
    coverage a, the shape and the motion are unchanged; the specs (the prompts) are not. Returns the
    bool [N] of repainted clips."""
    from mmrl.envs.video.clips import BACKGROUND, COLOURS, PALETTE

    bg = np.asarray(BACKGROUND, np.float32)
    picked = rng.random(len(specs)) < share
    for i in np.flatnonzero(picked):
        colour = specs[i].colour
        u = np.asarray(PALETTE[colour], np.float32) - bg
        new = np.asarray(PALETTE[COLOURS[(COLOURS.index(colour) + 1) % len(COLOURS)]], np.float32) - bg
        a = np.clip(((clips[i].astype(np.float32) - bg) @ u) / (u @ u), 0.0, 1.0)[..., None]
        clips[i] = np.clip(np.rint(bg + a * new), 0, 255).astype(np.uint8)
    return picked


def read_prompt_file(path: str, eval_prompts: int) -> tuple[list, list]:
    """(train, held-out) prompts of a text file, one per line: a `ClipSpec` where the line parses as
    a procedural prompt, else the text itself; the last `eval_prompts` lines are held out."""
    from mmrl.envs.video.clips import ClipSpec

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"task.params.prompt_file: {file} does not exist (a text file, one prompt per line)")
    try:
        lines = [ln.strip() for ln in file.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"task.params.prompt_file: cannot read {file} as UTF-8 text: {exc}") from None
    prompts = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(prompts) <= eval_prompts:
        raise ValueError(f"task.params.prompt_file: {file} has {len(prompts)} prompts; need more than eval_prompts="
                         f"{eval_prompts} (the last eval_prompts lines are held out)")

    def spec(text: str):
        try:
            return ClipSpec.from_prompt(text)
        except ValueError:
            return text

    specs = [spec(p) for p in prompts]
    return specs[:-eval_prompts] if eval_prompts else specs, specs[-eval_prompts:] if eval_prompts else specs
