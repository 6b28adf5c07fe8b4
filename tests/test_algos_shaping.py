"""Reward shaping and sampling filters."""

from collections import defaultdict

import pytest
import torch

from mmrl.algos import AlgorithmError, compute_advantages
from mmrl.algos.shaping import (
    gfpo_advantages,
    failed_groups,
    gfpo_keep,
    mask_truncated,
    nonconstant_groups,
    one_row_per_group,
    overlong_penalty,
    redit,
    success_rate_filter,
)

torch.set_num_threads(1)

T = torch.tensor


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=tol, rtol=tol)


def test_overlong_penalty():
    # L_max = 20, L_cache = 4: free up to 16, linear to -1 at 20, -1 beyond
    close(overlong_penalty(T([10, 16, 17, 18, 20, 21, 500]), 20, 4), [0, 0, -0.25, -0.5, -1.0, -1.0, -1.0])
    with pytest.raises(AlgorithmError, match="cache_len"):
        overlong_penalty(T([1]), 10, 0)


def test_nonconstant_groups():
    r = T([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 3.0, 2.0, 2.0])
    g = T([5, 5, 5, 9, 9, 9, 11, -4, 2**41])
    # group 5 mixed; 9 all equal; 11, -4, 2**41 are groups of one (all equal)
    assert nonconstant_groups(r, g).tolist() == [True, True, True, False, False, False, False, False, False]


def test_failed_groups():
    r = T([1.0, 0.0, -5.0, 0.0, -5.0, -5.0, 0.5])
    g = T([5, 5, 9, 9, 2**41, 2**41, -4])
    # best reward per group: 5 -> 1, 9 -> 0, 2**41 -> -5, -4 -> 0.5
    assert failed_groups(r, g, below=0.5).tolist() == [False, False, True, True, True, True, False]
    assert failed_groups(r, g, below=-5.0).tolist() == [False] * 7


@pytest.mark.parametrize("ids", [[7, 5, 7, 5, 9, 9], [2**41, -3, -3, 2**41, 0, 0]])
def test_one_row_per_group(ids):
    ids = T(ids)
    rows = one_row_per_group(ids)
    assert sorted(ids[rows].tolist()) == sorted(set(ids.tolist()))  # each group exactly once


def test_mask_truncated():
    mask = T([[1, 1, 0], [1, 1, 1], [1, 0, 0]]).bool()
    out = mask_truncated(mask, T([False, True, False]))
    assert out.tolist() == [[True, True, False], [False, False, False], [True, False, False]]
    fmask = mask.float()
    assert mask_truncated(fmask, T([True, False, False])).dtype == torch.float32
    with pytest.raises(AlgorithmError, match="truncated has shape"):
        mask_truncated(mask, T([True]))


def _naive_keep(r, g, k, metric, lengths):
    groups = defaultdict(list)
    for i, gid in enumerate(g.tolist()):
        groups[gid].append(i)
    keep = [False] * len(r)
    for idx in groups.values():
        if metric == "shortest":
            order = sorted(idx, key=lambda i: (lengths[i].item(), i))
        else:
            order = sorted(idx, key=lambda i: (-(r[i].item() / max(lengths[i].item(), 1)), i))
        for i in order[:k]:
            keep[i] = True
    return keep


def test_gfpo_keep_hand():
    r = T([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    lengths = T([30, 10, 10, 50, 5, 20])
    g = T([3, 3, 3, 8, 8, 8])
    # shortest, k=2: group 3 lengths 30/10/10 -> the two 10s; group 8: 5 and 20
    assert gfpo_keep(r, g, 2, "shortest", lengths).tolist() == [False, True, True, False, True, True]
    # tie on length 10 with k=1: the lower index wins
    assert gfpo_keep(r, g, 1, "shortest", lengths).tolist() == [False, True, False, False, True, False]
    # reward/length, k=1: group 3 -> 1/10 (index 2); group 8 -> 1/20 (index 5)
    assert gfpo_keep(r, g, 1, "reward_per_length", lengths).tolist() == [False, False, True, False, False, True]
    with pytest.raises(AlgorithmError, match=r"unknown gfpo metric 'longest'; valid: reward_per_length, shortest"):
        gfpo_keep(r, g, 1, "longest", lengths)


@pytest.mark.parametrize("metric", ["shortest", "reward_per_length"])
def test_gfpo_keep_matches_naive_on_random_sparse_ids(metric):
    gen = torch.Generator().manual_seed(0)
    n = 200
    g = torch.randint(-20, 20, (n,), generator=gen) * 10**9
    lengths = torch.randint(0, 12, (n,), generator=gen)  # many ties, some zero lengths
    r = torch.randint(0, 3, (n,), generator=gen).float()
    for k in (1, 3, 50):
        assert gfpo_keep(r, g, k, metric, lengths).tolist() == _naive_keep(r, g, k, metric, lengths)


def test_gfpo_advantages_use_kept_stats_only():
    r = T([1.0, 0.0, 1.0, 5.0, 0.0, 2.0])
    g = T([0, 0, 0, 0, 1, 1])
    keep = T([True, True, True, False, True, True])
    a = gfpo_advantages(r, g, keep)
    # group 0 kept [1, 0, 1] -> same as grpo on them; the dropped 5.0 gets 0 and does not shift stats
    ref0 = compute_advantages("grpo", T([1.0, 0.0, 1.0]), T([0, 0, 0]))
    ref1 = compute_advantages("grpo", T([0.0, 2.0]), T([0, 0]))
    close(a, torch.cat([ref0, T([0.0]), ref1]))


def test_redit():
    r = T([0.0, 1.0] * 5000)
    a = redit(r, 0.05, "gaussian", generator=torch.Generator().manual_seed(1))
    b = redit(r, 0.05, "gaussian", generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    noise = a - r
    assert abs(noise.mean().item()) < 0.003 and abs(noise.std().item() - 0.05) < 0.003
    u = redit(r, 0.1, "uniform", generator=torch.Generator().manual_seed(2)) - r
    assert u.abs().max() <= 0.1 and abs(u.mean().item()) < 0.005 and u.std().item() > 0.05
    assert torch.equal(redit(r, 0.0), r)
    with pytest.raises(AlgorithmError, match="redit kind"):
        redit(r, 0.1, "laplace")


def test_success_rate_filter():
    s = T([1, 1, 1, 0, 1, 0, 0, 0, 1, 1])
    g = T([7, 7, 7, 3, 3, 3, 99, 99, -1, -1])
    # rates: 7 -> 1.0, 3 -> 1/3, 99 -> 0.0, -1 -> 1.0
    assert success_rate_filter(s, g, 0.1, 0.9).tolist() == [False] * 3 + [True] * 3 + [False] * 4
    assert success_rate_filter(s, g, 0.0, 1.0).all()
    with pytest.raises(AlgorithmError, match="low <= high"):
        success_rate_filter(s, g, 0.9, 0.1)


def test_high_entropy_tokens_keeps_the_top_share_of_masked_tokens():
    from mmrl.algos.shaping import high_entropy_tokens

    ent = T([[0.9, 0.1, 0.5, 5.0], [0.3, 0.8, 0.05, 0.7]])
    mask = T([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()  # 5.0 sits on padding: never chosen
    keep = high_entropy_tokens(ent, mask, 0.3)  # ceil(0.3 * 7) = 3 tokens
    assert keep.tolist() == [[True, False, False, False], [False, True, False, True]]
    assert torch.equal(high_entropy_tokens(ent, mask, 1.0), mask)
    assert int(high_entropy_tokens(ent, mask, 0.01).sum()) == 1  # at least one token
    assert not high_entropy_tokens(ent, torch.zeros_like(mask), 0.5).any()
    with pytest.raises(AlgorithmError, match="top_frac"):
        high_entropy_tokens(ent, mask, 0.0)
    with pytest.raises(AlgorithmError, match="shape"):
        high_entropy_tokens(ent, mask[:, :3], 0.5)
