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

Loading runs no code from the files: a run folder may come from elsewhere, and its hashes in
`meta.json` say only that a file is whole. The trainer state (`trainer_state.pt`, `rank_R.pt`) holds
tensors and plain values (dict, list, tuple, int, float, str, bool, None, bytes), what torch's
weights-only unpickler reads (numpy state as lists, a replay buffer's contexts through `to_plain`);
DCP's own pickles are checked before torch reads them (`_check_dcp_metadata`, `_weights_only_planner`).
A file that needs more is refused in one line; `trust_checkpoints` (`--trust-checkpoint`) loads it
with pickle, for a run folder an older mmrl wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

log = logging.getLogger("mmrl")


class CheckpointError(RuntimeError):
    pass


RUN_CONFIG = "config.yaml"  # the resolved config a run folder was started with


# What an interrupted write leaves in a run folder: temporary files and folders (`.tmp_*`) and folders
# renamed aside before they are deleted (`.old_*`). Nothing else mmrl writes starts so; a resumed run
# removes them (`remove_leftovers`).
LEFTOVER_PREFIXES = (".tmp_", ".old_")


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary sibling (`.tmp_NAME.*`) renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp_{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        raise named_write_error(exc, path)


def named_write_error(exc: BaseException, path: Path) -> BaseException:
    """`exc`, an OSError of a write (which names no file: it fails at write or close, not open) naming
    `path`, so that its one line says which file."""
    if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
        return OSError(exc.errno, exc.strerror, str(path))
    return exc


def rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """Every RNG state as plain values and tensors (a checkpoint holds no numpy objects)."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, keys.tolist(), int(pos), int(has_gauss), float(cached_gaussian)),
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in generators.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]  # keys: a list (an older mmrl saved the array itself)
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    for k, g in generators.items():
        g.set_state(state["generators"][k])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


CHECKPOINT_FILES = ("model.safetensors", "trainer_state.pt")


class CheckpointWriteError(CheckpointError):
    """A save failed for space or I/O; the previous checkpoint is still the newest whole one."""


class NonFiniteWeightsError(CheckpointError):
    """Weights that hold NaN or inf: never saved as a whole checkpoint."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, step: int, names, **extra) -> None:
    """`meta.json`: each file's size and SHA-256, so that loading can tell a damaged file from a whole one."""
    files = {n: {"size": (folder / n).stat().st_size, "sha256": _sha256(folder / n)} for n in names}
    (folder / "meta.json").write_text(json.dumps({"step": step, **extra, "files": files}))


def replace_dir(src: Path, dst: Path) -> None:
    """Rename the finished folder `src` into place as `dst`. One already there (the same step saved
    again after the last evaluation; a run's previous final/) is renamed aside first and deleted
    after: a kill leaves the old or the new `dst` whole, or between the two renames a `.old_*` and a
    `.tmp_*` folder, never a half `dst`."""
    if dst.exists():
        aside = dst.parent / f".old_{dst.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(dst, aside)
        os.replace(src, dst)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(src, dst)


def rotate(ckpt_root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, each renamed aside first: a kill mid-delete
    leaves a `.old_*` folder, never a half `step_*` one."""
    if keep <= 0:
        return
    for path in sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())[:-keep]:
        aside = ckpt_root / f".old_{path.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        shutil.rmtree(aside, ignore_errors=True)


def publish(tmp: Path, final: Path, keep: int) -> None:
    """Make the checkpoint written in `tmp` the newest: rename it into place, point `latest` at it,
    rotate."""
    replace_dir(tmp, final)
    atomic_write_text(final.parent / "latest", final.name)
    rotate(final.parent, keep)


def remove_leftovers(run_dir: str | Path) -> list[tuple[str, int]]:
    """Delete what interrupted writes left in `run_dir` and its checkpoints/ (`LEFTOVER_PREFIXES`);
    returns each one's path (relative to `run_dir`) and size in bytes."""
    run_dir = Path(run_dir)
    removed = []
    for folder in (run_dir, run_dir / "checkpoints"):
        for path in sorted(folder.glob(".*")) if folder.is_dir() else ():
            if not path.name.startswith(LEFTOVER_PREFIXES):
                continue
            removed.append((str(path.relative_to(run_dir)), disk_bytes(path)))
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    return removed


def disk_bytes(path: Path) -> int:
    """The size of a file, or of every file under a folder."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir() or f.is_symlink())


def size_text(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a nested state (what writing it needs, less a little metadata)."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def non_finite_weights(weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors that hold NaN or inf."""
    return [k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def newest_step_dir(ckpt_root: Path) -> Path | None:
    """The newest `step_*` folder by name (not checked whole: for messages)."""
    steps = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir()) if ckpt_root.is_dir() else []
    return steps[-1] if steps else None


def warn_if_short_of_space(ckpt_root: Path) -> None:
    """A warning before a save when the disk has less free space than the last checkpoint took."""
    last = newest_step_dir(ckpt_root)
    if last is None:
        return
    size, free = disk_bytes(last), shutil.disk_usage(ckpt_root).free
    if free < size:
        from mmrl.logger import say

        say(f"warning: {size_text(free)} free on the disk of {ckpt_root}, less than the last checkpoint's "
            f"{size_text(size)}: this save may fail")


# What a write that fails for space or I/O raises: the OS's error, torch's zip writer's RuntimeError
# ("[enforce fail at inline_container.cc] unexpected pos"), safetensors' SafetensorError.
WRITE_FAILURES = (OSError, RuntimeError, SafetensorError)


def write_failure(exc: BaseException, what: str, where: Path, need: int) -> CheckpointWriteError:
    """One line for a write of `what` into `where` that failed: the reason, the bytes it needs and the
    bytes free there, and what the run folder still holds."""
    probe = where if where.exists() else where.parent
    free = shutil.disk_usage(probe).free if probe.exists() else 0
    ckpt_root = where if where.name == "checkpoints" else where / "checkpoints"  # a checkpoint's or a run folder
    newest = newest_step_dir(ckpt_root)
    kept = f"the newest checkpoint is still {newest.name}" if newest else "no checkpoint was written yet"
    return CheckpointWriteError(f"could not write {what} in {where}: {_first_line(exc)}. It needs about "
                                f"{size_text(need)}; {size_text(free)} are free there. Nothing of it is kept, "
                                f"{kept}: free space (or set train.output_dir on another disk) and run the same "
                                f"command again to go on from there")


def checkpoint_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights on the CPU, as safetensors takes them."""
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # Tied weights share storage; safetensors refuses shared tensors, so clone them apart.
    seen: dict[int, str] = {}
    for k, v in weights.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen:
            weights[k] = v.clone()
        seen[ptr] = k
    return weights


def refuse_non_finite(bad: list[str], total: int, step: int, ckpt_root: Path) -> NonFiniteWeightsError:
    newest = newest_step_dir(ckpt_root)
    return NonFiniteWeightsError(
        f"step {step}: {len(bad)} of {total} weight tensors hold NaN or inf (first: {bad[0]}), so they are not "
        f"saved as a checkpoint; the newest checkpoint is {newest or 'none'}. The run has diverged: lower "
        f"train.lr or raise train.warmup_steps, and train again")


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write `checkpoints/step_NNNNNN/` atomically (`publish`); `meta.json` records each file's size
    and SHA-256 so that loading can tell a damaged file from a whole one. Non-finite weights are
    refused, and a write that fails for space or I/O leaves the previous checkpoint the newest, each
    with one `CheckpointError` line."""
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:06d}"
    weights = checkpoint_weights(model)
    bad = non_finite_weights(weights)
    if bad:
        raise refuse_non_finite(bad, len(weights), step, ckpt_root)
    warn_if_short_of_space(ckpt_root)
    tmp = ckpt_root / f".tmp_{final.name}"
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(weights, str(tmp / "model.safetensors"))
        torch.save(trainer_state, tmp / "trainer_state.pt")
        write_manifest(tmp, step, CHECKPOINT_FILES)
        publish(tmp, final, keep)
    except WRITE_FAILURES as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(exc, f"checkpoint {final.name}", ckpt_root,
                            tensor_bytes(weights) + tensor_bytes(trainer_state)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_sharded_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            trainer_state: dict[str, Any], dist, keep: int = 2) -> Path:
    """`save_checkpoint` for a multi-process run; every rank calls it (`dist`: mmrl.distributed.Dist).
    The folder is published by rank 0 only after every rank has written its part, so a rank that
    dies mid-save leaves the previous checkpoint the newest whole one. Non-finite weights on any rank,
    or a write that fails on any rank, end the save on every rank with the same error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from mmrl.distributed import all_max, barrier

    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_{final.name}"  # one name every rank agrees on
    model_state, optim_state = get_state_dict(model, optimizer)
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in model_state.items()}  # this rank's shard
    bad = non_finite_weights(local)
    if all_max(dist, int(bool(bad))):
        raise refuse_non_finite(bad or ["(on another rank)"], len(local), step, ckpt_root)
    if dist.is_main:
        warn_if_short_of_space(ckpt_root)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(dist)
    failure = None
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "dcp"))
        torch.save({**trainer_state, "rank": dist.rank}, tmp / f"rank_{dist.rank}.pt")
    except WRITE_FAILURES as exc:  # DCP raises on every rank when one fails; a rank's own file may fail alone
        failure = exc
    need = tensor_bytes(local) + tensor_bytes(optim_state) + tensor_bytes(trainer_state)
    if all_max(dist, int(failure is not None)):
        barrier(dist)
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(failure or OSError("the write failed on another rank"), f"checkpoint {final.name}",
                            ckpt_root, need * dist.world)
    if dist.is_main:
        names = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        try:
            write_manifest(tmp, step, names, world_size=dist.world)
            publish(tmp, final, keep)
        except WRITE_FAILURES as exc:
            failure = write_failure(exc, f"checkpoint {final.name}", ckpt_root, need * dist.world)
            shutil.rmtree(tmp, ignore_errors=True)
    if all_max(dist, int(failure is not None)):
        raise failure if isinstance(failure, CheckpointWriteError) else write_failure(
            OSError("publishing failed on rank 0"), f"checkpoint {final.name}", ckpt_root, need * dist.world)
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
    load_weights(path, model, optimizer)
    return load_trainer_state(path, rank)


def load_weights(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """The weights of the checked step directory `path` into `model` (and a sharded checkpoint's
    optimizer state into `optimizer` when given), without reading the trainer state: what an
    evaluation needs (its step: `checkpoint_step`)."""
    if is_sharded(path):
        _load_sharded(path, model, optimizer)
        return
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


def load_trainer_state(path: Path, rank: int = 0) -> dict[str, Any]:
    """The trainer state of the checked step directory `path`: a sharded checkpoint's rank `rank`'s
    (rank 0's when the saving run had fewer ranks)."""
    if not is_sharded(path):
        return load_state_file(path / "trainer_state.pt")
    own = path / f"rank_{rank}.pt"
    return load_state_file(own if own.is_file() else path / "rank_0.pt")


def checkpoint_step(path: Path) -> int:
    """The training step of the checked step directory `path`, from its meta.json, else its name
    (`step_NNNNNN`); only a checkpoint with neither has its trainer state read for it."""
    meta = path / "meta.json"
    step = json.loads(meta.read_text()).get("step") if meta.is_file() else None
    if isinstance(step, int):
        return step
    named = re.fullmatch(r"step_(\d+)", path.name)
    return int(named[1]) if named else int(load_trainer_state(path)["step"])


def _load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    _check_dcp_metadata(path / "dcp" / ".metadata")
    planner = _weights_only_planner()
    try:
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=str(path / "dcp"), planner=planner)
            set_model_state_dict(model, state["model"])
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=str(path / "dcp"), planner=planner)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        if planner.refused is not None:  # DCP wraps the planner's error in its own; say what it was
            raise CheckpointError(_would_run_code(path / "dcp" / planner.refused, planner.named)) from None
        raise CheckpointError(f"checkpoint {path} does not load into this model: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    return key.endswith("lm_head.weight") and getattr(getattr(model, "config", None), "tie_word_embeddings", False)


# ------------------------------------------------------------------ loading runs no code from the files

TRUST_CHECKPOINT = False  # `trust_checkpoints`: this process loads checkpoint state with pickle

TRUST_NOTE = ("--trust-checkpoint: loading checkpoint state with pickle, which runs any code the file holds; "
              "use it only for run folders you wrote yourself")


def trust_checkpoints(trust: bool = True) -> None:
    """Let this process load a checkpoint's trainer state and DCP pickles with pickle (torch.load
    without its weights-only unpickler): what `mmrl train` / `mmrl eval --trust-checkpoint` set, for
    a run folder an older mmrl wrote (numpy state in its trainer_state.pt). Pickle runs whatever code
    the file names: only for run folders you wrote yourself. From Python, call it before
    `mmrl.train(cfg)` or `Trainer.train()`; `trust_checkpoints(False)` turns it off."""
    global TRUST_CHECKPOINT
    TRUST_CHECKPOINT = trust


def _would_run_code(path: Path, named: str | None) -> str:
    """One line refusing `path`, which names `named` (a global of the pickle, when known)."""
    names = f" (it names {named})" if named else ""
    return (f"checkpoint file {path} holds more than tensors and plain values{names}: "
            f"loading it would run code from the file. If you wrote this run folder yourself (an older mmrl saved "
            f"numpy state), pass --trust-checkpoint to load it with pickle")


def _named_global(exc: BaseException) -> str | None:
    """The global torch's weights-only unpickler refused ("Unsupported global: GLOBAL os.system ...")."""
    found = re.search(r"GLOBAL (\S+)", str(exc))
    return found[1] if found else None


def load_state_file(path: Path) -> dict[str, Any]:
    """A trainer state file (trainer_state.pt, rank_R.pt) read with torch's weights-only unpickler:
    tensors and plain values, never an object the file names (unless `trust_checkpoints`)."""
    try:
        return torch.load(path, weights_only=not TRUST_CHECKPOINT)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):
            raise CheckpointError(f"checkpoint file {path} is damaged: {_first_line(exc)}") from None
        raise CheckpointError(_would_run_code(path, _named_global(exc))) from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path} is damaged: {_first_line(exc)}") from None


# What DCP's .metadata pickles (found by saving replicated and FSDP2 checkpoints on 2 gloo ranks,
# torch 2.11): its dataclasses, torch.Size, the layout lookup and dtypes, the checkpoint's path.
# torch reads the file with a plain pickle.load (torch/distributed/checkpoint/filesystem.py,
# FileSystemReader.read_metadata), which would call anything it names.
DCP_METADATA_GLOBALS = frozenset({
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
})


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only `DCP_METADATA_GLOBALS` (the restriction pickle's docs give: every GLOBAL,
    STACK_GLOBAL, INST and extension code reaches `find_class`, and nothing else is called)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def _check_dcp_metadata(path: Path) -> None:
    """Refuse, in one line, a DCP .metadata file that names anything but DCP's own metadata classes,
    before torch unpickles it without restriction."""
    if TRUST_CHECKPOINT:
        return
    try:
        with path.open("rb") as f:
            _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise CheckpointError(_would_run_code(path, str(exc))) from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path} is damaged: {_first_line(exc)}") from None


def _weights_only_planner():
    """DCP's default load planner, but the non-tensor items of the state (the optimizer's
    hyperparameters) are read with the weights-only unpickler first: torch unpickles them with
    weights_only off (torch 2.11, torch/distributed/checkpoint/default_planner.py,
    DefaultLoadPlanner.load_bytes). Tensor items torch reads weights-only itself (filesystem.py,
    FileSystemReader.read_data)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        refused: str | None = None  # the shard file of a refused item
        named: str | None = None

        def load_bytes(self, read_item, value) -> None:
            if not TRUST_CHECKPOINT:
                try:
                    torch.load(value, weights_only=True)
                except pickle.UnpicklingError as exc:
                    self.refused = self.metadata.storage_data[read_item.storage_index].relative_path
                    self.named = _named_global(exc)
                    raise
                value.seek(0)  # the same bytes, now known to hold only plain values
            super().load_bytes(read_item, value)

    return WeightsOnlyLoadPlanner()


# ------------------------------------------------------------------ plain state

# Dataclasses a trainer state may hold (in a replay buffer's contexts), by "module.qualname": a
# checkpoint keeps their fields and `from_plain` rebuilds them, never importing a name from the file.
PLAIN_CLASSES: dict[str, type] = {}


def checkpointable(cls: type) -> type:
    """Class decorator: instances of the dataclass `cls` may be in a trainer state (`to_plain`)."""
    PLAIN_CLASSES[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return cls


def to_plain(obj: Any) -> Any:
    """`obj` (a context, nested dicts / lists / tuples) as tensors and plain values, what the
    weights-only unpickler reads: a numpy array as a tensor (sharing its memory where it can), a
    numpy scalar as a Python number, a `checkpointable` dataclass as its fields. `from_plain`
    rebuilds it."""
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(to_plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return _plain_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if type(obj) in (bool, int, float, str, bytes, type(None)) or isinstance(obj, torch.Tensor):
        return obj
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if is_dataclass(obj) and PLAIN_CLASSES.get(name) is type(obj):
        kept = {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj) if f.init}
        return {"__dataclass__": name, "fields": kept}
    raise TypeError(f"a checkpoint cannot keep a {name}: a trainer state holds tensors, plain values, numpy arrays "
                    f"and dataclasses marked with mmrl.checkpoint.checkpointable")


def _plain_array(a: np.ndarray) -> dict[str, Any]:
    if a.dtype.kind in "biuf" and a.dtype.isnative:  # a tensor sharing the array's memory (a copy if it cannot)
        whole = a.flags.c_contiguous and a.flags.writeable
        return {"__ndarray__": torch.from_numpy(a if whole else a.copy(order="C"))}
    return {"__ndarray__": to_plain(a.tolist()), "dtype": a.dtype.str}  # strings, objects: as a list


def from_plain(obj: Any) -> Any:
    """What `to_plain` turned `obj` into, rebuilt (anything else is returned as it is)."""
    if isinstance(obj, dict) and "__ndarray__" in obj:
        data = obj["__ndarray__"]
        return data.numpy() if isinstance(data, torch.Tensor) else np.array(from_plain(data), dtype=obj["dtype"])
    if isinstance(obj, dict) and "__dataclass__" in obj:
        cls = PLAIN_CLASSES.get(obj["__dataclass__"])
        if cls is None:
            raise CheckpointError(f"a checkpoint's state holds a {obj['__dataclass__']}, not a class it may hold "
                                  f"(mmrl.checkpoint.checkpointable: {', '.join(sorted(PLAIN_CLASSES)) or 'none'})")
        return cls(**{k: from_plain(v) for k, v in obj["fields"].items()})
    if isinstance(obj, dict):
        return {k: from_plain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(from_plain(v) for v in obj)
    return obj


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
    """config.yaml of the run; not written again when it already says the same (a resume)."""
    path, text = Path(cfg.train.output_dir) / RUN_CONFIG, yaml.safe_dump(plain_config(cfg.to_dict()), sort_keys=False)
    if not path.is_file() or path.read_text() != text:
        atomic_write_text(path, text)


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
