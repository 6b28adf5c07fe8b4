"""`algo.kl_kind: gaussian`: the exact KL of each Gaussian denoising step to the reference's step
(Flow-GRPO's KL term), its scale independent of the latent's size, computed from the step means of
the update's own forward, equal with and without unit windows, and refused where units are not
Gaussian steps."""

import pytest
import torch

import mmrl
from mmrl import algos, stages
from mmrl.cli import main
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


def _direct_kl_term(trainer, rollout, ref_means):
    """Flow-GRPO's KL written out on the video policy's own step forward (`_step`, not the
    `_unit_steps` bookkeeping the trainer uses), aggregated as the trainer aggregates its terms."""
    policy, C = trainer.policy, trainer.policy.num_chunks
    states, text = rollout.extras["states"], rollout.extras["text"]
    kl = []
    for j in range(policy.config.num_steps):  # step j: units j*C .. j*C + C-1, one per chunk
        _, mean, std = policy._step(policy.model, states, text, j)  # [N, ch, C, F/C, H, W]
        ref = ref_means[:, j * C:(j + 1) * C]  # [N, C, ch, F/C, H, W]
        kl.append(((mean.transpose(1, 2) - ref) ** 2).flatten(2).mean(-1) / (2 * std ** 2))
    mask, budget, agg = rollout.mask, trainer.updater.unit_budget(rollout), trainer.updater.agg
    denom = algos.agg_denominator(mask, agg, budget)
    return algos.aggregate(torch.cat(kl, 1), mask, agg, budget, denominator=denom)


def test_the_kl_gradient_is_the_direct_one_and_the_same_with_unit_windows(tmp_path):
    trainer = _trainer(tmp_path)
    policy = trainer.policy
    rollout, _ = trainer.collect()
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}

    def update(unit_chunk, beta):
        policy.model.load_state_dict(state)
        trainer.cfg.train.unit_chunk = unit_chunk
        trainer.cfg.algo.beta = beta
        # the trainer reads its terms once
        trainer.updater.loss_terms = stages.from_algo(trainer.cfg.algo, 1).of(stages.LossTerm)
        metrics = trainer.update(rollout)
        return metrics, {k: p.grad.clone() for k, p in policy.model.named_parameters() if p.grad is not None}

    one_metrics, one = update(0, 0.5)
    _, without_kl = update(0, 1e-12)
    # The KL term's share of the gradient (one mini-batch, one epoch: the grads of the first
    # parameters) is beta times the gradient of the directly computed term.
    policy.model.load_state_dict(state)
    policy.model.zero_grad(set_to_none=True)
    term = _direct_kl_term(trainer, rollout, policy.reference_means(rollout))
    assert term.item() == pytest.approx(one_metrics["train/kl_ref"], rel=1e-5)
    (0.5 * term).backward()
    direct = {k: p.grad for k, p in policy.model.named_parameters() if p.grad is not None}
    assert set(direct) <= set(one) and sum(float(g.abs().sum()) for g in direct.values()) > 0
    for k in one:
        expected = direct[k] if k in direct else torch.zeros_like(one[k])
        torch.testing.assert_close(one[k] - without_kl[k], expected, atol=1e-6, rtol=1e-3)
    for chunk in (policy.num_chunks, 1):
        metrics, chunked = update(chunk, 0.5)
        assert metrics["train/kl_ref"] == pytest.approx(one_metrics["train/kl_ref"], rel=1e-5)
        for k in one:
            torch.testing.assert_close(one[k], chunked[k], atol=1e-6, rtol=1e-3)


@pytest.mark.parametrize("config", ["configs/digit_sort_grpo.yaml", "configs/video_kvpo.yaml"])
def test_gaussian_kl_is_refused_in_one_line_where_units_are_not_gaussian_steps(tmp_path, config, capsys):
    """A text policy, and the video generator under KVPO (its units are branches of an ODE)."""
    assert main(["train", config, "algo.beta=0.1", "algo.kl_kind=gaussian", f"train.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "algo.kl_kind: 'gaussian' needs units that are Gaussian denoising steps" in err
    assert "accepted with: diffusion, smolvla, video_gen" in err and "else k1, k2, k3 or abs" in err


@pytest.mark.robot  # lerobot's SmolVLA / Diffusion Policy
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
