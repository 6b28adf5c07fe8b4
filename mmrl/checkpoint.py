"""Atomic checkpoints with everything needed for exact resume.

A checkpoint is a directory `step_000012/` holding the model weights (safetensors), the optimizer
and scheduler states, every RNG state and the data cursor. It is written to a temporary sibling
and renamed into place, so a crash mid-write never leaves a half checkpoint that looks whole;
`latest` is a small text file replaced atomically after the rename.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file


class CheckpointError(RuntimeError):
    pass


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in generators.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    for k, g in generators.items():
        g.set_state(state["generators"][k])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any],
                    keep: int = 2) -> Path:
    run_dir = Path(run_dir)
    ckpt_root = run_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=ckpt_root, prefix=f".tmp_step_{step:06d}_"))
    try:
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        # Tied weights share storage; safetensors refuses shared tensors, so clone them apart.
        seen: dict[int, str] = {}
        for k, v in weights.items():
            ptr = v.untyped_storage().data_ptr()
            if ptr in seen:
                weights[k] = v.clone()
            seen[ptr] = k
        save_file(weights, str(tmp / "model.safetensors"))
        torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(ckpt_root / "latest", final.name)
    old = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for p in old[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def find_latest(run_dir: str | Path) -> Path | None:
    ckpt_root = Path(run_dir) / "checkpoints"
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        path = ckpt_root / pointer.read_text().strip()
        if (path / "meta.json").is_file():
            return path
    return None


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir() and not (path / "meta.json").is_file():
        latest = find_latest(path)
        path = latest if latest is not None else path
    missing = [n for n in ("model.safetensors", "trainer_state.pt", "meta.json") if not (path / n).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {', '.join(missing)}; expected a step_NNNNNN "
                              f"directory or a run directory with checkpoints/latest")
    state = load_file(str(path / "model.safetensors"))
    result = model.load_state_dict(state, strict=False)
    bad = [k for k in result.missing_keys if not _is_tied(model, k)]
    if bad or result.unexpected_keys:
        raise CheckpointError(f"checkpoint {path} does not fit the model: missing {bad[:5]}, "
                              f"unexpected {result.unexpected_keys[:5]}")
    return torch.load(path / "trainer_state.pt", weights_only=False)


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    return key.endswith("lm_head.weight") and getattr(getattr(model, "config", None), "tie_word_embeddings", False)
