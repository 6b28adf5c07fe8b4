"""`mmrl eval --benchmark libero`: LIBERO's published protocol on a saved policy, resumable per task;
and `vla_eval`'s loading of the Diffusion Policy's saved folder. The tests that roll out need the
LIBERO assets (`libero_assets` skips without them) and use a tiny untrained policy, 1 official
initial state per task and 8-step episodes."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from mmrl.evals import libero_benchmark as lb

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
HAS_LIBERO = importlib.util.find_spec("libero") is not None
needs_libero = pytest.mark.skipif(not HAS_LIBERO, reason="hf-libero is not installed (pip install 'mmrl[libero]')")
# configs/vla_libero_grpo.yaml at a size a CPU builds in seconds (about 150k parameters).
TINY_ACTION_VLA = ["model.tiny={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, num_attention_heads: 2, "
                   "num_key_value_heads: 1, head_dim: 32, mrope_section: [8, 4, 4], vision_depth: 1, vision_width: 32, "
                   "vision_heads: 2}", "model.params.max_image_tokens=4", "task.params.image_size=64",
                   "task.params.num_workers=0", "train.device=cpu", "train.bf16=false"]


def bench_args(**kw) -> argparse.Namespace:
    """The namespace `mmrl eval --benchmark libero` hands to `main`."""
    base = dict(model=None, suites=["spatial"], trials=1, workers=1, output=None, seed=0, videos=0, task_ids=None,
                max_steps=None)
    return argparse.Namespace(**{**base, **kw})


def saved_run(run: Path, config: Path | str, overrides: list[str], checkpoint: bool = True):
    """A run folder as the trainer leaves it: config.yaml, a checkpoint and final/ (untrained weights)."""
    from mmrl import build
    from mmrl.checkpoint import save_checkpoint, write_run_config
    from mmrl.config import load_config

    cfg = load_config(config, [*overrides, f"train.output_dir={run}"])
    _, policy = build(cfg)
    write_run_config(cfg)
    if checkpoint:
        save_checkpoint(run, 1, policy.model, {"step": 1})
    policy.save(run / "final")
    return policy


# ---------------------------------------------------------------- arguments and errors (no LIBERO needed)


def test_suites_all_and_short_names():
    assert lb.parse_suites(["all"]) == ["libero_spatial", "libero_object", "libero_goal", "libero_10"]
    assert lb.parse_suites(["spatial", "long", "libero_goal", "10"]) == ["libero_spatial", "libero_10", "libero_goal"]
    with pytest.raises(ValueError, match="unknown LIBERO suite 'kitchen'; valid: .*libero_spatial"):
        lb.parse_suites(["kitchen"])


@pytest.mark.parametrize("field,value,match", [
    ("trials", 51, r"--trials 51: a LIBERO task has 50 official initial states; accepted: 1\.\.50"),
    ("trials", 0, r"--trials 0: .*accepted: 1\.\.50"),
    ("workers", 0, r"--workers 0: accepted: an integer >= 1"),
    ("videos", -1, r"--videos -1: accepted"),
    ("task_ids", [3, 10], r"--task-ids 10: accepted: 0\.\.9"),
    ("max_steps", 0, r"--max-steps 0: accepted"),
])
def test_bad_values_are_one_line(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match) as exc:
        lb.main(bench_args(model=str(tmp_path), **{field: value}))
    assert "\n" not in str(exc.value)


def test_cli_wires_the_options_and_prints_one_line(tmp_path, capsys):
    from mmrl.cli import main

    assert main(["eval", "--benchmark", "libero", "--model", str(tmp_path / "nowhere"), "--suites", "spatial",
                 "--trials", "5", "--workers", "2", "--seed", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmrl: error: --model ") and "no such folder" in err and "\n" not in err


def test_model_must_be_a_libero_run_with_its_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder; accepted: a run folder"):
        lb.run_config(str(tmp_path / "nowhere"))
    (tmp_path / "bare").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.yaml in .*bare"):
        lb.run_config(str(tmp_path / "bare"))
    from mmrl.checkpoint import write_run_config
    from mmrl.config import load_config

    write_run_config(load_config(ROOT / "configs" / "vla_tabletop_grpo.yaml", [f"train.output_dir={tmp_path / 'tt'}"]))
    with pytest.raises(ValueError, match="trained on task 'tabletop'; --benchmark libero evaluates policies trained "
                       "on LIBERO"):
        lb.run_config(str(tmp_path / "tt"))


def test_a_task_file_of_another_evaluation_is_refused(tmp_path, capsys):
    settings = {"weights_sha256": "abc", "trials": 50, "seed": 0, "mode": "greedy", "max_episode_steps": 220}
    path = lb.task_file(tmp_path, "libero_spatial", 3)
    assert path == tmp_path / "tasks" / "libero_spatial_03.json" and lb.read_done(path, settings) is None
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"settings": settings, "success": 0.5}))
    assert lb.read_done(path, settings)["success"] == 0.5
    for key, value in (("seed", 1), ("trials", 10), ("weights_sha256", "def"), ("max_episode_steps", 8)):
        with pytest.raises(ValueError, match=rf"{key}: .* there, .* now\); give this one another --output"):
            lb.read_done(path, {**settings, key: value})
    path.write_text('{"settings": ')  # cut short by hand: redone, with a warning
    assert lb.read_done(path, settings) is None and "damaged" in capsys.readouterr().err


def test_table_has_a_column_per_suite_then_the_average():
    def rec(suite, t, k, n=4):
        return {"suite": suite, "task_id": t, "instruction": f"do {t}", "trials": n, "successes": k, "success": k / n,
                "videos": []}

    # The suite is the mean over its tasks, the average the mean over suites (not over all tasks).
    records = {"libero_spatial": [rec("libero_spatial", 0, 4), rec("libero_spatial", 1, 2)],
               "libero_goal": [rec("libero_goal", 0, 1)]}
    summary = lb.summarize(records)
    assert summary["suites"]["libero_spatial"]["success"] == pytest.approx(0.75)
    assert summary["suites"]["libero_spatial"]["episodes"] == 8
    assert summary["average"] == pytest.approx((0.75 + 0.25) / 2)
    result = {"name": "run", "protocol": {"seed": 0, "trials": 4, "task_ids": [0, 1], "official_budget": True,
                                          "standard": False,
                                          "max_episode_steps": {"libero_spatial": 220, "libero_goal": 300}},
              **summary, "tasks": records}
    md = lb.markdown(result).splitlines()
    assert md[md.index("| Model | Spatial | Goal | Average |") + 2] == "| run | 75.0 | 25.0 | 50.0 |"
    assert "| 1 | do 1 | 50.0 | 2/4 |" in md
    assert any("Not the published protocol" in line for line in md)


# ---------------------------------------------------------------- the Diffusion Policy's saved folder


def test_vla_eval_loads_the_diffusion_policys_saved_folder(tmp_path):
    """final/ of a Diffusion Policy run holds lerobot's model.safetensors, like a checkpoint: it used
    to be taken for one (and refused for lacking trainer_state.pt)."""
    pytest.importorskip("lerobot")
    from mmrl.config import eval_config
    from mmrl.config import load_config
    from mmrl.evals.vla_eval import load_saved_policy, saved_policy_kind
    from mmrl.policies.vla.modeling_diffusion import DiffusionActionPolicy

    run = tmp_path / "run"
    saved = saved_run(run, ROOT / "configs" / "vla_tabletop_dppo.yaml", ["model.params.eta=0.7"], checkpoint=False)
    assert saved_policy_kind(run / "final") == "diffusion" and saved_policy_kind(run) is None
    _, policy, run_dir = load_saved_policy(eval_config(run / "final"), str(run / "final"))
    assert isinstance(policy, DiffusionActionPolicy) and run_dir == run and policy.eta == 0.7
    for (name, a), b in zip(saved.model.state_dict().items(), policy.model.state_dict().values()):
        assert torch.equal(a, b), name
    other = load_config(ROOT / "configs" / "vla_tabletop_grpo.yaml", [f"train.output_dir={run}"])
    with pytest.raises(ValueError, match="holds a saved 'diffusion' policy, but the config builds 'action_vla'"):
        load_saved_policy(other, str(run / "final"))


# ---------------------------------------------------------------- on LIBERO


@pytest.fixture(scope="module")
def action_vla_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("libero") / "run"
    saved_run(run, ROOT / "configs" / "vla_libero_grpo.yaml", TINY_ACTION_VLA)
    return run


class Interrupted(Exception):
    pass


@needs_libero
def test_benchmark_writes_the_table_and_resumes_without_redoing_tasks(action_vla_run, libero_assets, tmp_path,
                                                                      monkeypatch, capsys):
    import mmrl.envs.libero.env as libero_env

    out = tmp_path / "eval"
    args = bench_args(model=str(action_vla_run), task_ids=[0, 1, 2], max_steps=8, videos=1, output=str(out))
    # Interrupted while running task 1: task 0 is on disk, nothing else.
    real_run_task, calls = lb.run_task, []

    def interrupted_at_task_1(policy, suite, task_id, trials, seed):
        calls.append(task_id)
        if task_id == 1:
            raise Interrupted
        return real_run_task(policy, suite, task_id, trials, seed)

    monkeypatch.setattr(lb, "run_task", interrupted_at_task_1)
    with pytest.raises(Interrupted):
        lb.main(args)
    assert calls == [0, 1] and sorted(p.name for p in (out / "tasks").iterdir()) == ["libero_spatial_00.json"]
    assert not (out / "libero.json").exists()
    first = (out / "tasks" / "libero_spatial_00.json").read_bytes()
    monkeypatch.setattr(lb, "run_task", real_run_task)

    # The same command again: task 0's env is never built, tasks 1 and 2 run.
    built = []
    real_make = libero_env.make_libero_env

    def counting_make(suite="libero_spatial", task_id=0, **kwargs):
        built.append((suite, task_id))
        return real_make(suite, task_id, **kwargs)

    monkeypatch.setattr(libero_env, "make_libero_env", counting_make)
    capsys.readouterr()
    assert lb.main(args) == 0
    assert built == [("libero_spatial", 1), ("libero_spatial", 2)]
    assert (out / "tasks" / "libero_spatial_00.json").read_bytes() == first
    log = capsys.readouterr().out
    assert "2 of 3 tasks to run (1 done before" in log
    assert "libero_spatial task 0 (1/3): 0/1 = 0.0%  | suite so far 0.0%  (done before)" in log
    assert "LIBERO average success: 0.0% (spatial 0.0); written:" in log.splitlines()[-1]

    result = json.loads((out / "libero.json").read_text())
    tasks = result["tasks"]["libero_spatial"]
    assert [t["task_id"] for t in tasks] == [0, 1, 2] and all(t["trials"] == 1 for t in tasks)
    assert all(t["episodes"][0]["init_state_id"] == 0 and t["episodes"][0]["length"] == 8 for t in tasks)
    assert tasks[1]["instruction"] == "pick up the black bowl next to the ramekin and place it on the plate"
    assert result["average"] == pytest.approx(sum(t["success"] for t in tasks) / 3)
    assert result["protocol"]["max_episode_steps"] == {"libero_spatial": 8} and not result["protocol"]["standard"]
    prov = result["provenance"]
    assert prov["benchmark"] == "libero" and prov["grader"] == "libero env success/v1"
    assert prov["prompt_template"] == "libero task language" and prov["sampling"]["mode"] == "greedy"
    assert prov["seed"] == 0 and prov["suites"] == ["libero_spatial"] and prov["trials"] == 1
    assert len(prov["data_files"]) == 6 and prov["data_sha256"]  # init states + BDDL of each task
    assert prov["weights_sha256"] == tasks[0]["settings"]["weights_sha256"]
    md = (out / "libero.md").read_text()
    assert "| Model | Spatial | Average |\n| --- | ---: | ---: |\n| run | 0.0 | 0.0 |" in md
    videos = list((out / "videos" / "libero_spatial").glob("*.gif"))
    assert len(videos) == 1 and tasks[0]["videos"][0].endswith(".gif")  # --videos 1: the suite's first failure

    # Another seed into the same folder: refused before anything runs, in one line.
    built.clear()
    with pytest.raises(ValueError, match=r"libero_spatial_00\.json holds a result of another evaluation \(seed: 0 "
                       r"there, 1 now\)") as exc:
        lb.main(bench_args(**{**vars(args), "seed": 1}))
    assert "\n" not in str(exc.value) and built == []


@needs_libero
def test_diffusion_final_export_on_libero_with_env_workers(libero_assets, tmp_path):
    """A Diffusion Policy run's final/ as --model, its 2 episodes stepped in 2 env worker processes:
    the same episodes as in this process (the same seed)."""
    pytest.importorskip("lerobot")
    import yaml

    config = tmp_path / "diffusion_libero.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"policy": "diffusion", "source": "tiny",
                  "params": {"horizon": 8, "n_action_steps": 8, "action_dim": 7, "state_dim": 8, "image_size": 64,
                             "num_steps": 2, "cameras": ["agentview"], "encoder_size": 64}},
        "task": {"name": "libero", "params": {"suite": "spatial", "image_size": 64, "cameras": ["agentview"]}},
        "rewards": [{"name": "success"}], "sft": {"steps": 0}, "train": {"device": "cpu", "seed": 0}}))
    saved_run(tmp_path / "run", config, [], checkpoint=False)
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"eval{workers}"
        assert lb.main(bench_args(model=str(tmp_path / "run" / "final"), trials=2, workers=workers, task_ids=[4],
                                  max_steps=8, output=str(out))) == 0
        runs[workers] = json.loads((out / "libero.json").read_text())
    tasks = [r["tasks"]["libero_spatial"][0] for r in runs.values()]
    assert all(t["env_worker_restarts"] == 0 for t in tasks)
    assert tasks[0]["episodes"] == tasks[1]["episodes"] and [e["init_state_id"] for e in tasks[0]["episodes"]] == [0, 1]
    assert runs[1]["provenance"]["model"] == str(tmp_path / "run" / "final") and runs[1]["name"] == "run"
