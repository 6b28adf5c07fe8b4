"""Config validation and the CLI: bad input gets one clear line naming the value and the choices."""

from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.config import ConfigError, load_config, parse_overrides

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.train.steps >= 0


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(None, ["algo.loss=gspo", "train.steps=3", "sampling.temperature=0.7", "sft.lr=1e-3"])
    assert cfg.algo.loss == "gspo" and cfg.train.steps == 3 and cfg.sampling.temperature == 0.7
    assert cfg.sft.lr == pytest.approx(1e-3)  # YAML 1.1 reads 1e-3 as a string; accepted as a number
    assert cfg.algo.resolved_advantage() == "grpo"
    assert load_config(None, ["algo.loss=dr_grpo"]).algo.resolved_advantage() == "dr_grpo"


@pytest.mark.parametrize("override, fragment", [
    (["algo.loss=grpoo"], "unknown loss 'grpoo'"),
    (["algo.advantage=zscore"], "unknown estimator 'zscore'"),
    (["train.stepz=3"], "unknown key 'train.stepz'"),
    (["train.steps=many"], "train.steps: expected an integer"),
    (["algo.kl_kind=k9"], "algo.kl_kind: invalid value 'k9'; valid: k1, k2, k3, abs"),
    (["task.name=chess"], "unknown task 'chess'"),
    (["rewards=[{name: nope}]"], "unknown reward 'nope'"),
    (["model.policy=gpt"], "unknown policy 'gpt'"),
    (["sampling.top_p=1.5"], "sampling.top_p must be in (0, 1]"),
    (["algo.prompt_replay=1.5"], "algo.prompt_replay must be in [0, 1] (0 = off), got 1.5"),
    (["algo.guide_below=0.5", "algo.guide_coef=0"], "algo.guide_coef must be > 0, got 0"),
    (["model.source=pretrained", "model.path=/does/not/exist"], "checkpoint directory not found"),
    (["trainsteps"], "not of the form key=value"),
    (["sft.lr=-1e-3"], "sft.lr must be > 0, got -0.001"),
    (["sft.batch_size=0"], "sft.batch_size must be >= 1"),
])
def test_bad_values_name_the_key_and_choices(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert fragment in str(err.value)
    if "unknown loss" in fragment:
        assert "gspo" in str(err.value) and "cispo" in str(err.value)  # lists the valid names
    if "unknown key" in fragment:
        assert "steps" in str(err.value)


def test_malformed_yaml_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 3\nalgo: [\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmrl: error:") and "not valid YAML" in err[0]


def test_cli_reports_unknown_algorithm_without_traceback(capsys):
    cfg = Path(__file__).parent.parent / "configs" / "arithmetic_grpo.yaml"
    assert main(["train", str(cfg), "algo.loss=nope"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unknown loss 'nope'" in err


def test_cli_lists_algorithms_with_citations(capsys):
    assert main(["algos"]) == 0
    out = capsys.readouterr().out
    for name, cite in [("grpo", "2402.03300"), ("gspo", "2507.18071"), ("cispo", "2506.13585"), ("rloo", "2402.14740")]:
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert cite in line


def test_parse_overrides_nests():
    assert parse_overrides(["a.b.c=1", "a.d=x"]) == {"a": {"b": {"c": 1}, "d": "x"}}


def test_cli_train_then_eval_round_trip(tmp_path, capsys):
    cfg = Path(__file__).parent.parent / "configs" / "arithmetic_grpo.yaml"
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.steps=2", "sft.steps=2", "train.eval_size=8", "train.progress=false",
            "train.prompts_per_step=2", "sampling.group_size=2"]
    assert main(["train", str(cfg), *args]) == 0
    assert (out / "results.json").is_file() and (out / "curves.png").is_file() and (out / "final" / "config.json").is_file()
    assert main(["eval", str(cfg), *args, "--checkpoint", str(out)]) == 0
    assert (out / "eval.json").is_file()
    assert main(["eval", str(cfg), *args, "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_overrides_may_follow_flags(tmp_path):
    cfg = Path(__file__).parent.parent / "configs" / "arithmetic_grpo.yaml"
    # A bad override placed after the flag must still be seen (and rejected with a clear line).
    assert main(["train", str(cfg), "--no-resume", "algo.loss=nope"]) == 2
