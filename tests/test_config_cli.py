"""Config validation and the CLI: bad input gets one clear line naming the value and the choices."""

from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.config import ConfigError, load_config, parse_overrides

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path, local_inputs):
    cfg = load_config(path, local_inputs(path))
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
    (["algo.kl_kind=k9"], "algo.kl_kind: invalid value 'k9'; valid: abs, gaussian, k1, k2, k3"),
    (["task.name=chess"], "unknown task 'chess'"),
    (["rewards=[{name: nope}]"], "unknown reward 'nope'"),
    (["model.policy=gpt"], "unknown policy 'gpt'"),
    (["sampling.top_p=1.5"], "sampling.top_p must be in (0, 1]"),
    (["algo.prompt_replay=1.5"], "algo.prompt_replay must be in [0, 1] (0 = off), got 1.5"),
    (["algo.guide_below=0.5", "algo.guide_coef=0"], "algo.guide_coef must be > 0, got 0"),
    (["model.source=pretrained", "model.path=/does/not/exist"], "'/does/not/exist' is not a model folder (not found)"),
    (["trainsteps"], "not of the form key=value"),
    (["sft.lr=-1e-3"], "sft.lr must be > 0, got -0.001"),
    (["sft.batch_size=0"], "sft.batch_size must be >= 1"),
    (["rollout.correction=is"], "rollout.correction: invalid value 'is'; valid: none, tis, mis"),
    (["rollout.correction_level=row"], "rollout.correction_level: invalid value 'row'; valid: auto, token, sequence"),
    (["rollout.correction=tis", "rollout.correction_cap=1"], "rollout.correction_cap must be > 1, got 1"),
    (["rollout.correction=tis", "rollout.correction_level=token", "algo.loss=gspo"],
     "set rollout.correction_level: sequence"),
    (["train.fsdp=true", "train.unit_chunk=4"], "train.fsdp does not support train.unit_chunk (got 4)"),
    (["train.dist_timeout_s=0"], "train.dist_timeout_s must be > 0"),
    (["train.fsdp=true", "model.policy=video_gen"], "model.policy 'video_gen' runs replicated only"),
])
def test_bad_values_name_the_key_and_choices(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert fragment in str(err.value)
    if "unknown loss" in fragment:
        assert "gspo" in str(err.value) and "cispo" in str(err.value)  # lists the valid names
    if "unknown key" in fragment:
        assert "steps" in str(err.value)


def test_a_mismatch_correction_is_one_config_line():
    for loss in ("grpo", "cispo", "sapo", "dapo", "gspo", "gmpo"):  # auto level: sequence for gspo / gmpo
        assert load_config(None, [f"algo.loss={loss}", "rollout.correction=tis"]).rollout.correction == "tis"
    cfg = load_config(None, ["algo.loss=gspo", "rollout.correction=mis", "rollout.correction_level=sequence"])
    assert (cfg.rollout.correction, cfg.rollout.correction_cap) == ("mis", 2.0)


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
    assert not any(line.strip().startswith("gae ") for line in out.splitlines())  # no value head is trained
    # the stages, each with its kind, paper and fields
    line = next(line for line in out.splitlines() if line.strip().startswith("dynamic_sampling "))
    assert "RolloutStage" in line and "2503.14476" in line
    assert "fields: keep=1, metric='shortest'" in out and "RolloutStage/AuxiliaryLoss" in out


def test_parse_overrides_nests():
    assert parse_overrides(["a.b.c=1", "a.d=x"]) == {"a": {"b": {"c": 1}, "d": "x"}}


def test_a_tilde_override_removes_a_key_a_mapping_override_merges():
    base = load_config("configs/vqa_your_data.yaml").task.params["column_map"]
    merged = load_config("configs/vqa_your_data.yaml", ["task.params.column_map={problem: q}"]).task.params
    assert merged["column_map"] == {**base, "problem": "q"}  # a mapping merges key by key
    removed = load_config("configs/vqa_your_data.yaml", ["~task.params.column_map"]).task.params
    assert "column_map" not in removed and removed["data_path"] == "data/my_vqa"
    replaced = load_config("configs/vqa_your_data.yaml", ["~task.params.column_map", "task.params.column_map={problem: q}"])
    assert replaced.task.params["column_map"] == {"problem": "q"}  # removal, then the new mapping
    with pytest.raises(ConfigError, match=r"override ~task.params.colmn_map: the config has no key 'task.params.colmn_map'"):
        load_config("configs/vqa_your_data.yaml", ["~task.params.colmn_map"])


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


def test_a_text_config_imports_no_simulator_or_gl(tmp_path):
    """Tasks load by name: a text run never imports mujoco, gymnasium or OpenGL, nor sets MUJOCO_GL."""
    import subprocess
    import sys

    code = ("import os, sys\n"
            "from mmrl import build\n"
            "from mmrl.config import load_config\n"
            "from mmrl.trainer import Trainer\n"
            f"cfg = load_config('configs/digit_sort_grpo.yaml', ['train.output_dir={tmp_path}', 'model.tiny.hidden_size=32',"
            " 'model.tiny.intermediate_size=64', 'model.tiny.num_attention_heads=2', 'model.tiny.num_key_value_heads=1'])\n"
            "task, policy = build(cfg)\n"
            "Trainer(cfg, policy, task)\n"
            "print(sorted(m for m in ('mujoco', 'gymnasium', 'OpenGL', 'lerobot', 'robosuite') if m in sys.modules),"
            " os.environ.get('MUJOCO_GL'))\n")
    import os

    env = {k: v for k, v in os.environ.items() if k != "MUJOCO_GL"}  # an earlier test's import may have set it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[] None"


def test_a_missing_extra_is_named_in_one_line(monkeypatch, capsys):
    from mmrl import envs

    monkeypatch.setitem(envs.LAZY_TASKS, "arithmetic", ("mmrl.envs._not_installed", "robot"))
    monkeypatch.delitem(envs.TASKS, "arithmetic", raising=False)
    cfg = Path(__file__).parent.parent / "configs" / "arithmetic_grpo.yaml"
    assert main(["train", str(cfg), "train.steps=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task 'arithmetic' needs the mmrl.envs._not_installed package" in err[0]
    assert "pip install 'mmrl[robot]'" in err[0]


def test_base_inheritance_merges_sections_and_reports_loops(tmp_path):
    (tmp_path / "parent.yaml").write_text("algo: {loss: grpo, beta: 0.1}\ntrain: {steps: 5, lr: 0.01}\n"
                                          "rewards:\n  - {name: exact_match}\n  - {name: position_match, weight: 0.5}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nalgo: {loss: gspo}\nrewards:\n  - {name: exact_match}\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.steps=7"])
    assert (cfg.algo.loss, cfg.algo.beta, cfg.train.steps, cfg.train.lr) == ("gspo", 0.1, 7, 0.01)
    assert [r.name for r in cfg.rewards] == ["exact_match"]  # lists are replaced whole
    assert cfg.train.output_dir == "runs/child"
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "orphan.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="config file not found: .*nowhere.yaml"):
        load_config(tmp_path / "orphan.yaml")


def test_the_per_loss_caption_configs_differ_from_grpo_only_in_the_loss():
    root = Path(__file__).parent.parent / "configs"
    base = load_config(root / "caption_grpo.yaml").to_dict()
    for loss in ("dapo", "gmpo", "gspo", "sapo"):
        cfg = load_config(root / f"caption_{loss}.yaml").to_dict()
        assert cfg["algo"].pop("loss") == loss and cfg["train"].pop("output_dir") == f"runs/caption_{loss}"
        assert {**cfg, "algo": {**cfg["algo"], "loss": "grpo"}, "train": {**cfg["train"], "output_dir": "runs/caption_grpo"}} == base


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_typo_in_any_component_of_a_shipped_config_is_one_line(path, capsys, monkeypatch, local_inputs):
    """task / reward / loss / advantage parameters are checked at load, before anything is built."""
    import mmrl.cli

    def not_at_load(*_, **__):
        raise AssertionError("the typo passed load_config")

    monkeypatch.setattr(mmrl.cli, "run_training", not_at_load)
    local = local_inputs(path)
    cfg = load_config(path, local)
    capsys.readouterr()  # what building the stand-in inputs printed is not the CLI's output
    typos = [("task.params.bogus_key=1", "task.params"), ("model.params.bogus_key=1", "model.params"),
             ("algo.loss_params.bogus_key=1", "algo.loss_params"),
             ("algo.advantage_params.bogus_key=1", "algo.advantage_params")]
    typos += [(f"rewards.{i}.params.bogus_key=1", f"rewards[{i}].params") for i in range(len(cfg.rewards))]
    for override, where in typos:
        assert main(["train", str(path), *local, override]) == 2, override
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"mmrl: error: {where}") and "'bogus_key'" in err and "valid:" in err, err


@pytest.mark.parametrize("override, fragment", [
    ("model.lora_rank=two", "model.lora_rank: expected an integer"),
    ("task.name=chess", "task.name: unknown task 'chess'"),
    ("rewards.0.weight=heavy", "rewards[0].weight: expected a number"),
    ("sampling.temperature=0", "sampling.temperature must be > 0"),
    ("algo.advantage=gae", "algo.advantage: unknown estimator 'gae'"),
    ("algo.kl_kind=k9", "algo.kl_kind: invalid value 'k9'; valid: abs, gaussian, k1, k2, k3"),
    ("sft.lr=-1", "sft.lr must be > 0"),
    ("train.device=tpu", "train.device: invalid value 'tpu'"),
    ("rewards.5.weight=1", "override rewards.5: index 5 is past the end"),
])
def test_a_bad_value_in_each_section_exits_2_with_one_line(override, fragment, capsys):
    assert main(["train", str(CONFIGS[0]), override]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and fragment in err, err
