"""Advantage estimators: hand-computed cases, naive references, edge cases, vectorisation."""

import math
import statistics
from collections import defaultdict

import pytest
import torch

import mmrl.algos.advantages as adv_mod
from mmrl.algos import AlgorithmError, compute_advantages, list_algorithms, register_advantage
from mmrl.algos.advantages import make_groups

torch.set_num_threads(1)

T = torch.tensor


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=tol)


# ------------------------------------------------------------------ hand-computed cases


def test_grpo_hand():
    # mean 0.75, unbiased std sqrt((3*0.0625 + 0.5625)/3) = 0.5
    a = compute_advantages("grpo", T([1.0, 0.0, 1.0, 1.0]), T([7, 7, 7, 7]))
    close(a, [0.25 / (0.5 + 1e-6), -0.75 / (0.5 + 1e-6), 0.25 / (0.5 + 1e-6), 0.25 / (0.5 + 1e-6)], 1e-6)


def test_dr_grpo_hand():
    close(compute_advantages("dr_grpo", T([1.0, 0.0, 1.0, 1.0]), T([0, 0, 0, 0])), [0.25, -0.75, 0.25, 0.25])


def test_rloo_hand():
    # each 1: 1 - mean(others) = 1 - 2/3; the 0: 0 - 1
    a = compute_advantages("rloo", T([1.0, 0.0, 1.0, 1.0, 5.0]), T([3, 3, 3, 3, 9]))
    close(a, [1 / 3, -1.0, 1 / 3, 1 / 3, 0.0])


def test_w_reinforce_hand():
    r = T([1.0, 0.0, -5.0, -5.0, -5.0, 2.0])
    g = T([0, 0, 0, 1, 1, 2])
    # no baseline: an all-failed group still pushes its samples down; positives scaled by lam
    close(compute_advantages("w_reinforce", r, g), [0.1, 0.0, -5.0, -5.0, -5.0, 0.2])
    close(compute_advantages("w_reinforce", r, g, lam=0.0), [0.0, 0.0, -5.0, -5.0, -5.0, 0.0])  # NSR


def test_passk_ties_and_norm():
    r = T([3.0, 1.0, 3.0, 2.0, 5.0, 4.0, 7.0])
    g = T([0, 0, 0, 1, 1, 1, 2])
    # group 0: tie at the top -> 0; group 1: 5 - 4 = 1 for the best only; group 2 alone -> 0
    close(compute_advantages("passk", r, g), [0, 0, 0, 0, 1.0, 0, 0])
    std1 = math.sqrt((25 / 9 + 16 / 9 + 1 / 9) / 2)  # unbiased std of [2, 5, 4]
    close(compute_advantages("passk", r, g, norm_by_std=True), [0, 0, 0, 0, 1.0 / (std1 + 1e-6), 0, 0])


def test_reinforce_pp_token_weighted_whitening():
    r = T([1.0, 0.0, 1.0, 0.0])
    g = T([0, 0, 1, 1])  # R - mean_g = [0.5, -0.5, 0.5, -0.5]
    mask = T([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]).bool()  # lens 3, 1, 2, 2
    # token-weighted mean = (1.5 - 0.5 + 1 - 1) / 8 = 0.125
    # var = (3*0.375^2 + 0.625^2 + 2*0.375^2 + 2*0.625^2) / 7 = 1.875 / 7
    expect = T([0.375, -0.625, 0.375, -0.625]) / math.sqrt(1.875 / 7 + 1e-8)
    close(compute_advantages("reinforce_pp", r, g, mask=mask), expect)
    # Without a mask every sequence weighs 1: mean 0, var 4*0.25/3
    close(compute_advantages("reinforce_pp", r, g), T([0.5, -0.5, 0.5, -0.5]) / math.sqrt(1 / 3 + 1e-8))


def test_reinforce_pp_batch_pushes_down_an_all_failed_group():
    r = T([1.0, 1.0, -5.0, -5.0, 1.0, 0.0])
    g = T([0, 0, 1, 1, 2, 2])  # group 1 failed on every sample: GRPO gives it 0
    mask = T([[1, 1], [1, 1], [1, 0], [1, 0], [1, 1], [1, 1]]).bool()  # lens 2, 2, 1, 1, 2, 2
    # token-weighted mean = (2 + 2 - 5 - 5 + 2 + 0) / 10 = -0.4; var = sum w (r - mean)^2 / 9
    var = (6 * 1.4**2 + 2 * 4.6**2 + 2 * 0.4**2) / 9
    expect = (r + 0.4) / math.sqrt(var + 1e-8)
    a = compute_advantages("reinforce_pp_batch", r, g, mask=mask)
    close(a, expect)
    assert a[2] < 0 and a[3] < 0 and a[0] > 0
    assert torch.equal(compute_advantages("grpo", r, g)[2:4], torch.zeros(2))


def test_mapo_hand():
    r = T([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    g = T([0, 0, 0, 0, 1, 1, 2, 2])
    # group 0: p = 0.75 -> lam = 1 - 4*0.75*0.25 = 0.25; z = [0.5]*3 + [-1.5]; apd = [1/3]*3 + [-1]
    a1 = 0.75 * (0.25 / (0.5 + 1e-6)) + 0.25 * (0.25 / (0.75 + 1e-6))
    a0 = 0.75 * (-0.75 / (0.5 + 1e-6)) + 0.25 * (-0.75 / (0.75 + 1e-6))
    # group 1: p = 0.5 -> lam = 0, pure z-score; std([1, 0]) = sqrt(0.5)
    z1 = 0.5 / (math.sqrt(0.5) + 1e-6)
    # group 2: all failed -> 0
    close(compute_advantages("mapo", r, g), [a1, a1, a1, a0, z1, -z1, 0, 0])


# ------------------------------------------------------------------ random vs naive per-group loop


def _naive(name, r, g, **kw):
    groups = defaultdict(list)
    for i, k in enumerate(g.tolist()):
        groups[k].append(i)
    out = [0.0] * len(r)
    rl = r.tolist()
    for idx in groups.values():
        vals = [rl[i] for i in idx]
        n = len(vals)
        mean = sum(vals) / n
        std = statistics.stdev(vals) if n > 1 else 0.0
        for i in idx:
            x = rl[i]
            if name == "grpo":
                out[i] = 0.0 if n == 1 else (x - mean) / (std + 1e-6)
            elif name == "dr_grpo":
                out[i] = x - mean
            elif name == "rloo":
                out[i] = 0.0 if n == 1 else x - (sum(vals) - x) / (n - 1)
            elif name == "passk":
                others = [rl[j] for j in idx if j != i]
                best = n > 1 and x > max(others)
                out[i] = (x - max(others)) if best else 0.0
                if kw.get("norm_by_std") and best:
                    out[i] /= std + 1e-6
            elif name == "mapo":
                p = sum(v >= 1.0 for v in vals) / n
                lam = 1 - 4 * p * (1 - p)
                z = 0.0 if n == 1 or std == 0 else (x - mean) / (std + 1e-6)
                apd = 0.0 if std == 0 else (x - mean) / (mean + 1e-6)
                out[i] = (1 - lam) * z + lam * apd
    return torch.tensor(out)


@pytest.mark.parametrize(
    "name,kw",
    [("grpo", {}), ("dr_grpo", {}), ("rloo", {}), ("passk", {}), ("passk", {"norm_by_std": True}), ("mapo", {})],
)
def test_estimators_match_naive_loop(name, kw):
    gen = torch.Generator().manual_seed(1)
    n = 300
    ids = torch.randint(-50, 50, (n,), generator=gen) * 1_000_003  # sparse, negative, unsorted
    ids[:3] = T([5, 6, 7])  # a few groups of one
    r = torch.randint(0, 4, (n,), generator=gen).float() / 2 + (torch.rand(n, generator=gen) < 0.2).float()
    close(compute_advantages(name, r, ids, **kw), _naive(name, r, ids, **kw), 1e-4)


# ------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "passk", "mapo", "reinforce_pp"])
def test_group_of_one_and_all_equal_give_zero(name):
    r = T([0.1] * 8 + [0.7] + [0.3, 0.3])
    g = T([4] * 8 + [1] + [2, 2])
    a = compute_advantages(name, r, g)
    assert torch.isfinite(a).all()
    assert torch.equal(a, torch.zeros_like(a))  # exactly 0, not rounding noise / (tiny std + eps)


def test_nan_inf_rewards_raise():
    with pytest.raises(AlgorithmError, match="rewards contains NaN/inf at 2 positions"):
        compute_advantages("grpo", T([1.0, float("nan"), float("inf"), 0.0]), T([0, 0, 1, 1]))


def test_shape_errors():
    with pytest.raises(AlgorithmError, match=r"group_ids has shape \(3,\), expected \(4,\)"):
        compute_advantages("grpo", T([1.0, 0, 1, 0]), T([0, 0, 1]))
    with pytest.raises(AlgorithmError, match="integer"):
        compute_advantages("grpo", T([1.0, 0]), T([0.0, 1.0]))
    with pytest.raises(AlgorithmError, match="mask has shape"):
        compute_advantages("reinforce_pp", T([1.0, 0]), T([0, 0]), mask=torch.ones(3, 2))


def test_unknown_name_and_params():
    with pytest.raises(AlgorithmError, match=r"unknown advantage 'grop'; valid: dr_grpo, grpo, kvpo_anchor, mapo, passk"):
        compute_advantages("grop", T([1.0]), T([0]))
    with pytest.raises(AlgorithmError, match="norm_by_std") as e:
        compute_advantages("grpo", T([1.0]), T([0]), norm_by_std=True)
    assert "accepted: eps" in str(e.value)
    with pytest.raises(AlgorithmError, match="unknown advantage 'gae'"):  # no value head is trained
        compute_advantages("gae", T([1.0]), T([0]))
    assert issubclass(AlgorithmError, ValueError)


# ------------------------------------------------------------------ vectorisation


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "passk", "mapo", "reinforce_pp"])
def test_sparse_unsorted_ids_equal_relabelled(name):
    gen = torch.Generator().manual_seed(2)
    sparse = T([7, 3, 7, 3, 99, 7, -5, 2**40, 3, -5, 2**40, 99])
    _, dense = torch.unique(sparse, return_inverse=True)
    perm = torch.randperm(len(sparse), generator=gen)
    r = torch.rand(len(sparse), generator=gen).round()
    a = compute_advantages(name, r, sparse)
    close(a, compute_advantages(name, r, dense))
    close(a[perm], compute_advantages(name, r[perm], sparse[perm]))


def test_hash_collision_fallback(monkeypatch):
    # A constant "hash" puts every id in one slot: each round labels only one id, the rest reach
    # the torch.unique fallback. The grouping must stay exact.
    monkeypatch.setattr(adv_mod, "_HASH_MULS", (0, 0))
    ids = T([10**12, -(10**12), 5, 10**12, 5, 77, -(10**12)])
    g = make_groups(ids)
    lab = g.inverse.tolist()
    for i in range(len(ids)):
        for j in range(len(ids)):
            assert (lab[i] == lab[j]) == (ids[i].item() == ids[j].item())
        assert ids[g.rep[i]].item() == ids[i].item()
    assert g.counts[g.inverse].tolist() == [2, 2, 2, 2, 2, 1, 2]


def test_large_batch_is_fast_enough():
    # 10^5 responses must take milliseconds, not seconds (generous bound for a loaded CI box).
    import time

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 2**50, (12_500,), generator=gen).repeat_interleave(8)
    r = torch.rand(100_000, generator=gen)
    compute_advantages("grpo", r, ids)
    t0 = time.perf_counter()
    compute_advantages("grpo", r, ids)
    assert time.perf_counter() - t0 < 0.5


# ------------------------------------------------------------------ registry


def test_register_custom_advantage():
    @register_advantage("test_centred_twice", citation="none", description="2 * (R - mean)")
    def _twice(rewards, groups, *, scale: float = 2.0):
        return scale * (rewards - groups.gather(groups.mean(rewards)))

    close(compute_advantages("test_centred_twice", T([1.0, 0.0, 3.0]), T([0, 0, 1])), [1.0, -1.0, 0.0])
    close(compute_advantages("test_centred_twice", T([1.0, 0.0]), T([0, 0]), scale=1.0), [0.5, -0.5])
    assert ("test_centred_twice", "none", "2 * (R - mean)") in list_algorithms()["advantage"]
    with pytest.raises(AlgorithmError, match="already registered"):
        register_advantage("grpo", citation="x")(_twice)
