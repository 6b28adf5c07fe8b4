"""`algo.kl_kind: gaussian`: the exact KL of each Gaussian denoising step to the reference's step
(Flow-GRPO's KL term), its scale independent of the latent's size, computed from the step means of
the update's own forward, equal with and without unit windows, and refused where units are not
Gaussian steps."""

import pytest
import torch

import mmrl
from mmrl.config import ConfigError
from mmrl.flow import flow_timesteps, gaussian_kl, gaussian_logprob, sde_step
from mmrl.trainer import Trainer

torch.set_num_threads(1)

SMALL = ["task.params.num_frames=4", "task.params.image_size=8", "task.params.n_sft=64",
         "model.params.num_steps=4", "model.params.tiny.patch_size=[1, 2, 2]", "model.params.tiny.ffn_dim=32",
         "sampling.group_size=3", "train.prompts_per_step=2", "train.eval_size=4", "train.grad_clip=1e9",
         "algo.beta=0.5", "algo.kl_kind=gaussian"]


def test_gaussian_kl_is_flow_grpos_formula_and_does_not_grow_with_the_latent():
    g = torch.Generator().manual_seed(0)
    mean, ref = torch.randn(3, 4, 5, 6, generator=g), torch.randn(3, 4, 5, 6, generator=g)
    std = torch.rand(3, 1, 1, 1, generator=g) + 0.1
    # Flow-GRPO's train_sd3.py: ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dims) / (2 * std_dev_t ** 2)
    expected = ((mean - ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std.view(-1) ** 2)
    torch.testing.assert_close(gaussian_kl(mean, ref, std), expected)
    # It is the exact KL: the mean log-prob gap between the step's own mean and the reference's mean.
    at_ref = gaussian_logprob(ref, mean, std)
    at_mean = gaussian_logprob(mean, mean, std)
    torch.testing.assert_close(gaussian_kl(mean, ref, std), at_mean - at_ref)
    # The same per-element drift on a latent twice the size: the same KL.
    twice = (torch.cat([mean, mean], -1), torch.cat([ref, ref], -1))
    torch.testing.assert_close(gaussian_kl(*twice, std), gaussian_kl(mean, ref, std))
    # Only the current mean carries a gradient.
    m = mean.clone().requires_grad_()
    r = ref.clone().requires_grad_()
    gaussian_kl(m, r, std).sum().backward()
    assert r.grad is None and m.grad.abs().sum() > 0


def _trainer(tmp_path, *overrides):
    cfg = mmrl.load_config("configs/video_flowgrpo.yaml", [*SMALL, f"train.output_dir={tmp_path}", *overrides])
    task, policy = mmrl.build(cfg)
    trainer = Trainer(cfg, policy, task)
    with torch.no_grad():  # move the policy away from its reference so the KL is not 0
        g = torch.Generator().manual_seed(1)
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return trainer


def test_the_kl_metric_is_the_formula_on_the_policys_and_the_references_step_means(tmp_path):
    trainer = _trainer(tmp_path)
    policy = trainer.policy
    rollout, _ = trainer.collect()
    ref_means = policy.reference_means(rollout)
    N, T = rollout.mask.shape
    assert ref_means.shape[:2] == (N, T)
    with torch.no_grad():
        cur = policy._unit_steps(policy.model, rollout, with_means=True).means
        logp, kl = policy.logprobs_and_kl(rollout, ref_means)
    # Each unit's std is the schedule's at its step (the model does not set it)
    ts = flow_timesteps(policy.config.num_steps, shift=policy.config.shift)
    C = policy.num_chunks
    std = torch.stack([sde_step(torch.zeros(1), torch.zeros(1), float(ts[j]), float(ts[j + 1] - ts[j]),
                                policy.config.eta)[2].reshape(()) for j in range(len(ts) - 1)]).repeat_interleave(C)
    expected = ((cur - ref_means) ** 2).flatten(2).mean(-1) / (2 * std ** 2)
    m = rollout.mask
    torch.testing.assert_close(kl[m], expected[m])
    assert bool((kl[m] > 0).all())
    torch.testing.assert_close(logp, policy.logprobs(rollout)[0])  # the same forward's log-probs
    # The trainer logs the aggregated term and trains on it.
    metrics = trainer.update(rollout)
    assert metrics["train/kl_ref"] > 0


def test_the_kl_gradient_is_the_same_with_unit_windows(tmp_path):
    trainer = _trainer(tmp_path)
    policy = trainer.policy
    rollout, _ = trainer.collect()
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}

    def update(unit_chunk, beta):
        policy.model.load_state_dict(state)
        trainer.cfg.train.unit_chunk = unit_chunk
        trainer.cfg.algo.beta = beta
        metrics = trainer.update(rollout)
        return metrics, {k: p.grad.clone() for k, p in policy.model.named_parameters() if p.grad is not None}

    one_metrics, one = update(0, 0.5)
    _, without_kl = update(0, 1e-12)
    assert any(not torch.allclose(one[k], without_kl[k]) for k in one), "the KL term moves the gradient"
    for chunk in (policy.num_chunks, 1):
        metrics, chunked = update(chunk, 0.5)
        assert metrics["train/kl_ref"] == pytest.approx(one_metrics["train/kl_ref"], rel=1e-5)
        for k in one:
            torch.testing.assert_close(one[k], chunked[k], atol=1e-6, rtol=1e-3)


@pytest.mark.parametrize("config, overrides", [
    ("configs/digit_sort_grpo.yaml", []),
    ("configs/video_kvpo.yaml", []),
])
def test_gaussian_kl_is_refused_where_units_are_not_gaussian_steps(tmp_path, config, overrides):
    with pytest.raises(ConfigError, match="algo.kl_kind: 'gaussian' needs units that are Gaussian denoising steps"):
        mmrl.load_config(config, ["algo.beta=0.1", "algo.kl_kind=gaussian", f"train.output_dir={tmp_path}", *overrides])


def test_smolvla_kl_is_the_formula_on_its_chunk_means(tmp_path):
    """The lerobot chunk policies (SmolVLA here, the Diffusion Policy the same code) score the KL of
    every denoising step of every executed chunk from the same pass as the log-probs."""
    pytest.importorskip("lerobot")
    cfg = mmrl.load_config("configs/vla_tabletop_smolvla.yaml", [
        "algo.beta=0.5", "algo.kl_kind=gaussian", "sft.steps=0", "algo.success_filter=null", "algo.max_sampling_tries=1",
        "train.prompts_per_step=1", "sampling.group_size=2", "model.params.max_chunks=2", f"train.output_dir={tmp_path}"])
    task, policy = mmrl.build(cfg)
    trainer = Trainer(cfg, policy, task)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    rollout, _ = trainer.collect()
    ref_means = policy.reference_means(rollout)
    assert ref_means.shape == rollout.units.shape
    with torch.no_grad():
        cur = policy._unit_steps(policy.model, rollout, with_means=True).means
        _, kl = policy.logprobs_and_kl(rollout, ref_means)
    ts = policy.timesteps
    K = policy.num_steps
    std = torch.stack([sde_step(torch.zeros(1), torch.zeros(1), float(ts[k]), float(ts[k + 1] - ts[k]),
                                policy.eta)[2].reshape(()) for k in range(K)]).repeat(rollout.units.shape[1] // K)
    expected = ((cur - ref_means) ** 2).flatten(2).mean(-1) / (2 * std ** 2)
    m = rollout.mask
    torch.testing.assert_close(kl[m], expected[m])
    assert bool((kl[m] > 0).all()) and bool((kl[~m] == 0).all())
    assert trainer.update(rollout)["train/kl_ref"] > 0
