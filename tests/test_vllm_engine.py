"""The vLLM rollout engine (`rollout.engine: vllm`).

Everywhere: the pieces that do not need vLLM (sampling settings, packing the engine's outputs into
the sampler's tensors, the merged weights pushed to the engine, the weight version, how weights are
pushed, sleep mode, config checks, the policies' engine prompts and the rollout an engine's sample
becomes). Where vllm imports (its CPU build: `bash scripts/setup_vllm_cpu.sh`, then
`.venv-vllm/bin/python -m pytest -q tests/test_vllm_engine.py`; or a GPU build on a GPU), the engine
itself: its log-probs against the trainer's before and after updates, for a causal LM and a
Qwen2.5-VL with images, and a short GRPO run with TIS (skipped elsewhere, with the reason)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError, config_from_dict
from mmrl.policies.causal_lm import CausalLMPolicy
from mmrl.policies.qwen_vl import QwenVLPolicy
from mmrl.policies.vllm_engine import (
    SUPPRESS_BIAS,
    EngineSettings,
    VLLMEngine,
    engine_weights,
    pack_completions,
    sampling_kwargs,
    sleep_mode,
    starting_weights,
    weights_version,
)
from mmrl.rollout import SampleOutput
from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen2, build_tiny_qwen_vl, build_tokenizer

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]

EOS, PAD = 7, 0
# transformers' Qwen-VL processors load a video processor, which needs torchvision.
VISION_SKIP = "Qwen-VL processors need torchvision (the vLLM CPU lane: bash scripts/setup_vllm_cpu.sh --vision)"
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}


def completion(index, tokens, logps):
    return SimpleNamespace(index=index, token_ids=tokens,
                           logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logps)])


def request(*completions):
    return SimpleNamespace(outputs=list(completions))


def test_pack_completions_pads_masks_and_flags_truncation():
    # Two prompts x G=2; completions come back out of order and of different lengths.
    outputs = [request(completion(1, [3, 4, EOS], [-0.1, -0.2, -0.3]), completion(0, [5, EOS], [-1.0, -2.0])),
               request(completion(0, [2, 2, 2, 2], [-0.5] * 4), completion(1, [EOS], [-0.7]))]
    out = pack_completions(outputs, 2, eos_token_ids=[EOS, 9], pad_token_id=PAD)
    assert out.tokens.tolist() == [[5, EOS, PAD, PAD], [3, 4, EOS, PAD], [2, 2, 2, 2], [EOS, PAD, PAD, PAD]]
    assert out.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert out.truncated.tolist() == [False, False, True, False]
    expected = torch.tensor([[-1.0, -2.0, 0, 0], [-0.1, -0.2, -0.3, 0], [-0.5] * 4, [-0.7, 0, 0, 0]])
    assert torch.allclose(out.logp, expected)


def test_pack_completions_any_eos_id_ends_a_row():
    out = pack_completions([request(completion(0, [4, 9], [-1.0, -1.0]))], 1, eos_token_ids=[EOS, 9], pad_token_id=PAD)
    assert out.mask.tolist() == [[True, True]] and out.truncated.tolist() == [False]


def test_pack_completions_rejects_wrong_counts_and_missing_logprobs():
    with pytest.raises(RuntimeError, match="1 completions for prompt 0, expected 2"):
        pack_completions([request(completion(0, [EOS], [-1.0]))], 2, eos_token_ids=[EOS], pad_token_id=PAD)
    bare = SimpleNamespace(index=0, token_ids=[3, EOS], logprobs=None)
    with pytest.raises(RuntimeError, match="no log-prob"):
        pack_completions([request(bare)], 1, eos_token_ids=[EOS], pad_token_id=PAD)


def test_sampling_kwargs_mirror_the_hf_sampler():
    kw = sampling_kwargs(group_size=8, max_new_tokens=32, temperature=0.7, top_k=0, top_p=1.0,
                         eos_token_ids=[EOS, 9], suppress_token_ids=[11, 12], seed=5)
    assert kw["n"] == 8 and kw["max_tokens"] == 32 and kw["temperature"] == 0.7 and kw["seed"] == 5
    assert kw["stop_token_ids"] == [EOS, 9] and kw["logprobs"] == 0 and not kw["ignore_eos"]
    assert kw["logit_bias"] == {11: SUPPRESS_BIAS, 12: SUPPRESS_BIAS}
    greedy = sampling_kwargs(group_size=4, max_new_tokens=1, temperature=0.0, top_k=0, top_p=1.0,
                             eos_token_ids=[EOS], suppress_token_ids=[], seed=None)
    assert greedy["logit_bias"] is None and greedy["n"] == 1, "vLLM takes greedy requests one completion each"
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sampling_kwargs(group_size=1, max_new_tokens=1, temperature=-1.0, top_k=0, top_p=1.0, eos_token_ids=[EOS],
                        suppress_token_ids=[], seed=None)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["1 + 2 = 3", "go up down left right", "two images", "user assistant"], vocab_size=280)


def test_engine_weights_merge_lora_under_base_names(tokenizer):
    pytest.importorskip("peft", reason="LoRA needs peft (pip install 'mmrl[lora]')")
    from peft import LoraConfig, get_peft_model

    base = build_tiny_qwen2(tokenizer, seed=0, **TINY)
    names = list(base.state_dict())
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a non-zero adapter update (peft starts B at zero)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[3, 4, 5, 6]])
    before = model(input_ids=ids).logits
    pushed = dict(engine_weights(model))
    assert sorted(pushed) == sorted(names)
    after = model(input_ids=ids).logits
    assert torch.equal(before, after), "the push leaves the model's weights as they were"
    # The pushed weights are W + (alpha / r) B A: a plain model loaded with them computes what the
    # adapter model computes.
    plain = build_tiny_qwen2(tokenizer, seed=1, **TINY)
    plain.load_state_dict(pushed)
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"],
                           base.get_submodule("model.layers.0.self_attn.q_proj").base_layer.weight)
    assert torch.allclose(plain(input_ids=ids).logits, before, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_weights_version_moves_with_optimizer_steps_only(tokenizer, fused):
    model = build_tiny_qwen2(tokenizer, seed=0, **TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)  # fused: mmrl's AdamW (update.make_adamw)
    v0 = weights_version(model)
    loss = model(input_ids=torch.tensor([[3, 4, 5]])).logits.square().mean()
    loss.backward()
    assert weights_version(model) == v0, "a forward and backward change no weight"
    opt.step()
    assert weights_version(model) > v0, "the fused kernel bumps no version counter; the step still counts"


class RecordingEngine:
    """Stands in for VLLMEngine in the policy's routing test: records what the policy hands it and
    returns a fixed sample, so the test can check where each piece lands in the rollout."""

    def __init__(self, out: SampleOutput):
        self.out, self.calls = out, []

    def sample(self, model, prompts, group_size, **kwargs):
        self.calls.append((prompts, group_size, kwargs))
        return self.out


def test_causal_lm_samples_through_its_engine(tokenizer):
    policy = CausalLMPolicy(build_tiny_qwen2(tokenizer, seed=0, **TINY), tokenizer, max_new_tokens=3, temperature=0.7)
    contexts = [{"prompt": "1 + 2 ="}, {"prompt": "go up down left right"}]
    out = SampleOutput(tokens=torch.arange(12).view(4, 3), logp=-torch.rand(4, 3), mask=torch.ones(4, 3, dtype=torch.bool),
                       truncated=torch.tensor([True, False, False, True]))
    policy.engine = RecordingEngine(out)
    rollout = policy.sample(contexts, 2, generator=torch.Generator().manual_seed(0))
    (prompts, group_size, kwargs), = policy.engine.calls
    enc = policy.encode(contexts)
    assert group_size == 2 and kwargs["temperature"] == 0.7 and kwargs["max_new_tokens"] == 3
    for prompt, ids, keep in zip(prompts, enc["prompt_ids"], enc["prompt_mask"].bool()):
        assert prompt["prompt_token_ids"] == ids[keep].tolist(), "the engine gets the unpadded prompt ids"
    assert torch.equal(rollout.units, out.tokens) and torch.equal(rollout.truncated, out.truncated)
    assert torch.equal(rollout.logp_beh, out.logp), "the engine's log-probs are the behaviour policy's"
    assert torch.equal(rollout.extras["prompt_ids"], enc["prompt_ids"].repeat_interleave(2, 0))
    with torch.no_grad():  # the trainer can score the engine's tokens teacher-forced
        assert policy.logprobs(rollout)[0].shape == (4, 3)


def test_qwen_vl_engine_prompts_carry_images_and_their_size(tokenizer):
    pytest.importorskip("torchvision", reason=VISION_SKIP)
    processor = build_qwen_vl_processor(tokenizer, "qwen2_5_vl")
    policy = QwenVLPolicy(build_tiny_qwen_vl(tokenizer, "qwen2_5_vl", seed=0), processor, max_image_tokens=16,
                          min_image_tokens=4)
    img = np.zeros((56, 84, 3), dtype=np.uint8)
    prompts = policy.engine_prompts([{"frame": [img, img], "prompt": "two images"}, {"frame": None, "prompt": "go up"}])
    assert prompts[0]["prompt"].count("<|image_pad|>") == 2, "one placeholder per image; the engine expands it"
    assert len(prompts[0]["multi_modal_data"]["image"]) == 2
    assert prompts[0]["mm_processor_kwargs"] == policy.image_kwargs and policy.image_kwargs
    assert "multi_modal_data" not in prompts[1] and "go up" in prompts[1]["prompt"]


def engine_cfg(tmp_path, **rollout):
    return {"model": {"tiny": TINY, "tokenizer_vocab_size": 280}, "task": {"name": "arithmetic"},
            "rewards": [{"name": "exact_match"}], "train": {"output_dir": str(tmp_path), "recompute_old_logp": True},
            "rollout": rollout}


def test_engine_config_checks(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.engine: invalid value 'vllms'; valid: hf, vllm"):
        config_from_dict(engine_cfg(tmp_path, engine="vllms"))
    bad = engine_cfg(tmp_path, engine="vllm")
    bad["train"]["recompute_old_logp"] = False
    with pytest.raises(ConfigError, match="needs train.recompute_old_logp: true"):
        config_from_dict(bad)
    with pytest.raises(ConfigError, match=r"rollout.vllm_memory must be in \(0, 1\)"):
        config_from_dict(engine_cfg(tmp_path, engine="vllm", vllm_memory=1.5))
    with pytest.raises(ConfigError, match="rollout.vllm_kwargs: expected a mapping"):
        config_from_dict(engine_cfg(tmp_path, engine="vllm", vllm_kwargs=[1]))
    cfg = config_from_dict(engine_cfg(tmp_path, engine="vllm", vllm_kwargs={"enforce_eager": True}))
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm_kwargs == {"enforce_eager": True}


def test_engine_config_rejects_policies_it_cannot_sample(tmp_path):
    from mmrl.config import load_config

    with pytest.raises(ConfigError, match="vllm samples the text policies"):
        load_config("configs/vla_tabletop_grpo.yaml", overrides=["rollout.engine=vllm", "train.recompute_old_logp=true"])




# ---------------------------------------------------------------------------------- pushing weights

class RecordingLLM:
    """Stands in for `vllm.LLM` where weights are pushed: records the reload RPC, or runs
    `apply_model`'s function on a model whose `load_weights` does what the test says."""

    def __init__(self, load_weights=None):
        self.rpcs, self.loaded = [], []
        self.engine_model = SimpleNamespace(load_weights=load_weights or (lambda weights: self.loaded.extend(weights)))

    def collective_rpc(self, method, kwargs=None):
        self.rpcs.append((method, list(kwargs["weights_iterator"])))

    def apply_model(self, func):
        return [func(self.engine_model)]


def bare_engine(llm, *, reload: bool, version: str = "0.32.0") -> VLLMEngine:
    """A VLLMEngine around a stand-in LLM (its constructor needs vllm)."""
    engine = object.__new__(VLLMEngine)
    engine.llm, engine.reload, engine.vllm = llm, reload, SimpleNamespace(__version__=version)
    return engine


def test_weights_go_through_the_reload_api_where_vllm_has_it(tokenizer):
    model = build_tiny_qwen2(tokenizer, seed=0, **TINY)
    llm = RecordingLLM(load_weights=lambda weights: pytest.fail("the reload API is there: no load_weights"))
    engine = bare_engine(llm, reload=True)
    engine.load_weights(model)
    (method, pushed), = llm.rpcs
    assert method == "reload_weights" and [n for n, _ in pushed] == [n for n, _ in engine_weights(model)]
    assert engine.pushed_version == weights_version(model)


def test_without_the_reload_api_weights_load_in_place_or_fail_in_one_line(tokenizer):
    model = build_tiny_qwen2(tokenizer, seed=0, **TINY)
    llm = RecordingLLM()
    bare_engine(llm, reload=False, version="0.10.0").load_weights(model)  # an older vLLM on a GPU
    assert [n for n, _ in llm.loaded] == [n for n, _ in engine_weights(model)]

    def repacked(weights):  # what a backend that repacks its weights after loading (the CPU's) raises
        raise AttributeError("'Parameter' object has no attribute 'weight_loader'")

    with pytest.raises(RuntimeError) as err:
        bare_engine(RecordingLLM(repacked), reload=False, version="0.10.0").load_weights(model)
    message = str(err.value)
    assert message.startswith("vLLM 0.10.0 has no in-place reload API") and "weight_loader" in message
    assert "\n" not in message

    def broken(weights):  # any other AttributeError is a bug to see as it is
        raise AttributeError("'NoneType' object has no attribute 'shape'")

    with pytest.raises(AttributeError, match="shape"):
        bare_engine(RecordingLLM(broken), reload=False).load_weights(model)


def test_the_engine_starts_from_the_trainers_weights_or_their_checkpoint(tokenizer, tmp_path):
    from safetensors.torch import load_file

    model = build_tiny_qwen2(tokenizer, seed=0, **TINY)  # built in code, embeddings tied
    (tmp_path / "built").mkdir()
    starting_weights(model, str(tmp_path / "built"))
    written = load_file(tmp_path / "built" / "model.safetensors")
    pushed = dict(engine_weights(model))
    assert sorted(written) == sorted(set(pushed) - {"lm_head.weight"}), "a tied weight is written once"
    assert all(torch.equal(t, pushed[n]) for n, t in written.items())

    model.save_pretrained(tmp_path / "checkpoint")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    (tmp_path / "linked").mkdir()
    starting_weights(loaded, str(tmp_path / "linked"))
    (link,) = (tmp_path / "linked").iterdir()
    assert link.is_symlink() and link.resolve() == (tmp_path / "checkpoint" / "model.safetensors").resolve()


def test_sleep_mode_is_on_for_gpus_by_default_and_off_on_the_cpu(capsys):
    assert sleep_mode(None, cpu=False) and not sleep_mode(False, cpu=False) and sleep_mode(True, cpu=False)
    assert not sleep_mode(None, cpu=True) and capsys.readouterr().err == "", "the default says nothing on the CPU"
    assert not sleep_mode(True, cpu=True)
    assert "rollout.vllm_sleep: true is ignored on the CPU" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- the engine itself

# Sizes the CPU backend runs: its attention takes head_dim 64 (hidden 128 / 2 heads), not 16.
ENGINE_TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}
# Eager (no compilation or graph capture: a tiny model's engine builds in seconds), a 1 GiB KV cache.
ENGINE_KWARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}
LOGP_TOL = 1e-4  # float32 on both sides


def engine_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "the engine needs vllm: bash scripts/setup_vllm_cpu.sh (CPU) or pip install 'mmrl[vllm]' (GPU)"
    from mmrl.policies.vllm_engine import on_cpu

    if not on_cpu() and not torch.cuda.is_available():
        return "this vllm is a GPU build and no GPU is visible"
    return None


@pytest.fixture(scope="module")
def engine_device() -> torch.device:
    """Where the engine (and the trainer beside it) runs; skips the test where no engine can."""
    reason = engine_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from mmrl.policies.vllm_engine import on_cpu

    return torch.device("cpu" if on_cpu() else "cuda")


def logp_gap(policy, rollout) -> float:
    """The largest |trainer - engine| log-prob over the rollout's tokens."""
    with torch.no_grad():
        logp = policy.logprobs(rollout)[0]
    return torch.where(rollout.mask, logp - rollout.logp_beh, 0.0).abs().max().item()


def engine_gap(policy, contexts, group_size: int):
    """A rollout the engine samples, and its log-prob gap to the trainer."""
    rollout = policy.sample(contexts, group_size, generator=torch.Generator(policy.device).manual_seed(0))
    assert rollout.mask.sum() >= len(contexts) and rollout.logp_beh is not None
    return rollout, logp_gap(policy, rollout)


@pytest.fixture(scope="module")
def text_run(engine_device, tmp_path_factory):
    """A causal-LM policy with its engine, built from a config, with its task."""
    from mmrl.envs import make_task
    from mmrl.policies import build_policy

    cfg = config_from_dict({
        "model": {"tiny": ENGINE_TINY, "tokenizer_vocab_size": 280}, "task": {"name": "arithmetic"},
        # Completion length varies on random weights: rewards differ within groups, so updates move weights.
        "rewards": [{"name": "length", "params": {"target_chars": 0, "max_chars": 24}}],
        "sampling": {"group_size": 4, "max_new_tokens": 8},
        "rollout": {"engine": "vllm", "correction": "tis", "vllm_kwargs": ENGINE_KWARGS},
        "train": {"output_dir": str(tmp_path_factory.mktemp("text_run")), "device": engine_device.type, "bf16": False,
                  "recompute_old_logp": True, "steps": 2, "prompts_per_step": 4, "lr": 1e-2, "eval_every": 0,
                  "progress": False}})
    task = make_task(cfg.task.name, seed=0, **cfg.task.params)
    policy = build_policy(cfg, task, engine_device)
    yield cfg, task, policy
    policy.engine.close()


def test_engine_logprobs_equal_the_trainers_before_and_after_updates(text_run):
    from mmrl.trainer import Trainer

    cfg, task, policy = text_run
    contexts = task.eval_batch(8)
    first, gap = engine_gap(policy, contexts, 4)
    assert gap < LOGP_TOL
    trainer = Trainer(cfg, policy, task)
    for _ in range(2):
        trainer.train_step()
    assert logp_gap(policy, first) > 100 * LOGP_TOL, "the updates moved the trainer's log-probs"
    _, gap = engine_gap(policy, contexts, 4)
    assert gap < LOGP_TOL, "the engine samples from the pushed weights"


def vl_contexts() -> list[dict]:
    rng = np.random.default_rng(0)
    img = lambda h, w: rng.integers(0, 256, (h, w, 3), dtype=np.uint8)  # noqa: E731
    return [{"frame": img(56, 56), "prompt": "go up"},  # 4 image tokens
            {"frame": img(112, 84), "prompt": "the agent goes left then right and up"},  # 12
            {"frame": [img(56, 84), img(84, 56)], "prompt": "two images"},
            {"frame": None, "prompt": "go down"}]


@pytest.fixture(scope="module")
def vl_policy(engine_device):
    """A tiny Qwen2.5-VL policy with its engine."""
    pytest.importorskip("torchvision", reason=VISION_SKIP)
    tok = build_tokenizer(["go up down left right", "the agent goes left then right", "two images", "user assistant"],
                          vocab_size=300)
    processor = build_qwen_vl_processor(tok, "qwen2_5_vl")
    model = build_tiny_qwen_vl(tok, "qwen2_5_vl", seed=0, **ENGINE_TINY, head_dim=64, mrope_section=[16, 8, 8])
    policy = QwenVLPolicy(model.to(engine_device), processor, max_new_tokens=8, min_image_tokens=4, max_image_tokens=16)
    policy.engine = VLLMEngine(policy.model, processor, dtype="float32",
                               settings=EngineSettings(llm_kwargs=ENGINE_KWARGS))
    yield policy
    policy.engine.close()


def test_vl_engine_logprobs_equal_the_trainers_with_images_before_and_after_updates(vl_policy):
    contexts = vl_contexts()
    first, gap = engine_gap(vl_policy, contexts, 2)
    assert gap < LOGP_TOL
    opt = torch.optim.AdamW(vl_policy.model.parameters(), lr=1e-2)
    for _ in range(2):  # raise the likelihood of the first samples, vision tower included
        loss = -vl_policy.logprobs(first)[0][first.mask].mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert logp_gap(vl_policy, first) > 100 * LOGP_TOL, "the updates moved the trainer's log-probs"
    _, gap = engine_gap(vl_policy, contexts, 2)
    assert gap < LOGP_TOL, "the engine uses the pushed weights, and no image embedding of the old ones"


def test_grpo_with_the_engine_and_tis_trains_and_prints_its_headline(engine_device, tmp_path, capsys):
    from mmrl.cli import main

    out = tmp_path / "run"
    overrides = [f"train.output_dir={out}", f"train.device={engine_device.type}", "train.bf16=false",
                 "model.tiny={num_attention_heads: 2, num_key_value_heads: 1}",  # head_dim 64
                 "rollout.engine=vllm", "rollout.correction=tis", "train.recompute_old_logp=true",
                 "rollout.vllm_kwargs={enforce_eager: true, kv_cache_memory_bytes: 1073741824}",
                 "train.steps=2", "sft.steps=2", "train.eval_size=8", "train.progress=false",
                 "train.prompts_per_step=2", "sampling.group_size=4"]
    assert main(["train", str(ROOT / "configs" / "arithmetic_grpo.yaml"), *overrides]) == 0
    printed = capsys.readouterr().out
    assert "greedy exact match:" in printed and "(held-out, step 0 -> 2)" in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kl = [r["correction/mismatch_kl"] for r in rows if "correction/mismatch_kl" in r]
    assert kl and max(kl) < 1e-8, "TIS weighed the engine's log-probs, equal to the trainer's"
    assert all(r["correction/truncated_frac"] == 0 for r in rows if "correction/truncated_frac" in r)


def test_throughput_bench_smoke(engine_device, tmp_path):
    """bench/vllm_throughput.py runs both samplers on the same prompts and writes its JSON result."""
    if engine_device.type != "cpu":
        pytest.skip("bench/vllm_throughput.py measures vLLM's CPU build")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_throughput.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = result["rows"]
    assert row["hf_tokens"] == row["vllm_tokens"] == 2 * 2 * 8, "both sample the same full-length batch"
    assert row["ratio"] == pytest.approx(row["vllm_tokens_per_s"] / row["hf_tokens_per_s"], rel=1e-3)
    assert result["ratio"]["mean"] == row["ratio"] and result["logp_max_abs_diff"] < LOGP_TOL
