"""Hub ids and local folders for `model.path` and data paths, without network: a folder that exists
is never looked up online, an id in the Hugging Face cache trains offline, and a missing id (offline
or unreachable) is one line naming it."""

import shutil

import pytest
import yaml

from mmrl.hub import HubError, is_hub_id, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline (huggingface_hub reads both at call time)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def put_in_cache(cache, repo_id: str, kind: str, source) -> None:
    """`source`'s files as the cached snapshot of `repo_id`, laid out as huggingface_hub writes it."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(source, repo / "snapshots" / COMMIT)


def test_hub_id_shape():
    assert is_hub_id("Qwen/Qwen2.5-VL-3B-Instruct") and is_hub_id("hiyouga/geometry3k")
    assert not any(map(is_hub_id, ["/abs/path", "runs/a/b", "name", "./x/y", "a/b/c", ""]))


def test_an_existing_folder_is_never_looked_up(tmp_path, monkeypatch):
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("a local folder was looked up on the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    folder = tmp_path / "owner" / "name"  # a local folder shaped like a hub id, relative to the cwd
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve("owner/name", "model", "model.path") == folder.relative_to(tmp_path)
    assert resolve(str(folder), "dataset", "task.params.data_path") == folder


def test_not_a_path_nor_an_id_is_one_line(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"model.path: '/no/such/dir' is not a local file or folder, nor a hub id"):
        resolve("/no/such/dir", "model", "model.path")


@pytest.mark.parametrize("kind, key", [("model", "model.path"), ("dataset", "task.params.data_path")])
def test_a_missing_id_offline_names_it_and_hf_hub_offline(hub_cache, kind, key):
    with pytest.raises(HubError) as err:
        resolve("nobody/nothing", kind, key)
    msg = str(err.value)
    assert msg.startswith(f"{key}: cannot fetch {kind} 'nobody/nothing': the hub is offline (HF_HUB_OFFLINE=1)")
    assert msg.endswith("or give a local folder") and "\n" not in msg


def test_an_unreachable_hub_is_one_line(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    with pytest.raises(HubError, match=r"cannot fetch model 'nobody/nothing': the Hugging Face hub cannot be reached"):
        resolve("nobody/nothing", "model", "model.path")


def test_cli_missing_ids_are_one_line(hub_cache, tmp_path, capsys):
    from mmrl.cli import main

    runs = [["configs/digit_sort_grpo.yaml", "model.source=pretrained", "model.path=nobody/tiny-lm"],
            ["configs/vqa_your_data.yaml", "task.params.data_path=nobody/vqa-set"]]
    for args in runs:
        assert main(["train", *args, f"train.output_dir={tmp_path / 'run'}", "train.progress=false"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'nobody/" in err[0] and "HF_HUB_OFFLINE=1" in err[0], err


def test_a_cached_hub_model_trains_offline_and_the_run_keeps_its_id(hub_cache, tmp_path, capsys):
    from mmrl.cli import main

    small = ["train.steps=1", "train.prompts_per_step=2", "sampling.group_size=2", "train.eval_size=4",
             "train.progress=false"]
    assert main(["train", "configs/digit_sort_grpo.yaml", "sft.steps=2", *small,
                 f"train.output_dir={tmp_path / 'base'}"]) == 0
    put_in_cache(hub_cache, "someone/tiny-digit-sorter", "model", tmp_path / "base" / "final")
    assert main(["train", "configs/digit_sort_grpo.yaml", "sft.steps=0", "model.source=pretrained",
                 "model.path=someone/tiny-digit-sorter", *small, f"train.output_dir={tmp_path / 'from_hub'}"]) == 0
    assert "starting from model.path someone/tiny-digit-sorter" in capsys.readouterr().err
    saved = yaml.safe_load((tmp_path / "from_hub" / "config.yaml").read_text())
    assert saved["model"]["path"] == "someone/tiny-digit-sorter"  # the run's config names the id, not the cache


def test_a_cached_hub_dataset_loads_offline(hub_cache, tmp_path):
    from mmrl.envs.vqa.export import COLUMN_MAP, write_synthetic
    from mmrl.envs.vqa.task import VQATask

    write_synthetic(tmp_path / "ds", "parquet", n_train=8, n_test=3)
    put_in_cache(hub_cache, "someone/my-vqa", "dataset", tmp_path / "ds")
    task = VQATask(source="files", data_path="someone/my-vqa", column_map=COLUMN_MAP)
    assert (len(task.train), len(task.test)) == (8, 3)
    assert task.data_note.startswith("8 training records from someone/my-vqa (split train)")
