"""The ranks of tests/test_distributed.py, started by torchrun:

    torchrun --nproc_per_node 2 tests/dist_worker.py equivalence OUT_JSON
    torchrun --nproc_per_node 2 tests/dist_worker.py resume RUN_ROOT OUT_JSON

`equivalence`: for each variant (aggregation mode, replicate or FSDP2, micro-batches by rows or by
tokens, dynamic sampling), 3 training steps on 2 gloo ranks; rank 0 then replays the batches both
ranks trained on, concatenated, through one single-process trainer from the same initial weights,
and writes the largest weight difference. `resume`: a 2-rank run of 3 steps, and one of 2 steps resumed to 3.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from mmrl import distributed  # noqa: E402
from mmrl.algos import AGG_MODES  # noqa: E402
from mmrl.config import config_from_dict  # noqa: E402
from mmrl.envs import make_task  # noqa: E402
from mmrl.policies import build_policy  # noqa: E402
from mmrl.rewards import REWARDS, register_reward  # noqa: E402
from mmrl.rollout import Rollout  # noqa: E402
from mmrl.trainer import Trainer  # noqa: E402

UNUSED_DIR = str(Path(tempfile.gettempdir()) / "mmrl_dist_unused")  # these trainers never write a run

if "test_digit_share_odd_answers" not in REWARDS:

    @register_reward("test_digit_share_odd_answers")
    def _digit_share_odd(contexts, outputs, **_):
        """The completion's share of digits for prompts with an odd answer, 0 for the others: the
        groups of even answers are constant, so dynamic sampling drops a varying number per rank."""
        return torch.tensor([sum(ch.isdigit() for ch in o) / max(len(o), 1) if int(c["answer"]) % 2 else 0.0
                             for c, o in zip(contexts, outputs)])


def make_cfg(out_dir: str, agg: str = "token-mean", fsdp: bool = False, micro: int = 0, dynamic: bool = False,
             steps: int = 3, beta: float = 0.0, tokens: int = 0):
    return config_from_dict({
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                           "num_key_value_heads": 1}, "tokenizer_vocab_size": 280},
        "task": {"name": "arithmetic", "params": {"max_operand": 20}},
        "rewards": [{"name": "test_digit_share_odd_answers"}],
        "sampling": {"group_size": 4, "max_new_tokens": 4},
        "algo": {"loss": "grpo", "loss_params": {"agg": agg}, "dynamic_sampling": dynamic, "max_sampling_tries": 1,
                 "beta": beta},
        "train": {"steps": steps, "prompts_per_step": 3, "lr": 3e-3, "min_lr_ratio": 1.0, "eval_every": 0,
                  "eval_size": 8, "progress": False, "output_dir": out_dir, "seed": 1, "fsdp": fsdp,
                  "micro_batch_size": micro, "max_tokens_per_micro": tokens, "device": "cpu",
                  "dist_timeout_s": 60},
    })


def build(cfg, d):
    torch.manual_seed(cfg.train.seed)
    task = make_task(cfg.task.name, seed=cfg.train.seed, **cfg.task.params)
    return Trainer(cfg, build_policy(cfg, task, torch.device("cpu")), task, dist=d)


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """The whole weights on every rank (FSDP: gathered from the shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if trainer.dist.fsdp:
        state = get_model_state_dict(trainer.policy.model, options=StateDictOptions(full_state_dict=True))
    else:
        state = trainer.policy.model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def equivalence(out_json: str) -> None:
    variants = [dict(agg=agg, fsdp=fsdp, micro=3) for fsdp in (False, True) for agg in AGG_MODES]
    variants += [dict(agg="token-mean", fsdp=fsdp, micro=3, dynamic=True) for fsdp in (False, True)]
    variants += [dict(agg="seq-mean-token-mean", fsdp=True, micro=0, beta=0.1)]
    # Micro-batches packed by length: the ranks pack different numbers (FSDP evens them out).
    variants += [dict(agg="seq-mean-token-sum", fsdp=fsdp, tokens=24, dynamic=True) for fsdp in (False, True)]
    results = []
    for v in variants:
        cfg = make_cfg(UNUSED_DIR, **v)
        d = distributed.current(cfg.train.fsdp)
        trainer = build(cfg, d)
        batches: list[Rollout] = []
        collect = trainer.collect

        def recording_collect():
            rollout, stats = collect()
            batches.append(rollout)
            return rollout, stats

        trainer.collect = recording_collect
        kept = []
        for _ in range(cfg.train.steps):
            stats = distributed.reduce_metrics(d, trainer.train_step())
            kept.append(stats.get("sampling/kept_groups"))
        weights = full_weights(trainer)
        every: list[list[Rollout]] = [[] for _ in range(d.world)]
        dist.all_gather_object(every, batches)
        if d.is_main:
            single = build(make_cfg(UNUSED_DIR, **{**v, "fsdp": False}), distributed.SINGLE)
            rows = []
            for step in range(cfg.train.steps):
                parts = [every[r][step] for r in range(d.world) if len(every[r][step])]
                rows.append([len(every[r][step]) for r in range(d.world)])
                if parts:
                    single.update(Rollout.concat(parts))
            ref = {k: v.detach() for k, v in single.policy.model.state_dict().items()}
            diff = max((weights[k] - ref[k]).abs().max().item() for k in ref)
            moved = max((ref[k] - w).abs().max().item() for k, w in full_weights(build(
                make_cfg(UNUSED_DIR, **{**v, "fsdp": False}), distributed.SINGLE)).items())
            # the ranks' first-step prompts: disjoint, and together one process's draw of their total
            prompts = [[c["prompt"] for c in every[r][0].contexts[:: cfg.sampling.group_size]] for r in range(d.world)]
            one = make_task(cfg.task.name, seed=cfg.train.seed, **cfg.task.params).next_batch(sum(map(len, prompts)))
            results.append({**v, "max_diff": diff, "moved": moved, "rows": rows, "kept_groups": kept,
                            "prompts": prompts, "one_process_prompts": [c["prompt"] for c in one]})
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out_json).write_text(json.dumps(results, indent=1))


def resume(root: str, out_json: str) -> None:
    out = {}
    for fsdp in (False, True):
        name = "fsdp" if fsdp else "replicate"
        d = distributed.current(fsdp)
        straight = build(make_cfg(f"{root}/{name}_straight", fsdp=fsdp, steps=3), d)
        straight.train(resume=False)
        build(make_cfg(f"{root}/{name}_split", fsdp=fsdp, steps=2), d).train(resume=False)
        resumed = build(make_cfg(f"{root}/{name}_split", fsdp=fsdp, steps=3), d)
        resumed.train(resume=True)
        a, b = full_weights(straight), full_weights(resumed)
        out[name] = {"max_diff": max((a[k] - b[k]).abs().max().item() for k in a),
                     "step": resumed.step, "group_offset": resumed.collector.group_offset,
                     "weights_sum": float(sum(v.double().sum() for v in b.values()))}
    if dist.get_rank() == 0:
        Path(out_json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    distributed.setup("cpu", 60)
    if sys.argv[1] == "equivalence":
        equivalence(sys.argv[2])
    else:
        resume(sys.argv[2], sys.argv[3])
    # Every rank done, then out without gloo's teardown: rank 1 destroying its group aborted
    # ("terminate called without an active exception") in a fresh-clone CI run.
    distributed.exit_rank(0)
