"""Sampler log-probs must equal the trainer's teacher-forced log-probs: where RL code silently breaks."""

import pytest
import torch

from mmrl.policies.causal_lm import CausalLMPolicy
from mmrl.policies.fast_decode import FastDecoder
from mmrl.rollout import Rollout, _filter_logits, sample_tokens

PROMPTS = [{"prompt": "1+2="}, {"prompt": "13+45="}, {"prompt": "the cat sat and then 7+"}]


@pytest.fixture(params=[True, False], ids=["fused", "views"])
def fuse(request, monkeypatch):
    """The lean decoder both ways: fused weight copies (small layers) and the model's own weights
    through views (what layers above FastDecoder.FUSE_MAX_LAYER_PARAMS get)."""
    if not request.param:
        monkeypatch.setattr(FastDecoder, "FUSE_MAX_LAYER_PARAMS", 0)
    return request.param


def make_policy(tiny_lm, fast: bool, **kw) -> CausalLMPolicy:
    model, tok = tiny_lm
    return CausalLMPolicy(model, tok, max_new_tokens=12, fast_decode=fast, **kw)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_match_teacher_forcing(tiny_lm, fast, temperature, fuse):
    policy = make_policy(tiny_lm, fast, temperature=temperature)
    assert (policy._fast is not None) == fast
    assert not fast or policy._fast.fuse == fuse
    gen = torch.Generator().manual_seed(3)
    rollout = policy.sample(PROMPTS, group_size=4, generator=gen)
    # Prompts of different lengths: left padding is really exercised.
    assert (rollout.extras["prompt_mask"] == 0).any()
    with torch.no_grad():
        logp, entropy = policy.logprobs(rollout, with_entropy=True)
    m = rollout.mask
    assert m.any()
    diff = torch.where(m, logp - rollout.logp_old, 0.0).abs().max().item()
    assert diff < 1e-5, diff
    assert torch.isfinite(entropy[m]).all() and (entropy[m] >= 0).all()


def test_fast_decoder_draws_the_same_tokens_as_hf(tiny_lm, fuse):
    slow, fast = make_policy(tiny_lm, False), make_policy(tiny_lm, True)
    a = slow.sample(PROMPTS, 4, generator=torch.Generator().manual_seed(11))
    b = fast.sample(PROMPTS, 4, generator=torch.Generator().manual_seed(11))
    assert torch.equal(a.units, b.units)
    assert torch.equal(a.mask, b.mask)
    assert torch.allclose(a.logp_old, b.logp_old, atol=1e-5)


def test_fast_decoder_declines_unknown_architectures():
    class Dummy(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt2"})()

    assert FastDecoder.maybe(Dummy()) is None


def test_sampling_is_reproducible_under_a_seed(tiny_lm):
    policy = make_policy(tiny_lm, True)
    a = policy.sample(PROMPTS, 3, generator=torch.Generator().manual_seed(5))
    b = policy.sample(PROMPTS, 3, generator=torch.Generator().manual_seed(5))
    c = policy.sample(PROMPTS, 3, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.units, b.units) and torch.equal(a.logp_old, b.logp_old)
    assert not torch.equal(a.units, c.units)


def test_mask_runs_through_first_eos_and_truncation_flag(tiny_lm):
    model, tok = tiny_lm
    enc = tok(["1+2="] * 64, return_tensors="pt", padding=True)
    out = sample_tokens(model, enc.input_ids, enc.attention_mask, max_new_tokens=6,
                        eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                        generator=torch.Generator().manual_seed(0))
    for row, m, trunc in zip(out.tokens, out.mask, out.truncated):
        eos_at = (row == tok.eos_token_id).nonzero()
        if len(eos_at):
            first = int(eos_at[0])
            assert m[: first + 1].all() and not m[first + 1:].any()
            assert not trunc
        else:
            assert m.all() and trunc and out.tokens.shape[1] == 6


def test_suppressed_vision_tokens_are_never_sampled(tiny_lm):
    policy = make_policy(tiny_lm, True)
    assert policy.suppress_token_ids, "the tiny tokenizer carries the Qwen vision tokens"
    rollout = policy.sample(PROMPTS, 16, generator=torch.Generator().manual_seed(0))
    assert not torch.isin(rollout.units[rollout.mask], torch.tensor(policy.suppress_token_ids)).any()


def test_greedy_is_deterministic_and_argmax(tiny_lm):
    policy = make_policy(tiny_lm, True)
    a = policy.sample(PROMPTS, 2, temperature=0.0)
    b = policy.sample(PROMPTS, 2, generator=torch.Generator().manual_seed(99), temperature=0.0)
    assert torch.equal(a.units, b.units)
    assert torch.equal(a.units[0::2], a.units[1::2])


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = _filter_logits(logits, 2, 1.0)
    assert torch.isfinite(k2[0, :2]).all() and torch.isinf(k2[0, 2:]).all()
    p = _filter_logits(logits, 0, 0.7)  # 0.5 + 0.3 reaches 0.7: keep two
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    p1 = _filter_logits(logits, 0, 0.4)  # the top token alone covers 0.4
    assert torch.isfinite(p1[0, 0]) and torch.isinf(p1[0, 1:]).all()


def test_rollout_select_and_concat_pad(tiny_lm):
    policy = make_policy(tiny_lm, True)
    a = policy.sample(PROMPTS[:1], 2, generator=torch.Generator().manual_seed(0)).stamp_groups(2, 0)
    b = policy.sample(PROMPTS[1:], 2, generator=torch.Generator().manual_seed(1)).stamp_groups(2, 1)
    both = Rollout.concat([a, b])
    assert len(both) == 6 and both.units.shape[1] == max(a.units.shape[1], b.units.shape[1])
    assert both.extras["prompt_ids"].shape[1] == max(a.extras["prompt_ids"].shape[1], b.extras["prompt_ids"].shape[1])
    # Padding changes nothing that is trained: log-probs of the joined batch equal the parts'.
    with torch.no_grad():
        joined = policy.logprobs(both)[0]
        part = policy.logprobs(a)[0]
    Ta = a.units.shape[1]
    assert torch.allclose(torch.where(a.mask, joined[:2, :Ta], 0), torch.where(a.mask, part, 0), atol=1e-5)
    sub = both.select(torch.tensor([0, 5]))
    assert sub.group_ids.tolist() == [0, 2] and sub.contexts[1] == PROMPTS[2]
    assert both.max_units == a.max_units == policy.max_new_tokens
    # A window of tokens (train.unit_chunk) scores exactly those tokens, on the lean decoder and HF's forward.
    with torch.no_grad():
        for scorer in (policy, make_policy(tiny_lm, False)):
            for window in (slice(0, 1), slice(1, 3), slice(2, None)):
                assert torch.allclose(scorer.logprobs(both, units=window)[0], joined[:, window], atol=1e-5), window


def test_pretrained_path_loads_a_saved_tiny_model(tiny_lm, tmp_path):
    from mmrl.config import ModelConfig, SamplingConfig

    model, tok = tiny_lm
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = CausalLMPolicy.from_model_config(ModelConfig(source="pretrained", path=str(tmp_path)), SamplingConfig())
    original = CausalLMPolicy(model, tok)
    r = original.sample(PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.logprobs(r)[0], original.logprobs(r)[0])
    with pytest.raises(FileNotFoundError, match="config.json"):
        CausalLMPolicy.from_model_config(ModelConfig(source="pretrained", path=str(tmp_path / "nope")), SamplingConfig())


def test_lean_forward_matches_hf_in_value_and_gradient(tiny_lm, fuse):
    """The fast teacher-forced path must be the HF model's math: same log-probs, same gradients."""
    fast, slow = make_policy(tiny_lm, True), make_policy(tiny_lm, False)
    rollout = fast.sample(PROMPTS, 3, generator=torch.Generator().manual_seed(2))
    grads = []
    for policy in (fast, slow):
        policy.model.zero_grad()
        logp, ent = policy.logprobs(rollout, with_entropy=True)
        loss = torch.where(rollout.mask, logp + 0.1 * ent, 0.0).sum()
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in policy.model.named_parameters()})
        if policy is fast:
            fast_logp = logp.detach()
        else:
            assert torch.allclose(torch.where(rollout.mask, fast_logp - logp.detach(), 0), torch.zeros_like(logp), atol=1e-5)
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], atol=1e-5, rtol=1e-4), k


def test_sampler_draws_match_the_distribution():
    """The inverse-CDF draw samples each token with its probability and never a p = 0 token."""

    class Fixed(torch.nn.Module):  # a stepper whose next-token distribution never changes
        def prefill(self, ids, mask):
            return torch.log(torch.tensor([[0.0, 0.5, 0.3, 0.2, 0.0]])).expand(ids.shape[0], 5)

        step = lambda self, tok: self.prefill(tok[:, None], None)  # noqa: E731

    n = 20000
    out = sample_tokens(None, torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                        max_new_tokens=1, eos_token_ids=[9], pad_token_id=0, stepper=Fixed(),
                        generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(out.tokens[:, 0], minlength=5).float() / n
    assert freq[0] == 0 and freq[4] == 0
    assert torch.allclose(freq[1:4], torch.tensor([0.5, 0.3, 0.2]), atol=0.015)


def test_shared_prompt_pass_equals_one_pass_per_row(tiny_lm):
    """Rows with the same prompt share one prompt pass in the lean teacher-forced forward; the
    log-probs and gradients must be those of a full pass per row, whatever the row order."""
    model, _ = tiny_lm
    fast = FastDecoder(model)
    gen = torch.Generator().manual_seed(5)
    prompt_ids = torch.randint(3, 250, (3, 7), generator=gen)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :3] = 0  # left padding of different lengths
    prompt_mask[2, :1] = 0
    order = torch.tensor([2, 0, 1, 0, 2, 1, 1, 0])  # groups interleaved, as after a mini-batch shuffle
    ids, mask = prompt_ids[order], prompt_mask[order]
    units = torch.randint(3, 250, (len(order), 5), generator=gen)
    results = []
    for shared in (True, False):
        model.zero_grad()
        if shared:
            logits = fast.logits(fast.completion_hidden(ids, mask, units))
        else:
            full = torch.cat([ids, units], 1)
            logits = fast.logits(fast.forward_hidden(full, torch.cat([mask, torch.ones_like(units)], 1), keep_last=6)[:, :-1])
        logits.float().log_softmax(-1).gather(-1, units[..., None]).sum().backward()
        results.append((logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (shared_logits, shared_grads), (row_logits, row_grads) = results
    assert shared_logits.shape == (8, 5, model.config.vocab_size)
    torch.testing.assert_close(shared_logits, row_logits, atol=1e-5, rtol=1e-5)
    assert shared_grads.keys() == row_grads.keys()
    for k in row_grads:
        torch.testing.assert_close(shared_grads[k], row_grads[k], atol=1e-5, rtol=1e-4)
    # one completion token: the prompt pass alone
    torch.testing.assert_close(fast.logits(fast.completion_hidden(ids, mask, units[:, :1])), row_logits[:, :1],
                               atol=1e-5, rtol=1e-5)
