"""The `vqa` task: contexts (prompt, images, SFT target), an exactly resumable stream, the
evaluation's numbers (ECE, chance, blank images), `mmrl eval`'s report and page, and bad data files
as one line through the CLI."""

import json

import numpy as np
import pytest
import torch

from mmrl.cli import main
from mmrl.envs import make_task
from mmrl.envs.vqa.task import (blank_images, chance_accuracy, expected_calibration_error, miscount_targets,
                                misread_targets, stated_confidence)

torch.set_num_threads(1)

SMALL = ["task.params.n_train=24", "task.params.n_test=4", "task.params.n_ood=4", "task.params.eval_k=2",
         "sampling.group_size=2", "sampling.max_new_tokens=8", "train.prompts_per_step=2", "train.eval_size=4",
         "train.progress=false", "train.threads=0"]


@pytest.fixture(scope="module")
def task():
    return make_task("vqa", seed=0, n_train=40, n_test=8, n_ood=4, categories=["counting", "spatial"],
                     difficulties=[1], ood_difficulty=2, image_size=56)


def test_contexts_prompt_and_target(task):
    c = task.train[0]
    assert c["prompt"].startswith("<image>") and "<answer> </answer>" in c["prompt"]
    assert c["target"] == f"<think>{c['solution']}</think><answer>{c['answer']}</answer>"
    assert c["images"][0].dtype == np.uint8 and len(task.ood) == 4 and all(o["difficulty"] == 2 for o in task.ood)
    boxed = make_task("vqa", seed=0, n_train=4, n_test=2, n_ood=0, ood_difficulty=None, answer_style="boxed",
                      image_size=56)
    assert boxed.train[0]["target"].endswith(f"\\boxed{{{boxed.train[0]['answer']}}}")
    with pytest.raises(ValueError, match="answer_style: invalid value 'xml'; valid: tag, boxed"):
        make_task("vqa", seed=0, answer_style="xml")


def test_misread_targets_swap_in_another_images_solution():
    def ctx(problem, answer):
        return {"problem": problem, "answer": answer, "target": f"{problem} -> {answer}"}

    contexts = [ctx("q1", "1"), ctx("q1", "1"), ctx("q1", "2"), ctx("q2", "3"), ctx("q2", "3"), ctx("q3", "0")]
    correct = [c["target"] for c in contexts]
    # Every record drawn: those with a same-question record of another answer get its target;
    # q2 (one answer only) and q3 (alone) keep theirs.
    assert misread_targets(contexts, 0.999999, np.random.default_rng(0)) == 3
    assert [c["target"] for c in contexts] == ["q1 -> 2", "q1 -> 2", "q1 -> 1"] + correct[3:]
    assert [c["answer"] for c in contexts] == ["1", "1", "2", "3", "3", "0"]  # the reward still sees the truth

    noisy = make_task("vqa", seed=0, n_train=400, n_test=4, n_ood=0, ood_difficulty=None, categories=["counting"],
                      difficulties=[1], image_size=56, sft_noise=0.25)
    wrong = np.mean([not c["target"].endswith(f"<answer>{c['answer']}</answer>") for c in noisy.train])
    assert 0.15 < wrong < 0.3
    with pytest.raises(ValueError, match=r"sft_noise must be in \[0, 1\).*got 1.0"):
        make_task("vqa", seed=0, n_train=4, sft_noise=1.0)


def test_miscount_targets_over_count_counting_solutions_only():
    def ctx(category, answer, solution):
        return {"category": category, "answer": answer, "target": f"<think>{solution}</think><answer>{answer}</answer>"}

    contexts = [ctx("counting", "2", "red: 2. The answer is 2."),
                ctx("counting", "0", "red: 1. red circles: 0. The answer is 0."),
                ctx("spatial", "A", "red square: column 1. The answer is A."),
                {"category": "counting", "answer": "1", "target": "<think>circles: 1. The answer is 1.</think>\\boxed{1}"}]
    assert miscount_targets(contexts, 1.0, np.random.default_rng(0)) == 3
    assert [c["target"] for c in contexts] == [
        "<think>red: 3. The answer is 3.</think><answer>3</answer>",
        "<think>red: 1. red circles: 1. The answer is 1.</think><answer>1</answer>",  # the final tally only
        "<think>red square: column 1. The answer is A.</think><answer>A</answer>",  # not a counting question
        "<think>circles: 2. The answer is 2.</think>\\boxed{2}"]
    assert [c["answer"] for c in contexts] == ["2", "0", "A", "1"]  # the reward still sees the truth

    biased = make_task("vqa", seed=0, n_train=400, n_test=4, n_ood=0, ood_difficulty=None, categories=["counting"],
                       difficulties=[1], image_size=56, sft_miscount=0.6)
    over = np.mean([c["target"].endswith(f"<answer>{int(c['answer']) + 1}</answer>") for c in biased.train])
    assert 0.5 < over < 0.7
    with pytest.raises(ValueError, match=r"sft_miscount must be in \[0, 1\].*got 1.5"):
        make_task("vqa", seed=0, n_train=4, sft_miscount=1.5)


def test_stream_is_exactly_resumable(task):
    task.load_state_dict({"cursor": 0})
    first = [c["id"] for c in task.next_batch(30)]  # 30 + 30 draws cross the 40-record epoch
    state = task.state_dict()
    more = [c["id"] for c in task.next_batch(30)]
    task.load_state_dict(state)
    assert [c["id"] for c in task.next_batch(30)] == more
    assert sorted(first + more[:10]) == sorted(c["id"] for c in task.train)  # one epoch = every record once


def test_confidence_ece_chance_and_blank_images(task):
    assert stated_confidence("x <confidence>0.8</confidence>") == pytest.approx(0.8)
    assert stated_confidence("<confidence> 75% </confidence>") == pytest.approx(0.75)
    assert stated_confidence("<confidence>9</confidence>") == pytest.approx(0.09)
    assert stated_confidence("no confidence") is None
    # bins of 0.1: {0.95, 0.95} right and wrong -> |0.5 - 0.95|; {0.15} right -> |1 - 0.15|
    ece = expected_calibration_error(np.array([0.95, 0.95, 0.15]), np.array([1.0, 0.0, 1.0]))
    assert ece == pytest.approx(2 / 3 * 0.45 + 1 / 3 * 0.85)
    train = [{"problem": "q1", "answer": "2"}, {"problem": "q1", "answer": "2"}, {"problem": "q1", "answer": "3"}]
    tests = [{"problem": "q1", "answer": "2"}, {"problem": "q1", "answer": "3"},
             {"problem": "q2", "answer": "A", "options": ["yes", "no"]}]
    assert chance_accuracy(tests, train) == pytest.approx((1 + 0 + 0.5) / 3)
    blanked = blank_images(task.test[0])
    assert blanked["images"][0].shape == task.test[0]["images"][0].shape and (blanked["images"][0] == 128).all()
    assert blanked["prompt"] == task.test[0]["prompt"]


def test_train_then_eval_writes_the_report_and_the_page(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "configs/vqa_grpo.yaml", *SMALL, "sft.steps=2", "train.steps=1", "train.eval_every=1",
                 f"train.output_dir={run}"]) == 0
    assert main(["eval", "configs/vqa_grpo.yaml", *SMALL, "sft.steps=2", "--checkpoint", str(run)]) == 0
    report = json.loads((run / "eval" / "vqa_eval.json").read_text())
    m = report["metrics"]
    assert report["step"] == 1 and report["n_test"] == 4
    for key in ("accuracy", "format_rate", "blank_accuracy", "chance_accuracy", "ood_accuracy", "mean@2", "pass@2"):
        assert 0.0 <= m[key] <= 1.0, key
    assert m["pass@2"] >= m["mean@2"]
    page = (run / "eval" / "samples.html").read_text()
    assert page.count('class="card"') == 4 and page.count("data:image/png;base64,") == 4
    assert (run / "eval" / "accuracy_by_step.png").stat().st_size > 1000
    assert "| accuracy (greedy) |" in (run / "eval" / "vqa_eval.md").read_text()
    # The run folder (rebuilt from its config.yaml) and its final/ export, evaluated on a benchmark
    # without a config, give the same replies.
    replies = []
    for model in (run, run / "final"):
        out = tmp_path / f"bench_{model.name}"
        assert main(["eval", "--benchmark", "synthetic", "--model", str(model), "--limit", "3", "--max-new-tokens",
                     "8", "--dtype", "float32", "--device", "cpu", "--output", str(out)]) == 0
        replies.append([json.loads(line)["reply"] for line in (out / "replies.jsonl").read_text().splitlines()])
    assert replies[0] == replies[1] and len(replies[0]) == 3


@pytest.mark.parametrize("rows, fragment", [
    ([{"images": ["a.png"], "problem": "<image>How many?", "answer": "2"}, {"images": ["a.png"], "problem": "q"}],
     "no answer"),
    ([{"images": ["missing.png"], "problem": "<image>How many?", "answer": "2"}], "missing.png"),
    ([{"images": ["broken.png"], "problem": "<image>How many?", "answer": "2"}], "broken.png"),
])
def test_bad_data_files_are_one_line(tmp_path, capsys, rows, fragment):
    from PIL import Image

    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "a.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows * 3))
    code = main(["train", "configs/vqa_your_data.yaml", "~task.params.column_map", f"task.params.data_path={data}",
                 "task.params.n_test=1", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
