"""train.gradient_checkpointing on the flow-matching policies: SmolVLA (lerobot's joint VLM/expert
layer loop, checkpointed per layer around its KV cache) and the causal Wan video generator
(diffusers' switch on the Wan blocks). With it on, the log-probs, the losses and every parameter's
gradient equal those without; the layers do recompute in the backward, and only under gradients
(sampling is unchanged). Tiny models on CPU."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

import mmrl
from mmrl.config import load_config

torch.set_num_threads(1)

CONFIGS = Path(__file__).parent.parent / "configs"


def assert_same_grads(a: torch.nn.Module, b: torch.nn.Module, rtol=1e-6, atol=1e-9) -> int:
    """Every parameter's gradient of `a` equals that of the same-named parameter of `b`; returns
    how many parameters have a nonzero gradient."""
    ga, gb = dict(a.named_parameters()), dict(b.named_parameters())
    assert ga.keys() == gb.keys()
    nonzero = 0
    for name, p in ga.items():
        q = gb[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)
            nonzero += bool(p.grad.abs().sum() > 0)
    return nonzero


class CallCounter:
    """Counts forward calls of `modules`, so a recompute in the backward shows. Pre-hooks: a
    non-reentrant recompute stops as soon as the last saved tensor is back, inside the last module."""

    def __init__(self, modules):
        self.n = 0
        self.handles = [m.register_forward_pre_hook(self._hook) for m in modules]

    def _hook(self, *_):
        self.n += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def counted_backward(modules, forward):
    """(output, forward calls during the forward, forward calls during the backward)."""
    counter = CallCounter(modules)
    try:
        out = forward()
        before = counter.n
        out.sum().backward()
        return out, before, counter.n - before
    finally:
        counter.remove()


# ----------------------------------------------------------------------------- SmolVLA


@pytest.fixture(scope="module")
def smolvla(tmp_path_factory):
    """(plain policy, checkpointing policy): deep copies of one tiny SmolVLA whose VLM trains too
    (train_expert_only=False), so gradients cross the prefix's VLM layers as well as the expert's."""
    pytest.importorskip("lerobot")
    from test_action_vla import dot_envs

    from mmrl.policies.vla.modeling_smolvla import SmolVLAPolicy, build_tiny_smolvla

    root = tmp_path_factory.mktemp("smolvla_ckpt")
    model, pre, post = build_tiny_smolvla(root, ["move the dot to the centre 0 1"], cameras=("front",), state_dim=2,
                                          action_dim=2, chunk_size=4, n_action_steps=2, num_steps=3, image_size=32,
                                          seed=0, train_expert_only=False)
    kw = {"eta": 0.7, "env_factory": dot_envs, "max_chunks": 3}
    plain = SmolVLAPolicy(model, pre, post, **kw)
    ckpt = SmolVLAPolicy(copy.deepcopy(model), pre, post, **kw)
    ckpt.enable_gradient_checkpointing()
    return plain, ckpt


def _smolvla_layers(policy):
    vwe = policy.model.model.vlm_with_expert
    layers = [*vwe.lm_expert.layers, *vwe.get_vlm_model().text_model.layers]
    return [layer.mlp for layer in layers]


def test_smolvla_flag_and_class_switch():
    from mmrl.policies import policy_class

    assert policy_class("smolvla").GRADIENT_CHECKPOINTING is True


@pytest.mark.robot  # lerobot's SmolVLA / Diffusion Policy
def test_smolvla_sampling_is_unchanged_and_not_checkpointed(smolvla, monkeypatch):
    plain, ckpt = smolvla
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    contexts = [{"task": "dot", "init_state_id": 4}, {"task": "dot", "init_state_id": 9, "max_steps": 3}]
    a = plain.sample(contexts, 2, generator=torch.Generator().manual_seed(0))
    b = ckpt.sample(contexts, 2, generator=torch.Generator().manual_seed(0))
    assert not calls  # inference mode: lerobot's own forward
    assert torch.equal(a.units, b.units) and torch.equal(a.logp_old, b.logp_old)
    with torch.no_grad():
        assert torch.equal(ckpt.logprobs(b)[0], plain.logprobs(a)[0])
    assert not calls


@pytest.mark.robot  # lerobot's SmolVLA / Diffusion Policy
@pytest.mark.parametrize("batched", [True, False])
def test_smolvla_logprobs_and_gradients_match_with_checkpointing(smolvla, batched):
    plain, ckpt = smolvla
    contexts = [{"task": "dot", "init_state_id": 2}, {"task": "dot", "init_state_id": 7, "max_steps": 3}]
    rollout = plain.sample(contexts, 2, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(rollout.mask.shape, generator=torch.Generator().manual_seed(2))
    results = {}
    for name, policy in (("plain", plain), ("ckpt", ckpt)):
        policy.batched_recompute = batched
        policy.model.zero_grad(set_to_none=True)
        results[name] = counted_backward(_smolvla_layers(policy),
                                         lambda p=policy: (p.logprobs(rollout)[0] * weights).sum())
    (lp_plain, fwd_plain, bwd_plain), (lp_ckpt, fwd_ckpt, bwd_ckpt) = results["plain"], results["ckpt"]
    torch.testing.assert_close(lp_ckpt, lp_plain, rtol=1e-6, atol=1e-7)
    assert fwd_ckpt == fwd_plain > 0 and bwd_plain == 0
    assert bwd_ckpt == fwd_ckpt  # every layer (prefix and denoising steps) ran again in the backward
    nonzero = assert_same_grads(ckpt.model, plain.model)
    vlm = [n for n, p in plain.model.named_parameters() if "text_model.layers" in n and p.grad is not None
           and p.grad.abs().sum() > 0]
    assert nonzero > 10 and vlm  # the expert's and the VLM's layers both get gradients


@pytest.mark.robot  # lerobot's SmolVLA / Diffusion Policy
def test_smolvla_sft_loss_matches_with_checkpointing(smolvla):
    plain, ckpt = smolvla
    rng = np.random.default_rng(0)
    contexts = [{"images": {"front": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)},
                 "state": rng.normal(size=2).astype(np.float32), "instruction": "move the dot",
                 "actions": rng.uniform(-1, 1, (3, 2)).astype(np.float32)} for _ in range(3)]
    losses, counts = [], []
    for policy in (plain, ckpt):
        policy.model.zero_grad(set_to_none=True)
        torch.manual_seed(3)  # lerobot draws the flow-matching noise and times from the global RNG
        loss, fwd, bwd = counted_backward(_smolvla_layers(policy), lambda p=policy: p.sft_loss(contexts))
        losses.append(loss.detach())
        counts.append((fwd, bwd))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    assert counts[0][1] == 0 and counts[1][1] == counts[1][0] > 0
    assert assert_same_grads(ckpt.model, plain.model) > 10


@pytest.mark.robot  # lerobot's SmolVLA / Diffusion Policy
def test_smolvla_reference_copy_keeps_working(smolvla):
    _, ckpt = smolvla
    ref = copy.deepcopy(ckpt.model).eval().requires_grad_(False)  # what enable_reference does
    vwe = ref.model.vlm_with_expert
    assert vwe.forward.__self__ is vwe  # the switch travels with the copy, bound to it
    rollout = ckpt.sample([{"task": "dot", "init_state_id": 1}], 2, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ckpt._rollout_logprobs(ref, rollout), ckpt.logprobs(rollout)[0])


# ----------------------------------------------------------------------------- causal Wan (video_gen)

SMALL_VIDEO = ["task.params.num_frames=4", "task.params.image_size=8", "task.params.n_sft=16",
               "model.params.num_steps=3", "model.params.tiny.patch_size=[1, 2, 2]", "model.params.tiny.ffn_dim=32",
               "model.params.train_fraction=1.0", "sampling.group_size=2", "train.eval_size=2"]


def _video(tmp_path, config, on, *overrides):
    cfg = load_config(CONFIGS / config, [*SMALL_VIDEO, f"train.output_dir={tmp_path}",
                                         f"train.gradient_checkpointing={str(on).lower()}", *overrides])
    return mmrl.build(cfg)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """(task, plain policy, checkpointing policy) of the same tiny video_gen run (same seed, so the
    same weights), built through `mmrl.build` with train.gradient_checkpointing off and on."""
    root = tmp_path_factory.mktemp("video_ckpt")
    task, plain = _video(root / "off", "video_flowgrpo.yaml", False, "model.params.guidance_scale=2.0")
    _, ckpt = _video(root / "on", "video_flowgrpo.yaml", True, "model.params.guidance_scale=2.0")
    return task, plain, ckpt


def test_video_build_switches_it_on(videos):
    from mmrl.policies import policy_class

    _, plain, ckpt = videos
    assert policy_class("video_gen").GRADIENT_CHECKPOINTING is True
    assert ckpt.model.transformer.gradient_checkpointing and not plain.model.transformer.gradient_checkpointing
    for (n, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        assert torch.equal(p, q), n


def test_video_sampling_is_unchanged_and_not_checkpointed(videos, monkeypatch):
    task, plain, ckpt = videos
    calls = []
    real = ckpt.model.transformer._gradient_checkpointing_func
    monkeypatch.setattr(ckpt.model.transformer, "_gradient_checkpointing_func",
                        lambda *a: calls.append(1) or real(*a))
    contexts = task.next_batch(2)
    a = plain.sample(contexts, 2, torch.Generator().manual_seed(0))
    b = ckpt.sample(contexts, 2, torch.Generator().manual_seed(0))
    assert not calls
    assert torch.equal(a.extras["states"], b.extras["states"]) and torch.equal(a.logp_old, b.logp_old)


def test_video_logprobs_and_gradients_match_with_checkpointing(videos):
    task, plain, ckpt = videos
    rollout = plain.sample(task.next_batch(2), 2, torch.Generator().manual_seed(1))
    weights = torch.randn(rollout.mask.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for policy in (plain, ckpt):
        policy.model.zero_grad(set_to_none=True)
        results.append(counted_backward(list(policy.model.transformer.blocks),
                                        lambda p=policy: (p.logprobs(rollout)[0] * weights).sum()))
    (lp_plain, fwd_plain, bwd_plain), (lp_ckpt, fwd_ckpt, bwd_ckpt) = results
    torch.testing.assert_close(lp_ckpt, lp_plain, rtol=1e-6, atol=1e-7)
    assert bwd_plain == 0 and bwd_ckpt == fwd_ckpt == fwd_plain > 0  # every block recomputed once
    assert assert_same_grads(ckpt.model, plain.model) == len(list(plain.model.parameters()))


def test_video_sft_loss_matches_with_checkpointing(videos):
    task, plain, ckpt = videos
    contexts = task.sft_batch(3, np.random.default_rng(0))
    losses = []
    for policy in (plain, ckpt):
        policy.model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = policy.sft_loss(contexts)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    assert assert_same_grads(ckpt.model, plain.model) > 0


def test_kvpo_branch_logprobs_match_with_checkpointing(tmp_path):
    """KVPO's replay (teacher-forced velocities of the first tve_grad_steps steps, with gradient)."""
    kv = ["task.params.num_frames=8"]  # 8 one-frame chunks: sink 1, window 2, older frames to re-route to
    task, plain = _video(tmp_path / "off", "video_kvpo.yaml", False, *kv)
    _, ckpt = _video(tmp_path / "on", "video_kvpo.yaml", True, *kv)
    contexts = task.next_batch(2)
    rollout = plain.sample(contexts, 3, torch.Generator().manual_seed(0)).stamp_groups(3)
    assert rollout.extras["routed"].any()
    out = []
    for policy in (plain, ckpt):
        policy.model.zero_grad(set_to_none=True)
        lp = policy.logprobs(rollout)[0]
        (lp * torch.arange(1.0, len(rollout) + 1)[:, None]).sum().backward()
        out.append(lp.detach())
    torch.testing.assert_close(out[1], out[0], rtol=1e-6, atol=1e-7)
    assert assert_same_grads(ckpt.model, plain.model) > 0


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", ["vla_tabletop_smolvla.yaml", "video_flowgrpo.yaml", "video_dancegrpo.yaml",
                                  "video_kvpo.yaml", "video_pretrain.yaml", "video_wan_gpu.yaml"])
def test_shipped_configs_accept_gradient_checkpointing(name, local_inputs):
    path = CONFIGS / name
    cfg = load_config(path, [*local_inputs(path), "train.gradient_checkpointing=true"])
    assert cfg.train.gradient_checkpointing and cfg.model.policy in ("smolvla", "video_gen")
