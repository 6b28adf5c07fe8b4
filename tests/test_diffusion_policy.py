"""lerobot's Diffusion Policy trained with DPPO, on a small Diffusion Policy built offline: the
stochastic chain reproduces lerobot's own DDPM sampler from the same noise; the log-probs of the
denoising chain recomputed teacher-forced equal the sampled ones over whole trajectories; SFT,
checkpoints, config errors, and a 2-step SFT + 2-step DPPO run of the shipped tabletop config."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.policies import policy_class
from mmrl.rollout import Rollout

pytest.importorskip("lerobot")
torch.set_num_threads(1)

from mmrl.policies.vla.configuration import DiffusionPolicyConfig  # noqa: E402
from mmrl.policies.vla.modeling_diffusion import DiffusionActionPolicy, build_tiny_diffusion  # noqa: E402
from test_action_vla import dot_envs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONTEXTS = [{"task": "dot", "init_state_id": 4}, {"task": "dot", "init_state_id": 9, "max_steps": 3}]


def build(**kw):
    return build_tiny_diffusion(("front",), **{"state_dim": 2, "action_dim": 2, "horizon": 4, "n_action_steps": 2,
                                               "num_steps": 4, "image_size": 32, "keypoints": 8, **kw})


@pytest.fixture(scope="module")
def tiny():
    return build()


def make_policy(tiny, **kw):
    return DiffusionActionPolicy(*tiny, **{"env_factory": dot_envs, "max_chunks": 4, **kw})


def test_stochastic_chain_is_lerobots_ddpm_sampler():
    """eta = 1 is DDPM's posterior: with a vanishing std floor and the same noise stream the chain
    ends where lerobot's `conditional_sample` (diffusers' DDPMScheduler.step) does."""
    model, pre, post = build(noise_scheduler="DDPM", num_train_timesteps=20, num_steps=None)
    policy = DiffusionActionPolicy(model, pre, post, env_factory=dot_envs, eta=1.0, min_std=1e-9)
    assert policy.num_steps == 20 and policy_class("diffusion") is DiffusionActionPolicy
    rng = np.random.default_rng(0)
    batch = policy._batch(rng.integers(0, 256, (3, 1, 32, 32, 3), dtype=np.uint8), rng.normal(size=(3, 2)))
    noise = torch.randn(3, *policy.chunk_shape, generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        ref = model.diffusion.conditional_sample(3, model.diffusion._prepare_global_conditioning(batch),
                                                 generator=torch.Generator().manual_seed(1), noise=noise.clone())
        ours, logp = policy._sample_chunks(batch, torch.Generator().manual_seed(1), stochastic=True, noise=noise)
    assert ours.shape == (3, 21, 4, 2) and torch.equal(ours[:, 0], noise)
    assert (ours[:, -1] - ref).abs().max().item() < 1e-5
    assert torch.isfinite(logp).all() and logp.shape == (3, 20)


def test_teacher_forced_logprobs_equal_the_sampled_ones(tiny):
    policy = make_policy(tiny)
    ro = policy.sample(CONTEXTS, 2, generator=torch.Generator().manual_seed(0))
    K = policy.num_steps
    S = ro.units.shape[1] // K
    assert ro.units.shape == (4, S * K, 4, 2) and ro.logp_old.shape == ro.mask.shape == (4, S * K)
    acted = ro.mask.view(4, S, K).any(-1).sum(1)
    steps = ro.extras["env_steps"].tolist()  # 2 actions per chunk; the second context stops after 3 env steps
    assert acted.tolist() == [-(-n // 2) for n in steps] and max(steps[2:]) <= 3
    assert [len(x) for x in ro.extras["x_init"]] == acted.tolist()
    policy.model.train()  # re-scoring runs the encoder as the sampler did, whatever the module's mode
    with torch.no_grad():
        logp, _ = policy.logprobs(ro)
    assert torch.where(ro.mask, logp - ro.logp_old, 0.0).abs().max().item() < 1e-4
    assert bool((ro.logp_old[ro.mask] != 0).all())
    for window in (slice(0, K), slice(K, 2 * K), slice(1, K + 1)):
        with torch.no_grad():
            assert torch.allclose(policy.logprobs(ro, units=window)[0], logp[:, window], atol=1e-5), window
    # A changed U-Net changes every step's log-prob: the score depends on the weights.
    other = make_policy(build(seed=1))
    with torch.no_grad():
        assert (torch.where(ro.mask, other.logprobs(ro)[0] - ro.logp_old, 0.0).abs().max() > 1e-2)
    # The gradient reaches the U-Net and the image encoder.
    policy.model.zero_grad()
    policy.logprobs(ro)[0].sum().backward()
    for part in ("diffusion.unet.", "diffusion.rgb_encoder."):
        grads = [p.grad for n, p in policy.model.named_parameters() if n.startswith(part)]
        assert any(g is not None and g.abs().sum() > 0 for g in grads), part
    both = Rollout.concat([ro.select(torch.tensor([0, 3])), policy.sample(CONTEXTS[1:], 1)])
    with torch.no_grad():
        assert torch.where(both.mask, policy.logprobs(both)[0] - both.logp_old, 0.0).abs().max().item() < 1e-4
    greedy = policy.sample(CONTEXTS[:1], 2, temperature=0.0)
    assert torch.equal(greedy.logp_old, torch.zeros_like(greedy.logp_old))


def test_sft_and_checkpoint(tiny, tmp_path):
    policy = make_policy(tiny, eta=0.8, min_std=0.05)
    rng = np.random.default_rng(0)
    contexts = [{"images": {"front": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)},
                 "state": rng.normal(size=2).astype(np.float32), "instruction": "ignored",
                 "actions": rng.uniform(-1, 1, (3, 2)).astype(np.float32)} for _ in range(3)]
    policy.model.zero_grad()
    loss = policy.sft_loss(contexts)
    loss.backward()
    assert torch.isfinite(loss) and policy.model.diffusion.unet.final_conv[-1].weight.grad.abs().sum() > 0
    policy.save(tmp_path / "ckpt")
    back = DiffusionActionPolicy.from_pretrained(tmp_path / "ckpt", env_factory=dot_envs)
    assert (back.eta, back.min_std, back.num_steps, back.n_action_steps) == (0.8, 0.05, 4, 2)
    ro = policy.sample([{"task": "dot", "init_state_id": 1}], 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.where(ro.mask, back.logprobs(ro)[0] - ro.logp_old, 0.0).abs().max() < 1e-4
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DiffusionActionPolicy.from_pretrained(tmp_path / "missing")
    (tmp_path / "act").mkdir()
    (tmp_path / "act" / "config.json").write_text('{"type": "act"}')
    with pytest.raises(ValueError, match="holds a 'act' policy, not 'diffusion'"):
        DiffusionActionPolicy.from_pretrained(tmp_path / "act")


def test_bad_params_name_the_value(tiny):
    with pytest.raises(ValueError, match="min_std"):
        DiffusionPolicyConfig(min_std=0.0)
    with pytest.raises(ValueError, match="unknown noise_scheduler 'PNDM'; valid: DDPM, DDIM"):
        DiffusionPolicyConfig(noise_scheduler="PNDM")
    with pytest.raises(ValueError, match="horizon 6 must be a multiple of 2"):
        DiffusionPolicyConfig(horizon=6, down_dims=[8, 16, 32])
    with pytest.raises(ValueError, match=r"n_action_steps must be in \[1, horizon=4\], got 5"):
        make_policy(tiny, n_action_steps=5)
    with pytest.raises(ValueError, match="image features"):
        make_policy(tiny, cameras=["wrist"])
    two_obs = build()
    two_obs[0].config.n_obs_steps = 2
    with pytest.raises(ValueError, match="n_obs_steps must be 1"):
        make_policy(two_obs)


@pytest.mark.skipif(importlib.util.find_spec("mujoco") is None, reason="the tabletop task needs mujoco")
def test_dppo_smoke_with_the_tabletop_config(tmp_path):
    """configs/vla_tabletop_dppo.yaml shortened: 2 demos, SFT 2 steps, DPPO 2 steps, then evaluation."""
    from mmrl import build as build_run
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "vla_tabletop_dppo.yaml", [
        f"task.params.demo_root={tmp_path / 'demos'}", "task.params.demos_per_task=2", "task.params.n_eval=2",
        "task.params.eval_samples=1", "model.params.max_chunks=2", "sft.steps=2", "sft.batch_size=4",
        "train.steps=2", "train.prompts_per_step=1", "sampling.group_size=2", "algo.success_filter=null",
        "train.eval_every=0", "train.eval_size=2", "train.progress=false", f"train.output_dir={tmp_path / 'run'}"])
    task, policy = build_run(cfg)
    assert isinstance(policy, DiffusionActionPolicy) and policy.num_steps == 10
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    results = Trainer(cfg, policy, task).train(resume=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sft = [r["sft/loss"] for r in rows if "sft/loss" in r]
    train = [r for r in rows if "train/loss" in r]
    assert len(sft) == 2 and all(math.isfinite(x) for x in sft) and len(train) == 2
    for r in train:
        for k in ("train/loss", "train/grad_norm", "train/approx_kl", "reward/success"):
            assert math.isfinite(r[k]), (k, r[k])
    assert any(not torch.equal(before[n], p) for n, p in policy.model.named_parameters() if n.startswith("diffusion.unet"))
    after = results["eval_after"]
    assert 0 <= after["eval/success"] <= 1 and 0 <= after["eval/sampled/success"] <= 1
    assert (tmp_path / "run" / "final" / "mmrl_diffusion.json").is_file()
