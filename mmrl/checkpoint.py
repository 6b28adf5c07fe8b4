"""Atomic checkpoints with everything needed for exact resume.

A checkpoint is a directory `step_000012/` holding the model weights (safetensors), the optimizer
and scheduler states, every RNG state and the data cursor. It is written to a temporary sibling
and renamed into place, so a crash mid-write never leaves a half checkpoint that looks whole;
`latest` is a small text file replaced atomically after the rename. `meta.json` records each
file's size and SHA-256: loading checks them, names a damaged file, and a run directory resolves
to its newest checkpoint that is whole.

A run of several processes (torchrun) writes the sharded layout instead: `dcp/` holds the model
and optimizer as torch.distributed.checkpoint shards (each rank writes its own, and DCP re-shards
them on load into any number of ranks, one included), and `rank_R.pt` each rank's RNG states and
replay buffer; the manifest and the atomic rename are the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

log = logging.getLogger("mmrl")


class CheckpointError(RuntimeError):
    pass


RUN_CONFIG = "config.yaml"  # the resolved config a run folder was started with


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


CHECKPOINT_FILES = ("model.safetensors", "trainer_state.pt")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write `checkpoints/step_NNNNNN/` atomically; `meta.json` records each file's size and SHA-256
    so that loading can tell a damaged file from a whole one."""
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
        files = {n: {"size": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in CHECKPOINT_FILES}
        (tmp / "meta.json").write_text(json.dumps({"step": step, "files": files}))
        if final.exists():  # the same step again (the final save after the last evaluation): swap by two
            aside = Path(tempfile.mkdtemp(dir=ckpt_root, prefix=f".old_step_{step:06d}_"))  # renames, not a slow delete
            os.replace(final, aside / final.name)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(ckpt_root / "latest", final.name)
    old = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for p in old[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def save_sharded_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            trainer_state: dict[str, Any], dist, keep: int = 2) -> Path:
    """`save_checkpoint` for a multi-process run; every rank calls it (`dist`: mmrl.distributed.Dist).
    The folder is renamed into place by rank 0 only after every rank has written its part, so a rank
    that dies mid-save leaves the previous checkpoint the newest whole one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from mmrl.distributed import barrier

    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}_sharded"  # one name every rank agrees on
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(dist)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "dcp"))
    torch.save({**trainer_state, "rank": dist.rank}, tmp / f"rank_{dist.rank}.pt")
    barrier(dist)
    if dist.is_main:
        names = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        files = {n: {"size": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in names}
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": dist.world, "files": files}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(ckpt_root / "latest", final.name)
        old = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
        for p in old[:-keep] if keep > 0 else []:
            shutil.rmtree(p, ignore_errors=True)
    barrier(dist)
    return final


def is_sharded(path: Path) -> bool:
    return (path / "dcp").is_dir()


def verify_checkpoint(path: str | Path) -> None:
    """Raise CheckpointError naming the first missing or damaged file of the checkpoint at `path`."""
    path = Path(path)
    required = ("meta.json", "rank_0.pt") if is_sharded(path) else (*CHECKPOINT_FILES, "meta.json")
    missing = [n for n in required if not (path / n).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {', '.join(missing)}; expected a step_NNNNNN "
                              f"directory or a run directory with checkpoints/")
    try:
        files = json.loads((path / "meta.json").read_text()).get("files", {})
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint file {path / 'meta.json'} is damaged (not a JSON object)") from None
    for name, want in files.items():  # checkpoints written before manifests have none: nothing to check
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}, which was written at save time")
        size = (path / name).stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"checkpoint file {path / name} is damaged: {size} bytes, "
                                  f"{want['size']} were written")
        if _sha256(path / name) != want["sha256"]:
            raise CheckpointError(f"checkpoint file {path / name} is damaged: its SHA-256 differs from "
                                  f"the one written at save time")


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `run_dir/checkpoints`, or None. A damaged newer one is
    skipped with a warning that names it."""
    ckpt_root = Path(run_dir) / "checkpoints"
    for path in sorted((p for p in ckpt_root.glob("step_*") if p.is_dir()), reverse=True):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            log.warning(f"{exc}; falling back to an older checkpoint")
            continue
        return path
    return None


def _is_step_dir(path: Path) -> bool:
    return (path / "meta.json").is_file() or (path / "model.safetensors").is_file()


def run_dir_of(path: str | Path) -> Path:
    """The run directory of `path`: a run directory itself, or the one a step_NNNNNN checkpoint lies
    in. Reads no weights (`resolve_checkpoint` checks them)."""
    path = Path(path)
    if _is_step_dir(path):
        return path.parent.parent if path.parent.name == "checkpoints" else path.parent
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} not found: expected a step_NNNNNN directory or a run "
                              f"directory with checkpoints/")
    return path


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) for `path`: a step_NNNNNN directory (checked whole), or a
    run directory (its newest whole checkpoint)."""
    path, run_dir = Path(path), run_dir_of(path)
    if _is_step_dir(path):
        verify_checkpoint(path)
        return run_dir, path
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(f"no complete checkpoint under {path / 'checkpoints'}")
    return path, latest


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load the weights of the checkpoint at `path` (see `resolve_checkpoint`) into `model`, after
    checking its files; returns the trainer state."""
    return load_whole_checkpoint(resolve_checkpoint(path)[1], model)


def load_whole_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                          rank: int = 0) -> dict[str, Any]:
    """`load_checkpoint` for a step directory already checked (by `verify_checkpoint`, `find_latest`
    or `resolve_checkpoint`): hashing a large checkpoint twice is wasted time. A sharded checkpoint
    also loads `optimizer` when given, and returns rank `rank`'s trainer state (rank 0's, with its
    "rank" saying so, when the saving run had fewer ranks)."""
    if is_sharded(path):
        return _load_sharded(path, model, optimizer, rank)
    try:
        state = load_file(str(path / "model.safetensors"))
    except Exception as exc:  # safetensors raises its own error types for a bad header or body
        raise CheckpointError(f"checkpoint file {path / 'model.safetensors'} is damaged: {_first_line(exc)}") from None
    own = model.state_dict()
    # A model built from another config than the run's: one line naming a tensor, not torch's list of all.
    shapes = [(k, list(v.shape), list(own[k].shape)) for k, v in state.items() if k in own and own[k].shape != v.shape]
    if shapes:
        key, saved, built = shapes[0]
        more = f" (and {len(shapes) - 1} more tensors)" if len(shapes) > 1 else ""
        raise CheckpointError(f"checkpoint {path} does not fit the model built from this config: {key} is {saved} "
                              f"in the checkpoint, {built} in the model{more}; build it from the config it was "
                              f"trained with (its run folder's {RUN_CONFIG})")
    result = model.load_state_dict(state, strict=False)
    bad = [k for k in result.missing_keys if not _is_tied(model, k)]
    if bad or result.unexpected_keys:
        raise CheckpointError(f"checkpoint {path} does not fit the model: missing {bad[:5]}, "
                              f"unexpected {result.unexpected_keys[:5]}")
    try:
        return torch.load(path / "trainer_state.pt", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path / 'trainer_state.pt'} is damaged: {_first_line(exc)}") from None


def _load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  rank: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    try:
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=str(path / "dcp"))
            set_model_state_dict(model, state["model"])
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=str(path / "dcp"))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} does not load into this model: {_first_line(exc)}") from None
    own = path / f"rank_{rank}.pt"
    try:
        return torch.load(own if own.is_file() else path / "rank_0.pt", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {own} is damaged: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    return key.endswith("lm_head.weight") and getattr(getattr(model, "config", None), "tie_word_embeddings", False)


# ------------------------------------------------------------------ one run per folder


def plain_config(data: Any) -> Any:
    return json.loads(json.dumps(data))  # tuples -> lists, as the YAML snapshot reads back


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(old: dict[str, Any], new: dict[str, Any], allowed) -> str:
    """"key: old -> new; ..." for the keys of two nested config dicts that differ and `allowed(key)`
    does not accept (at most three shown), or "" when there are none."""
    old, new = _flatten(old), _flatten(new)
    missing = object()
    diff = sorted(k for k in old.keys() | new.keys() if not allowed(k) and old.get(k, missing) != new.get(k, missing))
    shown = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:3])
    return shown + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")


def check_same_run(cfg) -> None:
    """Refuse to resume the run in `cfg.train.output_dir` when it was started with a config that
    differs from `cfg` in anything but run length (`RUN_LENGTH_KEYS`): that is another run."""
    from mmrl.config_checks import RunMismatchError
    from mmrl.run_config import RUN_LENGTH_KEYS

    run_dir = Path(cfg.train.output_dir)
    saved = run_dir / RUN_CONFIG
    if not saved.is_file() or not any((run_dir / "checkpoints").glob("step_*")):
        return
    diff = config_differences(read_run_config(run_dir, fill=False), plain_config(cfg.to_dict()),
                              RUN_LENGTH_KEYS.__contains__)
    if diff:
        raise RunMismatchError(f"{run_dir} holds a run started with another config ({diff}); "
                               f"give this one its own folder (train.output_dir=DIR) or discard that run "
                               f"(--no-resume)")


def read_run_config(run_dir: str | Path, fill: bool = True) -> dict[str, Any]:
    """The resolved config `run_dir` was started with (its config.yaml): as written, or with `fill`
    checked against this mmrl's keys and every key filled in (not validated: a device it names may
    be one this machine lacks, which eval may override). A damaged file is one CheckpointError line."""
    from mmrl.config_checks import ConfigError, build_dataclass
    from mmrl.run_config import RunConfig, read_config_file

    saved = Path(run_dir) / RUN_CONFIG
    try:
        data = read_config_file(saved)
        return plain_config(build_dataclass(RunConfig, data).to_dict()) if fill else data
    except ConfigError as exc:
        raise CheckpointError(f"the run's config cannot be read: {exc} ({saved} is the config {run_dir} was "
                              f"started with; restore it, or remove it)") from None


def write_run_config(cfg) -> None:
    atomic_write_text(Path(cfg.train.output_dir) / RUN_CONFIG,
                      yaml.safe_dump(plain_config(cfg.to_dict()), sort_keys=False))


def discard_run(run_dir: str | Path) -> bool:
    """Remove a previous run's checkpoints, final weights and results (a fresh start, --no-resume)."""
    run_dir = Path(run_dir)
    found = False
    for name in ("checkpoints", "final"):
        if (run_dir / name).is_dir():
            shutil.rmtree(run_dir / name)
            found = True
    for name in ("results.json", RUN_CONFIG):
        if (run_dir / name).is_file():
            (run_dir / name).unlink()
            found = True
    return found
