"""KVPO functions (docs/kvpo.md) against values written out by hand."""

import pytest
import torch

from mmrl.algos import compute_advantages, policy_loss
from mmrl.algos.kvpo import (
    anchor_advantages,
    anchor_relative_advantages,
    branch_logprobs,
    first_steps_mask,
    fuse_signal_advantages,
    sample_history_routes,
    trajectory_velocity_energy,
    tve_step_weights,
)

torch.set_num_threads(1)

T = torch.tensor
F64 = torch.float64


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=tol, rtol=0)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# Causal History Routing
# ------------------------------------------------------------------------------------------------


def test_routes_anchor_is_identity_window_and_branches_keep_sink_and_nearest():
    r = sample_history_routes(20, window=9, keep_nearest=4, num_branches=8, generator=gen(0), sink=3)
    assert r.shape == (9, 12) and r.dtype == torch.long
    assert r[0].tolist() == [0, 1, 2, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    for row in r[1:].tolist():
        assert row[:3] == [0, 1, 2]
        assert row[-4:] == [16, 17, 18, 19]
        older = row[3:8]
        assert all(3 <= j < 16 for j in older)
        assert all(a < b for a, b in zip(older, older[1:]))  # sorted, distinct


def test_routes_history_limit_bounds_the_pool():
    r = sample_history_routes(20, 9, 4, 8, gen(1), sink=3, history_limit=10)  # pool [10, 16)
    assert all(10 <= j < 16 for j in r[1:, 3:8].flatten().tolist())
    with pytest.raises(ValueError, match="pool"):
        sample_history_routes(20, 9, 4, 8, gen(1), sink=3, history_limit=3)  # pool [17, 16): empty


def test_routes_dispersed_windows_overlap_by_n_minus_shift():
    # pool [3, 16) has 13 entries, n = 5: G = 8 -> shift 1, neighbours share 4; G = 2 -> shift 6, disjoint
    r = sample_history_routes(20, 9, 4, 8, gen(2), sink=3)
    for g in range(1, 8):
        assert len(set(r[g, 3:8].tolist()) & set(r[g + 1, 3:8].tolist())) == 4
    r2 = sample_history_routes(20, 9, 4, 2, gen(2), sink=3)
    assert not set(r2[1, 3:8].tolist()) & set(r2[2, 3:8].tolist())


def test_routes_fully_determined_cases_equal_the_anchor():
    # T = sink + window: the pool is exactly the n older slots, every branch is the identity route
    r = sample_history_routes(6, window=5, keep_nearest=2, num_branches=3, generator=gen(0), sink=1)
    assert r.tolist() == [[0, 1, 2, 3, 4, 5]] * 4
    # keep_nearest = window: nothing to re-route
    r = sample_history_routes(10, window=4, keep_nearest=4, num_branches=2, generator=gen(0), sink=2)
    assert r.tolist() == [[0, 1, 6, 7, 8, 9]] * 3


def test_routes_reproducible_with_the_generator():
    for dispersed in (True, False):
        a = sample_history_routes(30, 9, 4, 8, gen(7), sink=3, dispersed=dispersed)
        b = sample_history_routes(30, 9, 4, 8, gen(7), sink=3, dispersed=dispersed)
        c = sample_history_routes(30, 9, 4, 8, gen(8), sink=3, dispersed=dispersed)
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
        assert torch.equal(a[0], c[0])  # the anchor never depends on the draw


def test_routes_independent_draws_keep_structure():
    r = sample_history_routes(30, 9, 4, 16, gen(3), sink=3, dispersed=False)
    assert (r[1:, :3] == T([0, 1, 2])).all() and (r[1:, -4:] == T([26, 27, 28, 29])).all()
    mid = r[1:, 3:8]
    assert ((mid >= 3) & (mid < 26)).all() and (mid[:, 1:] > mid[:, :-1]).all()


@pytest.mark.parametrize(
    "args, kw, match",
    [
        ((20, 0, 0, 8), {}, "window"),
        ((20, 4, 5, 8), {}, "keep_nearest"),
        ((20, 4, -1, 8), {}, "keep_nearest"),
        ((20, 4, 2, 0), {}, "num_branches"),
        ((5, 4, 2, 8), {"sink": 3}, "sink \\+ window"),
        ((20, 4, 2, 8), {"sink": -1}, "sink"),
        ((20.0, 4, 2, 8), {}, "int"),
    ],
)
def test_routes_bad_arguments(args, kw, match):
    with pytest.raises(ValueError, match=match):
        sample_history_routes(*args, generator=gen(0), **kw)


# ------------------------------------------------------------------------------------------------
# TVE and the branch policy
# ------------------------------------------------------------------------------------------------


def test_tve_step_weights_by_hand():
    close(tve_step_weights([1.0, 0.5]), [0.5, 0.125])  # t^2 / (2 max(t, 1)^2)
    close(tve_step_weights([1.0, 0.5], space="velocity"), [0.5, 0.5])  # 1 / (2 max(t, 1)^2)
    close(tve_step_weights([1.0, 0.5], sigma_floor=0.25), [0.5, 0.5])
    close(tve_step_weights([1.0, 0.5], sigma_floor=0.25, space="velocity"), [0.5, 2.0])
    with pytest.raises(ValueError):
        tve_step_weights([1.0], space="score")
    with pytest.raises(ValueError):
        tve_step_weights([-0.1])


def test_first_steps_mask():
    assert first_steps_mask(4, 2, num_blocks=2).tolist() == [True, True, False, False] * 2
    assert first_steps_mask(3, 0).tolist() == [False] * 3


def test_tve_by_hand():
    # N=2, S=2, D=2. Row 0 diffs: s0 (1,-1) -> 1, s1 (2,0) -> 2. Row 1: s0 (0,0) -> 0, s1 (3,1) -> 5.
    vb = torch.zeros(2, 2, 2)
    vr = T([[[1.0, -1.0], [2.0, 0.0]], [[0.0, 0.0], [3.0, 1.0]]])
    w = T([0.5, 0.25])
    close(trajectory_velocity_energy(vb, vr), [3.0, 5.0])
    close(trajectory_velocity_energy(vb, vr, w), [1.0, 1.25])
    valid = T([[True, True], [True, False]])
    close(trajectory_velocity_energy(vb, vr, w, valid=valid), [1.0, 0.0])
    vr_nan = vr.clone()
    vr_nan[1, 1] = float("nan")  # padding may hold garbage
    close(trajectory_velocity_energy(vb, vr_nan, w, valid=valid), [1.0, 0.0])


def test_tve_grad_mask_and_target_is_detached():
    vb = torch.zeros(2, 2, 2, requires_grad=True)
    vr = T([[[1.0, -1.0], [2.0, 0.0]], [[0.0, 0.0], [3.0, 1.0]]], requires_grad=True)
    tve = trajectory_velocity_energy(vb, vr, T([0.5, 0.25]), grad_mask=T([True, False]))
    tve.sum().backward()
    # d/dv of w * mean_D (v - vb)^2 = w * 2 (v - vb) / D = 0.5 * diff on step 0; step 1 detached
    close(vr.grad, [[[0.5, -0.5], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    assert vb.grad is None or not vb.grad.any()


def test_tve_x0_weights_reproduce_the_codes_x0_gaussian_logprob():
    # x0 = x_t - t v, so at equal x_t: x0 diff = -t (v_replay - v_branch).
    # sigmas (1.0, 0.5), D=2: step 0 v diff (-1, 0) -> x0 diff (1, 0), mse 0.5;
    # step 1 v diff (-1, 1) -> x0 diff (0.5, -0.5), mse 0.25. Code: -(0.5 + 0.25) / (2 * 1^2) = -0.375.
    vb = T([[[1.0, 0.0], [2.0, 2.0]]])
    vr = T([[[0.0, 0.0], [1.0, 3.0]]])
    close(trajectory_velocity_energy(vb, vr, tve_step_weights([1.0, 0.5])), [0.375])
    close(trajectory_velocity_energy(vb, vr, tve_step_weights([1.0, 0.5], space="velocity")), [0.75])


def test_tve_shape_errors():
    with pytest.raises(ValueError):
        trajectory_velocity_energy(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError):
        trajectory_velocity_energy(torch.zeros(2, 3), torch.zeros(2, 3), step_weights=torch.ones(4))


# rows: group 7 = three branches (TVE 1, 2, 3) + anchor (TVE nan, ignored); group 3 = two branches (5, 5)
TVE_ROWS = T([1.0, 2.0, 3.0, float("nan"), 5.0, 5.0])
TVE_GIDS = T([7, 7, 7, 7, 3, 3])
TVE_ANCHOR = T([False, False, False, True, False, False])


def test_branch_logprobs_by_hand():
    lp = branch_logprobs(TVE_ROWS, TVE_GIDS, is_anchor=TVE_ANCHOR)
    # log-softmax of (-1, -2, -3): logsumexp = -1 + log(1 + e^-1 + e^-2) = -0.59239404
    close(lp, [-0.40760596, -1.40760596, -2.40760596, 0.0, -0.69314718, -0.69314718])
    lp2 = branch_logprobs(TVE_ROWS, TVE_GIDS, temperature=2.0, is_anchor=TVE_ANCHOR)
    close(lp2[:3], [-0.68026967, -1.18026967, -1.68026967])
    with pytest.raises(ValueError):
        branch_logprobs(TVE_ROWS, TVE_GIDS)  # the anchor's NaN is in the pool without is_anchor
    with pytest.raises(ValueError):
        branch_logprobs(TVE_ROWS, TVE_GIDS, temperature=0.0, is_anchor=TVE_ANCHOR)


def test_branch_logprobs_gradient_by_hand():
    tve = TVE_ROWS.clone().requires_grad_(True)
    lp = branch_logprobs(tve, TVE_GIDS, is_anchor=TVE_ANCHOR)
    lp[4].backward()  # d log p_0 / d tve_j = -(delta_0j - p_j), p = (1/2, 1/2)
    close(tve.grad, [0, 0, 0, 0, -0.5, 0.5])


def test_branch_logprobs_groups_do_not_leak():
    base = branch_logprobs(TVE_ROWS, TVE_GIDS, is_anchor=TVE_ANCHOR)
    # group 3 gets other values and its rows are moved around; group 7 must not change
    tve = T([9.0, 1.0, 2.0, 3.0, float("nan"), 0.5])
    gids = T([3, 7, 7, 7, 7, 3])
    anchor = T([False, False, False, False, True, False])
    lp = branch_logprobs(tve, gids, is_anchor=anchor)
    close(lp[1:5], base[:4])
    close(lp[[0, 5]].exp().sum(), 1.0)


# ------------------------------------------------------------------------------------------------
# Anchor-relative advantages and fusion
# ------------------------------------------------------------------------------------------------

# Group 5: branches r = 1, 2, 4 and the anchor r = 3 (third row).
# sigma = std_unbiased(1, 2, 3, 4) = sqrt(5/3) = 1.29099445; A = (-2, -1, 1) / sigma.
A5 = {"r": T([1.0, 2.0, 3.0, 4.0])}
A5_ANCHOR = T([False, False, True, False])
A5_GIDS = T([5, 5, 5, 5])


def test_anchor_relative_advantage_by_hand():
    adv = anchor_relative_advantages(A5, A5_ANCHOR, A5_GIDS)
    close(adv, [-1.54919334, -0.77459667, 0.0, 0.77459667])


@pytest.mark.parametrize(
    "fusion, clip, expected",
    [
        ("none", 0.0, [-1.54919334, -0.77459667, 0.0, 0.77459667]),
        # std_pop(-2, -1, 1) = sqrt(14)/3: A = (-2, -1, 1) * 3 / sqrt(14) (sigma cancels)
        ("std", 0.0, [-1.60356745, -0.80178373, 0.0, 0.80178373]),
        # zscore: (-4/3, -1/3, 5/3) * 3 / sqrt(14)
        ("zscore", 0.0, [-1.06904497, -0.26726124, 0.0, 1.33630621]),
        ("std", 1.5, [-1.5, -0.80178373, 0.0, 0.80178373]),
    ],
)
def test_fusion_modes_by_hand(fusion, clip, expected):
    per = {"local": anchor_relative_advantages(A5, A5_ANCHOR, A5_GIDS)}
    adv = fuse_signal_advantages(per, A5_ANCHOR, A5_GIDS, {"local": 1.0}, fusion=fusion, adv_clip=clip)
    close(adv, expected)


# Group -2: two branches and the anchor (last row), two signals.
#   local  a: (2, 0 | 1): std_u(2,0,1) = 1           -> A_a = (1, -1)
#   local  b: (5, 5 | 3): std_u(5,5,3) = sqrt(4/3)   -> A_b = (2, 2)/sqrt(4/3) = (1.7320508, 1.7320508)
#   local = A_a + 0.5 A_b = (1.8660254, -0.1339746)
#   global a: (0, 3 | 1): std_u(0,3,1) = sqrt(7/3)   -> (-1, 2)/1.5275252 = (-0.6546537, 1.3093073)
TWO = {
    "local": {"a": T([2.0, 0.0, 1.0]), "b": T([5.0, 5.0, 3.0])},
    "global": {"a": T([0.0, 3.0, 1.0])},
}
TWO_ANCHOR = T([False, False, True])
TWO_GIDS = T([-2, -2, -2])
W = {"a": 1.0, "b": 0.5}


def test_two_signal_advantages_by_hand():
    adv, per = anchor_advantages(TWO, TWO_ANCHOR, TWO_GIDS, W, fusion="none", adv_clip=0.0)
    close(per["local"], [1.86602540, -0.13397460, 0.0])
    close(per["global"], [-0.65465367, 1.30930734, 0.0])
    close(adv, [1.86602540 - 0.5 * 0.65465367, -0.13397460 + 0.5 * 1.30930734, 0.0])  # w_global = 0.5
    # std fusion: local std_pop = 1 (unchanged); global / std_pop(0.98198051) = (-2/3, 4/3)
    adv, _ = anchor_advantages(TWO, TWO_ANCHOR, TWO_GIDS, W)  # defaults: std, clip 2.5
    close(adv, [1.53269207, 0.53269207, 0.0])
    adv, _ = anchor_advantages(TWO, TWO_ANCHOR, TWO_GIDS, W, adv_clip=1.5)
    close(adv, [1.5, 0.53269207, 0.0])


def test_anchor_advantage_is_zero_and_constant_group_is_zero():
    r = {"local": {"a": T([3.0, 3.0, 3.0, 1.0, 2.0, 9.0])}}
    anchor = T([False, True, False, False, True, False])
    gids = T([0, 0, 0, 1, 1, 1])
    adv, per = anchor_advantages(r, anchor, gids, signal_weights={"local": 1.0}, fusion="zscore")
    assert adv[1] == 0 and adv[4] == 0
    assert adv[0] == 0 and adv[2] == 0  # every branch equals the anchor: exactly 0
    assert per["local"][1] == 0 and per["local"][4] == 0


def test_advantage_groups_do_not_leak():
    alone5 = anchor_advantages({"local": A5}, A5_ANCHOR, A5_GIDS, signal_weights={"local": 1.0, "global": 0.5})[0]
    alone2 = anchor_advantages(TWO, TWO_ANCHOR, TWO_GIDS, W)[0]
    # batch both groups; group -2's rows are permuted (anchor first, branches swapped) and
    # group 5 carries a global signal of zeros (rows of group 5 get the same global row everywhere)
    perm = [2, 1, 0]
    rewards = {
        "local": {
            "r": torch.cat([A5["r"], T([0.0, 0.0, 0.0])]),
            "a": torch.cat([T([0.0] * 4), TWO["local"]["a"][perm]]),
            "b": torch.cat([T([0.0] * 4), TWO["local"]["b"][perm]]),
        },
        "global": {"a": torch.cat([T([0.0] * 4), TWO["global"]["a"][perm]])},
    }
    anchor = torch.cat([A5_ANCHOR, TWO_ANCHOR[perm]])
    gids = torch.cat([A5_GIDS, TWO_GIDS])
    adv, _ = anchor_advantages(rewards, anchor, gids, W)
    close(adv[:4], alone5)
    close(adv[4:], alone2[perm])


def test_advantage_errors():
    with pytest.raises(ValueError, match="exactly one anchor"):
        anchor_relative_advantages(A5, T([False] * 4), A5_GIDS)
    with pytest.raises(ValueError, match="exactly one anchor"):
        anchor_relative_advantages(A5, T([True, True, False, False]), A5_GIDS)
    with pytest.raises(ValueError, match="fusion"):
        fuse_signal_advantages({"local": T([1.0, 0.0])}, T([False, True]), T([0, 0]), fusion="rank")
    with pytest.raises(ValueError, match="no weight"):
        fuse_signal_advantages({"video": T([1.0, 0.0])}, T([False, True]), T([0, 0]))
    with pytest.raises(ValueError, match="NaN"):
        anchor_relative_advantages({"r": T([1.0, float("nan")])}, T([False, True]), T([0, 0]))


# ------------------------------------------------------------------------------------------------
# Objective: the registry's clipped loss on the branch log-probs (configs/video_kvpo.yaml)
# ------------------------------------------------------------------------------------------------


def test_gradient_step_raises_the_logprob_of_positive_advantage_branches():
    """TVE -> branch softmax -> the shipped loss (grpo, KVPO's clip 0.1 / 0.2, anchor masked out): a
    descent step on the replay velocities raises log π of the branch with the largest advantage and
    lowers the one with the most negative advantage."""
    torch.manual_seed(0)
    G, S, D = 4, 3, 5
    v_branch = torch.randn(G + 1, S, D)
    v_replay = (v_branch + 0.3).clone().requires_grad_(True)  # equal TVE: π uniform
    gids = torch.zeros(G + 1, dtype=torch.long)
    anchor = T([False] * G + [True])
    adv = T([2.0, -1.0, 0.5, -1.5, 0.0])
    w = tve_step_weights([1.0, 0.75, 0.5])

    def logp_of(v):
        tve = trajectory_velocity_energy(v_branch, v, w, grad_mask=first_steps_mask(S, 2))
        return tve, branch_logprobs(tve, gids, is_anchor=anchor)

    tve, lp = logp_of(v_replay)
    tve.retain_grad()
    loss, _ = policy_loss("grpo", lp[:, None], lp.detach()[:, None], adv, (~anchor)[:, None], eps_low=0.1, eps_high=0.2)
    loss.backward()
    # at ratio 1 and π = uniform: dL/dTVE_j = (A_j - p_j sum A) / G = A_j / 4 (the branch advantages sum to 0)
    close(tve.grad, [0.5, -0.25, 0.125, -0.375, 0.0])
    assert v_replay.grad[:, 2].abs().max() == 0  # step 2 carries no gradient
    with torch.no_grad():
        _, lp_after = logp_of(v_replay - 0.05 * v_replay.grad)
    assert lp_after[0] > lp[0] and lp_after[3] < lp[3]


def test_kvpo_anchor_estimator_takes_each_groups_first_row_as_the_anchor():
    # Group 0: anchor 0.5, branches (0.7, 0.3, 0.5): differences (0.2, -0.2, 0); fusion "std" divides
    # by their population std sqrt(0.08 / 3) = 0.1633 (sigma_c cancels): (1.2247, -1.2247, 0).
    # Group 1 (rows interleaved with group 0's, first row 1): anchor 1, branches (1, 0, 2) -> (0, -1.2247, 1.2247).
    rewards = torch.tensor([0.5, 1.0, 0.7, 1.0, 0.3, 0.0, 0.5, 2.0])
    groups = torch.tensor([7, 3, 7, 3, 7, 3, 7, 3])
    adv = compute_advantages("kvpo_anchor", rewards, groups)
    s = 1 / (2 / 3) ** 0.5  # 1.2247
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, s, 0.0, -s, -s, 0.0, s]), atol=1e-4)
    clipped = compute_advantages("kvpo_anchor", rewards, groups, adv_clip=1.0)
    assert float(clipped.abs().max()) == pytest.approx(1.0)
