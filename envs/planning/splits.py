"""Seeded layout generation, train/test splits disjoint by layout, and the paper's test split.

The paper uses 1,000 train and 250 test layouts per size; :func:`make_splits` draws the test split
from its own seeded stream first (so it does not change with ``n_train``), then the train split
from another stream, skipping every test key and any ``exclude`` layouts (e.g. the paper's test
split, so that our train data never contains a paper test instance).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from . import frozenlake, maze, minibehavior
from .grid import TASKS, Layout, canonical_task, state_array

GENERATORS: dict[str, Callable[..., Layout]] = {
    "frozenlake": frozenlake.generate,
    "maze": maze.generate,
    "minibehavior": minibehavior.generate,
}
PAPER_FILES = {
    "frozenlake": "vprl_frozenlake_test_meta.json",
    "minibehavior": "vprl_minibehaviour_test_meta.json",
}
_SPLIT_IDS = {"test": 0, "train": 1, "other": 2}


def generate_layout(task: str, size: int, rng: np.random.Generator, **kwargs: Any) -> Layout:
    """One random layout of ``task`` at ``size`` (grid side; MiniBehavior: interior side)."""
    task = canonical_task(task)
    if int(size) < 2:
        raise ValueError(f"size must be >= 2, got {size}")
    return GENERATORS[task](rng, int(size), **kwargs)


def _rng(seed: int, task: str, size: int, stream: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), TASKS.index(task), int(size),
                                                         _SPLIT_IDS[stream]]))


def generate_layouts(task: str, size: int, n: int, seed: int = 0, *, exclude: Iterable[Layout | str] = (),
                     stream: str = "other", max_draws: int | None = None, **kwargs: Any) -> list[Layout]:
    """``n`` distinct layouts (by ``Layout.key()``), none of them in ``exclude``; deterministic."""
    task = canonical_task(task)
    if stream not in _SPLIT_IDS:
        raise ValueError(f"unknown stream {stream!r}; valid: {', '.join(_SPLIT_IDS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = _rng(seed, task, size, stream)
    seen = {x if isinstance(x, str) else x.key() for x in exclude}
    out: list[Layout] = []
    budget = max_draws if max_draws is not None else 50 * n + 1000
    for _ in range(budget):
        if len(out) == n:
            break
        lay = generate_layout(task, size, rng, **kwargs)
        k = lay.key()
        if k not in seen:
            seen.add(k)
            out.append(lay)
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} distinct {task} layouts of size {size} in {budget} draws "
                           f"(asked for {n}); the space may be too small, lower the counts")
    return out


@dataclass(frozen=True)
class Split:
    task: str
    size: int
    train: tuple[Layout, ...]
    test: tuple[Layout, ...]

    def keys(self, which: str) -> set[str]:
        return {lay.key() for lay in getattr(self, which)}


def make_splits(task: str, size: int, n_train: int = 1000, n_test: int = 250, seed: int = 0, *,
                exclude: Iterable[Layout | str] = (), **kwargs: Any) -> Split:
    """Train/test layouts of one task and size, disjoint by layout key, reproducible from ``seed``."""
    task = canonical_task(task)
    exclude = [x if isinstance(x, str) else x.key() for x in exclude]
    test = generate_layouts(task, size, n_test, seed, exclude=exclude, stream="test", **kwargs)
    train = generate_layouts(task, size, n_train, seed, exclude=exclude + [t.key() for t in test],
                             stream="train", **kwargs)
    return Split(task, int(size), tuple(train), tuple(test))


# ----------------------------------------------------------------------------- paper test split


@dataclass(frozen=True)
class PaperTestSplit:
    """The VPRL paper's test environments with their reference (optimal) plans.

    ``plans[i]``: int64 states [T+1, 5] of the reference plan, start included, in our coordinates
    (MiniBehavior cells shifted by +1 for the wall ring). ``levels[i]``: the paper's level.
    """

    task: str
    layouts: tuple[Layout, ...]
    plans: tuple[np.ndarray, ...]
    levels: np.ndarray
    record_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.layouts)


def _frozenlake_record(rec: dict) -> tuple[Layout, np.ndarray]:
    level = int(rec["level"])
    lay = frozenlake.from_text(["".join(row) for row in rec["layout"]])
    if lay.start != divmod(int(rec["start_pos"]), level) or lay.goal != divmod(int(rec["target_pos"]), level):
        raise ValueError(f"record start/target {rec['start_pos']}/{rec['target_pos']} disagree with its layout")
    plan = np.stack([state_array(divmod(int(i), level), lay) for i in rec["input_state"]])
    return lay, plan


def _minibehavior_record(rec: dict) -> tuple[Layout, np.ndarray]:
    level = int(rec["level"])
    lay = minibehavior.make_layout(level, tuple(rec["start_pos"]), tuple(rec["printer_pos"]),
                                   [tuple(t) for t in rec["table_pos"]], start_dir=int(rec["start_dir"]),
                                   meta={"idx": rec.get("idx")})
    states, phase = [], 0
    for (r, c), carrying in rec["input_state"]:
        if carrying:
            phase = 1
        elif phase == 1:
            phase = 2  # the printer was dropped
        states.append(state_array((int(r) + 1, int(c) + 1, phase), lay))
    return lay, np.stack(states)


def load_paper_test_split(path: str | os.PathLike, task: str) -> PaperTestSplit:
    """Load the paper's test split (FrozenLake levels 3-6, MiniBehavior levels 5-6).

    ``path``: the metadata JSON file, or the folder holding ``vprl_*_test_meta.json``.
    """
    task = canonical_task(task)
    if task not in PAPER_FILES:
        raise ValueError(f"the paper's test metadata covers {', '.join(PAPER_FILES)}; not {task!r}")
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, PAPER_FILES[task])
    if not os.path.exists(path):
        raise FileNotFoundError(f"paper test metadata not found: {path}")
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    convert = _frozenlake_record if task == "frozenlake" else _minibehavior_record
    layouts, plans, levels, ids = [], [], [], []
    for i, rec in enumerate(records):
        try:
            lay, plan = convert(rec)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: record {i} is not a {task} record: {exc}") from exc
        layouts.append(lay)
        plans.append(plan)
        levels.append(int(rec["level"]))
        ids.append(int(rec.get("idx", i)))
    return PaperTestSplit(task, tuple(layouts), tuple(plans), np.asarray(levels), np.asarray(ids))
