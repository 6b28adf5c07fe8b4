"""Where LIBERO's asset files (scene XML, meshes, textures) come from and where mmrl finds them.

No pip package ships them: hf-libero (`lerobot[libero]`) downloads them from the Hugging Face
dataset `lerobot/libero-assets` on first use, a copy of the `libero/libero/assets` folder of the
LIBERO project (github.com/Lifelong-Robot-Learning/LIBERO). mmrl never downloads them behind your
back; it looks, in this order, in

1. `task.params.assets_dir` (or `LiberoEnv(assets_dir=...)`), when given;
2. `$MMRL_LIBERO_ASSETS`;
3. the cache folder `mmrl fetch-assets libero` fills: `$MMRL_CACHE/libero/assets`, where
   MMRL_CACHE defaults to `$XDG_CACHE_HOME/mmrl`, else `~/.cache/mmrl`.

Importing this module imports neither hf-libero nor huggingface_hub (the CLI loads it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mmrl.hub import is_hub_id

HUB_REPO = "lerobot/libero-assets"  # a dataset repo: HF_ASSETS_REPO_ID of hf-libero 0.1.4 (lerobot 0.6.1)
SOURCE = "LIBERO's libero/libero/assets folder (github.com/Lifelong-Robot-Learning/LIBERO)"
ASSETS_ENV_VAR = "MMRL_LIBERO_ASSETS"
CACHE_ENV_VAR = "MMRL_CACHE"
CACHE_HELP = f"${CACHE_ENV_VAR}/libero/assets, ${CACHE_ENV_VAR} defaulting to $XDG_CACHE_HOME/mmrl or ~/.cache/mmrl"
# The top-level folders of a whole copy (the ones hf-libero checks, and scenes/): a download cut
# short can leave some of them out.
PARTS = ("scenes", "articulated_objects", "stable_scanned_objects", "turbosquid_objects", "stable_hope_objects")
FETCHED = ".mmrl_fetched"  # written into the folder after a whole fetch: the hub id or folder it came from


class AssetsError(ValueError):
    """Assets that cannot be fetched (offline, unreachable, unknown repo): the message is one line."""


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mmrl"


def cache_dir() -> Path:
    """Where `mmrl fetch-assets libero` puts the assets by default, and where mmrl looks for them."""
    return cache_root() / "libero" / "assets"


def default_assets_dir() -> Path:
    """`$MMRL_LIBERO_ASSETS`, else the cache folder (`cache_dir`)."""
    if os.environ.get(ASSETS_ENV_VAR):
        return Path(os.environ[ASSETS_ENV_VAR]).expanduser()
    return cache_dir()


def missing_parts(path: str | Path) -> list[str]:
    """The top-level folders of a LIBERO assets copy that `path` lacks ([] for a whole copy)."""
    return [p for p in PARTS if not (Path(path) / p).is_dir()]


def find_assets(assets_dir: str | Path | None = None) -> Path:
    """The assets folder to use (`assets_dir`, else `default_assets_dir()`), checked whole; else a
    FileNotFoundError of one line that says where the assets come from and how to point at them."""
    path = Path(assets_dir).expanduser() if assets_dir is not None else default_assets_dir()
    missing = missing_parts(path)
    if not missing:
        return path
    given = ("assets_dir" if assets_dir is not None
             else ASSETS_ENV_VAR if os.environ.get(ASSETS_ENV_VAR) else "the default cache folder")
    what = "does not exist" if not path.is_dir() else f"lacks {', '.join(missing)}/"
    raise FileNotFoundError(
        f"LIBERO assets not found: {path} ({given}) {what}. No pip package ships them: run `mmrl fetch-assets "
        f"libero` (downloads the hub dataset {HUB_REPO}, the copy lerobot uses, into {cache_dir()}), or set "
        f"{ASSETS_ENV_VAR}=DIR (or task.params.assets_dir) to a copy of {SOURCE}; see docs/libero.md")


def fetch(dest: str | Path | None = None, source: str = HUB_REPO) -> str:
    """`mmrl fetch-assets libero`: put the assets into `dest` (default: the cache folder): `source`
    is a Hugging Face dataset id, downloaded with huggingface_hub, or a local folder (a LIBERO
    checkout's libero/libero/assets), copied. Nothing is done when a whole earlier fetch of `source`
    is there. Returns what to print: where the assets are and, when mmrl would not find them there
    by itself, how to point at it. Offline or unreachable: an AssetsError of one line naming the
    repo id and HF_HUB_OFFLINE."""
    target = Path(dest).expanduser() if dest is not None else cache_dir()
    local = Path(source).expanduser()
    if not local.is_dir() and not is_hub_id(source):
        raise AssetsError(f"--source: {source!r} is neither a local folder nor a Hugging Face dataset id "
                          f"(owner/name); accepted: a copy of {SOURCE}, or {HUB_REPO}")
    origin = str(local.resolve()) if local.is_dir() else source
    marker = target / FETCHED
    if not (marker.is_file() and marker.read_text().strip() == origin and not missing_parts(target)):
        if local.is_dir():
            _copy(local, target)
        else:
            _download(source, target)
        marker.write_text(origin + "\n")
    found = f"LIBERO assets ({origin}) in {target}"
    if target.resolve() == default_assets_dir().resolve():
        return f"{found}; mmrl finds them there"
    return f"{found}; point mmrl at them with {ASSETS_ENV_VAR}={target} (or task.params.assets_dir)"


def _copy(folder: Path, target: Path) -> None:
    missing = missing_parts(folder)
    if missing:
        raise AssetsError(f"--source: {folder} lacks {', '.join(missing)}/: not a copy of {SOURCE}")
    if target.resolve() != folder.resolve():
        shutil.copytree(folder, target, dirs_exist_ok=True)


def _download(repo: str, target: Path) -> None:
    from mmrl.hub import HubError, snapshot

    try:
        snapshot(repo, "dataset", "LIBERO assets", local_dir=str(target))
    except HubError as exc:
        raise AssetsError(f"{exc}; or set {ASSETS_ENV_VAR}=DIR to a copy of {SOURCE}") from None
    missing = missing_parts(target)
    if missing:  # a repo that is not LIBERO's assets
        raise AssetsError(f"--source: the hub dataset {repo} downloaded into {target} lacks {', '.join(missing)}/: "
                          f"not LIBERO's assets (those are {HUB_REPO})")
