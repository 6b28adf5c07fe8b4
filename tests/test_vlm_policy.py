"""`model.policy: vlm`, any Hugging Face vision-language model (mmrl.policies.vlm), on tiny random
models of every family the installed transformers has (mmrl.tiny_vlm): sampled log-probs equal the
teacher-forced ones (also on a micro-batch with other padding), PAPO's masked pass, a GRPO step
after SFT from a config, `mmrl eval --benchmark` on a saved folder, and the bad inputs, one line each.
A Qwen-VL goes to the Qwen-VL adapter's fast paths (tests/test_qwen_vl_policy.py checks those)."""

import json

import numpy as np
import pytest
import torch

import mmrl
from mmrl.cli import main
from mmrl.config import ConfigError, load_config
from mmrl.policies.qwen_vl import QwenVLPolicy
from mmrl.policies.vlm import VLMPolicy, vlm_policy_class
from mmrl.tiny_vlm import VLM_FAMILIES, build_tiny_vlm, family_unavailable

torch.set_num_threads(1)

CORPUS = ["how many red squares are there ? <think> count them </think> <answer> 3 </answer>",
          "is the circle left of the square ? yes no left right above below one two three four"] * 20


def _family(name: str) -> str:
    why = family_unavailable(name)
    if why:
        pytest.skip(why)
    return name


FAMILIES = [pytest.param(f, id=f) for f in VLM_FAMILIES]
_built: dict[str, tuple] = {}


def _policy(family: str, **kwargs) -> VLMPolicy:
    if family not in _built:
        _built[family] = build_tiny_vlm(_family(family), CORPUS, seed=0)
    model, processor = _built[family]
    return vlm_policy_class(model)(model, processor, max_new_tokens=6, **kwargs)


def _contexts():
    rng = np.random.default_rng(0)
    return [{"frame": rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), "prompt": "how many red squares ?"},
            {"frame": rng.integers(0, 256, (40, 64, 3), dtype=np.uint8),
             "prompt": "is the circle left of the square ? answer yes or no"}]


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_logprobs_equal_teacher_forcing(family):
    policy = _policy(family)
    assert isinstance(policy, QwenVLPolicy) == family.startswith(("qwen2_5_vl", "qwen3_vl"))
    rollout = policy.sample(_contexts(), 2, generator=torch.Generator().manual_seed(0))
    assert rollout.mask.any(1).all()
    logp, _ = policy.logprobs(rollout)
    err = (logp - rollout.logp_old).abs()[rollout.mask].max().item()
    assert err < 1e-4, f"{family}: sampled vs teacher-forced log-probs differ by {err:.2e}"
    # A micro-batch of rows from both contexts, its prompts re-padded: the same scores.
    part = policy.trim_padding(rollout.select(torch.tensor([1, 2])))
    sub, _ = policy.logprobs(part)
    assert (sub - logp[1:3][:, :sub.shape[1]]).abs()[part.mask].max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_images_score_the_same_units_differently(family):
    policy = _policy(family)
    rollout = policy.sample(_contexts(), 2, generator=torch.Generator().manual_seed(1))
    masked = policy.mask_images(rollout, 0.6, torch.Generator().manual_seed(0))
    assert torch.equal(masked.units, rollout.units)
    base, _ = policy.logprobs(rollout)
    logp, _ = policy.logprobs(masked)
    assert logp.shape == base.shape and torch.isfinite(logp[rollout.mask]).all()
    assert (logp - base).abs()[rollout.mask].max().item() > 1e-6  # the image reaches the scores
    assert torch.equal(policy.logprobs(policy.mask_images(rollout, 0.0))[0], base)  # nothing masked: nothing moves


def _cfg(tmp_path, family, *overrides):
    return load_config("configs/vqa_any_vlm.yaml", [
        f"model.params.arch={family}", "task.params.n_train=32", "task.params.n_test=4", "task.params.n_ood=0",
        "task.params.eval_k=0", "sampling.group_size=2", "sampling.max_new_tokens=8", "train.prompts_per_step=2",
        "train.eval_size=2", "train.progress=false", "train.threads=0", f"train.output_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_grpo_step_with_papo_after_sft_from_the_config(tmp_path, family):
    _family(family)
    cfg = _cfg(tmp_path, family, "sft.steps=2", "sft.batch_size=2", "train.steps=1", "train.eval_every=0",
               "algo.papo_gamma=0.01", "algo.mask_prob=0.6")
    results = mmrl.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if "train/loss" in r]
    assert len(step) == 1 and np.isfinite(step[0]["train/loss"]) and "train/perception_kl" in step[0]
    assert any("sft/loss" in r for r in rows) and (tmp_path / "final" / "config.json").is_file()
    assert "final" in results or results  # the run's results were written


@pytest.mark.parametrize("family", FAMILIES)
def test_benchmark_eval_of_a_saved_folder(tmp_path, capsys, family):
    policy = _policy(family)
    policy.save(tmp_path / "model")
    out = tmp_path / "eval"
    assert main(["eval", "--benchmark", "synthetic", "--model", str(tmp_path / "model"), "--limit", "4",
                 "--max-new-tokens", "6", "--dtype", "float32", "--device", "cpu", "--output", str(out)]) == 0
    rec = json.loads((out / "synthetic.json").read_text())
    assert rec["n"] == 4 and 0.0 <= rec["scores"]["rule"]["accuracy"] <= 1.0
    assert "synthetic: " in capsys.readouterr().out


def test_bad_inputs_are_one_line(tmp_path, capsys):
    from mmrl.tiny import build_tiny_qwen2, build_tokenizer

    # A text-only model: not a VLM transformers can load as one.
    tok = build_tokenizer(CORPUS, vocab_size=300)
    build_tiny_qwen2(tok).save_pretrained(tmp_path / "text")
    tok.save_pretrained(tmp_path / "text")
    with pytest.raises(ValueError, match=r"model type 'qwen2' is not a vision-language model .* causal_lm"):
        VLMPolicy.from_pretrained(tmp_path / "text")
    # A processor without a chat template.
    policy = _policy("gemma3" if not family_unavailable("gemma3") else "smolvlm")
    processor = policy.processor
    template, processor.chat_template = processor.chat_template, None
    try:
        with pytest.raises(ValueError, match="has no chat template; accepted: a processor"):
            VLMPolicy(policy.model, processor)
    finally:
        processor.chat_template = template
    # model.policy qwen_vl on another family.
    with pytest.raises(ValueError, match=r"qwen_vl takes a Qwen-VL .* model.policy: vlm takes any"):
        QwenVLPolicy(policy.model, processor)
    # model.path beside model.source: tiny is refused, not ignored.
    with pytest.raises(ConfigError, match=r"model.path: '/nonexistent' is given but model.source is 'tiny'"):
        load_config("configs/vqa_any_vlm.yaml", ["model.path=/nonexistent"])
    # An unknown tiny family.
    with pytest.raises(ConfigError, match="model.params.arch"):
        load_config("configs/vqa_any_vlm.yaml", ["model.params.arch=llava9"])
    capsys.readouterr()
    assert main(["train", "configs/vqa_any_vlm.yaml", "model.path=/nonexistent"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.source is 'tiny'" in err[0]
