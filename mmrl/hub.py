"""A local path or a Hugging Face hub id, for models and datasets alike (as TRL, verl and EasyR1 take them).

`resolve(path, kind, key)`: a file or folder that exists is used as it is and never looked up online;
anything else shaped like a hub id (``owner/name``) is fetched into the Hugging Face cache with
`huggingface_hub.snapshot_download` (the download `from_pretrained` / `datasets.load_dataset` make),
or found there when the hub is offline (``HF_HUB_OFFLINE=1``). Every failure is one line that names
the id and what to do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# A model snapshot takes what `from_pretrained` reads, not every file a repo holds (ONNX exports,
# other frameworks' weights); .bin weights only when the repo has no safetensors.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py", "*.yaml"]
LEGACY_WEIGHTS = ["*.bin", "*.pt", "*.pth"]


class HubError(ValueError):
    """A hub id that cannot be fetched (offline, unknown, unreachable): the message is one line."""


def is_hub_id(path: str) -> bool:
    return HUB_ID.fullmatch(path) is not None


def resolve(path: str | Path, kind: Literal["model", "dataset"], key: str) -> Path:
    """The local file or folder behind `path` (a local path, or a hub id fetched into the cache)."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    if not is_hub_id(str(path)):
        raise FileNotFoundError(f"{key}: {str(path)!r} is not a local file or folder, nor a hub id (owner/name); "
                                f"accepted: a local path or a Hugging Face {kind} id")
    try:
        if kind == "dataset":
            return snapshot(str(path), kind, key)
        folder = snapshot(str(path), kind, key, allow_patterns=MODEL_FILES)
        if not any(folder.rglob("*.safetensors")):
            folder = snapshot(str(path), kind, key, allow_patterns=MODEL_FILES + LEGACY_WEIGHTS)
        return folder
    except HubError as exc:
        raise HubError(f"{exc}; or give a local folder") from None


def snapshot(repo_id: str, kind: Literal["model", "dataset"], key: str, **kwargs) -> Path:
    """`huggingface_hub.snapshot_download(repo_id, repo_type=kind, **kwargs)`: the local folder of the
    repo (the cache's copy, or `local_dir`), fetched or completed where the hub is reachable and read
    as it is where it is not; each failure a one-line HubError naming `key` and the id."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    try:
        return Path(snapshot_download(repo_id, repo_type=kind, **kwargs))
    except LocalEntryNotFoundError as exc:  # offline, or the hub cannot be reached, and no whole copy here
        why = ("the hub is offline (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE
               else "the Hugging Face hub cannot be reached from here")
        have = "only part of it is" if isinstance(exc, IncompleteSnapshotError) else "it is not"
        where = kwargs.get("local_dir") or f"the Hugging Face cache, {constants.HF_HUB_CACHE}"
        raise HubError(f"{key}: cannot fetch {kind} {repo_id!r}: {why}, and {have} on this machine ({where}); "
                       f"fetch it where the hub is reachable (HF_HUB_OFFLINE unset)") from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise HubError(f"{key}: no {kind} {repo_id!r} on the Hugging Face hub, or it is gated / private "
                       f"({type(exc).__name__}; log in with `hf auth login` for a private one)") from None
    except OSError as exc:  # network errors mid-download, a full disk
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HubError(f"{key}: fetching {kind} {repo_id!r} from the Hugging Face hub failed ({first}); "
                       f"run the command again to resume") from None
