"""Training with several processes (torchrun, 2 gloo ranks on the CPU) is training with one.

The ranks run tests/dist_worker.py; each scenario is one torchrun launch shared by its tests.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).parent / "dist_worker.py"


def torchrun(*args: str, timeout: float = 600) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(WORKER), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "equivalence.json"
    torchrun("equivalence", str(out))
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_resume")
    torchrun("resume", str(root), str(root / "resume.json"))
    return root, json.loads((root / "resume.json").read_text())


def test_two_ranks_give_the_weights_of_one_rank_on_the_whole_batch(equivalence):
    """3 steps on 2 ranks (micro-batches of 3 rows, groups of 4) against one process updating on
    both ranks' batches concatenated: every aggregation mode, replicate and FSDP2, dynamic
    sampling (ranks keep different numbers of groups, one none), FSDP with a reference model, and
    micro-batches packed by a token budget (a different number per rank)."""
    assert len(equivalence) == 13
    for v in equivalence:
        assert v["moved"] > 1e-3, v  # training changed the weights, so equality means something
        # Both modes sum the same float32 numbers in another order than one process, and Adam
        # magnifies the rounding in near-zero gradient components. How much depends on the CPU's
        # kernels: 2.7e-6-1.3e-5 (0.04-0.2% of the step) on one 2-core machine, under 1e-6 in
        # replicate mode on another. A bug (a rank's rows dropped or counted twice) moves weights
        # by a sizeable part of the step.
        assert v["max_diff"] < 0.01 * v["moved"], v


def test_ranks_draw_disjoint_slices_of_one_data_stream(equivalence):
    for v in (x for x in equivalence if not x.get("dynamic")):
        rank0, rank1 = v["prompts"]
        assert len(rank0) == len(rank1) == 3 and not set(rank0) & set(rank1)
        assert rank0 + rank1 == v["one_process_prompts"]


def test_dynamic_sampling_splits_unevenly_and_counts_kept_groups_over_ranks(equivalence):
    for v in (x for x in equivalence if x.get("dynamic")):
        rows = v["rows"]
        assert any(r[0] != r[1] for r in rows), rows  # the ranks kept different numbers of groups
        assert any(0 in r and sum(r) > 0 for r in rows), rows  # a rank with nothing while the other updates
        assert v["kept_groups"] == [sum(r) / 4 for r in rows]  # the logged counter is the sum over ranks


def test_resume_at_two_ranks_equals_the_uninterrupted_run(resumed):
    _, out = resumed
    for mode in ("replicate", "fsdp"):
        assert out[mode]["step"] == 3
        assert out[mode]["group_offset"] == 18  # 3 steps x 2 ranks x 3 prompts: one global data cursor
        assert out[mode]["max_diff"] == 0.0, out


def test_a_two_rank_checkpoint_loads_into_one_process(resumed):
    """The FSDP run's sharded checkpoint (step 3) loads into a single process: the same weights as
    the run's consolidated export, the optimizer's state, the cursor; and training goes on."""
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import build, make_cfg

    from mmrl.checkpoint import find_latest
    from mmrl.distributed import SINGLE

    root, _ = resumed
    run = root / "fsdp_split"
    assert sorted(p.name for p in find_latest(run).iterdir()) == ["dcp", "meta.json", "rank_0.pt", "rank_1.pt"]
    trainer = build(make_cfg(str(run), steps=4), SINGLE)
    assert trainer.resume() is not None
    assert trainer.step == 3 and trainer.collector.group_offset == 18
    exported = load_file(str(run / "final" / "model.safetensors"))
    loaded = trainer.policy.model.state_dict()
    for k, v in exported.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    adam = trainer.optimizer.state_dict()["state"]
    assert adam and all(float(s["step"]) == 3 for s in adam.values())
    before = {k: v.clone() for k, v in loaded.items()}
    trainer.train(resume=True)
    assert trainer.step == 4
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.model.state_dict().items())


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_killed_or_hung_rank_ends_the_run_with_one_clear_error(tmp_path, how):
    """`mmrl train --nproc 2`; rank 1 is killed (SIGKILL) or hangs (SIGSTOP) mid-run: a death ends
    every rank at once; a hang makes rank 0's next collective time out after train.dist_timeout_s
    (20 s here), and torchrun then ends the hung rank. Either way the launcher says so in one line
    and the last checkpoint stays whole."""
    from mmrl.checkpoint import find_latest, verify_checkpoint

    config = tmp_path / "tiny.yaml"
    config.write_text(
        "model: {tiny: {hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 1},"
        " tokenizer_vocab_size: 280}\n"
        "task: {name: arithmetic, params: {max_operand: 20}}\n"
        "rewards: [{name: arithmetic_digits}]\n"
        "sampling: {group_size: 4, max_new_tokens: 4}\n"
        f"train: {{steps: 100000, prompts_per_step: 2, eval_every: 0, eval_size: 8, save_every: 1, device: cpu,"
        f" progress: false, dist_timeout_s: 20, output_dir: {tmp_path / 'run'}}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "mmrl.cli", "train", str(config), "--nproc", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 240
        while find_latest(tmp_path / "run") is None or len(list((tmp_path / "run" / "checkpoints").glob("step_*"))) < 2:
            assert proc.poll() is None and time.time() < deadline, "the 2-rank run did not start"
            time.sleep(0.5)
        rank1 = _rank_pid(proc.pid, local_rank=1)
        os.kill(rank1, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        signalled_at = time.time()
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.time() - signalled_at < (30 if how == "killed" else 150)
    assert proc.returncode != 0
    if how == "hung":
        # gloo's timeout, in the words of the collective rank 0 waits in: a barrier ("Timed out waiting
        # 20000ms"), or an all-reduce whose peer stopped mid-transfer ("Application timeout caused pair closure").
        assert "Timed out waiting 20000ms" in err or "Application timeout caused pair closure" in err, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("mmrl: error: training with 2 processes failed"), err[-2000:]
    assert "Last complete checkpoint:" in last and "step_" in last
    verify_checkpoint(find_latest(tmp_path / "run"))


def _rank_pid(root_pid: int, local_rank: int) -> int:
    """The pid of the torchrun worker with LOCAL_RANK=`local_rank` among `root_pid`'s descendants."""
    children = {}
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(status.parent.name))
    todo, found = [root_pid], []
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"LOCAL_RANK={local_rank}".encode() in env:
                found.append(child)
    assert found, "no torchrun worker found"
    return min(found)


def test_one_process_with_fsdp_on_trains_unsharded(tmp_path):
    """`train.fsdp: true` without torchrun: one process, nothing to shard; it trains as without it."""
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import build, make_cfg

    from mmrl import distributed

    plain, sharded = (build(make_cfg(str(tmp_path / f"run{i}"), fsdp=fsdp, steps=2), distributed.current(fsdp))
                      for i, fsdp in enumerate((False, True)))
    assert not sharded.dist.fsdp and not sharded.dist.active
    for trainer in (plain, sharded):
        trainer.train(resume=False)
    for k, v in plain.policy.model.state_dict().items():
        assert torch.equal(v, sharded.policy.model.state_dict()[k])
