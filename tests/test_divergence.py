"""Divergence ends in one line, never a traceback (issue 49): an optimizer step whose loss or
gradient norm is not finite is skipped, not applied; `train.max_nonfinite_steps` of them in a row
stop the run naming the newest checkpoint (every checkpoint on disk holds finite weights); a policy
whose weights are NaN stops sampling with one line, in every policy family; a reward that returns
NaN is named with a sample. Real faults throughout: huge learning rates, NaN weights, a NaN reward."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mmrl.checkpoint import find_latest
from mmrl import distributed
from mmrl.cli import main
from mmrl.collect import Collector
from mmrl.config import config_from_dict
from mmrl.distributed import SINGLE
from mmrl.envs import make_task
from mmrl.policies import build_policy
from mmrl.rewards import REWARDS, register_reward
from mmrl.rollout import Diverged, NonFiniteSampling
from mmrl.run_control import TrainingDiverged
from mmrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
DIGIT_SORT = str(ROOT / "configs" / "digit_sort_grpo.yaml")

if "test_nan_for_odd_answers" not in REWARDS:

    @register_reward("test_nan_for_odd_answers")
    def _nan_for_odd_answers(contexts, outputs, **_):
        """A broken reward: NaN for the samples of prompts with an odd answer, 1 for the others."""
        return torch.tensor([float("nan") if int(c["answer"]) % 2 else 1.0 for c in contexts])


def make_cfg(tmp_path, **sections):
    base = {
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                           "num_key_value_heads": 1}, "tokenizer_vocab_size": 280},
        "task": {"name": "arithmetic", "params": {"max_operand": 20}},
        "sampling": {"group_size": 4, "max_new_tokens": 4},
        "train": {"steps": 2, "prompts_per_step": 4, "lr": 3e-3, "eval_every": 0, "eval_size": 8,
                  "progress": False, "output_dir": str(tmp_path / "run"), "seed": 1, "device": "cpu"},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return config_from_dict(base)


def build(cfg, dist=None) -> Trainer:
    torch.manual_seed(cfg.train.seed)
    task = make_task(cfg.task.name, seed=cfg.train.seed, **cfg.task.params)
    return Trainer(cfg, build_policy(cfg, task, torch.device("cpu")), task, dist=dist)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("mmrl: error:")]


# ----------------------------------------------------------------------------- a diverging run


@pytest.mark.parametrize("lr", [1000, 30])
def test_a_diverging_run_stops_in_one_line_and_keeps_only_finite_checkpoints(tmp_path, capsys, lr):
    """The digit-sort demo at a learning rate that blows it up: before, the NaN step was applied and
    the next sampling died with `index 266 is out of bounds`; now the non-finite steps are skipped
    and logged, and the run stops after 3 in a row with one line and exit code 1."""
    run = tmp_path / "run"
    code = main(["train", DIGIT_SORT, "train.steps=8", "train.save_every=2", "train.eval_every=4", "train.eval_size=20",
                 "sft.steps=40", f"train.lr={lr}", f"train.output_dir={run}", "train.progress=false"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    [line] = error_lines(err)
    newest = find_latest(run)
    assert newest is not None and line.endswith(f"newest checkpoint: {newest}"), line
    assert "stopped at step" in line and "the run has diverged" in line and "non-finite" in line, line
    assert "non-finite loss" in err.split(line)[0]  # the first skipped step's warning, before the stop
    checkpoints = list((run / "checkpoints").glob("step_*/*.safetensors"))
    assert checkpoints
    for path in checkpoints:
        assert all(torch.isfinite(w).all() for w in load_file(str(path)).values()), path
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["train/skipped_nonfinite"] for r in rows if "train/skipped_nonfinite" in r]
    assert skipped[0] == 0 and skipped[-2:] == [1, 1], skipped  # the third in a row stopped the run unlogged


# ----------------------------------------------------------------------------- the optimizer step


def nan_gradient(trainer: Trainer) -> None:
    for p in trainer.updater.params:
        p.grad = torch.zeros_like(p)
    trainer.updater.params[0].grad[0] = float("nan")


def finite_gradient(trainer: Trainer) -> None:
    for p in trainer.updater.params:
        p.grad = torch.ones_like(p)


def test_a_nan_gradient_or_loss_leaves_weights_optimizer_and_schedule_as_they_were(tmp_path, capsys):
    trainer = build(make_cfg(tmp_path))
    up = trainer.updater
    trainer.train_step()  # a real step first: Adam has state to keep
    weights = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    adam = {i: {k: v.clone() for k, v in s.items()} for i, s in up.optimizer.state_dict()["state"].items()}
    epoch = up.scheduler.last_epoch
    for set_gradient, loss in ((nan_gradient, 0.5), (finite_gradient, float("nan"))):
        set_gradient(trainer)
        sums = {"grad_norm": 0.0, "skipped_nonfinite": 0.0}
        up.optimizer_step(sums, step=7, loss=loss)
        assert sums["skipped_nonfinite"] == 1.0
        assert all(p.grad is None for p in up.params)  # zero_grad: nothing of the step is left
    for k, v in trainer.policy.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for i, s in up.optimizer.state_dict()["state"].items():
        assert all(torch.equal(v, adam[i][k]) for k, v in s.items()), i
    assert up.scheduler.last_epoch == epoch
    err = capsys.readouterr().err
    assert "step 7: non-finite loss 0.5, gradient norm nan; the optimizer step was skipped" in err
    warnings = [json.loads(x)["warning"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                if "warning" in json.loads(x)]
    assert len(warnings) == 2  # the console shows the first; the log keeps both


def test_the_run_stops_after_max_nonfinite_steps_in_a_row(tmp_path):
    trainer = build(make_cfg(tmp_path, train={"max_nonfinite_steps": 2}))
    up = trainer.updater
    sums = {"grad_norm": 0.0, "skipped_nonfinite": 0.0}
    nan_gradient(trainer)
    up.optimizer_step(sums, step=0)
    trainer.train_step()  # a finite step in between: the count starts again
    assert up.nonfinite.in_a_row == 0
    nan_gradient(trainer)
    up.optimizer_step(sums, step=1)
    nan_gradient(trainer)
    with pytest.raises(Diverged, match=r"^2 optimizer steps in a row had a non-finite loss or gradient norm"):
        up.optimizer_step(sums, step=2)
    never = build(make_cfg(tmp_path / "never", train={"max_nonfinite_steps": 0})).updater
    for step in range(5):  # 0: skip them all, never stop
        for p in never.params:
            p.grad = torch.full_like(p, float("inf"))
        never.optimizer_step(sums, step)
    assert never.nonfinite.in_a_row == 5 and never.scheduler.last_epoch == 0


def test_sft_skips_non_finite_steps_and_stops_after_max_in_a_row(tmp_path, capsys):
    """The SFT warm start's steps are guarded as RL's: a NaN weight makes every SFT loss NaN, no SFT
    step is applied (one would write NaN into every weight) and the run stops in one line."""
    trainer = build(make_cfg(tmp_path, sft={"steps": 5, "batch_size": 4}))
    with torch.no_grad():
        next(trainer.policy.model.parameters())[0, 0] = float("nan")
    with pytest.raises(TrainingDiverged, match=r"^3 optimizer steps in a row .*stopped at step 0 of 2"):
        trainer.train()
    assert "SFT step 0: non-finite loss nan" in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["sft/skipped_nonfinite"] for r in rows if "sft/loss" in r] == [1.0, 1.0]
    assert all(torch.isfinite(p).all() for name, p in trainer.policy.model.named_parameters() if "embed" not in name)


def test_max_nonfinite_steps_is_checked(tmp_path):
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.max_nonfinite_steps must be >= 0 .* got -1"):
        make_cfg(tmp_path, train={"max_nonfinite_steps": -1})


# ----------------------------------------------------------------------------- sampling with NaN weights


def poison(model: torch.nn.Module) -> None:
    """Fill the first matrix of `model` with NaN: its outputs become NaN, as a diverged model's do."""
    matrix = next(p for p in model.parameters() if p.dim() >= 2)
    with torch.no_grad():
        matrix.fill_(float("nan"))


def sample_through_collector(policy, contexts: list[dict]) -> None:
    collector = Collector(config_from_dict({"train": {"device": "cpu"}}), policy, None, SINGLE, [],
                          torch.Generator().manual_seed(0), contextlib.nullcontext(), contextlib.nullcontext,
                          lambda *a, **k: None)
    collector.sample(contexts, 2, collector.generator)


def assert_sampling_stops(policy, contexts: list[dict]) -> str:
    poison(policy.model)
    with pytest.raises(NonFiniteSampling) as caught:
        sample_through_collector(policy, contexts)
    message = str(caught.value)
    assert "\n" not in message and "not finite" in message and "diverged" in message, message
    return message


def test_a_text_policy_with_nan_weights_stops_the_run_in_one_line(tmp_path):
    """The text LM: its sampler meets NaN logits (before: an index error); the trainer turns it into
    the run's one-line stop, which saves nothing and names the newest checkpoint (none yet)."""
    trainer = build(make_cfg(tmp_path))
    assert "log-probs are NaN/inf" in assert_sampling_stops(trainer.policy, trainer.task.next_batch(2))
    with pytest.raises(TrainingDiverged, match=r"stopped at step 0 of 2: the run has diverged .* newest checkpoint: "
                                               r"none yet"):
        trainer.train(resume=False)
    assert find_latest(tmp_path / "run") is None


@pytest.fixture(scope="module")
def tiny_vl():
    """A tiny Qwen2.5-VL with the action tokens in its vocabulary and its processor."""
    from mmrl.policies.vla.processor import add_action_tokens
    from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer

    tok = add_action_tokens(build_tokenizer(["move the dot to the centre 0 1 what action"], vocab_size=300), 256)
    return build_tiny_qwen_vl(tok, "qwen2_5_vl", seed=0).eval(), build_qwen_vl_processor(tok, "qwen2_5_vl", 4, 4)


DOT = [{"task": "dot", "init_state_id": 3}]


def test_a_qwen_vl_policy_with_nan_weights_stops_sampling(tiny_vl):
    from mmrl.policies.qwen_vl import QwenVLPolicy

    frame = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    assert_sampling_stops(QwenVLPolicy(*tiny_vl, max_new_tokens=4), [{"frame": frame, "prompt": "move the dot"}])


def test_an_action_token_vla_with_nan_weights_stops_sampling(tiny_vl):
    """Its action tokens were drawn with torch.multinomial, which failed on NaN probabilities."""
    from mmrl.policies.vla.modeling_action_tokens import ActionTokenVLAPolicy
    from test_action_vla import dot_envs

    policy = ActionTokenVLAPolicy(*tiny_vl, action_dim=3, chunk_size=2, env_factory=dot_envs, max_chunks=2)
    assert_sampling_stops(policy, DOT)


@pytest.mark.robot  # lerobot's SmolVLA / Diffusion Policy
def test_flow_vlas_with_nan_weights_stop_before_their_actions_reach_the_env(tmp_path):
    """SmolVLA's Gaussian SDE steps and the diffusion policy's denoising chain: NaN actions are refused
    in the episode loop every VLA rolls out with, before any env steps them."""
    pytest.importorskip("lerobot")
    from mmrl.policies.vla.modeling_diffusion import DiffusionActionPolicy, build_tiny_diffusion
    from mmrl.policies.vla.modeling_smolvla import SmolVLAPolicy, build_tiny_smolvla
    from test_action_vla import dot_envs

    stepped = []

    def envs(rows):
        env = dot_envs(rows)
        step_chunk = env.step_chunk
        env.step_chunk = lambda actions: stepped.append(actions) or step_chunk(actions)
        return env

    smolvla = SmolVLAPolicy(*build_tiny_smolvla(tmp_path, ["move the dot to the centre 0 1"], cameras=("front",),
                                                state_dim=2, action_dim=2, chunk_size=4, n_action_steps=2,
                                                num_steps=2, image_size=32, seed=0),
                            eta=0.7, env_factory=envs, max_chunks=2)
    diffusion = DiffusionActionPolicy(*build_tiny_diffusion(("front",), state_dim=2, action_dim=2, horizon=4,
                                                            n_action_steps=2, num_steps=2, image_size=32, keypoints=8),
                                      env_factory=envs, max_chunks=2)
    for policy in (smolvla, diffusion):
        assert "actions are not finite" in assert_sampling_stops(policy, DOT)
    assert stepped == []


def test_a_video_policy_with_nan_weights_stops_sampling(tmp_path):
    import mmrl

    small = ["task.params.num_frames=4", "task.params.image_size=8", "model.params.num_steps=2",
             "model.params.tiny.patch_size=[1, 2, 2]", "model.params.tiny.ffn_dim=32", f"train.output_dir={tmp_path}"]
    task, policy = mmrl.build(mmrl.load_config(str(ROOT / "configs" / "video_flowgrpo.yaml"), small))
    assert_sampling_stops(policy, task.next_batch(1))


def test_a_visual_planner_with_nan_weights_stops_sampling(tmp_path):
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1}
    cfg = config_from_dict({
        "model": {"policy": "visual_planner", "tiny": tiny,
                  "params": {"codebook_size": 32, "vq_steps": 10, "vq_layouts": 10, "vq_hidden": 32}},
        "task": {"name": "planning", "params": {"env": "frozenlake", "sizes": [3], "n_train": 10, "n_test": 2}},
        "rewards": [{"name": "vprl_progress"}],
        "train": {"output_dir": str(tmp_path), "device": "cpu"},
    })
    task = make_task("planning", seed=0, **cfg.task.params)
    assert_sampling_stops(build_policy(cfg, task, torch.device("cpu")), task.next_batch(1))


# ----------------------------------------------------------------------------- a NaN reward


def test_a_nan_reward_is_named_with_a_sample(tmp_path, capsys):
    config = tmp_path / "nan_reward.yaml"
    config.write_text(
        "model: {tiny: {hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 1},"
        " tokenizer_vocab_size: 280}\n"
        "task: {name: arithmetic, params: {max_operand: 20}}\n"
        "rewards: [{name: test_nan_for_odd_answers}]\n"
        "sampling: {group_size: 4, max_new_tokens: 4}\n"
        f"train: {{steps: 2, prompts_per_step: 8, eval_every: 0, eval_size: 4, progress: false, device: cpu,"
        f" output_dir: {tmp_path / 'run'}}}\n")
    assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    [line] = error_lines(err)
    assert line.startswith("mmrl: error: reward 'test_nan_for_odd_answers' returned nan for "), line
    n_bad, n = map(int, line.split("returned nan for ")[1].split(" samples")[0].split(" of "))
    assert 0 < n_bad < n == 4, line  # the held-out evaluation before step 1: its prompts with an odd answer
    assert "e.g. for the completion '" in line and "' of prompt '" in line and "stopped at step 0 of 2" in line, line


# ----------------------------------------------------------------------------- two ranks


def test_two_ranks_take_the_same_decision(tmp_path):
    """Under torchrun (2 gloo ranks, this file as the worker): NaN weights on one rank stop both at
    the same step; a NaN loss on one rank skips the step on both; FSDP's clip norm is the global one
    and a NaN in one rank's shard skips the step on both."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    for r in ranks:
        assert "the policy's outputs are not finite" in r["diverged"] and "stopped at step 0 of 2" in r["diverged"]
        assert r["nan_loss_skipped"] == 1.0
        assert r["fsdp_norm"] == pytest.approx(r["fsdp_whole_norm"], rel=1e-5)
        assert r["fsdp_nan_skipped"] == 1.0 and r["fsdp_unchanged"]


def two_rank_worker(out: Path) -> None:
    """Each rank's view of the scenarios of `test_two_ranks_take_the_same_decision`, to ranks.json."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    d = distributed.setup("cpu", 60)
    seen: dict = {}
    replicated = build(make_cfg(out / "replicate", train={"max_nonfinite_steps": 0}), distributed.current(False))
    up = replicated.updater
    finite_gradient(replicated)  # a NaN loss on rank 1 only
    sums = {"grad_norm": 0.0, "skipped_nonfinite": 0.0}
    up.optimizer_step(sums, 0, loss=float("nan") if d.rank == 1 else 0.0)
    seen["nan_loss_skipped"] = sums["skipped_nonfinite"]
    if d.rank == 1:
        poison(replicated.policy.model)
    try:
        replicated.train(resume=False)
    except TrainingDiverged as stop:
        seen["diverged"] = str(stop)
    sharded = build(make_cfg(out / "fsdp", train={"fsdp": True, "max_nonfinite_steps": 0}), distributed.current(True))
    params = sharded.updater.params
    finite_gradient(sharded)
    sums = {"grad_norm": 0.0, "skipped_nonfinite": 0.0}
    sharded.updater.optimizer_step(sums, 0)
    seen["fsdp_norm"], seen["fsdp_whole_norm"] = sums["grad_norm"], sum(p.numel() for p in params) ** 0.5
    before = [p.detach().to_local().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    if d.rank == 1:
        params[0].grad.to_local().view(-1)[0] = float("nan")
    sums = {"grad_norm": 0.0, "skipped_nonfinite": 0.0}
    sharded.updater.optimizer_step(sums, 1)
    seen["fsdp_nan_skipped"] = sums["skipped_nonfinite"]
    seen["fsdp_unchanged"] = all(torch.equal(b, p.detach().to_local()) for b, p in zip(before, params))
    every: list = [None] * d.world
    dist.all_gather_object(every, seen)
    if d.rank == 0:
        (out / "ranks.json").write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    two_rank_worker(Path(sys.argv[1]))
