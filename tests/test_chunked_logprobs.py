"""Real sizes: log-probs and entropies from the final hidden states through the output head a chunk
of tokens at a time (values and gradients equal the one-pass logits' for every token-scoring policy,
and no pass makes more than a chunk's logits), no-grad passes in the update's micro-batches, and
sampler calls bounded by rollout.batch_size."""

import numpy as np
import pytest
import torch

from mmrl.rollout import _HeadLogprobs, head_logprobs, positions_from_mask, token_logprobs

torch.set_num_threads(1)


def _one_pass(hidden, weight, units, bias=None, suppress=None, temperature=1.0):
    """The old way: the whole [N, T, V] logits in float32, then `token_logprobs`."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    return token_logprobs(logits, units, suppress, True)


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_head_logprobs_equal_the_one_pass_values_and_gradients(chunk, temperature, with_bias):
    gen = torch.Generator().manual_seed(0)
    N, T, H, V = 3, 7, 16, 50
    hidden = torch.randn(N, T, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    bias = torch.randn(V, generator=gen, requires_grad=True) if with_bias else None
    suppress = torch.tensor([V - 1, V - 2, 5])
    units = torch.randint(0, V - 2, (N, T), generator=gen)
    units[0, 0] = 5  # a suppressed unit: log-prob -inf, and no gradient through it
    g_logp, g_ent = torch.randn(N, T, generator=gen), torch.randn(N, T, generator=gen)
    keep = units != 5
    results = []
    for fn in (_one_pass, lambda *a, **k: head_logprobs(*a, **k, with_entropy=True, chunk=chunk)):
        for p in (hidden, weight, bias):
            if p is not None:
                p.grad = None
        logp, ent = fn(hidden, weight, units, bias=bias, suppress=suppress, temperature=temperature)
        (torch.where(keep, logp * g_logp, 0.0) + ent * g_ent).sum().backward()
        results.append((logp.detach(), ent.detach(), [p.grad.clone() for p in (hidden, weight, bias) if p is not None]))
    (ref_logp, ref_ent, ref_grads), (logp, ent, grads) = results
    assert torch.isneginf(logp[0, 0]) and torch.isneginf(ref_logp[0, 0])
    torch.testing.assert_close(logp[keep], ref_logp[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, atol=1e-4, rtol=1e-4)  # float32 sums in another order


def test_no_more_than_a_chunk_of_logits_exists(monkeypatch):
    """Every logits tensor the head makes, forward and backward, has at most `chunk` rows."""
    seen = []
    original = _HeadLogprobs._chunk_logits

    def spy(h, weight, bias, temperature):
        out = original(h, weight, bias, temperature)
        seen.append(out.shape[0])
        return out

    monkeypatch.setattr(_HeadLogprobs, "_chunk_logits", staticmethod(spy))
    hidden = torch.randn(4, 25, 8, requires_grad=True)
    logp, ent = head_logprobs(hidden, torch.randn(30, 8), torch.randint(0, 30, (4, 25)), with_entropy=True, chunk=16)
    (logp.sum() + ent.sum()).backward()
    assert seen and max(seen) <= 16 and sum(seen) == 2 * 100  # every token once forward, once backward


# ----------------------------------------------------------------------------- the policies


def _grads(module):
    return {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


def _compare(policy_pass, reference_pass, module, mask):
    """Values and parameter gradients of a policy's log-probs against the one-pass reference."""
    out = []
    for fn in (reference_pass, policy_pass):
        module.zero_grad()
        logp, ent = fn()
        (torch.where(mask, logp, 0.0).sum() + torch.where(mask, ent, 0.0).sum()).backward()
        out.append((logp.detach(), ent.detach(), _grads(module)))
    (ref_logp, ref_ent, ref_g), (logp, ent, g) = out
    torch.testing.assert_close(logp[mask], ref_logp[mask], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent[mask], ref_ent[mask], atol=2e-5, rtol=1e-5)
    assert g.keys() == ref_g.keys() and g
    for k in g:
        torch.testing.assert_close(g[k], ref_g[k], atol=2e-5, rtol=1e-3)


@pytest.mark.parametrize("lean", [True, False])
def test_causal_lm_logprobs_equal_one_pass_logits(tiny_lm, lean):
    """The lean decoder and the HF body (a reference copy, dropout, LoRA take it), through the chunked
    head, with suppressed tokens and a temperature: the full-logits values and gradients."""
    from mmrl.policies.causal_lm import CausalLMPolicy

    model, tok = tiny_lm
    policy = CausalLMPolicy(model, tok, temperature=0.8, max_new_tokens=6, fast_decode=lean)
    policy.logprob_chunk = 7
    contexts = [{"prompt": "12+3="}, {"prompt": "7+45="}]
    rollout = policy.sample(contexts, 3, generator=torch.Generator().manual_seed(3))
    assert (policy._fast is not None) == lean and len(policy.suppress_token_ids)

    def reference():
        e = rollout.extras
        ids = torch.cat([e["prompt_ids"], rollout.units], 1)
        attn = torch.cat([e["prompt_mask"], torch.ones_like(rollout.units)], 1)
        T = rollout.units.shape[1]
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn),
                       logits_to_keep=T + 1).logits[:, :-1].float() / 0.8
        return token_logprobs(logits, rollout.units, torch.tensor(policy.suppress_token_ids), True)

    _compare(lambda: policy.logprobs(rollout, with_entropy=True), reference, model, rollout.mask)
    with torch.no_grad():
        assert torch.where(rollout.mask, policy.logprobs(rollout)[0] - rollout.logp_old, 0.0).abs().max() < 1e-5


@pytest.fixture(scope="module")
def tiny_vl():
    from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer
    from mmrl.policies.vla.processor import add_action_tokens

    tok = add_action_tokens(build_tokenizer(["how many red objects are there move the dot"], vocab_size=300), 64)
    return build_tiny_qwen_vl(tok, "qwen2_5_vl", seed=0), build_qwen_vl_processor(tok, "qwen2_5_vl", 4, 4)


def _hf_logits(model, enc, units):
    """The old way for a Qwen-VL: the HF forward's float32 logits [N, T, V] that predict `units`
    after the prompts of `enc` (prompt tensors and per-row vision lists)."""
    from mmrl.policies.qwen_vl import rope_positions, vision_inputs

    ids = torch.cat([enc["prompt_ids"], units], 1)
    attn = torch.cat([enc["prompt_mask"], torch.ones_like(units)], 1)
    mm = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(units)], 1)
    vision = vision_inputs(enc["pixel_values"], enc["image_grid_thw"])
    pos = rope_positions(model, ids, attn, mm, vision.get("image_grid_thw"))
    return model(input_ids=ids, attention_mask=attn, position_ids=pos, mm_token_type_ids=mm,
                 logits_to_keep=units.shape[1] + 1, **vision).logits[:, :-1].float()


def test_qwen_vl_logprobs_equal_one_pass_logits(tiny_vl):
    from mmrl.policies.qwen_vl import QwenVLPolicy

    model, processor = tiny_vl
    policy = QwenVLPolicy(model, processor, temperature=0.9, max_new_tokens=6)
    policy.logprob_chunk = 5
    rng = np.random.default_rng(0)
    contexts = [{"frame": rng.integers(0, 256, (56, 56, 3), dtype=np.uint8), "prompt": p}
                for p in ("how many red objects", "move the dot")]
    rollout = policy.sample(contexts, 2, generator=torch.Generator().manual_seed(1))
    suppress = torch.tensor(policy.suppress_token_ids)

    def reference():
        return token_logprobs(_hf_logits(model, rollout.extras, rollout.units) / 0.9, rollout.units, suppress, True)

    _compare(lambda: policy.logprobs(rollout, with_entropy=True), reference, model, rollout.mask)


def test_action_vla_logprobs_equal_one_pass_logits(tiny_vl):
    """The action-token VLA scores its bins through the head's rows of the action ids only."""
    from mmrl.policies.vla.modeling_action_tokens import ActionTokenVLAPolicy

    model, processor = tiny_vl
    policy = ActionTokenVLAPolicy(model, processor, action_dim=3, chunk_size=2, n_bins=64, temperature=1.3)
    policy.logprob_chunk = 4
    rng = np.random.default_rng(0)
    obs = {"images": {"front": rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)}}
    instr = ["move the dot", "move"]
    tokens = policy.act(obs, instr, generator=torch.Generator().manual_seed(0)).tokens
    enc = policy.encode(policy._vl_contexts(list(obs["images"]["front"][:, None]), instr))

    def reference():
        z = _hf_logits(model, enc, tokens)[..., policy.token_start:policy.token_start + 64] / 1.3
        return token_logprobs(z, tokens - policy.token_start, None, True)

    mask = torch.ones_like(tokens, dtype=torch.bool)
    _compare(lambda: policy._chunk_logprobs(model, enc, tokens, True), reference, model, mask)


# ----------------------------------------------------------------------------- the trainer's passes


def _trainer(tmp_path, **train):
    from test_trainer import build, make_cfg

    return build(make_cfg(tmp_path, train=train, algo={"beta": 0.05}))


def test_no_grad_passes_run_in_the_update_micro_batches(tmp_path, monkeypatch):
    """The old-log-prob recompute and the reference pass see at most micro_batch_size rows at once,
    and the update they feed equals the one of whole-batch passes."""
    results = []
    for micro in (0, 3):
        trainer = _trainer(tmp_path / f"m{micro}", recompute_old_logp=True, micro_batch_size=micro)
        rows = {"logprobs": [], "reference": []}
        logprobs, reference = trainer.policy.logprobs, trainer.policy.reference_logprobs
        monkeypatch.setattr(trainer.policy, "logprobs", lambda r, *a, **k: rows["logprobs"].append(len(r)) or logprobs(r, *a, **k))
        monkeypatch.setattr(trainer.policy, "reference_logprobs",
                            lambda r: rows["reference"].append(len(r)) or reference(r))
        torch.manual_seed(0)
        rollout, _ = trainer.collect()
        trainer.update(rollout)
        assert rows["reference"] and max(rows["reference"]) == (micro or len(rollout)), rows
        assert max(rows["logprobs"]) == (micro or len(rollout)), rows
        results.append({k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()})
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], atol=1e-5, rtol=1e-4)  # an Adam step is ~3e-3


def test_rollout_batch_size_bounds_a_sampler_call(tmp_path, monkeypatch):
    from test_trainer import build, make_cfg

    trainer = build(make_cfg(tmp_path, rollout={"batch_size": 16}))  # 2 groups of 8 a call
    calls = []
    sample = trainer.policy.sample
    monkeypatch.setattr(trainer.policy, "sample", lambda c, g, **k: calls.append(len(c) * g) or sample(c, g, **k))
    contexts = trainer.task.next_batch(5)
    rollout = trainer.collector.sample(contexts, 8, torch.Generator().manual_seed(0), first_group=3)
    assert calls == [16, 16, 8] and len(rollout) == 40
    assert rollout.group_ids.tolist() == [g for g in range(3, 8) for _ in range(8)]
    assert [c["prompt"] for c in rollout.contexts[::8]] == [c["prompt"] for c in contexts]


# ----------------------------------------------------------------------------- gradient checkpointing


def _layer_calls(model, layers_of):
    """A counter of decoder-layer forward calls (a checkpointed layer runs again in the backward),
    counted at each layer's MLP: from transformers 5.2x the checkpoint wraps the layer's `forward`,
    inside its own hooks, so only a submodule's hooks see the recompute."""
    calls = []
    for layer in layers_of(model):
        layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # a recompute may stop before the post-hook
    return calls


def test_gradient_checkpointing_recomputes_and_keeps_the_gradients(tmp_path):
    """causal_lm and qwen_vl (its language model and vision tower): the same log-probs and
    gradients with train.gradient_checkpointing as without (the causal LM's lean decoder), and each
    layer runs twice (forward, recompute)."""
    import mmrl
    from mmrl.config import load_config

    for config, layers_of in [
        ("configs/digit_sort_grpo.yaml", lambda m: m.model.layers),
        ("configs/vqa_grpo.yaml", lambda m: [*m.model.language_model.layers, *m.model.visual.blocks]),
    ]:
        out = []
        for on in (False, True):
            cfg = load_config(config, [f"train.output_dir={tmp_path}", f"train.gradient_checkpointing={on}",
                                       "task.params.n_train=40", "task.params.n_test=4"]
                              if "vqa" in config else [f"train.output_dir={tmp_path}",
                                                       f"train.gradient_checkpointing={on}"])
            task, policy = mmrl.build(cfg)
            rollout = policy.sample(task.next_batch(2), 2, generator=torch.Generator().manual_seed(0))
            policy.model.train()
            calls = _layer_calls(policy.model, layers_of)
            logp, _ = policy.logprobs(rollout)
            n_forward = len(calls)
            torch.where(rollout.mask, logp, 0.0).sum().backward()
            if on:  # (off, the causal LM's update runs the lean decoder: no HF layer is called)
                assert n_forward > 0 and len(calls) == 2 * n_forward, (config, calls)
            out.append((logp.detach(), _grads(policy.model)))
        (logp0, g0), (logp1, g1) = out
        torch.testing.assert_close(logp1, logp0, atol=1e-5, rtol=1e-5)
        assert g0.keys() == g1.keys()
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_is_refused_where_it_is_not_built():
    from mmrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"train.gradient_checkpointing: model.policy 'visual_planner' does not support"):
        load_config("configs/vprl_frozenlake_grpo.yaml", ["train.gradient_checkpointing=true"])


@pytest.mark.robot  # its VLA part needs lerobot's stack
def test_action_vla_gradient_checkpointing(tiny_vl):
    import copy

    from mmrl.policies.vla.modeling_action_tokens import ActionTokenVLAPolicy

    rng = np.random.default_rng(1)
    obs = {"images": {"front": rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)}}
    out = []
    for on in (False, True):
        model = copy.deepcopy(tiny_vl[0])
        policy = ActionTokenVLAPolicy(model, tiny_vl[1], action_dim=3, chunk_size=2, n_bins=64)
        tokens = policy.act(obs, ["move the dot", "move"], generator=torch.Generator().manual_seed(0)).tokens
        if on:
            policy.enable_gradient_checkpointing()
        model.train()
        calls = _layer_calls(model, lambda m: m.model.language_model.layers)
        logp, _ = policy.logprobs_of(obs, ["move the dot", "move"], tokens)
        n_forward = len(calls)
        logp.sum().backward()
        assert len(calls) == (2 if on else 1) * n_forward > 0
        out.append((logp.detach(), _grads(model)))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-5, rtol=1e-5)
    for k in out[0][1]:
        torch.testing.assert_close(out[1][1][k], out[0][1][k], atol=1e-5, rtol=1e-4)
