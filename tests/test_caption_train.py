"""End to end: the CapRL config trains 2 SFT + 2 GRPO steps through the Trainer with the tiny
Qwen2.5-VL captioner, `mmrl eval` reports the Prism-style metrics, the caption report writes its
JSON / Markdown / gallery, and the benchmark scripts run in their smoke modes."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from mmrl.evals.caption_eval import evaluate_captioner, write_caption_report

from mmrl import build
from mmrl.cli import main as cli_main
from mmrl.config import load_config
from mmrl.trainer import Trainer

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TINY = ("model.tiny={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
        "num_key_value_heads: 1, head_dim: 16, mrope_section: [4, 2, 2], vision_depth: 1, vision_width: 16, "
        "vision_heads: 1}")
SMALL = [TINY,
         "task.params.n_test=6", "task.params.eval_k=2", "sampling.group_size=2", "sampling.max_new_tokens=6",
         "sft.steps=2", "sft.batch_size=4", "train.steps=2", "train.prompts_per_step=2", "train.eval_every=1",
         "train.eval_size=3", "train.progress=false"]


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_two_step_training_smoke(tmp_path, loss):
    cfg = load_config(ROOT / f"configs/caption_{loss}.yaml", [*SMALL, f"train.output_dir={tmp_path}"])
    assert cfg.algo.loss == loss
    task, policy = build(cfg)
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    results = Trainer(cfg, policy, task).train(resume=False)
    assert [e["step"] for e in results["eval_history"]] == [0, 1, 2]
    after = results["eval_after"]
    for key in ("eval/caption_qa", "eval/caption_acc_mean", "eval/caption_acc_best_of_2", "eval/caption_acc_no_caption",
                "eval/caption_acc_shuffled_images", "eval/caption_len_mean", "eval/caption_acc_reference"):
        assert key in after, key
    assert after["eval/caption_acc_no_caption"] == 0.0  # the lexical judge never guesses without a caption
    assert after["eval/caption_acc_reference"] == 1.0  # the templated caption answers everything
    assert 0 <= after["eval/caption_acc_mean"] <= after["eval/caption_acc_best_of_2"] <= 1
    assert any(not torch.equal(before[k], v) for k, v in policy.model.named_parameters())
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/caption_qa" in r for r in rows) and any("sft/loss" in r for r in rows)


def test_eval_command_and_report(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = [*SMALL, "train.steps=1", f"train.output_dir={run}"]
    cfg = load_config(ROOT / "configs/caption_grpo.yaml", overrides)
    task, policy = build(cfg)
    Trainer(cfg, policy, task).train(resume=False)
    assert cli_main(["eval", "configs/caption_grpo.yaml", *overrides, "--checkpoint", str(run)]) == 0
    result = json.loads((run / "eval.json").read_text())
    assert "eval/caption_acc_mean" in result and "eval/caption_acc_no_caption" in result
    contexts = task.eval_batch(3)
    metrics, raw = evaluate_captioner(policy, contexts, "lexical", k=2)
    report = write_caption_report(tmp_path / "eval", contexts, {"before": (metrics, raw), "after": (metrics, raw)}, 2)
    assert "| best of 2 |" in report["table"]
    page = (tmp_path / "eval" / "gallery.html").read_text()
    assert page.count("<img src='data:image/png;base64,") == 3 and "reference:" in page
    assert json.loads((tmp_path / "eval" / "caption_eval.json").read_text())["after"]["metrics"] == metrics


def _bench(name: str):
    """A bench script as a module, so its smoke mode runs in this process (no second torch import)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_judge_bench_smoke(capsys):
    assert _bench("judge").main(["--smoke"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["match"] is True and result["questions"] == 64
    assert result["ratio"] == pytest.approx(result["one_per_question_s"] / result["batched_s"], rel=1e-6)


def test_gpu_caption_bench_smoke(tmp_path, capsys):
    assert _bench("gpu_caption").main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["captions_per_s"] > 0 and result["judged_questions_per_s"] > 0 and result["step_s"] > 0
    assert result["captioner_params"] > 0 and result["judge_params"] > 0


def test_caption_resume_is_exact_and_evaluation_never_changes_training(tmp_path):
    """The caption reward's question draws are trainer state: a run stopped at step 2 and resumed by
    a new Trainer ends with the weights of one that never stopped, and evaluating every step (which
    judges captions too) leaves training exactly as it is without evaluations."""
    def trainer(out, eval_every, save_every=0):
        cfg = load_config(ROOT / "configs/caption_grpo.yaml", [*SMALL, "train.steps=4", f"train.eval_every={eval_every}",
                                                               f"train.save_every={save_every}", f"train.output_dir={out}"])
        task, policy = build(cfg)
        return Trainer(cfg, policy, task)

    def weights(t):
        return {k: v.detach().clone() for k, v in t.policy.model.state_dict().items()}

    quiet = trainer(tmp_path / "quiet", eval_every=0)
    quiet.train(resume=False)
    evaluated = trainer(tmp_path / "evaluated", eval_every=1)
    evaluated.train(resume=False)
    stopped = trainer(tmp_path / "stopped", eval_every=0, save_every=2)
    stopped.cfg.train.steps = 2  # stop after step 2's checkpoint, as if killed there
    stopped.train(resume=False)
    resumed = trainer(tmp_path / "stopped", eval_every=0, save_every=2)
    resumed.train()
    assert resumed.collector.rewards[0][2].state_dict() == quiet.collector.rewards[0][2].state_dict() == {"draws": 4}
    a, b, c = weights(quiet), weights(evaluated), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), "evaluation changed training"
    assert all(torch.equal(a[k], c[k]) for k in a), "resume is not exact"
