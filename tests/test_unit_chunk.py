"""`train.unit_chunk`: back-propagating a few units of each row at a time gives the one-pass loss
and gradient, for every aggregation mode and for sequence-level losses, with KL and entropy terms.
Also: the unit budget comes from the rollout, and group ids are stamped by the trainer."""

import pytest
import torch

from mmrl.algos import AGG_MODES
from test_trainer import build, make_cfg

torch.set_num_threads(1)


def _update(trainer, rollout, state, unit_chunk):
    """The loss and parameter gradient of one update from the weights `state`."""
    trainer.policy.model.load_state_dict(state)
    trainer.cfg.train.unit_chunk = unit_chunk
    metrics = trainer.update(rollout)
    grads = {k: p.grad.clone() for k, p in trainer.policy.model.named_parameters() if p.grad is not None}
    return metrics, grads


def _assert_same_update(tmp_path, algo, windows=(1, 3)):
    # grad_clip off: the clipped step would hide a gradient that is off by a constant factor.
    trainer = build(make_cfg(tmp_path, algo=algo,
                             sampling={"max_new_tokens": 8}, train={"grad_clip": 1e9, "prompts_per_step": 3}))
    rollout, _ = trainer.collect()
    assert rollout.units.shape[1] > max(windows)  # several windows per row
    state = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    one_metrics, one = _update(trainer, rollout, state, 0)
    assert one and any(g.abs().sum() > 0 for g in one.values())
    for chunk in windows:
        metrics, chunked = _update(trainer, rollout, state, chunk)
        assert metrics["train/loss"] == pytest.approx(one_metrics["train/loss"], rel=1e-5, abs=1e-7), chunk
        assert metrics["train/entropy"] == pytest.approx(one_metrics["train/entropy"], rel=1e-5), chunk
        for k in one:
            assert torch.allclose(one[k], chunked[k], atol=1e-7, rtol=1e-4), (chunk, k)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_chunked_update_equals_one_pass_for_every_aggregation(tmp_path, agg):
    _assert_same_update(tmp_path, {"loss": "grpo", "loss_params": {"agg": agg}, "beta": 0.05, "entropy_coef": 0.01})


@pytest.mark.parametrize("loss", ["gspo", "gmpo", "cispo", "sapo"])
def test_chunked_update_equals_one_pass_for_sequence_and_soft_losses(tmp_path, loss):
    # GSPO / GMPO take each row's ratio over all its tokens: no window alone sees it.
    _assert_same_update(tmp_path, {"loss": loss})


def test_the_unit_budget_comes_from_the_rollout(tmp_path):
    trainer = build(make_cfg(tmp_path, sampling={"max_new_tokens": 6}, train={"grad_clip": 1e9},
                             algo={"loss": "grpo", "loss_params": {"agg": "seq-mean-token-sum-norm"}}))
    rollout, _ = trainer.collect()
    assert rollout.max_units == 6 and trainer.updater.unit_budget(rollout) == 6
    state = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    _, whole = _update(trainer, rollout, state, 0)
    rollout.max_units = 12  # a policy whose units are not tokens sets its own budget
    _, halved = _update(trainer, rollout, state, 0)
    for k in whole:  # N * budget normalises the summed loss
        assert torch.allclose(halved[k], whole[k] / 2, atol=1e-8, rtol=1e-4), k


def test_group_ids_are_stamped_by_the_trainer(tmp_path):
    trainer = build(make_cfg(tmp_path, train={"prompts_per_step": 3}, sampling={"group_size": 4}))
    first, _ = trainer.collect()
    second, _ = trainer.collect()
    assert first.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert second.group_ids.tolist() == [3] * 4 + [4] * 4 + [5] * 4  # ids never repeat across steps
    raw = trainer.policy.sample(trainer.task.next_batch(2), 4)
    assert raw.group_ids is None  # policies return rows; only the trainer makes ids
    with pytest.raises(ValueError, match="groups of 3"):
        raw.stamp_groups(3)
