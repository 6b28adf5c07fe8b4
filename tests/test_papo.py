"""Perception-aware terms: PAPO's k3 perception KL (hand-computed), the masked-image pass (same
units, black patches as the processor makes them), padding never counted, the terms in the update
(gradient moves, chunked update equals one pass), and VL-Calibration's reweighting wired in."""

import math

import numpy as np
import pytest
import torch

import mmrl
from mmrl.algos import perception_kl
from mmrl.config import load_config
from mmrl import stages
from mmrl.stages import AdvantageInputs, CertaintyReweight
from mmrl.trainer import Trainer
from mmrl.update import Updater

torch.set_num_threads(1)


def test_perception_kl_is_k3_and_zero_on_padding():
    logp = torch.tensor([[math.log(0.5), math.log(0.2), float("-inf")]])
    masked = torch.tensor([[math.log(0.25), math.log(0.2), 3.0]])
    mask = torch.tensor([[True, True, False]])
    kl = perception_kl(logp, masked, mask)
    # d = log 0.25 - log 0.5 = -log 2: exp(d) - d - 1 = 0.5 + log 2 - 1
    assert kl[0, 0].item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert kl[0, 1].item() == 0.0 and kl[0, 2].item() == 0.0  # equal log-probs; padding
    assert perception_kl(logp, masked - 5, mask, kl_max=0.2)[0, 0].item() == pytest.approx(0.2)


def _cfg(tmp_path, *overrides):
    return load_config("configs/vqa_grpo.yaml", [
        "task.params.n_train=32", "task.params.n_test=4", "task.params.n_ood=0", "task.params.eval_k=0",
        "sampling.group_size=4", "sampling.max_new_tokens=12", "train.prompts_per_step=2", "train.eval_size=4",
        "train.progress=false", "train.threads=0", "train.grad_clip=1e9", f"train.output_dir={tmp_path}",
        *overrides])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("papo"))
    task, policy = mmrl.build(cfg)
    return cfg, task, policy


def test_black_patch_is_what_the_processor_makes_of_a_black_image(built):
    _, _, policy = built
    enc = policy.processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[np.zeros((56, 56, 3), np.uint8)],
                           return_tensors="pt", **policy.image_kwargs)
    rows = enc["pixel_values"]
    assert torch.allclose(rows, policy.black_patch().expand_as(rows), atol=1e-6)


def test_the_masked_pass_scores_the_same_units(built):
    _, task, policy = built
    rollout = policy.sample(task.eval_batch(2), 2, generator=torch.Generator().manual_seed(0)).stamp_groups(2)
    gen = torch.Generator().manual_seed(1)
    same = policy.mask_images(rollout, 0.0, gen)
    dark = policy.mask_images(rollout, 1.0, gen)
    assert same.units is rollout.units and dark.units is rollout.units and dark.mask is rollout.mask
    black = policy.black_patch()
    assert all(torch.equal(p, black.expand_as(p)) for p in dark.extras["pixel_values"])
    assert not any(torch.equal(p, q) for p, q in zip(dark.extras["pixel_values"], rollout.extras["pixel_values"]))
    half = policy.mask_images(rollout, 0.6, gen).extras["pixel_values"][0]
    share = (half == black).all(1).float().mean().item()
    assert 0.2 < share < 0.95  # each patch blacked independently, about 60% of them
    with torch.no_grad():
        base = policy.logprobs(rollout)[0]
        assert torch.equal(policy.logprobs(same)[0], base)
        assert not torch.allclose(policy.logprobs(dark)[0][rollout.mask], base[rollout.mask])


def _trainer(tmp_path, *overrides):
    cfg = _cfg(tmp_path, *overrides)
    torch.manual_seed(cfg.train.seed)
    task, policy = mmrl.build(cfg)
    return Trainer(cfg, policy, task)


def test_papo_terms_ignore_padding(tmp_path):
    """Ragged rows: garbage at padded positions of any score changes neither loss nor gradient."""
    trainer = _trainer(tmp_path, "algo.papo_gamma=0.5", "algo.papo_entropy=[0.1,0.2]", "algo.beta=0.1")
    rollout, _ = trainer.collect()
    mask = rollout.mask.clone()
    mask[0, 3:] = False  # make sure rows are ragged
    n, T = mask.shape
    g = torch.Generator().manual_seed(0)

    def run(pad_value):
        scores = {k: torch.where(mask, -torch.rand(n, T, generator=torch.Generator().manual_seed(i)), pad_value)
                  .requires_grad_() for i, k in enumerate(("logp", "entropy", "logp_masked", "entropy_masked"))}
        denom = torch.tensor(float(mask.sum()))
        old = torch.where(mask, -torch.rand(n, T, generator=g.manual_seed(9)), 0.0)
        ref = torch.where(mask, -torch.rand(n, T, generator=g.manual_seed(8)), 0.0)
        adv = torch.linspace(-1, 1, n)
        loss, metrics = trainer.updater.micro_loss(rollout, scores, mask, old, adv, ref, denom)
        loss.backward()
        return loss.item(), metrics, {k: v.grad for k, v in scores.items()}

    (l1, m1, g1), (l2, m2, g2) = run(0.0), run(-1e4)
    assert l1 == pytest.approx(l2, rel=1e-6) and m1["perception_kl"] == pytest.approx(m2["perception_kl"], rel=1e-6)
    for k in g1:
        assert torch.equal(g1[k][mask], g2[k][mask]) and not g1[k][~mask].any() and not g2[k][~mask].any(), k
    assert m1["perception_kl"] > 0 and "entropy_masked" in m1


def _grads(trainer, rollout, state, **cfg):
    trainer.policy.model.load_state_dict(state)
    for k, v in cfg.items():
        section, key = k.split("__")
        setattr(getattr(trainer.cfg, section), key, v)
    if any(k.startswith("algo__") for k in cfg):  # the update reads its stages once: build them again
        trainer.updater = Updater(trainer.cfg, trainer.policy, trainer.task, trainer.dist,
                                  stages.from_algo(trainer.cfg.algo, 1), trainer.autocast, trainer.shuffle_gen,
                                  trainer.sample_gen)
    trainer.sample_gen.manual_seed(7)  # the same image mask in every call
    metrics = trainer.update(rollout)
    return metrics, {k: p.grad.clone() for k, p in trainer.policy.model.named_parameters() if p.grad is not None}


def test_papo_moves_the_gradient_and_chunking_keeps_it(tmp_path):
    trainer = _trainer(tmp_path, "algo.papo_gamma=0.5", "algo.papo_entropy=[0.05,0.05]")
    rollout, _ = trainer.collect()
    state = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    metrics, papo = _grads(trainer, rollout, state)
    assert metrics["train/perception_kl"] > 0
    _, chunked = _grads(trainer, rollout, state, train__unit_chunk=3)
    for k in papo:
        assert torch.allclose(papo[k], chunked[k], atol=1e-7, rtol=1e-4), k
    _, plain = _grads(trainer, rollout, state, train__unit_chunk=0, algo__papo_gamma=0.0, algo__papo_entropy=[0.0, 0.0])
    assert any(not torch.allclose(papo[k], plain[k]) for k in papo)  # the perception terms change the update
    assert any("visual" in k and papo[k].abs().sum() > 0 for k in papo)  # they reach the vision tower


def test_certainty_reweighting_changes_only_negative_advantage_tokens(tmp_path):
    trainer = _trainer(tmp_path, "algo.certainty_reweight=0.5")
    rollout, _ = trainer.collect()
    mask = rollout.mask
    adv = torch.linspace(-1, 1, len(rollout))
    masked = trainer.policy.mask_images(rollout, 0.6, torch.Generator().manual_seed(0))
    u = trainer.updater
    x = AdvantageInputs(rollout, rollout.rewards["total"], mask, lambda: u.masked_pass_scores(rollout, masked))
    w = CertaintyReweight(alpha=0.5).weights(adv, x)
    assert w.shape == mask.shape and not w[~mask].any()
    assert torch.all(w[(adv >= 0)[:, None] & mask] == 1)  # positive advantages are left alone
    assert torch.all((w[mask] >= 0) & (w[mask] <= 2))


def test_papo_on_a_text_policy_is_one_clear_line(tmp_path, capsys):
    from mmrl.cli import main

    assert main(["train", "configs/digit_sort_grpo.yaml", "algo.papo_gamma=0.01", "train.steps=1",
                 f"train.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mmrl: error: algo.papo_gamma, algo.papo_entropy and algo.certainty_reweight need a policy whose "
                   "rollouts carry images to mask (qwen_vl); CausalLMPolicy cannot"]
    assert not (tmp_path / "metrics.jsonl").exists() or "sft/loss" not in (tmp_path / "metrics.jsonl").read_text()
