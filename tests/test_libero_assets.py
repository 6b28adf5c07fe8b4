"""Where mmrl finds LIBERO's assets (MMRL_LIBERO_ASSETS, else the cache folder `mmrl fetch-assets
libero` fills) and `mmrl fetch-assets libero` itself: a local copy, and offline one line naming the
hub dataset and HF_HUB_OFFLINE. Fake asset folders stand in: only the lookup is tested here."""

from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.envs.libero.assets import HUB_REPO, PARTS, cache_dir, default_assets_dir, find_assets


def _fake_assets(path: Path, parts=PARTS) -> Path:
    for part in parts:
        (path / part).mkdir(parents=True, exist_ok=True)
    (path / "scenes" / "floor.xml").write_text("<mujoco/>")
    return path


def _one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_assets_env(monkeypatch, tmp_path):
    """No MMRL_LIBERO_ASSETS, and an empty cache of this test's own."""
    monkeypatch.delenv("MMRL_LIBERO_ASSETS", raising=False)
    monkeypatch.setenv("MMRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "libero" / "assets"


def test_the_env_var_wins_then_the_cache_folder(no_assets_env, monkeypatch, tmp_path):
    assert default_assets_dir() == cache_dir() == no_assets_env
    with pytest.raises(FileNotFoundError, match=r"\(the default cache folder\) does not exist\. No pip package ships "
                       r"them: run `mmrl fetch-assets libero` \(downloads the hub dataset lerobot/libero-assets"):
        find_assets()
    _fake_assets(no_assets_env)
    assert find_assets() == no_assets_env
    mine = _fake_assets(tmp_path / "mine")
    monkeypatch.setenv("MMRL_LIBERO_ASSETS", str(mine))
    assert find_assets() == mine
    assert find_assets(tmp_path / "cache" / "libero" / "assets") == no_assets_env  # an explicit assets_dir wins
    # Without MMRL_CACHE: XDG_CACHE_HOME, else ~/.cache.
    monkeypatch.delenv("MMRL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mmrl" / "libero" / "assets"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "mmrl" / "libero" / "assets"


def test_a_partial_copy_names_what_it_lacks(no_assets_env, monkeypatch, tmp_path):
    partial = _fake_assets(tmp_path / "partial", parts=("scenes", "articulated_objects"))
    monkeypatch.setenv("MMRL_LIBERO_ASSETS", str(partial))
    with pytest.raises(FileNotFoundError, match=r"\(MMRL_LIBERO_ASSETS\) lacks stable_scanned_objects, "
                       r"turbosquid_objects, stable_hope_objects/.*Lifelong-Robot-Learning/LIBERO"):
        find_assets()


def test_fetch_offline_is_one_line_naming_the_repo_and_hf_hub_offline(no_assets_env, monkeypatch, tmp_path, capsys):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at import
    dest = tmp_path / "dest"
    assert main(["fetch-assets", "libero", "--dest", str(dest)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mmrl: error: LIBERO assets: cannot fetch dataset 'lerobot/libero-assets': "
                           "the hub is offline (HF_HUB_OFFLINE=1)"), line
    assert "MMRL_LIBERO_ASSETS=DIR" in line and HUB_REPO in line
    assert not (dest / ".mmrl_fetched").exists() and not no_assets_env.exists()


def test_fetch_from_a_local_copy_fills_the_cache_mmrl_reads(no_assets_env, tmp_path, capsys):
    checkout = _fake_assets(tmp_path / "LIBERO" / "libero" / "libero" / "assets")
    assert main(["fetch-assets", "libero", "--source", str(checkout)]) == 0
    out = capsys.readouterr().out
    assert f"in {no_assets_env}; mmrl finds them there" in out
    assert find_assets() == no_assets_env and (no_assets_env / "scenes" / "floor.xml").read_text() == "<mujoco/>"
    # Fetched whole already: nothing is copied again (the marker names the source).
    (checkout / "scenes" / "floor.xml").write_text("changed")
    assert main(["fetch-assets", "libero", "--source", str(checkout)]) == 0
    assert (no_assets_env / "scenes" / "floor.xml").read_text() == "<mujoco/>"
    # Elsewhere (--dest): the output says how to point mmrl at them.
    assert main(["fetch-assets", "libero", "--source", str(checkout), "--dest", str(tmp_path / "other")]) == 0
    assert f"MMRL_LIBERO_ASSETS={tmp_path / 'other'}" in capsys.readouterr().out
    # Neither a folder nor a hub id; a folder that is not LIBERO's assets.
    assert main(["fetch-assets", "libero", "--source", "no such thing"]) == 2
    assert "neither a local folder nor a Hugging Face dataset id" in _one_line(capsys.readouterr().err)
    (tmp_path / "empty").mkdir()
    assert main(["fetch-assets", "libero", "--source", str(tmp_path / "empty"), "--dest", str(tmp_path / "d")]) == 2
    assert "lacks scenes, articulated_objects" in _one_line(capsys.readouterr().err)
