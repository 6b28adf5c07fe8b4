"""The vLLM rollout engine (`rollout.engine: vllm`).

On CPU: the pieces that do not need vLLM (sampling settings, packing the engine's outputs into the
sampler's tensors, the merged weights pushed to the engine, the weight version, config checks, the
policies' engine prompts and the rollout an engine's sample becomes). Where vllm imports and a CUDA
GPU is visible, the engine itself: its log-probs against the trainer's, weights pushed after an
update, and a short training run (skipped elsewhere; bench/gpu_session.sh runs it)."""

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError, config_from_dict
from mmrl.policies.causal_lm import CausalLMPolicy
from mmrl.policies.qwen_vl import QwenVLPolicy
from mmrl.policies.vllm_engine import (
    SUPPRESS_BIAS,
    engine_weights,
    pack_completions,
    sampling_kwargs,
    weights_version,
)
from mmrl.rollout import SampleOutput
from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen2, build_tiny_qwen_vl, build_tokenizer

torch.set_num_threads(1)

EOS, PAD = 7, 0
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


def test_weights_version_moves_with_optimizer_steps_only(tokenizer):
    model = build_tiny_qwen2(tokenizer, seed=0, **TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    v0 = weights_version(model)
    loss = model(input_ids=torch.tensor([[3, 4, 5]])).logits.square().mean()
    loss.backward()
    assert weights_version(model) == v0, "a forward and backward change no weight"
    opt.step()
    assert weights_version(model) > v0


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


# ---------------------------------------------------------------------------------- the engine itself

needs_engine = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
    reason="the vLLM engine needs the vllm package (pip install 'mmrl[vllm]') and a CUDA GPU")


@needs_engine
def test_vllm_logprobs_track_the_trainer_and_its_updates(tmp_path):
    from mmrl.envs import make_task
    from mmrl.policies import build_policy
    from mmrl.trainer import Trainer

    cfg = config_from_dict({**engine_cfg(tmp_path, engine="vllm", vllm_memory=0.2, vllm_kwargs={"enforce_eager": True}),
                            "sampling": {"group_size": 4, "max_new_tokens": 8},
                            "train": {"output_dir": str(tmp_path / "run"), "recompute_old_logp": True, "bf16": False,
                                      "steps": 2, "prompts_per_step": 4, "lr": 1e-2, "eval_every": 0,
                                      "progress": False}})
    task = make_task(cfg.task.name, seed=0, **cfg.task.params)
    policy = build_policy(cfg, task, torch.device("cuda"))
    trainer = Trainer(cfg, policy, task)

    def gap():
        rollout = policy.sample(task.eval_batch(8), 4, generator=torch.Generator("cuda").manual_seed(0))
        with torch.no_grad():
            logp = policy.logprobs(rollout)[0]
        return torch.where(rollout.mask, logp - rollout.logp_beh, 0.0).abs().max().item()

    assert gap() < 1e-3  # float32 on both sides
    for _ in range(2):
        trainer.train_step()
    assert gap() < 1e-3, "after updates, the engine samples from the pushed weights"
    policy.engine.close()
