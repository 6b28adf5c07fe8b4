"""VL-Calibration (arXiv 2604.09529): mmrl/algos/calibration.py and the `vl_calibration` reward.
Every expected value is computed by hand in the comments."""

from __future__ import annotations

import math

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402

from mmrl.algos import AlgorithmError  # noqa: E402
from mmrl.algos.calibration import (  # noqa: E402
    calibration_reward,
    calibration_terms,
    certainty_from_stats,
    certainty_token_weights,
    decoupled_format_ok,
    harmonic_confidence,
    parse_confidences,
    parse_confidences_with_reason,
    token_visual_kl,
    visual_certainty,
)

T = torch.tensor
NAN, INF = float("nan"), float("inf")
SIG_R = 1 / (1 + math.exp(-math.sqrt(1.5)))  # sigmoid(sqrt(3/2)) = 0.772892...


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=tol, rtol=tol,
                               equal_nan=True)


def same(a, b):
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


# ---------------------------------------------------------------- token KL

def test_token_visual_kl_estimators():
    # d = logp_perturbed - logp = [ln 2, -1, 0]
    lp = T([[-1.0, -1.0, -2.0]])
    lq = lp + T([[math.log(2.0), -1.0, 0.0]])
    m = T([[True, True, True]])
    # k3 = e^d - d - 1: [2 - ln2 - 1, e^-1 + 1 - 1, 0] = [0.306853, 0.367879, 0]
    close(token_visual_kl(lp, lq, m), [[1 - math.log(2), math.exp(-1), 0.0]])
    # k1 = -d = [-ln2, 1, 0]; k2 = d^2/2 = [ln2^2/2, 0.5, 0]; abs = [ln2, 1, 0]
    close(token_visual_kl(lp, lq, m, "k1"), [[-math.log(2), 1.0, 0.0]])
    close(token_visual_kl(lp, lq, m, "k2"), [[math.log(2) ** 2 / 2, 0.5, 0.0]])
    close(token_visual_kl(lp, lq, m, "abs"), [[math.log(2), 1.0, 0.0]])
    with pytest.raises(AlgorithmError, match="estimator"):
        token_visual_kl(lp, lq, m, "k4")


def test_token_visual_kl_padding_is_zero_and_ignored():
    m = T([[True, False]])
    a = token_visual_kl(T([[-1.0, -INF]]), T([[-2.0, NAN]]), m)
    b = token_visual_kl(T([[-1.0, 5e6]]), T([[-2.0, -3e6]]), m)
    # first token d = -1: k3 = e^-1; padding exactly 0
    close(a, [[math.exp(-1), 0.0]])
    same(a, b)
    with pytest.raises(AlgorithmError, match="NaN"):
        token_visual_kl(T([[NAN, 0.0]]), T([[0.0, 0.0]]), m)


# ---------------------------------------------------------------- visual certainty (VCE)

def _vce_batch(pad_logp, pad_pert, pad_ent):
    """Three ragged replies, k1 estimator (kl_t = logp - logp_perturbed):
    A: 2 tokens, kl = [1, 3] -> mean 2,   H = [0.25, 0.75] -> mean 0.5,  ratio 4
    B: 1 token,  kl = [1]    -> mean 1,   H = [1]          -> mean 1,    ratio 1
    C: 3 tokens, kl = [0, 0.5, 1] -> 0.5, H = [1, 2, 3]    -> mean 2,    ratio 1/4
    """
    p = pad_logp
    logp = T([[-1.0, -1.0, p], [-0.5, p, p], [-1.0, -1.0, -1.0]])
    q = pad_pert
    pert = T([[-2.0, -4.0, q], [-1.5, q, q], [-1.0, -1.5, -2.0]])
    e = pad_ent
    ent = T([[0.25, 0.75, e], [1.0, e, e], [1.0, 2.0, 3.0]])
    mask = T([[True, True, False], [True, False, False], [True, True, True]])
    return logp, pert, ent, mask


def test_visual_certainty_sequence_hand_computed():
    logp, pert, ent, mask = _vce_batch(0.0, 0.0, 0.0)
    out = visual_certainty(logp, pert, ent, mask, kl_estimator="k1")
    # S = log(kl + eps) - log(H + eps) ~ [ln 4, 0, -ln 4]; mean 0, population std ln4 * sqrt(2/3)
    # z = [sqrt(3/2), 0, -sqrt(3/2)]; sigmoid -> [0.772892, 0.5, 0.227108]
    close(out, [SIG_R, 0.5, 1 - SIG_R])
    # padding holding huge / non-finite values changes nothing
    same(out, visual_certainty(*_vce_batch(1e9, -INF, NAN), kl_estimator="k1"))
    same(out, visual_certainty(*_vce_batch(NAN, 7e7, -1e9), kl_estimator="k1"))


def test_visual_certainty_is_detached_and_default_k3():
    logp, pert, ent, mask = _vce_batch(0.0, 0.0, 0.0)
    logp.requires_grad_(True)
    out = visual_certainty(logp, pert, ent, mask)
    assert not out.requires_grad
    # k3 per token: A d = [-1, -3] -> [e^-1, e^-3 + 2]; mean (0.367879 + 2.049787) / 2 = 1.208833
    # B d = -1 -> e^-1 = 0.367879; C d = [0, -0.5, -1] -> [0, 0.106531, 0.367879], mean 0.158137
    kl = T([(math.exp(-1) + math.exp(-3) + 2) / 2, math.exp(-1), (math.exp(-0.5) - 0.5 + math.exp(-1)) / 3])
    close(out, certainty_from_stats(kl, T([0.5, 1.0, 2.0])))


def test_certainty_from_stats_groups_constant_and_invalid():
    kl, h = T([2.0, 1.0, 0.5, 3.0, 9.0, 1.0]), T([0.5, 1.0, 2.0, 1.0, 1.0, 1.0])
    valid = T([True, True, True, True, False, True])
    # whole batch: S = [ln4, 0, -ln4, ln3, -, 0] (row 4 invalid: NaN, ignored)
    s = torch.tensor([math.log(4), 0.0, -math.log(4), math.log(3), 0.0])
    z = (s - s.mean()) / s.std(unbiased=False)
    close(certainty_from_stats(kl, h, valid), torch.cat([torch.sigmoid(z)[:4], T([NAN]), torch.sigmoid(z)[4:]]))
    # groups: {0,1,2} as before; {3,4}: one valid reply -> std 0 -> z 0 -> 0.5; {5}: alone -> 0.5
    out = certainty_from_stats(kl, h, valid, group_ids=T([7, 7, 7, -1, -1, 3]))
    close(out, [SIG_R, 0.5, 1 - SIG_R, 0.5, NAN, 0.5])
    # the invalid reply's values never matter
    same(out, certainty_from_stats(T([2.0, 1.0, 0.5, 3.0, NAN, 1.0]), T([0.5, 1.0, 2.0, 1.0, -INF, 1.0]), valid,
                                   group_ids=T([7, 7, 7, -1, -1, 3])))
    # all equal -> std 0 -> 0.5 everywhere
    close(certainty_from_stats(T([1.0, 1.0]), T([2.0, 2.0])), [0.5, 0.5])


def test_visual_certainty_reply_without_visual_tokens_is_nan():
    logp, pert, ent, mask = _vce_batch(0.0, 0.0, 0.0)
    mask[1] = False
    out = visual_certainty(logp, pert, ent, mask, kl_estimator="k1")
    # A: ln4, C: -ln4 -> z = +-1 -> sigmoid(1) = 0.731059; B has no token -> NaN
    close(out, [1 / (1 + math.exp(-1)), NAN, 1 / (1 + math.exp(1))])


def test_visual_certainty_token_level():
    # k1; masked tokens: (0,0) kl 2, H 1 -> S ln2; (0,1) kl 0.5, H 1 -> S -ln2; (1,0) kl 1, H 1 -> S 0
    # mean 0, population std ln2 * sqrt(2/3) -> z = [sqrt(3/2), -sqrt(3/2), 0]
    def batch(pad):
        logp = T([[0.0, 0.0, pad], [0.0, pad, pad]])
        pert = T([[-2.0, -0.5, pad], [-1.0, pad, pad]])
        ent = T([[1.0, 1.0, pad], [1.0, pad, pad]])
        return logp, pert, ent, T([[True, True, False], [True, False, False]])

    out = visual_certainty(*batch(0.0), kl_estimator="k1", level="token")
    close(out, [[SIG_R, 1 - SIG_R, 0.0], [0.5, 0.0, 0.0]])
    same(out, visual_certainty(*batch(NAN), kl_estimator="k1", level="token"))
    same(out, visual_certainty(*batch(-1e30), kl_estimator="k1", level="token"))
    with pytest.raises(AlgorithmError, match="level"):
        visual_certainty(*batch(0.0), level="word")


# ---------------------------------------------------------------- token weights (TAR)

def test_certainty_token_weights_sequence_certainty():
    mask = T([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]).bool()
    target = T([[1, 1, 0, 0], [1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 0]]).bool()
    cert = T([0.25, 0.9, 0.5, 0.1])
    adv = T([-1.0, -2.0, -0.5, 1.0])
    w = certainty_token_weights(cert, mask, advantages=adv, target_mask=target)
    # alpha 0.5: w = 1 + 0.5 (1 - 2c): c .25 -> 1.25, c .9 -> 0.6, c .5 -> 1; row 3 has A > 0 -> 1
    # non-target response tokens 1, padding 0
    close(w, [[1.25, 1.25, 1.0, 0.0], [0.6, 0.6, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert (w[~mask] == 0).all()
    # without target_mask every negative-advantage response token is reweighted
    w_all = certainty_token_weights(cert, mask, advantages=adv)
    close(w_all, [[1.25, 1.25, 1.25, 0.0], [0.6, 0.6, 0.0, 0.0], [1.0] * 4, [1.0, 0.0, 0.0, 0.0]])


def test_certainty_token_weights_token_certainty_clip_and_padding():
    mask = T([[True, True, True, False], [True, True, False, False]])

    def run(pad, **kw):
        cert = T([[0.0, 1.0, 0.3, pad], [0.75, 0.5, pad, pad]])
        adv = T([[-1.0, -1.0, 2.0, pad], [-3.0, -3.0, pad, pad]])
        return certainty_token_weights(cert, mask, advantages=adv, **kw)

    w = run(0.0)
    # per token: c 0 -> 1.5, c 1 -> 0.5, A > 0 -> 1; c .75 -> 0.75, c .5 -> 1; padding 0
    close(w, [[1.5, 0.5, 1.0, 0.0], [0.75, 1.0, 0.0, 0.0]])
    same(w, run(NAN))
    same(w, run(1e9))
    # alpha 2: c 0 -> 3 clipped to w_max 2; c 1 -> -1 clipped to w_min 0; c .75 -> 0; c .5 -> 1
    close(run(0.0, alpha=2.0), [[2.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    close(run(0.0, alpha=2.0, w_min=0.25, w_max=1.5), [[1.5, 0.25, 1.0, 0.0], [0.25, 1.0, 0.0, 0.0]])


def test_certainty_token_weights_errors():
    mask = T([[True, False]])
    with pytest.raises(AlgorithmError, match="\\[0, 1\\]"):
        certainty_token_weights(T([1.5]), mask, advantages=T([-1.0]))
    with pytest.raises(AlgorithmError, match="NaN"):
        certainty_token_weights(T([NAN]), mask, advantages=T([-1.0]))
    with pytest.raises(AlgorithmError, match="shape"):
        certainty_token_weights(T([0.5, 0.5]), mask, advantages=T([-1.0]))
    # a NaN certainty on an untouched (positive-advantage) reply is fine: weight 1
    close(certainty_token_weights(T([NAN]), mask, advantages=T([1.0])), [[1.0, 0.0]])


# ---------------------------------------------------------------- confidences and reward terms

def test_harmonic_confidence():
    # 2 * .8 * .6 / 1.4 = 24/35; 2 * .5 * .5 / 1 = .5; a zero -> 0; 1, 1 -> 1
    close(harmonic_confidence(T([0.8, 0.5, 0.0, 1.0, 0.0]), T([0.6, 0.5, 0.7, 1.0, 0.0])),
          [24 / 35, 0.5, 0.0, 1.0, 0.0])


def _conf(v, r):
    return (f"<confidence><vision_confidence>{v}</vision_confidence>"
            f"<reasoning_confidence>{r}</reasoning_confidence></confidence>")


def test_parse_confidences():
    assert parse_confidences("blah " + _conf(8, 6)) == (0.8, 0.6)
    assert parse_confidences(_conf("7.5", "10")) == (0.75, 1.0)
    # whitespace around < > / is dropped first (the code's normalisation)
    assert parse_confidences("< confidence >< vision_confidence > 3 </ vision_confidence >\n"
                             "<reasoning_confidence> 0 </reasoning_confidence></confidence>") == (0.3, 0.0)
    # the first complete block wins; an incomplete block before it is skipped
    txt = "<confidence><vision_confidence>2</vision_confidence></confidence>" + _conf(4, 5) + _conf(9, 9)
    assert parse_confidences(txt) == (0.4, 0.5)
    assert parse_confidences(_conf(80, 60), scale=100) == (0.8, 0.6)
    assert parse_confidences_with_reason(_conf(11, 5)) == (None, "confidence_out_of_range")
    assert parse_confidences_with_reason(_conf("high", 5)) == (None, "bad_confidence")
    assert parse_confidences_with_reason(_conf(-3, 5)) == (None, "bad_confidence")
    assert parse_confidences_with_reason("<vision_confidence>8</vision_confidence>") == (None, "no_confidence")
    # reasoning before vision is not the format
    swapped = ("<confidence><reasoning_confidence>5</reasoning_confidence>"
               "<vision_confidence>8</vision_confidence></confidence>")
    assert parse_confidences_with_reason(swapped) == (None, "no_confidence")
    assert parse_confidences_with_reason(None) == (None, "no_confidence")


def reply(answer="red", v=8, r=6, vision="a red ball", analysis=True):
    ana = "<analysis>check</analysis>" if analysis else ""
    return (f"<think><vision>{vision}</vision><reasoning>so it is {answer}</reasoning></think> "
            f"\\boxed{{{answer}}} {ana}" + _conf(v, r))


def test_decoupled_format_ok():
    assert decoupled_format_ok(reply())
    assert decoupled_format_ok(reply().replace("<think>", "< think >"))
    assert not decoupled_format_ok(reply(analysis=False))
    assert not decoupled_format_ok(reply(v=12))
    assert not decoupled_format_ok(reply().replace("\\boxed{red}", "red"))
    assert not decoupled_format_ok("<think><reasoning>x</reasoning><vision>y</vision></think>\\boxed{1}"
                                   "<analysis>a</analysis>" + _conf(5, 5))
    assert not decoupled_format_ok(3)


def test_calibration_reward_hand_computed():
    cv, cr = T([0.8, 0.5, NAN, 1.0]), T([0.6, 0.0, NAN, 1.0])
    y, t = T([1.0, 0.0, 1.0, 0.0]), T([0.5, 0.5, 0.3, NAN])
    r_cal, r_vis = calibration_terms(cv, cr, y, t)
    # row 0: Phi 24/35, R_cal = -(11/35)^2 = -121/1225, R_vis = -(0.8 - 0.5)^2 = -0.09
    # row 1: Phi 0 (a zero confidence), wrong: R_cal = 0; R_vis = -(0.5 - 0.5)^2 = 0
    # row 2: no confidences -> -1, -1; row 3: Phi 1, wrong -> R_cal -1; no target -> R_vis -1
    close(r_cal, [-121 / 1225, 0.0, -1.0, -1.0])
    close(r_vis, [-0.09, 0.0, -1.0, -1.0])
    # 2 R_cal + 0.4 R_vis
    close(calibration_reward(cv, cr, y, t), [-242 / 1225 - 0.036, 0.0, -2.4, -2.4])
    close(calibration_reward(cv, cr, y, t, brier_weight=1.0, vision_weight=1.0, missing_penalty=0.5),
          [-121 / 1225 - 0.09, 0.0, -1.0, -1.5])
    # no target at all: R_vis = -1 everywhere
    close(calibration_reward(cv, cr, y), [-242 / 1225 - 0.4, -0.4, -2.4, -2.4])
    with pytest.raises(AlgorithmError, match="\\[0, 1\\]"):
        calibration_terms(T([1.2]), T([0.5]), T([1.0]))


# ---------------------------------------------------------------- the registered reward

@pytest.fixture(scope="module")
def build():
    pytest.importorskip("math_verify")
    import mmrl.rewards.calibration  # noqa: F401  (registers vl_calibration)
    from mmrl.rewards import REWARDS, build_reward

    assert "vl_calibration" in REWARDS
    return lambda **params: build_reward("vl_calibration", params)


def test_reward_values_and_metrics(build):
    rw = build()
    ctxs = [
        {"answer": "red", "visual_certainty": 0.5},
        {"answer": "blue"},
        {"answer": "red"},
        {"answer": "red", "visual_certainty": 1.0},
        {"answer": "B", "options": ["cat", "dog"], "visual_certainty": 0.5},
        {"answer": "red"},
    ]
    outs = [
        reply(),                                   # correct, format ok, 8/6, target .5
        reply(),                                   # wrong, 8/6, no target
        "\\boxed{red} and no confidence",          # correct, bad format, no confidence
        "I think red. " + _conf(10, 10),           # no \boxed answer, confidences 1/1, target 1
        reply(answer="B", v=5, r=5),               # multiple choice correct, Phi .5, target .5
        None,                                      # not a string
    ]
    out = rw(ctxs, outs)
    assert out.dtype == torch.float32 and out.shape == (6,)
    # 0: 1 + 2 (-121/1225) + 0.4 + 0.4 (-0.09)           = 1.166449
    # 1: 0 + 2 (-(24/35)^2 = -576/1225) + 0.4 + 0.4 (-1) = -0.940408
    # 2: 1 + 2 (-1) + 0 + 0.4 (-1)                         = -1.4
    # 3: 0 + 2 (-(1 - 0)^2) + 0 + 0.4 (-(1 - 1)^2)         = -2.0
    # 4: 1 + 2 (-(0.5 - 1)^2) + 0.4 + 0.4 (-(0.5 - .5)^2)  = 0.9
    # 5: 0 + 2 (-1) + 0 + 0.4 (-1)                         = -2.4
    close(out, [1.4 - 242 / 1225 - 0.036, -1152 / 1225, -1.4, -2.0, 0.9, -2.4])
    m = rw.metrics()
    assert m["correct"] == 3 and m["wrong"] == 1 and m["no_answer"] == 2 and m["unparseable"] == 0
    assert m["format_ok"] == 3 and m["bad_format"] == 3
    assert m["no_confidence"] == 2 and m["parse_failures"] == 2
    assert m["no_visual_target"] == 3
    # parsed replies 0, 1, 3, 4: c_vis .8 .8 1 .5, c_reas .6 .6 1 .5, Phi 24/35 24/35 1 .5
    assert m["mean_vision_confidence"] == pytest.approx(3.1 / 4)
    assert m["mean_reasoning_confidence"] == pytest.approx(2.7 / 4)
    assert m["mean_confidence"] == pytest.approx((48 / 35 + 1.5) / 4)
    # (Phi - I)^2: 121/1225, 576/1225, 1, 0.25
    assert m["mean_brier"] == pytest.approx((697 / 1225 + 1.25) / 4)
    assert m["mean_visual_target"] == pytest.approx((0.5 + 1.0 + 0.5) / 3)


def test_reward_targets_from_raw_stats(build):
    rw = build()
    # mean KL / mean entropy ratios 4, 1, 1/4 -> targets sigmoid(+-sqrt(3/2)), 0.5 (see the VCE test);
    # an explicit visual_certainty (0.9) is used as given and stays out of the normalisation;
    # an entropy without a KL is no target
    ctxs = [
        {"answer": "red", "vision_kl": 2.0, "vision_entropy": 0.5},
        {"answer": "red", "vision_kl": 1.0, "vision_entropy": 1.0},
        {"answer": "red", "vision_kl": 0.5, "vision_entropy": 2.0},
        {"answer": "red", "visual_certainty": 0.9, "vision_kl": 100.0, "vision_entropy": 0.001},
        {"answer": "red", "vision_entropy": 1.0},
    ]
    out = rw(ctxs, [reply(v=5, r=5)] * 5)
    # each: 1 + 2 (-(0.5 - 1)^2) + 0.4 = 0.9, plus 0.4 R_vis with R_vis = -(0.5 - t)^2 (or -1)
    want = [0.9 - 0.4 * (0.5 - t) ** 2 for t in (SIG_R, 0.5, 1 - SIG_R, 0.9)] + [0.5]
    close(out, want)
    m = rw.metrics()
    assert m["no_visual_target"] == 1
    assert m["mean_visual_target"] == pytest.approx((1.0 + 0.5 + 0.9) / 4)


def test_reward_weights_and_options(build):
    rw = build(accuracy_weight=0.0, brier_weight=1.0, format_weight=0.0, vision_weight=0.0, scale=100)
    # scale 100: 80/60 -> .8/.6, Phi 24/35, correct -> -(11/35)^2
    out = rw([{"answer": "red"}], [reply(v=80, r=60)])
    close(out, [-121 / 1225])
    # a repeated call resets the counts
    rw([{"answer": "red"}], ["nothing"])
    assert rw.metrics()["no_answer"] == 1 and rw.metrics()["correct"] == 0
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError):
        build(answer_format="nope")
    with pytest.raises(ConfigError):
        build(scale=0)
