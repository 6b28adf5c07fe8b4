"""Policy losses, aggregation, KL and entropy against written-out references."""

import math

import pytest
import torch

from mmrl.algos import (
    AlgorithmError,
    agg_denominator,
    aggregate,
    get_loss_spec,
    kl_penalty,
    list_algorithms,
    policy_loss,
    register_loss,
)

torch.set_num_threads(1)

T = torch.tensor
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_LEN = 16


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a).double(), torch.as_tensor(b).double(), atol=tol, rtol=tol)


# ------------------------------------------------------------------ random batch with padding


def make_batch(seed=0, n=6, t_len=7, spread=0.3, token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, t_len + 1, (n,), generator=g)
    lens[2] = 0  # a fully masked row
    mask = torch.arange(t_len)[None, :] < lens[:, None]
    old = -torch.rand(n, t_len, generator=g) * 3
    logp = old + spread * torch.randn(n, t_len, generator=g)
    adv = torch.randn(n, t_len if token_adv else 1, generator=g).squeeze(-1)
    # padding holds -inf, as a model's log-probs of pad tokens may
    logp = torch.where(mask, logp, torch.full_like(logp, float("-inf")))
    old = torch.where(mask, old, torch.full_like(old, float("-inf")))
    return logp, old, adv, mask


# ------------------------------------------------------------------ naive references (row loops)


def naive_terms(name, logp, old, adv, mask, p):
    """List of (row, per-token terms) with explicit loops; differentiable in logp."""
    n, t_len = mask.shape
    rows = []
    for i in range(n):
        idx = [t for t in range(t_len) if mask[i, t]]
        a_row = [adv[i, t] if adv.dim() == 2 else adv[i] for t in idx]
        terms = []
        if name in ("gspo", "gspo_token", "gmpo") and idx:
            ls = [logp[i, t] - old[i, t] for t in idx]
            if name == "gmpo":
                a = a_row[0]
                sg = 1.0 if a > 0 else (-1.0 if a < 0 else 0.0)
                lt = [sg * torch.minimum(sg * l, sg * l.clamp(-p["eps_low"], p["eps_high"])) for l in ls]
                rho = torch.exp(sum(lt) / len(idx))
                terms = [-a * rho for _ in idx]
            else:
                s = torch.exp(sum(ls) / len(idx))
                for k, t in enumerate(idx):
                    a = a_row[k]
                    st = s if name == "gspo" else s.detach() * torch.exp(logp[i, t] - logp[i, t].detach())
                    clipped = st.clamp(1 - p["eps_low"], 1 + p["eps_high"])
                    terms.append(-torch.minimum(st * a, clipped * a))
        else:
            for k, t in enumerate(idx):
                a = a_row[k]
                r = torch.exp(logp[i, t] - old[i, t])
                if name in ("grpo", "ppo", "dapo", "dr_grpo", "dual_clip"):
                    term = -torch.minimum(r * a, r.clamp(1 - p["eps_low"], 1 + p["eps_high"]) * a)
                    if name == "dual_clip" and a < 0:
                        term = torch.minimum(term, -p["dual_clip_c"] * a)
                elif name == "sapo":
                    tau = p["tau_pos"] if a > 0 else p["tau_neg"]
                    term = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a
                elif name == "cispo":
                    w = r.detach().clamp(max=1 + p["eps_high"])
                    if p.get("eps_low") is not None:
                        w = w.clamp(min=1 - p["eps_low"])
                    term = -w * a * logp[i, t]
                else:
                    raise KeyError(name)
                terms.append(term)
        rows.append(terms)
    return rows


def naive_agg(rows, agg, max_len=MAX_LEN):
    n = len(rows)
    if agg == "token-mean":
        cnt = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows if r) / max(cnt, 1)
    if agg == "seq-mean-token-mean":
        nz = [r for r in rows if r]
        return sum(sum(r) / len(r) for r in nz) / len(nz)
    if agg == "seq-mean-token-sum":
        return sum(sum(r) for r in rows if r) / n
    return sum(sum(r) for r in rows if r) / (n * max_len)


DEFAULTS = {
    "grpo": dict(eps_low=0.2, eps_high=0.2),
    "ppo": dict(eps_low=0.2, eps_high=0.2),
    "dr_grpo": dict(eps_low=0.2, eps_high=0.2),
    "dapo": dict(eps_low=0.2, eps_high=0.28),
    "dual_clip": dict(eps_low=0.2, eps_high=0.2, dual_clip_c=3.0),
    "gspo": dict(eps_low=3e-4, eps_high=4e-4),
    "gspo_token": dict(eps_low=3e-4, eps_high=4e-4),
    "gmpo": dict(eps_low=0.4, eps_high=0.4),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    "cispo": dict(eps_low=None, eps_high=4.0),
}
DEFAULT_AGG = {
    "grpo": "seq-mean-token-mean",
    "ppo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "dual_clip": "seq-mean-token-mean",
    "gspo": "seq-mean-token-mean",
    "gspo_token": "seq-mean-token-mean",
    "gmpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "cispo": "token-mean",
}


def check_against_naive(name, params, agg, seed, spread=0.3, token_adv=False):
    logp, old, adv, mask = make_batch(seed, spread=spread, token_adv=token_adv)
    lp = logp.clone().requires_grad_(True)
    kw = dict(params)
    if agg is not None:
        kw["agg"] = agg
    loss, metrics = policy_loss(name, lp, old, adv, mask, max_response_len=MAX_LEN, **kw)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask] == 0).all()

    p = {**DEFAULTS[name], **params}
    lp2 = torch.where(mask, logp, torch.zeros_like(logp)).clone().requires_grad_(True)
    ref = naive_agg(naive_terms(name, lp2, old, adv, mask, p), agg or DEFAULT_AGG[name])
    ref.backward()
    close(loss, ref)
    close(lp.grad, lp2.grad)
    for k in ("clip_frac", "approx_kl", "ratio_min", "ratio_mean", "ratio_max"):
        assert metrics[k].dim() == 0 and not metrics[k].requires_grad and torch.isfinite(metrics[k])
    return loss, metrics


# ------------------------------------------------------------------ every loss vs naive, value and gradient


CASES = [
    ("grpo", {}),
    ("ppo", {}),
    ("grpo", {"eps_low": 0.1, "eps_high": 0.3}),
    ("dr_grpo", {}),
    ("dapo", {}),
    ("dual_clip", {}),
    ("dual_clip", {"dual_clip_c": 1.5}),
    ("gspo", {}),
    ("gspo", {"eps_low": 0.05, "eps_high": 0.08}),
    ("gspo_token", {"eps_low": 0.05, "eps_high": 0.08}),
    ("gmpo", {}),
    ("gmpo", {"eps_low": 0.1, "eps_high": 0.15}),
    ("sapo", {}),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 3.0}),
    ("cispo", {}),
    ("cispo", {"eps_low": 0.2, "eps_high": 0.3}),
]


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_matches_naive_default_agg(name, params, seed):
    check_against_naive(name, params, None, seed, spread=0.3 if "gspo" not in name else 0.05)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", ["grpo", "dual_clip", "gspo", "gmpo", "sapo", "cispo"])
def test_loss_matches_naive_every_agg(name, agg):
    params = {"eps_low": 0.05, "eps_high": 0.08} if name == "gspo" else {}
    check_against_naive(name, params, agg, seed=3)


@pytest.mark.parametrize("name", ["grpo", "dapo", "sapo", "cispo", "gspo_token"])
def test_token_level_advantages(name):
    params = {"eps_low": 0.05, "eps_high": 0.08} if name == "gspo_token" else {}
    check_against_naive(name, params, None, seed=4, token_adv=True)


def test_gspo_token_equals_gspo_for_sequence_advantages():
    logp, old, adv, mask = make_batch(5, spread=0.05)
    for params in ({}, {"eps_low": 0.02, "eps_high": 0.03}):
        a = logp.clone().requires_grad_(True)
        b = logp.clone().requires_grad_(True)
        la, ma = policy_loss("gspo", a, old, adv, mask, **params)
        lb, mb = policy_loss("gspo_token", b, old, adv, mask, **params)
        la.backward()
        lb.backward()
        close(la, lb)
        close(a.grad, b.grad)
        close(ma["ratio_mean"], mb["ratio_mean"])
    # broadcast [N,T] advantages that are constant per row are accepted by gspo too
    adv_tok = adv[:, None].expand_as(logp).clone()
    close(policy_loss("gspo", logp, old, adv_tok, mask)[0], policy_loss("gspo", logp, old, adv, mask)[0])
    with pytest.raises(AlgorithmError, match="gspo_token"):
        policy_loss("gspo", logp, old, adv_tok + torch.randn_like(adv_tok), mask)


def test_gspo_sequence_metrics():
    logp = T([[-1.0, -2.0, -3.0]])
    old = T([[-1.1, -2.0, -2.6]])  # mean log-ratio (0.1 + 0 - 0.4)/3 = -0.1
    _, m = policy_loss("gspo", logp, old, T([1.0]), torch.ones(1, 3, dtype=torch.bool))
    close(m["ratio_mean"], math.exp(-0.1))
    close(m["ratio_min"], math.exp(-0.1))
    close(m["clip_frac"], 0.0)  # s = 0.905 with A > 0: the clip only acts above 1 + eps_high
    _, m = policy_loss("gspo", logp, old, T([-1.0]), torch.ones(1, 3, dtype=torch.bool))
    close(m["clip_frac"], 1.0)  # with A < 0, s < 1 - eps_low is clipped


def test_dual_clip_cap():
    logp = T([[math.log(10.0), math.log(2.0), math.log(10.0)]])
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = T([[-1.0, -1.0, 1.0]])
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss("dual_clip", lp, old, adv, mask, agg="token-mean")
    # r=10, A=-1: PPO term 10, capped at 3 (no gradient); r=2, A=-1: 2 < 3 stays; r=10, A=1: -1.2 (clipped)
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    loss.backward()
    close(lp.grad, [[0.0, 2.0 / 3, 0.0]])
    close(m["dual_clip_frac"], 1 / 3)
    grpo_loss, _ = policy_loss("grpo", logp, old, adv, mask, agg="token-mean")
    close(grpo_loss, (10.0 + 2.0 - 1.2) / 3)


def test_cispo_every_token_keeps_gradient():
    logp = T([[math.log(8.0), math.log(0.5), 0.0 - 0.1]])  # ratios 8 (above 1+4), 0.5, ~0.905
    old = T([[0.0, 0.0, 0.0]])
    adv = T([2.0])
    mask = torch.ones(1, 3, dtype=torch.bool)
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss("cispo", lp, old, adv, mask)
    loss.backward()
    # d/dlogp of -sg(w)*A*logp is -w*A: the clipped token (w=5) still gets a gradient
    close(lp.grad, [[-5.0 * 2 / 3, -0.5 * 2 / 3, -math.exp(-0.1) * 2 / 3]])
    close(loss, -(5.0 * 2 * math.log(8.0) + 0.5 * 2 * math.log(0.5) + math.exp(-0.1) * 2 * -0.1) / 3)
    close(m["clip_frac"], 1 / 3)
    # eps_low sets a lower bound on the weight
    lp2 = logp.clone().requires_grad_(True)
    policy_loss("cispo", lp2, old, adv, mask, eps_low=0.2)[0].backward()
    close(lp2.grad[0, 1], -0.8 * 2 / 3)


def test_sapo_gate_at_ratio_one_is_plain_pg():
    # f(r) = 4/tau sigmoid(tau (r-1)) has f(1) = 2/tau and f'(1) = 1: the on-policy gradient is -A
    logp = T([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    for a, tau in ((1.5, 1.0), (-1.5, 1.05)):
        lp = logp.clone().requires_grad_(True)
        loss, _ = policy_loss("sapo", lp, logp, T([a]), mask)
        close(loss, -(2 / tau) * a)
        loss.backward()
        close(lp.grad, [[-a / 2, -a / 2]])


def test_gmpo_clips_in_log_space_by_sign():
    logp = T([[0.6, -0.1]])  # log-ratios 0.6 and -0.1 against old = 0
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # A > 0: l~ = min(l, clip(l)) = [0.4, -0.1]; rho = exp(0.15)
    close(policy_loss("gmpo", logp, old, T([2.0]), mask)[0], -2.0 * math.exp(0.15))
    # A < 0: l~ = max(l, clip(l)) = [0.6, -0.1]; rho = exp(0.25)
    close(policy_loss("gmpo", logp, old, T([-2.0]), mask)[0], 2.0 * math.exp(0.25))


# ------------------------------------------------------------------ clip_cov / kl_cov selection


def _cov_case():
    # Two rows of 4 tokens, A = +2 / -2 (mean A = 0), logp chosen so cov = (logp - mean) * A is
    # known: mean logp = -1.
    logp = T([[0.0, -1.5, -1.0, -1.5], [-1.0, -0.5, -4.0, 1.5]])
    assert logp.mean().item() == pytest.approx(-1.0)
    adv = T([2.0, -2.0])
    cov = (logp + 1.0) * adv[:, None]
    # cov = [[2, -1, 0, -1], [0, -1, 6, -5]]: only token (0,0) lies in [1, 5]; (1,2) is the largest
    return logp, adv, cov


def test_clip_cov_detaches_selected_token():
    logp, adv, cov = _cov_case()
    mask = torch.ones(2, 4, dtype=torch.bool)
    old = logp.clone()
    lp = logp.clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    loss, m = policy_loss("clip_cov", lp, old, adv, mask, generator=gen)
    loss.backward()
    ref = logp.clone().requires_grad_(True)
    ref_loss, _ = policy_loss("grpo", ref, old, adv, mask, agg="token-mean")
    ref_loss.backward()
    close(loss, ref_loss)  # detaching keeps the value
    expect = ref.grad.clone()
    expect[0, 0] = 0.0  # the one token with cov in [1, 5] (k = max(1, floor(2e-4 * 8)) = 1)
    close(lp.grad, expect)
    assert m["cov_selected"].item() == 1


def test_clip_cov_skips_tokens_the_ppo_clip_already_cut():
    logp, adv, cov = _cov_case()
    mask = torch.ones(2, 4, dtype=torch.bool)
    old = logp.clone()
    old[0, 0] -= 1.0  # ratio e > 1.2 with A > 0: clipped, so the only in-band token is not eligible
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss("clip_cov", lp, old, adv, mask, generator=torch.Generator().manual_seed(0))
    loss.backward()
    ref = logp.clone().requires_grad_(True)
    policy_loss("grpo", ref, old, adv, mask, agg="token-mean")[0].backward()
    assert m["cov_selected"].item() == 0
    close(lp.grad, ref.grad)


def test_clip_cov_random_selection_is_reproducible():
    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(8, 50, generator=g) * 3
    adv = torch.randn(8, generator=g) * 3
    mask = torch.ones(8, 50, dtype=torch.bool)

    def grads(seed):
        lp = logp.clone().requires_grad_(True)
        policy_loss("clip_cov", lp, logp, adv, mask, clip_cov_ratio=0.02, generator=torch.Generator().manual_seed(seed))[0].backward()
        return lp.grad

    cov = (logp - logp.mean()) * (adv[:, None] - adv.mean())
    eligible = (cov >= 1) & (cov <= 5)
    assert eligible.sum() > 8  # more eligible tokens than k = 8: a random subset is chosen
    g1, g2, g3 = grads(1), grads(1), grads(2)
    assert torch.equal(g1, g2)
    zero = g1 == 0
    assert zero.sum() == 8 and (zero <= eligible).all()
    assert not torch.equal(g1 == 0, g3 == 0)


def test_kl_cov_adds_penalty_on_top_k():
    logp, adv, cov = _cov_case()
    old = logp - T([[0.1, -0.2, 0.3, 0.05], [0.2, -0.1, -0.3, 0.4]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    # k = floor(0.25 * 8) = 2: the two largest covariances are (1,2) = 6 and (0,0) = 2
    loss, m = policy_loss("kl_cov", logp, old, adv, mask, kl_cov_ratio=0.25, kl_cov_coef=0.5)
    l = logp - old
    base = -(torch.exp(l) * adv[:, None])
    base[1, 2] += 0.5 * l[1, 2].abs()
    base[0, 0] += 0.5 * l[0, 0].abs()
    close(loss, base.mean())
    assert m["cov_selected"].item() == 2
    # default ratio 2e-4 still selects one token (the largest covariance)
    loss1, _ = policy_loss("kl_cov", logp, old, adv, mask)
    base1 = -(torch.exp(l) * adv[:, None])
    base1[1, 2] += 0.1 * l[1, 2].abs()
    close(loss1, base1.mean())


# ------------------------------------------------------------------ micro-batch invariance


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "cispo", "sapo", "gmpo", "dr_grpo", "dual_clip"])
def test_microbatch_split_equals_full_batch(name, agg):
    logp, old, adv, mask = make_batch(11, n=9, spread=0.05 if name == "gspo" else 0.3)
    params = {"agg": agg, "max_response_len": MAX_LEN}
    full = logp.clone().requires_grad_(True)
    loss_full, _ = policy_loss(name, full, old, adv, mask, **params)
    loss_full.backward()

    split = logp.clone().requires_grad_(True)
    bounds = [(0, 2), (2, 6), (6, 9)]  # the fully masked row 2 sits in the second micro-batch
    den = sum(agg_denominator(mask[a:b], agg, MAX_LEN) for a, b in bounds)
    total = 0.0
    for a, b in bounds:
        l, _ = policy_loss(name, split[a:b], old[a:b], adv[a:b], mask[a:b], denominator=den, **params)
        l.backward()  # gradient accumulation, one backward per micro-batch
        total = total + l.detach()
    close(total, loss_full.detach())
    close(split.grad, full.grad)


# ------------------------------------------------------------------ aggregation


def test_aggregate_modes_by_hand():
    L = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = T([[1, 1, 0], [1, 1, 1], [0, 0, 0]]).bool()
    close(aggregate(L, mask, "token-mean"), (1 + 2 + 4 + 5 + 6) / 5)
    close(aggregate(L, mask, "seq-mean-token-mean"), (1.5 + 5.0) / 2)  # the empty row is skipped
    close(aggregate(L, mask, "seq-mean-token-sum"), (3 + 15) / 3)
    close(aggregate(L, mask, "seq-mean-token-sum-norm", max_response_len=10), 18 / 30)
    close(agg_denominator(mask, "token-mean"), 5.0)
    close(agg_denominator(mask, "seq-mean-token-mean"), 2.0)
    close(agg_denominator(mask, "seq-mean-token-sum"), 3.0)
    close(agg_denominator(mask, "seq-mean-token-sum-norm", 10), 30.0)
    close(aggregate(L, mask, "token-mean", denominator=10.0), 18 / 10)
    close(aggregate(L, mask.float(), "token-mean"), (1 + 2 + 4 + 5 + 6) / 5)  # float masks work


def test_aggregate_errors_and_empty():
    L = torch.ones(2, 3)
    with pytest.raises(AlgorithmError, match="max_response_len"):
        aggregate(L, torch.ones(2, 3), "seq-mean-token-sum-norm")
    with pytest.raises(AlgorithmError, match=r"unknown aggregation 'mean'; valid: seq-mean-token-mean"):
        aggregate(L, torch.ones(2, 3), "mean")
    for agg in AGGS:
        out = aggregate(L, torch.zeros(2, 3), agg, max_response_len=4)
        assert out.item() == 0.0
    with pytest.raises(AlgorithmError, match="max_response_len"):
        policy_loss("dr_grpo", torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3))


# ------------------------------------------------------------------ edge cases and validation


@pytest.mark.parametrize("name", ["grpo", "dual_clip", "dr_grpo", "dapo", "gspo", "gspo_token", "gmpo", "sapo", "cispo", "clip_cov", "kl_cov"])
def test_fully_masked_rows_no_nan(name):
    logp, old, adv, mask = make_batch(8)
    for m in (mask, torch.zeros_like(mask)):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = policy_loss(name, lp, old, adv, m, max_response_len=MAX_LEN)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        assert all(torch.isfinite(v) for v in metrics.values())


def test_nan_inputs_raise():
    logp, old, adv, mask = make_batch(9)
    bad = logp.clone()
    bad[0, 0] = float("nan")
    bad[1, 0] = float("inf")
    bad[3, 0] = float("nan")
    with pytest.raises(AlgorithmError, match="logp contains NaN/inf at 3 masked positions"):
        policy_loss("grpo", bad, old, adv, mask)
    bad_old = old.clone()
    bad_old[0, 0] = float("-inf")
    with pytest.raises(AlgorithmError, match="old_logp contains NaN/inf at 1 masked positions"):
        policy_loss("grpo", logp, bad_old, adv, mask)
    bad_adv = adv.clone()
    bad_adv[0] = float("nan")
    with pytest.raises(AlgorithmError, match="advantages contains NaN/inf"):
        policy_loss("grpo", logp, old, bad_adv, mask)
    # NaN advantage on the fully masked row 2 and -inf padding are legal
    ok_adv = adv.clone()
    ok_adv[2] = float("nan")
    assert torch.isfinite(policy_loss("grpo", logp, old, ok_adv, mask)[0])


def test_shape_errors():
    logp, old, adv, mask = make_batch(10)
    with pytest.raises(AlgorithmError, match=r"old_logp has shape \(6, 6\), expected \(6, 7\)"):
        policy_loss("grpo", logp, old[:, :6], adv, mask)
    with pytest.raises(AlgorithmError, match=r"advantages has shape \(5,\), expected \(6,\) or \(6, 7\)"):
        policy_loss("grpo", logp, old, adv[:5], mask)
    with pytest.raises(AlgorithmError, match=r"mask has shape \(6, 3\)"):
        policy_loss("grpo", logp, old, adv, mask[:, :3])


def test_unknown_loss_lists_valid_names():
    with pytest.raises(AlgorithmError) as e:
        policy_loss("grpoo", torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1))
    msg = str(e.value)
    assert msg.startswith("unknown loss 'grpoo'; valid: cispo, clip_cov, dapo, dr_grpo, dual_clip, gmpo, grpo,")
    assert "ppo" in msg and "sapo" in msg and "kl_cov" in msg


def test_unknown_param_rejected():
    with pytest.raises(AlgorithmError) as e:
        policy_loss("grpo", torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), tau_pos=1.0)
    assert "tau_pos" in str(e.value)
    assert "accepted: agg, denominator, eps_high, eps_low, max_response_len" in str(e.value)
    with pytest.raises(AlgorithmError, match="generator"):
        policy_loss("grpo", torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), generator=None)


def test_metrics_values():
    logp = T([[-1.0, -2.0, 0.0]])
    old = T([[-1.5, -1.0, 0.0]])  # l = 0.5, -1 (last token masked out)
    mask = T([[1, 1, 0]]).bool()
    _, m = policy_loss("grpo", logp, old, T([1.0]), mask)
    d = T([-0.5, 1.0])  # old - new
    close(m["approx_kl"], (torch.exp(d) - d - 1).mean())
    close(m["ratio_min"], math.exp(-1.0))
    close(m["ratio_max"], math.exp(0.5))
    close(m["ratio_mean"], (math.exp(0.5) + math.exp(-1.0)) / 2)
    close(m["clip_frac"], 0.5)  # r = 1.65 > 1.2 with A > 0 is clipped; r = 0.37 with A > 0 is not


def test_bf16_inputs_computed_in_fp32():
    logp, old, adv, mask = make_batch(12)
    loss32, _ = policy_loss("grpo", logp.bfloat16().float(), old.bfloat16().float(), adv, mask)
    loss16, _ = policy_loss("grpo", logp.bfloat16(), old.bfloat16(), adv, mask)
    assert loss16.dtype == torch.float32
    close(loss16, loss32)


# ------------------------------------------------------------------ registry


def test_register_custom_loss():
    @register_loss(
        "test_plain_pg",
        default_agg="token-mean",
        citation="1992 Williams",
        defaults={"scale": 1.0},
        aliases=("test_reinforce",),
    )
    def _plain(logp, old_logp, adv, mask, *, scale):
        """Plain policy gradient -scale * A * logp."""
        return -scale * adv * logp

    logp = T([[-1.0, -2.0], [-0.5, 0.0]])
    mask = T([[1, 1], [1, 0]]).bool()
    loss, m = policy_loss("test_plain_pg", logp, logp, T([1.0, 2.0]), mask)
    close(loss, (1.0 + 2.0 + 1.0) / 3)
    close(policy_loss("test_reinforce", logp, logp, T([1.0, 2.0]), mask, scale=2.0)[0], 8 / 3)
    assert set(m) >= {"clip_frac", "approx_kl", "ratio_min", "ratio_mean", "ratio_max"}
    spec = get_loss_spec("test_reinforce")
    assert spec.name == "test_plain_pg" and spec.default_agg == "token-mean" and spec.defaults == {"scale": 1.0}
    rows = list_algorithms()["loss"]
    assert ("test_plain_pg", "1992 Williams", "Plain policy gradient -scale * A * logp.") in rows
    assert any(r[0] == "test_reinforce" and "alias of test_plain_pg" in r[2] for r in rows)
    with pytest.raises(AlgorithmError, match="already registered"):
        register_loss("grpo", default_agg="token-mean", citation="x")(_plain)
    with pytest.raises(AlgorithmError, match="unknown aggregation"):
        register_loss("test_bad", default_agg="mean", citation="x")


def test_builtin_specs_match_spec_table():
    assert get_loss_spec("ppo").name == "grpo"
    for name, agg in DEFAULT_AGG.items():
        spec = get_loss_spec(name)
        assert spec.default_agg == agg
        assert dict(spec.defaults) == DEFAULTS[name]
    assert dict(get_loss_spec("kl_cov").defaults) == {"kl_cov_ratio": 2e-4, "kl_cov_coef": 0.1}
    clip_cov = dict(get_loss_spec("clip_cov").defaults)
    assert clip_cov == {"eps_low": 0.2, "eps_high": 0.2, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "generator": None}
    kinds = list_algorithms()
    assert {"advantage", "loss", "kl"} == set(kinds)
    assert [r[0] for r in kinds["kl"]] == ["abs", "gaussian", "k1", "k2", "k3"]


# ------------------------------------------------------------------ KL and entropy


def test_kl_penalty_values():
    logp = T([[-1.0, -2.0]])
    ref = T([[-1.5, -1.0]])
    d = ref - logp  # [-0.5, 1.0]
    close(kl_penalty(logp, ref, "k1"), -d)
    close(kl_penalty(logp, ref, "k2"), d**2 / 2)
    close(kl_penalty(logp, ref, "k3"), torch.exp(d) - d - 1)
    close(kl_penalty(logp, ref, "abs"), d.abs())
    with pytest.raises(AlgorithmError, match=r"unknown kl estimator 'k4'; valid: abs, gaussian, k1, k2, k3"):
        kl_penalty(logp, ref, "k4")
    with pytest.raises(AlgorithmError, match="computed from a flow policy's step means"):
        kl_penalty(logp, ref, "gaussian")  # not an estimator on log-probs


def test_k3_stays_finite_for_large_log_ratios():
    """float32 exp overflows above ~88; beyond the clamp k3 continues exp linearly: finite, still
    growing with the log-ratio, and its gradient still pulls logp towards the reference."""
    logp = T([[-200.0, -100.0, -1.0]]).requires_grad_(True)
    ref = T([[-1.0, -1.0, -1.5]])
    kl = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(kl).all()
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[0, :2] < 0).all()
    close(kl[0, 2], math.exp(-0.5) + 0.5 - 1)
    assert kl[0, 0] > kl[0, 1] > 1e8


def test_kl_penalty_mask_keeps_padding_out_of_gradients():
    logp = T([[-1.0, float("-inf")]]).requires_grad_(True)
    ref = T([[-1.5, float("-inf")]])
    mask = T([[1, 0]]).bool()
    kl = kl_penalty(logp, ref, "k3", mask=mask)
    aggregate(kl, mask, "token-mean").backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()
    close(logp.grad, [[-(math.exp(-0.5) - 1), 0.0]])  # d/dlogp (e^d - d - 1) = -(e^d - 1)
