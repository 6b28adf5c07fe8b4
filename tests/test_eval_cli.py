"""`mmrl eval --checkpoint RUN` evaluates with the run's own config.yaml: a run trained with an
override that changes the model evaluates without naming any config, a CONFIG that disagrees with
the run on what the weights were trained with is refused in one line, and overrides of evaluation
keys still apply."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from mmrl.cli import main

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "digit_sort_grpo.yaml"
# The shipped config trains a tokenizer of 266 tokens on the task's corpus; a 264-token budget
# changes the embedding and lm_head shapes, as a task or tokenizer override does in practice.
TRAINED_WITH = ["model.tokenizer_vocab_size=264"]
QUICK = ["train.steps=1", "sft.steps=0", "train.eval_size=8", "train.eval_samples=0", "train.progress=false",
         "train.prompts_per_step=2", "sampling.group_size=2"]


def _one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval_cli") / "run"
    assert main(["train", str(CONFIG), *TRAINED_WITH, *QUICK, f"train.output_dir={out}"]) == 0
    assert (out / "config.yaml").is_file() and (out / "final" / "tokenizer.json").is_file()
    return out


def test_eval_without_config_uses_the_runs_config(run, capsys):
    capsys.readouterr()
    (run / "eval.json").unlink(missing_ok=True)
    assert main(["eval", "--checkpoint", str(run)]) == 0
    out = capsys.readouterr().out
    result = json.loads((run / "eval.json").read_text())
    assert result["step"] == 1 and "eval/total" in result and f"written: {run / 'eval.json'}" in out
    # A checkpoint inside the run folder finds the same config.
    step = run / "checkpoints" / "step_000001"
    assert main(["eval", "--checkpoint", str(step), "--output", str(run / "step.json")]) == 0
    assert json.loads((run / "step.json").read_text())["step"] == 1


def test_the_rebuilt_tokenizer_has_the_training_vocabulary(run):
    """A tiny model's tokenizer is trained again on the task's corpus at evaluation: from the run's
    config it is the one the run trained with (token for token), not the shipped config's."""
    from transformers import AutoTokenizer

    import mmrl
    from mmrl.config import eval_config

    torch.set_num_threads(1)
    _, policy = mmrl.build(eval_config(run))
    trained = AutoTokenizer.from_pretrained(run / "final").get_vocab()
    assert len(trained) == 264 and policy.tokenizer.get_vocab() == trained
    _, shipped = mmrl.build(eval_config(run, CONFIG, [*TRAINED_WITH, *QUICK]))  # CONFIG + the run's overrides agrees
    assert shipped.tokenizer.get_vocab() == trained


def test_the_shipped_config_for_a_run_trained_otherwise_is_refused_in_one_line(run, capsys):
    capsys.readouterr()
    assert main(["eval", str(CONFIG), "--checkpoint", str(run)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mmrl: error: ") and "model.tokenizer_vocab_size: 264 -> 320" in line, line
    assert "drop the CONFIG argument" in line and f"mmrl eval --checkpoint {run}" in line, line
    # Run-length and evaluation keys are not reasons: the run had sft.steps=0 and train.steps=1,
    # which are not named (sft.steps is: it shaped the weights).
    assert "train.steps:" not in line and "train.eval_size:" not in line and "sft.steps: 0 -> 300" in line


def test_overrides_apply_on_top_of_the_runs_config(run, capsys):
    out = run / "eval_small.json"
    assert main(["eval", "--checkpoint", str(run), "train.eval_size=4", "train.steps=50", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["step"] == 1
    # With CONFIG: the shipped file plus the run's overrides is the run's config, up to evaluation keys.
    out2 = run / "eval_config.json"
    assert main(["eval", str(CONFIG), *TRAINED_WITH, *QUICK, "train.eval_size=4", "--checkpoint", str(run),
                 "--output", str(out2)]) == 0
    assert json.loads(out2.read_text())["step"] == 1
    # An override the weights cannot take fails in one line naming the tensor, not torch's listing.
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "model.tiny.hidden_size=64"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "does not fit the model" in line and "[264, 128] in the checkpoint, [264, 64] in the model" in line, line


def test_a_missing_or_damaged_run_config_is_one_line(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "eval.json").unlink(missing_ok=True)
    (copy / "config.yaml").write_text("model: {tiny: [unclosed\n")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(copy)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "config cannot be read" in line and "not valid YAML" in line and str(copy / "config.yaml") in line, line
    (copy / "config.yaml").write_text("model: {wings: 2}\n")
    assert main(["eval", "--checkpoint", str(copy)]) == 2
    assert "unknown key 'model.wings'" in _one_line(capsys.readouterr().err)
    (copy / "config.yaml").unlink()
    assert main(["eval", "--checkpoint", str(copy)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "has no config.yaml" in line and "mmrl eval CONFIG --checkpoint" in line, line
    # A run folder from before config.yaml was kept still evaluates with the CONFIG it was trained with.
    assert main(["eval", str(CONFIG), *TRAINED_WITH, *QUICK, "--checkpoint", str(copy)]) == 0
    assert (copy / "eval.json").is_file()


def test_a_device_this_machine_lacks_is_one_line_at_eval(run, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: train.device=cuda is valid here")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "train.device=cuda"]) == 2
    assert "train.device: 'cuda' but no CUDA GPU is visible here" in _one_line(capsys.readouterr().err)
