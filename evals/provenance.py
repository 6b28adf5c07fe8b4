"""What an evaluation result was computed from, stamped into every evaluation JSON.

A number in a paper is only comparable to another when both came from the same data, the same
prompt and the same grader. `provenance` records those (as content hashes and version strings)
together with the model's weight hash, the sampling settings, the seed and the package versions;
`comparable` says in one line why two records may not be compared.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
PACKAGES = ("mmrl", "torch", "transformers", "datasets", "numpy", "math-verify", "lerobot", "mujoco")
# Fields two records must share to be compared: the same items, asked the same way, graded the same way.
MUST_MATCH = ("benchmark", "data_sha256", "prompt_template", "grader")


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def files_sha256(paths: Iterable[str | Path]) -> str:
    """One hash over several files: each file's name and content hash, in name order (so a folder
    hashes the same wherever it lives)."""
    h = hashlib.sha256()
    for p in sorted(Path(x) for x in paths):
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    return h.hexdigest()


def weights_sha256(model: str | Path) -> str:
    """The hash of a model folder's weight files (searched recursively: a run's checkpoint keeps
    them one level down); a hub id that is not a local folder is recorded as "hub:<id>"."""
    p = Path(model).expanduser()
    if not p.exists():
        return f"hub:{model}"
    files = [p] if p.is_file() else [f for f in sorted(p.rglob("*")) if f.suffix in WEIGHT_SUFFIXES and f.is_file()]
    if not files:
        raise ValueError(f"{p}: no weight files ({', '.join(WEIGHT_SUFFIXES)}) to hash")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(p) if p.is_dir() else f.name}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def provenance(*, benchmark: str, model: str | Path, data_files: Iterable[str | Path], prompt_template: str,
               grader: str, sampling: dict[str, Any], seed: int, **extra: Any) -> dict[str, Any]:
    """The provenance block of an evaluation JSON. `prompt_template` names the prompt construction
    (e.g. "mathvista.build_query/zero-shot"), `grader` the scorer and its version."""
    files = list(data_files)
    return {"benchmark": benchmark, "model": str(model), "weights_sha256": weights_sha256(model),
            "data_files": [str(f) for f in files], "data_sha256": files_sha256(files) if files else None,
            "prompt_template": prompt_template, "grader": grader, "sampling": dict(sampling), "seed": int(seed),
            "packages": package_versions(), **extra}


def comparable(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when two provenance blocks may be compared, else one line naming what differs."""
    differ = [k for k in MUST_MATCH if a.get(k) != b.get(k)]
    if not differ:
        return None
    return "; ".join(f"{k} differs ({a.get(k)!r} vs {b.get(k)!r})" for k in differ)
