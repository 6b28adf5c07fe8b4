"""TIS / MIS training-inference mismatch weights against hand-computed values."""

import math

import pytest
import torch

from mmrl.algos import CORRECTION_LEVELS, CORRECTIONS, AlgorithmError, mismatch_weights

torch.set_num_threads(1)

T = torch.tensor
INF = float("inf")
L05, L3, L15 = math.log(0.5), math.log(3.0), math.log(1.5)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a).double(), torch.as_tensor(b).double(), atol=tol, rtol=tol)


def token_batch():
    """One row, log-ratios log 0.5, log 3, log 1.5 (rho = 0.5, 3, 1.5) and a padded 4th position
    holding -inf (trainer) and NaN (sampler)."""
    logp_beh = T([[-1.0, -2.0, -0.5, float("nan")]])
    logp_old = T([[-1.0 + L05, -2.0 + L3, -0.5 + L15, -INF]])
    mask = T([[True, True, True, False]])
    return logp_old, logp_beh, mask


def seq_batch():
    """Row 0: rho = 0.5 * 3 * 1.5 = 2.25 (+ a -inf pad); row 1: 0.5 * 3 = 1.5; row 2: 0.5;
    row 3: no masked unit at all (pads hold -inf)."""
    logp_beh = T(
        [
            [-1.0, -2.0, -0.5, -INF],
            [-0.3, -0.7, -INF, -INF],
            [-1.2, 0.0, 0.0, 0.0],
            [-INF, -INF, -INF, -INF],
        ]
    )
    d = T(
        [
            [L05, L3, L15, 0.0],
            [L05, L3, 0.0, 0.0],
            [L05, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    mask = T(
        [
            [True, True, True, False],
            [True, True, False, False],
            [True, False, False, False],
            [False, False, False, False],
        ]
    )
    logp_old = torch.where(mask, logp_beh + d, torch.full_like(d, -INF))
    return logp_old, logp_beh, mask


def assert_all_finite(weights, metrics):
    assert torch.isfinite(weights).all()
    for k, v in metrics.items():
        assert v.dim() == 0, k
        assert torch.isfinite(v), k


# ------------------------------------------------------------------ token level


def test_token_tis_truncates_at_cap():
    w, met = mismatch_weights(*token_batch(), kind="tis", level="token")
    assert w.shape == (1, 4)
    close(w, [[0.5, 2.0, 1.5, 0.0]])  # min(0.5, 2), min(3, 2), min(1.5, 2); pad -> 0
    close(met["truncated_frac"], 1 / 3)  # only the ratio 3 exceeds C = 2
    close(met["mismatch_ratio_max"], 3.0)
    assert "masked_frac" not in met
    assert_all_finite(w, met)


def test_token_mis_rejects_above_cap():
    w, met = mismatch_weights(*token_batch(), kind="mis", level="token")
    close(w, [[0.5, 0.0, 1.5, 0.0]])  # 3 > 2 rejected, the others keep their ratio
    close(met["masked_frac"], 1 / 3)
    close(met["mismatch_ratio_max"], 3.0)
    assert "truncated_frac" not in met
    assert_all_finite(w, met)


def test_token_custom_cap():
    logp_old, logp_beh, mask = token_batch()
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="tis", cap=1.2)
    close(w, [[0.5, 1.2, 1.2, 0.0]])  # 3 and 1.5 both exceed 1.2
    close(met["truncated_frac"], 2 / 3)
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="mis", cap=4.0)
    close(w, [[0.5, 3.0, 1.5, 0.0]])  # nothing above 4: plain ratios
    close(met["masked_frac"], 0.0)


def test_mis_keeps_ratio_equal_to_cap():
    # rho = exactly C = 2 (logp_old = log 2, logp_beh = 0): 1[rho <= C] keeps it; TIS gives C.
    logp_old, logp_beh, mask = T([[math.log(2.0)]]), T([[0.0]]), T([[True]])
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="mis")
    close(w, [[2.0]])
    close(met["masked_frac"], 0.0)
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="tis")
    close(w, [[2.0]])
    close(met["truncated_frac"], 0.0)


def test_token_rows_without_masked_units_get_zero():
    logp_old = T([[L3, 0.0], [-INF, -INF]])
    logp_beh = T([[0.0, 0.0], [-INF, 5.0]])
    mask = T([[True, False], [False, False]])
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="tis")
    close(w, [[2.0, 0.0], [0.0, 0.0]])
    close(met["truncated_frac"], 1.0)  # 1 of the 1 masked unit
    close(met["mismatch_ratio_max"], 3.0)
    close(met["mismatch_kl"], 3.0 - L3 - 1.0)


def test_huge_log_ratio_stays_finite():
    # d = +100 / -100: exp would overflow float32; the weight is still C (tis) / 0 (mis), no inf.
    logp_old, logp_beh, mask = T([[0.0, -100.0]]), T([[-100.0, 0.0]]), T([[True, True]])
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="tis")
    close(w[0, 0], 2.0)
    assert 0 <= float(w[0, 1]) < 1e-8
    close(met["truncated_frac"], 0.5)
    assert_all_finite(w, met)
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="mis")
    close(w[0, 0], 0.0)
    close(met["masked_frac"], 0.5)
    assert_all_finite(w, met)
    # Rejection is decided on the unclamped log-ratio: a cap above e^20 still rejects d = 100.
    w, _ = mismatch_weights(logp_old, logp_beh, mask, kind="mis", cap=1e9)
    close(w[0, 0], 0.0)


# ------------------------------------------------------------------ sequence level


def test_sequence_tis_products_of_ratios():
    w, met = mismatch_weights(*seq_batch(), kind="tis", level="sequence")
    assert w.shape == (4,)
    # row ratios 2.25, 1.5, 0.5 (products, not geometric means), row 3 has no unit -> 1
    close(w, [2.0, 1.5, 0.5, 1.0])
    close(met["truncated_frac"], 1 / 3)  # 1 of the 3 rows with a masked unit
    close(met["mismatch_ratio_max"], 2.25)
    assert_all_finite(w, met)


def test_sequence_mis_rejects_rows():
    w, met = mismatch_weights(*seq_batch(), kind="mis", level="sequence")
    close(w, [0.0, 1.5, 0.5, 1.0])
    close(met["masked_frac"], 1 / 3)
    close(met["mismatch_ratio_max"], 2.25)
    assert_all_finite(w, met)


def test_sequence_clamps_summed_log_ratio():
    # Sum of log-ratios 30 + 30 = 60: exp(60) overflows nothing thanks to the clamp; TIS -> C, MIS -> 0.
    logp_old, logp_beh, mask = T([[0.0, 0.0]]), T([[-30.0, -30.0]]), T([[True, True]])
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="tis", level="sequence")
    close(w, [2.0])
    close(met["mismatch_ratio_max"], math.exp(20.0), tol=1e-4)
    assert_all_finite(w, met)
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="mis", level="sequence")
    close(w, [0.0])
    assert_all_finite(w, met)


def test_sequence_mismatch_kl_is_per_token():
    # Same per-token k3 mean as the token level (units are tokens for the KL metric).
    _, met_s = mismatch_weights(*seq_batch(), kind="tis", level="sequence")
    # units: rho = 0.5, 3, 1.5, 0.5, 3, 0.5; k3 = rho - log rho - 1
    k3 = lambda r: r - math.log(r) - 1.0  # noqa: E731
    expected = (3 * k3(0.5) + 2 * k3(3.0) + k3(1.5)) / 6
    close(met_s["mismatch_kl"], expected)


# ------------------------------------------------------------------ metrics


def test_mismatch_kl_by_hand_two_units():
    # rho = 3 and 0.5: k3 = exp(d) - d - 1 = rho - log rho - 1
    #   (3 - 1.098612 - 1) + (0.5 + 0.693147 - 1) = 0.901388 + 0.193147 = 1.094535; mean 0.547267.
    # The reversed direction (1/rho + log rho - 1) would give 0.369400, k1 (-d) -0.202733.
    logp_beh = T([[-2.0, -1.0, 7.0]])
    logp_old = T([[-2.0 + L3, -1.0 + L05, -INF]])
    mask = T([[1.0, 1.0, 0.0]])  # 0/1 float mask accepted
    for kind in CORRECTIONS:
        for level in CORRECTION_LEVELS:
            _, met = mismatch_weights(logp_old, logp_beh, mask, kind=kind, level=level)
            close(met["mismatch_kl"], 0.547267)
            close(met["mismatch_kl"], (1.5 - L15) / 2)


def test_no_masked_unit_at_all():
    logp_old = T([[-INF, 0.0]])
    logp_beh = T([[float("nan"), -INF]])
    mask = T([[False, False]])
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="tis", level="token")
    close(w, [[0.0, 0.0]])
    close(met["mismatch_kl"], 0.0)
    close(met["mismatch_ratio_max"], 1.0)
    close(met["truncated_frac"], 0.0)
    w, met = mismatch_weights(logp_old, logp_beh, mask, kind="mis", level="sequence")
    close(w, [1.0])
    close(met["masked_frac"], 0.0)
    close(met["mismatch_ratio_max"], 1.0)


def test_float_mask_equals_bool_mask():
    logp_old, logp_beh, mask = seq_batch()
    for level in CORRECTION_LEVELS:
        wb, mb = mismatch_weights(logp_old, logp_beh, mask, kind="mis", level=level)
        wf, mf = mismatch_weights(logp_old, logp_beh, mask.float(), kind="mis", level=level)
        close(wb, wf)
        assert mb.keys() == mf.keys()
        for k in mb:
            close(mb[k], mf[k])


# ------------------------------------------------------------------ kind none


def test_none_gives_ones_and_watches_the_mismatch():
    w, met = mismatch_weights(*token_batch(), kind="none", level="token")
    assert w.shape == (1, 4)
    close(w, torch.ones(1, 4))
    assert set(met) == {"mismatch_kl", "mismatch_ratio_max"}
    close(met["mismatch_ratio_max"], 3.0)
    k3 = lambda r: r - math.log(r) - 1.0  # noqa: E731
    close(met["mismatch_kl"], (k3(0.5) + k3(3.0) + k3(1.5)) / 3)  # 0.396357
    close(met["mismatch_kl"], 0.396357)

    w, met = mismatch_weights(*seq_batch(), kind="none", level="sequence")
    assert w.shape == (4,)
    close(w, torch.ones(4))
    assert set(met) == {"mismatch_kl", "mismatch_ratio_max"}
    close(met["mismatch_ratio_max"], 2.25)


# ------------------------------------------------------------------ detached, dtype


def test_weights_are_detached():
    logp_old, logp_beh, mask = token_batch()
    logp_old = logp_old.clone().requires_grad_(True)
    logp_beh = logp_beh.clone().requires_grad_(True)
    for kind in CORRECTIONS:
        for level in CORRECTION_LEVELS:
            w, met = mismatch_weights(logp_old, logp_beh, mask, kind=kind, level=level)
            assert not w.requires_grad
            assert w.grad_fn is None
            assert all(not v.requires_grad for v in met.values())
    w, _ = mismatch_weights(logp_old, logp_beh, mask, kind="tis")
    close(w, [[0.5, 2.0, 1.5, 0.0]])


def test_bf16_inputs_give_float32_weights():
    logp_old, logp_beh, mask = T([[math.log(3.0), math.log(0.5)]]), T([[0.0, 0.0]]), T([[True, True]])
    w, met = mismatch_weights(logp_old.bfloat16(), logp_beh.bfloat16(), mask, kind="tis")
    assert w.dtype == torch.float32
    close(w, [[2.0, 0.5]], tol=1e-2)
    close(met["truncated_frac"], 0.5)


# ------------------------------------------------------------------ bad input


def test_unknown_kind():
    with pytest.raises(AlgorithmError) as e:
        mismatch_weights(*token_batch(), kind="tiss")
    msg = str(e.value)
    assert "'tiss'" in msg
    for name in CORRECTIONS:
        assert name in msg
    assert "mis, none, tis" in msg


def test_unknown_level():
    with pytest.raises(AlgorithmError) as e:
        mismatch_weights(*token_batch(), level="seq")
    msg = str(e.value)
    assert "'seq'" in msg
    assert "sequence, token" in msg


@pytest.mark.parametrize("cap", [1.0, 0.5, -3.0, float("nan")])
def test_cap_must_exceed_one(cap):
    with pytest.raises(AlgorithmError) as e:
        mismatch_weights(*token_batch(), cap=cap)
    msg = str(e.value)
    assert repr(cap) in msg
    assert "> 1" in msg


def test_cap_not_a_number():
    with pytest.raises(AlgorithmError) as e:
        mismatch_weights(*token_batch(), cap="two")
    assert "'two'" in str(e.value)


def test_shape_mismatch():
    with pytest.raises(AlgorithmError) as e:
        mismatch_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    assert "(2, 4)" in str(e.value) and "(2, 3)" in str(e.value)
    with pytest.raises(AlgorithmError) as e:
        mismatch_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))
    assert "mask" in str(e.value) and "(2, 4)" in str(e.value)
    with pytest.raises(AlgorithmError) as e:
        mismatch_weights(torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool))
    assert "(3,)" in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), INF, -INF])
def test_non_finite_at_masked_position(bad):
    mask = T([[True, True]])
    with pytest.raises(AlgorithmError) as e:
        mismatch_weights(T([[0.0, bad]]), T([[0.0, 0.0]]), mask)
    assert "logp_old" in str(e.value) and "NaN/inf" in str(e.value)
    with pytest.raises(AlgorithmError) as e:
        mismatch_weights(T([[0.0, 0.0]]), T([[bad, 0.0]]), mask, level="sequence")
    assert "logp_beh" in str(e.value)


# ---------------------------------------------------------------- wired into the trainer


def test_the_trainer_weights_each_units_loss_by_its_truncated_ratio(tmp_path):
    """`rollout.correction: tis`: each unit's loss term is weighted by min(rho, 2), rho = pi_old /
    pi_beh per unit, from the rollout's behaviour log-probs (an engine's); the logged
    share truncated is the share of units with rho > 2."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from dist_worker import build, make_cfg

    from mmrl.config import config_from_dict
    from mmrl.distributed import SINGLE

    cfg = make_cfg(str(tmp_path / "run"))
    cfg = config_from_dict({**cfg.to_dict(), "rollout": {"correction": "tis", "correction_cap": 2.0}})
    trainer = build(cfg, SINGLE)
    rollout, _ = trainer.collect()
    rho = torch.tensor([0.5, 3.0, 1.5, 2.5])[torch.arange(rollout.mask.shape[1]) % 4].expand_as(rollout.logp_old)
    rollout.logp_beh = rollout.logp_old - rho.log()
    adv, _ = trainer.advantages(rollout)
    weights, metrics = trainer.updater.correct_mismatch(rollout, rollout.logp_old, rollout.mask)
    torch.testing.assert_close(weights, torch.where(rollout.mask, rho.clamp(max=2.0), torch.zeros_like(rho)))
    share = ((rho > 2) & rollout.mask).sum() / rollout.mask.sum()
    assert metrics["correction/truncated_frac"] == pytest.approx(float(share))
    logged = trainer.update(rollout)
    assert logged["correction/truncated_frac"] == pytest.approx(float(share))


def test_auto_level_gives_a_sequence_loss_one_weight_per_sequence(tmp_path):
    """`rollout.correction: tis` with gspo (one advantage per sequence): the default level "auto"
    weights each row by min(prod_t rho_t, 2), and the update runs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from dist_worker import build, make_cfg

    from mmrl.config import config_from_dict
    from mmrl.distributed import SINGLE

    cfg = make_cfg(str(tmp_path / "run")).to_dict()
    cfg["algo"]["loss"], cfg["algo"]["loss_params"] = "gspo", {}
    trainer = build(config_from_dict({**cfg, "rollout": {"correction": "tis"}}), SINGLE)
    rollout, _ = trainer.collect()
    log_rho = torch.linspace(-0.3, 0.3, len(rollout))[:, None].expand_as(rollout.logp_old)  # per row, per unit
    rollout.logp_beh = rollout.logp_old - log_rho
    adv, _ = trainer.advantages(rollout)
    weights, _ = trainer.updater.correct_mismatch(rollout, rollout.logp_old, rollout.mask)
    assert weights.shape == adv.shape  # one weight per sequence, as its advantage
    torch.testing.assert_close(weights, torch.exp((log_rho * rollout.mask).sum(1)).clamp(max=2.0))
    assert "correction/truncated_frac" in trainer.update(rollout)


def test_correction_weights_the_whole_kl_cov_loss_and_picks_tokens_by_the_plain_advantage():
    """KL-Cov by hand, one row of 4 tokens: centred covariances (logp - 0.05)(A - 0.625) are
    0.019, 0.406, 0.344, 0.006, so token 1 takes the penalty 0.1 |logp - old|. The loss is the
    token mean of w * (-exp(logp - old) A + penalty). Weighting the advantages instead (the old
    trainer) would rank by A w, pick token 2 (0.703) and leave the penalty unweighted."""
    import math

    from mmrl.algos import policy_loss

    lp, adv, w = [0.1, -0.2, 0.3, 0.0], [1.0, -1.0, 2.0, 0.5], [0.5, 0.25, 2.0, 1.0]
    old, mask = torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool)
    term = [-math.exp(x) * a + (0.1 * abs(x) if i == 1 else 0.0) for i, (x, a) in enumerate(zip(lp, adv))]
    expected = sum(wi * ti for wi, ti in zip(w, term)) / 4
    loss, metrics = policy_loss("kl_cov", torch.tensor([lp]), old, torch.tensor([adv]), mask, weights=torch.tensor([w]))
    assert loss.item() == pytest.approx(expected, rel=1e-6) and metrics["cov_selected"].item() == 1
    weighted_adv, _ = policy_loss("kl_cov", torch.tensor([lp]), old, torch.tensor([adv]) * torch.tensor([w]), mask)
    assert abs(weighted_adv.item() - expected) > 1e-3  # the two are not the same loss
    # Clip-Cov and a sequence weight [N]: a constant weight scales the loss, whatever tokens it detaches.
    args = (torch.tensor([lp, lp]), torch.zeros(2, 4), torch.tensor([adv, adv]), torch.ones(2, 4, dtype=torch.bool))
    kw = {"clip_cov_lb": 0.0, "clip_cov_ub": 1.0, "clip_cov_ratio": 0.25}
    plain, _ = policy_loss("clip_cov", *args, generator=torch.Generator().manual_seed(0), **kw)
    scaled, _ = policy_loss("clip_cov", *args, generator=torch.Generator().manual_seed(0), weights=torch.tensor([3.0, 3.0]),
                            **kw)
    assert scaled.item() == pytest.approx(3 * plain.item(), rel=1e-6)
