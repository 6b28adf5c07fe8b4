"""The trainer end to end on tiny models: it learns, resumes exactly, and micro-batching is invisible."""

import json

import numpy as np
import pytest
import torch

from mmrl.config import config_from_dict
from mmrl.envs import make_task
from mmrl.policies import build_policy
from mmrl.rewards import REWARDS, register_reward
from mmrl.stages import Guidance, PromptReplay, SFTMix
from mmrl.trainer import Trainer

if "test_digit_share" not in REWARDS:

    @register_reward("test_digit_share")
    def _digit_share(contexts, outputs, **_):
        """Share of the completion's characters that are digits: trivially learnable from scratch,
        and dense (a random model scores ~0.04 with spread), so every batch carries signal."""
        return torch.tensor([sum(ch.isdigit() for ch in o) / max(len(o), 1) for o in outputs])

if "test_digit_share_odd_answers" not in REWARDS:

    @register_reward("test_digit_share_odd_answers")
    def _digit_share_odd(contexts, outputs, **_):
        """The digit share for prompts with an odd answer, 0 for every sample of the others: groups
        of even-answer prompts are constant (no signal), the others differ."""
        share = _digit_share(contexts, outputs)
        return torch.tensor([float(s) if int(c["answer"]) % 2 else 0.0 for c, s in zip(contexts, share)])


def make_cfg(tmp_path, **sections):
    base = {
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                           "num_key_value_heads": 1}, "tokenizer_vocab_size": 280},
        "task": {"name": "arithmetic", "params": {"max_operand": 20}},
        "rewards": [{"name": "test_digit_share"}],
        "sampling": {"group_size": 8, "max_new_tokens": 4},
        "train": {"steps": 4, "prompts_per_step": 4, "lr": 3e-3, "eval_every": 0, "eval_size": 16,
                  "progress": False, "output_dir": str(tmp_path / "run"), "seed": 1},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return config_from_dict(base)


def build(cfg):
    torch.manual_seed(cfg.train.seed)
    task = make_task(cfg.task.name, seed=cfg.train.seed, **cfg.task.params)
    return Trainer(cfg, build_policy(cfg, task, torch.device("cpu")), task)


def grads(trainer):
    return {k: p.grad.clone() for k, p in trainer.policy.model.named_parameters() if p.grad is not None}


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()}


def test_grpo_learns_a_trivial_task(tmp_path):
    cfg = make_cfg(tmp_path, train={"steps": 40, "lr": 1e-2, "prompts_per_step": 4}, sampling={"temperature": 1.0})
    trainer = build(cfg)
    rewards = [trainer.train_step()["reward/total"] for _ in range(40)]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > 0.6 and last > first + 0.4, (first, last)  # from ~0.04 to most samples


@pytest.mark.parametrize("algo", [{"loss": "grpo"}, {"loss": "gspo"}, {"loss": "cispo", "beta": 0.05},
                                  {"loss": "dr_grpo", "entropy_coef": 0.01}])
def test_micro_batching_does_not_change_the_update(tmp_path, algo):
    def one_step(micro):
        cfg = make_cfg(tmp_path, algo=algo, train={"micro_batch_size": micro, "steps": 1})
        trainer = build(cfg)
        trainer.train_step()
        return grads(trainer)

    # Gradients, not weights: Adam's first step is ~lr*sign(g) and would amplify float noise.
    whole, split = one_step(0), one_step(5)  # 32 rows in micro-batches of 5, 5, ..., 2
    assert whole.keys() == split.keys() and len(whole) > 0
    for k in whole:
        assert torch.allclose(whole[k], split[k], atol=1e-7, rtol=1e-4), k


@pytest.mark.parametrize("algo", [{}, {"prompt_replay": 0.5}])
def test_resume_is_exact(tmp_path, algo):
    straight = build(make_cfg(tmp_path / "a", train={"steps": 4, "save_every": 0}, algo=algo))
    straight.train()
    cfg_b = make_cfg(tmp_path / "b", train={"steps": 4, "save_every": 2}, algo=algo)
    interrupted = build(cfg_b)
    interrupted.cfg.train.steps = 2  # stop after step 2, as if killed right after its checkpoint
    interrupted.train()
    resumed = build(make_cfg(tmp_path / "b", train={"steps": 4, "save_every": 2}, algo=algo))
    assert resumed.resume() and resumed.step == 2
    resumed.train()
    a, b = weights(straight), weights(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert straight.task.state_dict() == resumed.task.state_dict()
    rows = [json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "reward/total" in r]
    assert train_steps == [1, 2, 3, 4]  # the resumed log reads as one clean run


def test_reference_model_only_when_beta_positive(tmp_path):
    assert build(make_cfg(tmp_path)).policy.reference is None
    t = build(make_cfg(tmp_path, algo={"beta": 0.1}))
    assert t.policy.reference is not None
    assert not any(p.requires_grad for p in t.policy.reference.parameters())
    metrics = t.train_step()
    assert "train/kl_ref" in metrics and metrics["train/kl_ref"] >= 0


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    cfg = make_cfg(tmp_path, algo={"loss": "dapo", "dynamic_sampling": True, "max_sampling_tries": 3})
    trainer = build(cfg)
    rollout, stats = trainer.collect()
    assert stats["sampling/tries"] >= 1
    r, g = rollout.rewards["total"], rollout.group_ids
    for gid in g.unique():
        vals = r[g == gid]
        assert vals.max() > vals.min(), "a kept group has all-equal rewards"
    assert len(rollout) <= cfg.train.prompts_per_step * cfg.sampling.group_size


def test_prompt_replay_draws_again_the_prompts_whose_groups_differed(tmp_path):
    cfg = make_cfg(tmp_path, rewards=[{"name": "test_digit_share_odd_answers"}],
                   train={"prompts_per_step": 8}, algo={"prompt_replay": 0.5, "prompt_replay_size": 64})
    trainer = build(cfg)
    first, stats = trainer.collect()
    G = cfg.sampling.group_size
    prompts = [c["prompt"] for c in first.contexts[::G]]
    rewards = first.rewards["total"].reshape(-1, G)
    differing = [p for p, r in zip(prompts, rewards) if r.max() > r.min()]
    assert 0 < len(differing) < len(prompts)  # odd answers differ, even ones are constant
    replay = trainer.stages.find(PromptReplay)
    assert [c["prompt"] for c in replay.buffer] == differing
    assert stats["replay/pushed"] == len(differing) and stats["replay/drawn"] == 0
    second, stats = trainer.collect()
    n_replayed = min(4, len(differing))  # round(0.5 * 8), oldest first
    assert [c["prompt"] for c in second.contexts[::G]][:n_replayed] == differing[:n_replayed]
    assert stats["replay/drawn"] == n_replayed
    # the replayed prompts left the buffer; the ones still informative came back behind the rest
    left = differing[n_replayed:]
    assert [c["prompt"] for c in replay.buffer][:len(left)] == left


def test_prompt_replay_buffer_is_a_bounded_fifo():
    replay = PromptReplay(capacity=3)
    replay.push(["a", "b"])
    replay.push(["c", "d"])
    assert list(replay.buffer) == ["b", "c", "d"]  # full: the oldest went first
    assert replay.draw(2) == ["b", "c"] and replay.draw(5) == ["d"] and len(replay) == 0


def test_group_contexts_takes_each_selected_groups_context_once(tmp_path):
    from mmrl.rollout import Rollout
    from mmrl.stages import group_contexts

    ids = torch.tensor([7, 5, 7, 5, 9, 9])  # interleaved groups
    rollout = Rollout(group_ids=ids, units=torch.zeros(6, 1), logp_old=torch.zeros(6, 1), max_units=1,
                      mask=torch.ones(6, 1, dtype=torch.bool), truncated=torch.zeros(6, dtype=torch.bool),
                      contexts=["a", "b", "a", "b", "c", "c"])
    assert group_contexts(rollout, torch.tensor([True, False, True, False, True, True])) == ["a", "c"]
    assert group_contexts(rollout, torch.zeros(6, dtype=torch.bool)) == []


def test_guidance_adds_the_supervised_loss_of_failed_groups_to_the_update(tmp_path):
    def make(**algo):  # no clipping: the gradients are compared as computed
        return build(make_cfg(tmp_path, rewards=[{"name": "test_digit_share_odd_answers"}], algo=algo,
                              train={"prompts_per_step": 8, "grad_clip": 1e9}))

    trainer = make(guide_below=1e-6, guide_coef=0.5)
    rollout, stats = trainer.collect()
    G = trainer.cfg.sampling.group_size
    best = rollout.rewards["total"].reshape(-1, G).amax(1)
    failed = [c["prompt"] for c, b in zip(rollout.contexts[::G], best) if b < 1e-6]
    guided = trainer.stages.find(Guidance).contexts
    assert 0 < len(failed) < 8 and [c["prompt"] for c in guided] == failed
    assert stats["guide/failed_groups"] == len(failed)
    # the update's gradient is the RL gradient plus 0.5 x the supervised gradient on those prompts
    plain, sft_only = make(), make()
    for t in (plain, sft_only):
        t.policy.model.load_state_dict(trainer.policy.model.state_dict())
    m = trainer.update(rollout)
    plain.update(rollout)
    (0.5 * sft_only.policy.sft_loss(guided)).backward()
    g_guided, g_plain, g_sft = grads(trainer), grads(plain), grads(sft_only)
    assert m["train/guide_loss"] > 0
    for k in g_guided:
        assert torch.allclose(g_guided[k], g_plain[k] + g_sft[k], atol=1e-6, rtol=1e-4), k


def test_sft_coef_adds_a_fresh_expert_batch_to_every_optimizer_step(tmp_path):
    def make(**algo):  # no clipping: the gradients are compared as computed
        return build(make_cfg(tmp_path, algo=algo, train={"grad_clip": 1e9}, sft={"batch_size": 6}))

    trainer = make(sft_coef=0.3)
    rollout, _ = trainer.collect()
    plain, sft_only = make(), make()
    for t in (plain, sft_only):
        t.policy.model.load_state_dict(trainer.policy.model.state_dict())
    # The batch the update draws: the trainer's own stream, which a checkpoint carries.
    state = trainer.state_dict()
    probe = np.random.default_rng()
    probe.bit_generator.state = state["stages"]["sft_mix"]["rng"]
    expert = trainer.task.sft_batch(6, probe)
    m = trainer.update(rollout)
    plain.update(rollout)
    (0.3 * sft_only.policy.sft_loss(expert)).backward()
    g_mixed, g_plain, g_sft = grads(trainer), grads(plain), grads(sft_only)
    assert m["train/sft_loss"] > 0 and "train/sft_loss" not in plain.update(rollout)
    for k in g_mixed:
        assert torch.allclose(g_mixed[k], g_plain[k] + g_sft[k], atol=1e-6, rtol=1e-4), k
    # The stream moved on, and a resumed trainer continues it where the checkpoint left it.
    mix = trainer.stages.find(SFTMix)
    assert mix.rng.bit_generator.state != state["stages"]["sft_mix"]["rng"]
    trainer.step = 1
    trainer.save()
    resumed = make(sft_coef=0.3)
    resumed.resume()
    assert resumed.stages.find(SFTMix).rng.bit_generator.state == mix.rng.bit_generator.state


def test_guidance_steps_even_when_filtering_leaves_no_group(tmp_path):
    if "test_zero" not in REWARDS:
        register_reward("test_zero")(lambda contexts, outputs, **_: torch.zeros(len(outputs)))
    trainer = build(make_cfg(tmp_path, rewards=[{"name": "test_zero"}],
                             algo={"dynamic_sampling": True, "max_sampling_tries": 2, "guide_below": 0.5}))
    before = weights(trainer)
    m = trainer.train_step()
    assert m["sampling/kept_groups"] == 0 and m["guide/failed_groups"] == 2 * trainer.cfg.train.prompts_per_step
    assert m["train/guide_loss"] > 0 and "train/loss" not in m
    assert any(not torch.equal(before[k], v) for k, v in weights(trainer).items())


def test_guidance_without_targets_is_a_clear_error(tmp_path):
    trainer = build(make_cfg(tmp_path, algo={"guide_below": 2.0}))  # every group "failed"
    rollout, _ = trainer.collect()
    for c in trainer.stages.find(Guidance).contexts:
        del c["target"]
    with pytest.raises(ValueError, match="guide_below.*'target'"):
        trainer.update(rollout)


def test_reused_sampler_logprobs_give_ratio_one(tmp_path):
    trainer = build(make_cfg(tmp_path))
    m = trainer.train_step()
    assert abs(m["train/ratio_mean"] - 1) < 1e-5 and m["train/clip_frac"] == 0


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    from mmrl.checkpoint import CheckpointError, load_checkpoint

    trainer = build(make_cfg(tmp_path))
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(tmp_path / "nowhere", trainer.policy.model)


def test_lora_trains_only_adapters_and_uses_the_base_as_reference(tmp_path):
    pytest.importorskip("peft")
    cfg = make_cfg(tmp_path, model={"lora_rank": 4, "lora_target_modules": ["q_proj", "v_proj"]}, algo={"beta": 0.1})
    trainer = build(cfg)
    assert trainer.policy.reference is None  # the disabled adapter is the reference: no copy
    trainable = {n for n, p in trainer.policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters() if p.requires_grad}
    metrics = trainer.train_step()
    after = dict(trainer.policy.model.named_parameters())
    assert all(torch.equal(frozen_before[n], after[n]) for n in frozen_before)
    assert any(not torch.equal(lora_before[n], after[n]) for n in lora_before)
    assert metrics["train/kl_ref"] >= 0


def test_gfpo_gives_zero_advantage_to_filtered_members(tmp_path):
    trainer = build(make_cfg(tmp_path, algo={"gfpo_keep": 3, "gfpo_metric": "shortest"}))
    rollout, _ = trainer.collect()
    adv, _ = trainer.advantages(rollout)
    for gid in rollout.group_ids.unique():
        rows = rollout.group_ids == gid
        assert int((adv[rows] != 0).sum()) <= 3
        kept_len = rollout.lengths[rows][adv[rows] != 0]
        if len(kept_len):  # the kept ones are among the shortest of their group
            assert kept_len.max() <= rollout.lengths[rows].sort().values[2]


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_batch"])
def test_token_weighted_advantages_get_the_rollout_mask(tmp_path, name):
    """Estimators that whiten over tokens are given the rollout's mask: longer completions weigh more."""
    from mmrl.algos import compute_advantages

    trainer = build(make_cfg(tmp_path, algo={"advantage": name}))
    rollout, _ = trainer.collect()
    assert len(set(rollout.lengths.tolist())) > 1  # otherwise the mask would not matter
    # rewards spread over every group (a tiny random model's own are mostly 0)
    rewards = rollout.rewards["total"] = torch.rand(len(rollout.lengths), generator=torch.Generator().manual_seed(0))
    expect = compute_advantages(name, rewards, rollout.group_ids, mask=rollout.mask)
    torch.testing.assert_close(trainer.advantages(rollout)[0], expect)
    assert not torch.allclose(expect, compute_advantages(name, rewards, rollout.group_ids))


def test_several_epochs_and_mini_batches_clip_off_policy_ratios(tmp_path):
    cfg = make_cfg(tmp_path, train={"ppo_epochs": 3, "mini_batches": 2, "lr": 2e-2},
                   algo={"loss": "grpo", "loss_params": {"eps_low": 0.05, "eps_high": 0.05}})
    trainer = build(cfg)
    m = trainer.train_step()
    # After the first optimizer step the policy has moved: later mini-batches see ratios != 1.
    assert m["train/ratio_max"] > 1.0 or m["train/ratio_min"] < 1.0
    assert m["train/clip_frac"] > 0
    assert trainer.updater.scheduler.last_epoch == 6  # 3 epochs x 2 mini-batches = 6 optimizer steps


def test_entropy_top_frac_restricts_the_policy_gradient_to_high_entropy_tokens(tmp_path, monkeypatch):
    import mmrl.algos as algos

    seen = []
    real = algos.policy_loss

    def spy(name, logp, old_logp, adv, mask, **kw):
        logp.retain_grad()
        seen.append((logp, mask))
        return real(name, logp, old_logp, adv, mask, **kw)

    monkeypatch.setattr(algos, "policy_loss", spy)
    trainer = build(make_cfg(tmp_path, algo={"entropy_top_frac": 0.25}))
    rollout, _ = trainer.collect()
    with torch.no_grad():
        _, entropy = trainer.policy.logprobs(rollout, with_entropy=True)
    trainer.update(rollout)
    logp, pg_mask = seen[0]
    full = rollout.mask
    assert int(pg_mask.sum()) == int(np.ceil(0.25 * int(full.sum())))
    assert not (pg_mask & ~full).any()
    # the kept tokens are the highest-entropy ones; the others get no policy gradient
    assert entropy[pg_mask].min() >= entropy[full & ~pg_mask].max() - 1e-6
    assert torch.all(logp.grad[~pg_mask] == 0) and logp.grad[pg_mask].abs().sum() > 0
