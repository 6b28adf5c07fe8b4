"""A VQA dataset of one's own: every file layout a user brings, column_map for every record field,
splits, SFT targets with and without solutions, parameters a source ignores, and the CLI's one line."""

import json

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("PIL")

from mmrl.config import ConfigError, load_config  # noqa: E402
from mmrl.envs.vqa.export import COLUMN_MAP, FORMATS, write_split, write_synthetic  # noqa: E402
from mmrl.envs.vqa.task import VQATask  # noqa: E402

CONFIG = "configs/vqa_your_data.yaml"


def _pixels(image):
    from PIL import Image

    return np.asarray(Image.open(image).convert("RGB")) if isinstance(image, str) else image


def signature(task):
    return [(c["prompt"], c["answer"], c["options"], c["target"], c["category"], _pixels(c["images"][0]).tobytes())
            for c in task.train + task.test]


@pytest.fixture(scope="module")
def datasets_by_format(tmp_path_factory):
    root = tmp_path_factory.mktemp("your_data")
    return {fmt: (root / fmt, write_synthetic(root / fmt, fmt, n_train=24, n_test=6, seed=3)) for fmt in FORMATS}


def test_every_layout_gives_the_same_contexts(datasets_by_format):
    """JSONL, JSON, CSV, hub-style parquet (images inside) and image folders, each a folder with
    train and test splits: the same prompts, answers, options, SFT targets and pixels."""
    tasks = {fmt: VQATask(source="files", data_path=str(folder), column_map=COLUMN_MAP)
             for fmt, (folder, _) in datasets_by_format.items()}
    reference = signature(tasks["jsonl"])
    assert len(reference) == 30
    for fmt, task in tasks.items():
        assert (len(task.train), len(task.test)) == (24, 6), fmt
        assert signature(task) == reference, fmt
    # the multiple-choice label was an option's text: it is the letter now, the options listed in the prompt
    mc = next(c for c in tasks["csv"].train if c["options"])
    assert mc["answer"] in "AB" and "\nA. yes\nB. no" in mc["prompt"]
    assert tasks["parquet"].data_note.startswith("24 training records from") and "(split test)" in tasks["parquet"].data_note


def test_teacher_replies_are_the_sft_targets_and_labels_the_answers(datasets_by_format):
    folder, files = datasets_by_format["jsonl"]
    rows = [json.loads(line) for line in files["train"].read_text().splitlines()]
    task = VQATask(source="files", data_path=str(folder), column_map=COLUMN_MAP)
    assert task.sft_targets() == "the records' solutions"
    wrong = [(row, c) for row, c in zip(rows, task.train)
             if not row["choices"] and f"<answer>{row['label']}</answer>" not in row["response"]]
    assert wrong, "the teacher over-counts on some counting questions"
    for row, c in wrong:  # the reply is imitated as written; the reward checks the label
        assert c["target"] == row["response"] and c["answer"] == row["label"] and c["category"] == "counting"


def test_no_solution_column_trains_on_the_answer_alone(tmp_path):
    from mmrl.envs.vqa.synthetic import make_splits

    records = make_splits(0, 12, 4, 0, categories=("counting",), train_difficulties=(1,), ood_difficulty=2,
                          image_size=56)
    write_split(records["train"], tmp_path / "d", "train", "jsonl")  # responses absent: a plain QA set
    column_map = {k: v for k, v in COLUMN_MAP.items() if k != "solution"}
    task = VQATask(source="files", data_path=str(tmp_path / "d"), column_map=column_map, n_test=4)
    assert task.sft_targets().startswith("the answers alone")
    assert all(c["target"] == f"<think></think><answer>{c['answer']}</answer>" for c in task.train)
    boxed = VQATask(source="files", data_path=str(tmp_path / "d"), column_map=column_map, n_test=4, answer_style="boxed")
    assert boxed.train[0]["target"] == f"<think></think>\\boxed{{{boxed.train[0]['answer']}}}"
    assert len(task.sft_batch(5, np.random.default_rng(0))) == 5


def test_splits_are_picked_by_name(datasets_by_format):
    folder, _ = datasets_by_format["parquet"]
    swapped = VQATask(source="files", data_path=str(folder), column_map=COLUMN_MAP, split="test", eval_split="train")
    assert (len(swapped.train), len(swapped.test)) == (6, 24)
    only_train = VQATask(source="files", data_path=str(folder), column_map=COLUMN_MAP, split="train", n_test=4,
                         eval_path=str(folder), eval_split="train")
    assert len(only_train.test) == 24
    with pytest.raises(ValueError, match=r"no split 'dev'; the folder's splits are \['test', 'train'\]"):
        VQATask(source="files", data_path=str(folder), column_map=COLUMN_MAP, split="dev")


@pytest.mark.parametrize("override, fragment", [
    ("task.params.categories=[counting]", "task.params.categories: not read by source 'files'"),
    ("task.params.n_train=10", "task.params.n_train: not read by source 'files'"),
    ("task.params.source=synthetic", "task.params.data_path: not read by source 'synthetic'"),
    ("task.params.splt=train", "unknown parameter 'splt'"),
])
def test_parameters_a_source_does_not_read_are_refused_at_load(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [override])
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_column_map_on_the_synthetic_source_is_refused():
    with pytest.raises(ConfigError, match="column_map: not read by source 'synthetic'"):
        load_config("configs/vqa_grpo.yaml", ["task.params.column_map={problem: q}"])


@pytest.mark.parametrize("overrides, fragment", [
    (['task.params.column_map={"solution": "why"}'], "column_map names columns that are not there: {'solution': 'why'}"),
    (['task.params.column_map={"images": "picture"}'], "column_map names columns that are not there: {'images': 'picture'}"),
    (["task.params.split=dev"], "no split 'dev'; the folder's splits are ['test', 'train']"),
    (["task.params.eval_split=dev"], "no split 'dev'; the folder's splits are ['test', 'train']"),
    (["task.params.data_path=no/such/folder/here"], "'no/such/folder/here' is not a local file or folder, nor a hub id"),
])
def test_bad_data_settings_are_one_line_through_the_cli(datasets_by_format, tmp_path, capsys, overrides, fragment):
    from mmrl.cli import main

    folder, _ = datasets_by_format["jsonl"]
    code = main(["train", CONFIG, f"task.params.data_path={folder}", *overrides, f"train.output_dir={tmp_path / 'run'}",
                 "train.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err


def test_a_data_subfolder_with_images_elsewhere(datasets_by_format, tmp_path):
    """The hub's `data/train.jsonl` layout, images read from `image_root` (relative paths in the data)."""
    import shutil

    folder, _ = datasets_by_format["jsonl"]
    (tmp_path / "ds" / "data").mkdir(parents=True)
    for split in ("train", "test"):
        shutil.copy(folder / f"{split}.jsonl", tmp_path / "ds" / "data" / f"{split}.jsonl")
    shutil.copytree(folder / "images", tmp_path / "pictures" / "images")
    task = VQATask(source="files", data_path=str(tmp_path / "ds"), column_map=COLUMN_MAP,
                   image_root=str(tmp_path / "pictures"))
    assert (len(task.train), len(task.test)) == (24, 6)
    assert signature(task) == signature(VQATask(source="files", data_path=str(folder), column_map=COLUMN_MAP))


def test_a_run_says_what_it_learns_from(tmp_path, capsys):
    """The CLI run starts with one line on the data and one on SFT's targets (a plain QA set in image
    folders, no replies to imitate: the answers alone)."""
    from mmrl.cli import main
    from mmrl.envs.vqa.synthetic import make_splits

    records = make_splits(1, 12, 4, 0, categories=("counting",), train_difficulties=(1,), ood_difficulty=2,
                          image_size=56)
    for split in ("train", "test"):
        write_split(records[split], tmp_path / "qa", split, "imagefolder")
    code = main(["train", CONFIG, f"task.params.data_path={tmp_path / 'qa'}",
                 "sft.steps=2", "sft.batch_size=4", "train.steps=1", "train.prompts_per_step=2",
                 "sampling.group_size=2", "sampling.max_new_tokens=8", "train.eval_size=4", "task.params.eval_k=0",
                 "task.params.blank_eval=false", f"train.output_dir={tmp_path / 'run'}", "train.progress=false"])
    err = capsys.readouterr().err
    assert code == 0, err
    folder = tmp_path / "qa"
    assert f"mmrl: data: 12 training records from {folder} (split train); 4 held out from {folder} (split test)" in err
    assert "mmrl: SFT: 2 steps on the answers alone" in err
    assert (tmp_path / "run" / "final").is_dir()
