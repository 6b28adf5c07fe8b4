"""A run folder from elsewhere runs no code (issue 49): the trainer state is tensors and plain
values that torch's weights-only unpickler reads, for every domain; a planted pickle (meta.json's
hashes updated to match, as an attacker would) is refused in one line on resume and never read by
`mmrl eval`; DCP's pickles are checked before torch reads them; the plugins a run folder's
config.yaml names are not imported by `mmrl eval`; `--trust-checkpoint` loads a checkpoint an older
mmrl wrote (numpy state), and says what it does."""

import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import mmrl
from mmrl import checkpoint
from mmrl.checkpoint import (CheckpointError, find_latest, from_plain, load_state_file, save_sharded_checkpoint,
                             to_plain)
from mmrl.cli import main
from mmrl.config import load_config
from mmrl.distributed import SINGLE
from mmrl.stages import PromptReplay
from mmrl.trainer import Trainer, TrainingInterrupted

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "arithmetic_grpo.yaml"
TINY = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=1", "task.params.max_operand=20", "sampling.group_size=2",
        "sampling.max_new_tokens=4", "train.prompts_per_step=2", "train.eval_size=4", "train.eval_every=0",
        "train.progress=false", "train.threads=1", "sft.steps=0"]


class Payload:
    """What an attacker plants: unpickling it makes the folder `marker` (any code would run the same way)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def rewrite_manifest(ckpt: Path, name: str) -> None:
    """meta.json's size and SHA-256 of `name` made to match the file planted there."""
    meta = json.loads((ckpt / "meta.json").read_text())
    data = (ckpt / name).read_bytes()
    meta["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def plant(ckpt: Path, name: str, marker: Path) -> None:
    """`name` (a trainer state file) rewritten with a payload among its values."""
    state = torch.load(ckpt / name, weights_only=True)
    torch.save({**state, "eval_history": Payload(marker)}, ckpt / name)
    rewrite_manifest(ckpt, name)


def one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def assert_refused(err: str, path: Path) -> None:
    line = one_line(err)
    assert line.startswith("mmrl: error: ") and str(path) in line, line
    assert "would run code from the file" in line and "--trust-checkpoint" in line, line


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("untrusted") / "run"
    assert main(["train", str(CONFIG), *TINY, "train.steps=1", f"train.output_dir={run}"]) == 0
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


# ----------------------------------------------------------------------------- a planted payload


def test_a_planted_trainer_state_is_refused_on_resume_and_not_read_by_eval(run, tmp_path, capsys):
    marker = tmp_path / "ran"
    ckpt = find_latest(run)
    plant(ckpt, "trainer_state.pt", marker)
    capsys.readouterr()
    assert main(["train", str(CONFIG), *TINY, "train.steps=2", f"train.output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert_refused(err, ckpt / "trainer_state.pt")
    assert "(it names posix.mkdir)" in err and not marker.exists()
    # Evaluation needs only the weights (and the step, from meta.json): the state is not read at all.
    for target in (run, ckpt):
        assert main(["eval", "--checkpoint", str(target), "--output", str(tmp_path / "eval.json")]) == 0
        assert json.loads((tmp_path / "eval.json").read_text())["step"] == 1
    assert not marker.exists()
    # The payload is real: pickle would run it.
    checkpoint.trust_checkpoints()
    try:
        load_state_file(ckpt / "trainer_state.pt")
    finally:
        checkpoint.trust_checkpoints(False)
    assert marker.is_dir()


def test_the_benchmark_reads_only_the_weights_of_a_run_folder(local_inputs, tmp_path, capsys):
    """`mmrl eval --benchmark synthetic --model RUN` on a tiny Qwen-VL run folder whose trainer
    state holds a payload: evaluated, the payload never unpickled."""
    run, marker = tmp_path / "vqa_run", tmp_path / "ran"
    cfg = load_config(REPO / "configs" / "vqa_grpo.yaml", [
        *local_inputs(REPO / "configs" / "vqa_grpo.yaml"), "task.params.n_train=8", "task.params.n_test=2",
        "task.params.n_ood=2", f"train.output_dir={run}", "train.progress=false",
        "model.tiny={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
        "num_key_value_heads: 1, head_dim: 16, mrope_section: [4, 2, 2], vision_depth: 1, vision_width: 16, "
        "vision_heads: 1}"])
    task, policy = mmrl.build(cfg)
    checkpoint.write_run_config(cfg)
    plant(Trainer(cfg, policy, task).save(), "trainer_state.pt", marker)
    capsys.readouterr()
    assert main(["eval", "--benchmark", "synthetic", "--model", str(run), "--limit", "2", "--max-new-tokens", "4",
                 "--dtype", "float32", "--device", "cpu", "--output", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "synthetic.json").read_text())["n"] == 2
    assert not marker.exists() and "would run code" not in capsys.readouterr().err


def test_the_plugins_a_run_folders_config_names_are_not_imported_by_eval(run, tmp_path, capsys):
    marker = tmp_path / "imported"
    plugin = tmp_path / "plugin.py"
    plugin.write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "plugins": [str(plugin)]}))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(run / "config.yaml") in line and "names plugins" in line and "--trust-checkpoint" in line, line
    assert not marker.exists()
    assert main(["eval", "--checkpoint", str(run), "--trust-checkpoint"]) == 0
    assert marker.is_dir()


# ----------------------------------------------------------------------------- sharded checkpoints


def sharded(tmp_path) -> tuple[Trainer, Path]:
    """A trainer and its sharded checkpoint (dcp/ + rank_0.pt), written by one process as rank 0 of
    a run of one: the files and loader of a torchrun run."""
    cfg = load_config(CONFIG, [*TINY, f"train.output_dir={tmp_path / 'sharded'}"])
    task, policy = mmrl.build(cfg)
    trainer = Trainer(cfg, policy, task)
    trainer.train_step()  # the optimizer has state and hyperparameters to save
    trainer.step = 1
    ckpt = save_sharded_checkpoint(trainer.out_dir, 1, trainer.policy.model, trainer.optimizer,
                                   trainer.state_dict(with_optimizer=False), SINGLE)
    return trainer, ckpt


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a process group: one process
def test_a_sharded_checkpoint_loads_weights_only_and_each_planted_file_is_refused(tmp_path):
    trainer, ckpt = sharded(tmp_path)
    assert trainer.resume() == ckpt and trainer.step == 1  # plain files load (DCP's metadata allowlisted)
    marker = tmp_path / "ran"
    # rank_R.pt: the trainer state.
    bad = tmp_path / "rank_file"
    shutil.copytree(ckpt, bad)
    plant(bad, "rank_0.pt", marker)
    with pytest.raises(CheckpointError, match="rank_0.pt holds more than tensors and plain values"):
        trainer.resume(bad)
    # dcp/.metadata: torch reads it with a plain pickle.load.
    bad = tmp_path / "metadata"
    shutil.copytree(ckpt, bad)
    (bad / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(bad, "dcp/.metadata")
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata holds more .*\(it names posix\.mkdir\)") as exc:
        trainer.resume(bad)
    assert "\n" not in str(exc.value)
    # A non-tensor item in a shard (the optimizer's lr): DCP's planner reads it with weights_only=False.
    bad = tmp_path / "bytes_item"
    shutil.copytree(ckpt, bad)
    shard = plant_bytes_item(bad / "dcp", marker)
    rewrite_manifest(bad, "dcp/.metadata")
    rewrite_manifest(bad, f"dcp/{shard}")
    with pytest.raises(CheckpointError, match=rf"dcp/{shard} holds more .*\(it names posix\.mkdir\)"):
        trainer.resume(bad)
    assert not marker.exists()


def plant_bytes_item(dcp_dir: Path, marker: Path) -> str:
    """Point a non-tensor item of DCP's metadata at a payload appended to its shard file; returns
    the shard's name."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = pickle.loads((dcp_dir / ".metadata").read_bytes())  # the test's own file, before planting
    fqn = next(k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
               and k.endswith(".lr"))
    index, info = next((i, s) for i, s in meta.storage_data.items() if i.fqn == fqn)
    shard = dcp_dir / info.relative_path
    payload = io_bytes(Payload(marker))
    info.offset, info.length = shard.stat().st_size, len(payload)
    with shard.open("ab") as f:
        f.write(payload)
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(meta))
    return info.relative_path


def io_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ----------------------------------------------------------------------------- --trust-checkpoint


def test_trust_checkpoint_resumes_a_checkpoint_of_an_older_mmrl(run, capsys):
    """An older mmrl saved numpy's RNG state as an array: refused, then resumed with the flag, which
    says what it does; the next command loads weights-only again."""
    ckpt = find_latest(run)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    state["rng"]["numpy"] = np.random.get_state()
    torch.save(state, ckpt / "trainer_state.pt")
    rewrite_manifest(ckpt, "trainer_state.pt")
    command = ["train", str(CONFIG), *TINY, "train.steps=2", f"train.output_dir={run}"]
    capsys.readouterr()
    assert main(command) == 2
    line = one_line(capsys.readouterr().err)
    assert str(ckpt / "trainer_state.pt") in line and "_reconstruct" in line, line
    assert main([*command, "--trust-checkpoint"]) == 0
    err = capsys.readouterr().err
    assert f"mmrl: warning: {checkpoint.TRUST_NOTE}" in err.splitlines()
    assert "resuming from step 1 of 2" in err
    assert not checkpoint.TRUST_CHECKPOINT
    # The checkpoint it wrote is plain.
    assert torch.load(find_latest(run) / "trainer_state.pt", weights_only=True)["step"] == 2


def test_trust_checkpoint_reaches_every_rank(monkeypatch, tmp_path):
    import subprocess

    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: launched.append(cmd) or 0)
    assert main(["train", str(CONFIG), *TINY, f"train.output_dir={tmp_path}", "--nproc", "2",
                 "--trust-checkpoint"]) == 0
    assert launched[0][-1] == "--trust-checkpoint" and "mmrl.cli" in launched[0]


# ----------------------------------------------------------------------------- every domain's state is plain

VL_TINY = ("model.tiny={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
           "num_key_value_heads: 1, head_dim: 16, mrope_section: [4, 2, 2], vision_depth: 1, vision_width: 16, "
           "vision_heads: 1}")
STAGES = "algo.stages=[{name: prompt_replay, share: 0.5, capacity: 8}, {name: sft_mix, coef: 0.1, batch_size: 2}]"
DOMAINS = {  # the shipped configs, shrunk as their own tests shrink them
    "arithmetic": ("arithmetic_grpo.yaml", [*TINY, "sft.steps=2"]),
    "digit_sort": ("digit_sort_grpo.yaml", ["train.eval_size=2", "sampling.group_size=2", "sft.steps=0"]),
    "vqa": ("vqa_grpo.yaml", [VL_TINY, "task.params.n_train=8", "task.params.n_test=2", "task.params.n_ood=2",
                              "task.params.eval_k=1", "train.eval_size=2", "sampling.max_new_tokens=4",
                              "sampling.group_size=2", "sft.steps=0"]),
    "caption": ("caption_grpo.yaml", [VL_TINY, "task.params.n_test=2", "task.params.eval_k=1", "sampling.group_size=2",
                                      "sampling.max_new_tokens=4", "train.eval_size=2", "sft.steps=0"]),
    "video": ("video_flowgrpo.yaml", ["task.params.num_frames=4", "task.params.image_size=8", "task.params.n_sft=8",
                                      "model.params.num_steps=4", "model.params.tiny.patch_size=[1, 2, 2]",
                                      "model.params.tiny.ffn_dim=32", "sampling.group_size=2", "train.eval_size=2",
                                      "sft.steps=0"]),
    "planning": ("vprl_frozenlake_grpo.yaml", [
        "task.params.sizes=[3]", "task.params.n_train=16", "task.params.n_test=2", "model.params.vq_steps=5",
        "model.params.vq_layouts=4", "train.eval_size=2", "sampling.group_size=2", "sampling.max_new_tokens=8",
        "sft.steps=0", "model.tiny={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
        "num_attention_heads: 2, num_key_value_heads: 1}"]),
    "planning_text": ("vprl_frozenlake_text_grpo.yaml", [VL_TINY, "task.params.sizes=[3]", "task.params.n_train=16",
                                                         "task.params.n_test=2", "train.eval_size=2",
                                                         "sampling.group_size=2", "sampling.max_new_tokens=8",
                                                         "sft.steps=0"]),
}


def same(a, b) -> bool:
    """Equal values of the same types, through containers, numpy arrays and dataclasses."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_domains_trainer_state_loads_weights_only(domain, tmp_path):
    """Through the real trainer: an evaluation in eval_history, contexts in a prompt replay buffer,
    the SFT-mix stream, the reward's and task's state, (arithmetic) an SFT warm start stopped in the
    middle; saved, read back with weights_only=True and the replay buffer's contexts rebuilt."""
    name, overrides = DOMAINS[domain]
    cfg = load_config(REPO / "configs" / name, [*overrides, STAGES, "train.progress=false", "train.threads=0",
                                                f"train.output_dir={tmp_path}"])
    task, policy = mmrl.build(cfg)
    trainer = Trainer(cfg, policy, task)
    trainer.eval_history.append(trainer.evaluate())
    replay = trainer.stages.find(PromptReplay)
    replay.push(task.next_batch(2))
    if cfg.sft.steps:
        trainer.stop.signal_name = "SIGTERM"
        with pytest.raises(TrainingInterrupted) as stop:
            trainer.sft()
        ckpt = Path(stop.value.checkpoint)
    else:
        ckpt = trainer.save()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["eval_history"][0]["step"] == 0
    assert (state["sft_progress"] is not None) == bool(cfg.sft.steps)
    contexts = list(replay.buffer)
    replay.load_state_dict(state["stages"]["prompt_replay"])
    assert same(contexts, list(replay.buffer))


def test_only_registered_dataclasses_are_rebuilt():
    from mmrl.envs.video.clips import ClipSpec

    spec = ClipSpec("red", "square", "left", "quickly")
    assert from_plain(to_plain({"spec": spec, "n": np.int64(3)})) == {"spec": spec, "n": 3}
    with pytest.raises(CheckpointError, match="holds a os.system, not a class it may hold"):
        from_plain({"__dataclass__": "os.system", "fields": {}})
    with pytest.raises(TypeError, match="a checkpoint cannot keep a builtins.set"):
        to_plain({"a": {1, 2}})
