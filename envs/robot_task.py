"""What the robot tasks (`tabletop`, `libero`) share: the training stream, held-out evaluation by
closed-loop episodes, and SFT frames read from a LeRobotDataset. One module, so both tasks import
it and neither imports the other (the tabletop task never loads LIBERO).

A context is an initial state, `{"task": "reach", "init_state_id": 17}` (tabletop) or
`{"suite": "libero_spatial", "task_id": 3, "init_state_id": 7}` (LIBERO); the policy's `sample`
runs G episodes from each (trajectory-level GRPO). SFT contexts are frames of demonstrations with
the next `chunk_size` expert actions:

    {"images": {"front": HxWx3 uint8}, "state": float32[8], "instruction": str,
     "actions": float32[chunk_size, 7], "action_is_pad": bool[chunk_size], "task": str}

`evaluate(policy, n)` rolls out the first n held-out states greedily and/or sampled at the
policy's training temperature and reports success overall, per task and the mean episode length.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mmrl.envs import TaskBase
from mmrl.policies.base import eval_mode

EVAL_MODES = ("greedy", "sampled", "both")


def check_choice(name: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ValueError(f"task.params.{name}: invalid value {value!r}; valid: {', '.join(valid)}")


def rollout_episodes(policy, contexts: list[dict], temperature: float | None, samples: int = 1,
                     seed: int = 12345) -> tuple[list[dict], list[dict]]:
    """Run `samples` episodes per context (temperature 0 = greedy; None = the policy's own) with a
    fixed generator, so an evaluation is repeatable. Returns (contexts with "instruction" filled in,
    decoded trajectories: success, frames, length, instruction)."""
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    with torch.no_grad():
        rollout = policy.sample(contexts, samples, generator=gen, temperature=temperature)
    return list(rollout.contexts), policy.decode(rollout)


def episode_metrics(contexts: list[dict], outputs: list[dict], key: str = "task") -> dict[str, float]:
    """Success rate overall and per `contexts[i][key]`, mean episode length (env steps) overall and
    over successes only."""
    success = np.array([bool(o["success"]) for o in outputs], bool)
    length = np.array([int(o["length"]) for o in outputs], float)
    out = {"success": float(success.mean()) if len(success) else float("nan"),
           "episode_len": float(length.mean()) if len(length) else float("nan"),
           "episodes": float(len(success))}
    if success.any():
        out["episode_len_success"] = float(length[success].mean())
    groups = [str(c.get(key, "")) for c in contexts]
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        out[f"success/{g}"] = float(success[idx].mean())
    return out


class RobotTask(TaskBase):
    """What the robot tasks share: a training stream over `self.train` (a fresh seeded permutation
    each epoch, so the cursor alone fixes the stream and resume is exact), the fixed held-out list
    `self.test`, and `evaluate(policy, n)`: greedy and/or sampled success on the first n held-out
    contexts. The trainer already logs greedy success as `eval/success` (its own greedy pass over
    `eval_batch`), so the tabletop default is "sampled": the rate the policy earns at its training
    temperature, `eval_samples` episodes per state."""

    REPORT = "vla"

    seed: int
    train: list[dict]
    test: list[dict]
    cursor: int
    eval_mode: str
    eval_samples: int
    # episodes run at once (the env factory's max_envs; evaluate's batches): bounds env and frame memory
    eval_envs: int = 64
    group_key: str = "task"
    num_workers: int
    prefetch_resets: bool = True
    _last_batch: list[dict] | None = None  # the latest `next_batch`, for `upcoming_rows`

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 17, epoch]).permutation(len(self.train))

    def _peek(self, start: int, n: int) -> list[dict]:
        out = []
        for pos in range(start, start + n):
            epoch, k = divmod(pos, len(self.train))
            out.append(dict(self.train[int(self._epoch_order(epoch)[k])]))
        return out

    def next_batch(self, n: int) -> list[dict]:
        out = self._peek(self.cursor, n)
        self.cursor += n
        self._last_batch = [dict(c) for c in out]
        return out

    def upcoming_rows(self, rows: list[dict]) -> list[dict] | None:
        """If `rows` are G copies of each context of the latest `next_batch` (a training rollout),
        the rows of the next one (the stream is a pure function of the cursor); else None."""
        last = self._last_batch
        if not last or len(rows) % len(last):
            return None
        G = len(rows) // len(last)
        key = lambda c: tuple(c.get(k) for k in ("task", "suite", "task_id", "init_state_id"))  # noqa: E731
        if [key(r) for r in rows] != [key(c) for c in last for _ in range(G)]:
            return None
        return [c for c in self._peek(self.cursor, len(last)) for _ in range(G)]

    def make_vector_env(self, rows: list[dict]):
        """The vector env for a batch of contexts (the policy's env hook; see `env_factory`)."""
        return self.env_factory(rows)

    def _upcoming(self):
        """The factory's `upcoming` hook: only worker processes can reset while the policy trains."""
        return self.upcoming_rows if self.prefetch_resets and self.num_workers > 0 else None

    def eval_batch(self, n: int) -> list[dict]:
        return [dict(c) for c in self.test[: min(n, len(self.test))]]

    def run_health(self) -> dict[str, Any]:
        """Facts on how the run went that its results should carry (the trainer's hook: it adds them
        to results.json as "run_health" and prints each of "notes"): here, how often an env worker
        died or hung and was restarted. Each restart scored the episodes in flight on that worker as
        failures, so a run with restarts learned from, and was evaluated on, some unlucky zeros."""
        factory = getattr(self, "_env_factory", None)  # built on first use: no envs, nothing to say
        if self.num_workers == 0 or factory is None:
            return {}
        n = int(getattr(factory, "restarts", 0))
        health: dict[str, Any] = {"env_worker_restarts": n}
        if n:
            health["notes"] = [f"{n} env worker restart(s) during this run: a worker process died or hung, and "
                               "the episodes it was running counted as failures"]
        return health

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    def rollouts(self, policy, contexts: list[dict], mode: str) -> tuple[list[dict], list[dict]]:
        """Episodes of `contexts` in `mode` (greedy: 1 per state; sampled: `eval_samples` per state),
        at most `eval_envs` at a time."""
        temperature, k = (0.0, 1) if mode == "greedy" else (None, self.eval_samples)
        per = max(1, self.eval_envs // k)
        rows, outputs = [], []
        for i in range(0, len(contexts), per):
            r, o = rollout_episodes(policy, contexts[i:i + per], temperature, k, seed=12345 + i)
            rows += r
            outputs += o
        return rows, outputs

    def evaluate(self, policy, n: int) -> dict[str, float]:
        """Success on the first n held-out states per eval mode; with `eval_grounding`, also with
        images shuffled across episodes ("shuffled_<mode>/...") and the SFT loss on demo frames
        with their own vs shuffled images ("grounding/..."): a policy that looks does worse."""
        contexts = self.eval_batch(n)
        out: dict[str, float] = {}
        modes = self.eval_modes()
        for mode in modes:
            rows, outputs = self.rollouts(policy, contexts, mode)
            # "sampled/success", "sampled/success/reach", "greedy/episode_len", ...: the trainer logs
            # them as eval/<key>, apart from its own eval/<reward> and eval/sampled_<reward>.
            out.update({f"{mode}/{name}": v for name, v in episode_metrics(rows, outputs, self.group_key).items()})
        if self.eval_grounding:
            with self.env_factory.images_shuffled():
                for mode in modes:
                    rows, outputs = self.rollouts(policy, contexts, mode)
                    m = episode_metrics(rows, outputs, self.group_key)
                    out.update({f"shuffled_{mode}/{k}": m[k] for k in ("success", "episode_len")})
            frames = self.demo_frames() if self.has_demos() else []
            if frames:
                out.update({f"grounding/{k}": v for k, v in grounding_loss(policy, frames).items()})
        return out

    eval_grounding: bool = False

    def eval_modes(self) -> tuple[str, ...]:
        return ("greedy", "sampled") if self.eval_mode == "both" else (self.eval_mode,)

    def has_demos(self) -> bool:
        return getattr(self, "demos_per_task", 0) > 0 and hasattr(self, "demo_frames")

    def headline(self, before: dict[str, Any], after: dict[str, Any]) -> list:
        """Held-out success in percent, sampled at the training temperature (`evaluate`'s
        sampled/success) and greedy (greedy/success, or the trainer's own greedy pass of the
        `success` reward when the eval mode is sampled): README's rows."""
        from mmrl.envs.base import headline_rows

        greedy = "eval/greedy/success" if "eval/greedy/success" in after else "eval/success"
        return headline_rows(before, after, [("sampled success", "eval/sampled/success", ".1%"),
                                             ("greedy success", greedy, ".1%")])


def grounding_loss(policy, frames: list[dict], n: int = 128, seed: int = 0) -> dict[str, float]:
    """The policy's SFT loss on `n` demo frames with their own images and with images shuffled
    among them (each frame shown another frame's cameras), and the gap shuffled - own: about 0 for
    a policy that ignores its images. One noise draw serves both passes (flow policies sample noise
    in their loss), and the model is in eval mode (no augmentation)."""
    rng = np.random.default_rng(seed)
    picked = [dict(frames[int(i)]) for i in rng.choice(len(frames), min(n, len(frames)), replace=False)]
    if len(picked) < 2:
        raise ValueError("the grounding loss needs at least 2 demo frames")
    order = rng.permutation(len(picked))
    shown = np.empty(len(picked), np.int64)
    shown[order] = np.roll(order, 1)  # a cycle through a random order: no frame keeps its own images
    shuffled = [{**f, "images": picked[int(j)]["images"]} for f, j in zip(picked, shown)]
    losses = []
    with eval_mode(policy.model):
        for batch in (picked, shuffled):
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                losses.append(float(policy.sft_loss(batch)))
    own, other = losses
    return {"sft_loss_own": own, "sft_loss_shuffled": other, "sft_loss_gap": other - own}


@contextlib.contextmanager
def quiet_lerobot() -> Iterator[None]:
    """lerobot logs a long torchcodec traceback on import where FFmpeg is missing (our image-mode
    datasets never decode video) and `datasets` draws a progress bar per episode: mute both."""
    log = logging.getLogger("lerobot")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import datasets

        bars = datasets.utils.logging.is_progress_bar_enabled()
        datasets.disable_progress_bars()
    except ImportError:
        bars = False
    try:
        yield
    finally:
        log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def load_sft_frames(root: Path, chunk_size: int, cameras: Sequence[str], task_of: dict[str, str] | None = None
                    ) -> list[dict[str, Any]]:
    """Every frame of the LeRobotDataset at `root` as an SFT context (uint8 HWC images), read once
    into memory: a few hundred small frames, and `sft_batch` then costs nothing per step."""
    from mmrl.envs.tabletop.demos import load_demos

    with quiet_lerobot():
        ds = load_demos(root, chunk_size=chunk_size)
    missing = [c for c in cameras if f"observation.images.{c}" not in ds.features]
    if missing:
        have = [k[len("observation.images."):] for k in ds.features if k.startswith("observation.images.")]
        raise KeyError(f"demos at {root} lack camera(s) {missing}; they have {have}")
    frames = []
    with quiet_lerobot():
        items = [ds[i] for i in range(len(ds))]
    for item in items:
        images = {c: (item[f"observation.images.{c}"].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
                  for c in cameras}
        actions = item["action"].numpy().astype(np.float32).reshape(chunk_size, -1)
        pad = item["action_is_pad"].numpy().astype(bool).reshape(chunk_size) if "action_is_pad" in item \
            else np.zeros(chunk_size, bool)
        instruction = str(item["task"])
        frames.append({"images": images, "state": item["observation.state"].numpy().astype(np.float32),
                       "instruction": instruction, "actions": actions, "action_is_pad": pad,
                       "task": (task_of or {}).get(instruction, ""), "episode_index": int(item["episode_index"])})
    if not frames:
        raise ValueError(f"the demo dataset at {root} is empty")
    return frames


__all__ = ["EVAL_MODES", "RobotTask", "check_choice", "episode_metrics", "grounding_loss", "load_sft_frames",
           "quiet_lerobot", "rollout_episodes"]
