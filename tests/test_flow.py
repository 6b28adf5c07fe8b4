"""The shared flow-matching SDE: the ODE limit, the Gaussian log-prob, sampler/recompute parity and
marginal preservation on a 1-D Gaussian whose velocity is known in closed form."""

import math

import pytest
import torch

from mmrl.flow import VelocityFn, flow_timesteps, gaussian_logprob, ode_step, sde_step

torch.set_num_threads(1)


# The reference samplers the flow policies' per-step functions compose into: whole trajectories by
# Euler (ODE) or the reverse SDE, and their teacher-forced log-probs. Test oracles, not library code.

def _check_timesteps(timesteps: torch.Tensor) -> torch.Tensor:
    timesteps = torch.as_tensor(timesteps)
    if timesteps.dim() != 1 or timesteps.numel() < 2:
        raise ValueError(f"timesteps must be a 1-D tensor of K + 1 >= 2 times, got shape {tuple(timesteps.shape)}")
    if bool((timesteps[1:] >= timesteps[:-1]).any()):
        raise ValueError(f"timesteps must decrease strictly (1 -> 0), got {timesteps.tolist()}")
    return timesteps


def _time_batch(t: torch.Tensor, B: int, x: torch.Tensor) -> torch.Tensor:
    return t.to(device=x.device, dtype=x.dtype).expand(B)


def sample_ode(velocity_fn: VelocityFn, x_T: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """Plain Euler integration from x_T at timesteps[0] to timesteps[-1] (the reference sampler)."""
    timesteps = _check_timesteps(timesteps)
    x = x_T
    for k in range(timesteps.numel() - 1):
        t, t_next = timesteps[k], timesteps[k + 1]
        x = ode_step(x, velocity_fn(x, _time_batch(t, x.shape[0], x)), float(t_next - t))
    return x


def sample_sde(velocity_fn: VelocityFn, x_T: torch.Tensor, timesteps: torch.Tensor, eta: float,
               generator: torch.Generator | None = None, noise_schedule: str = "flow_grpo"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample with the SDE: returns the states [B, K+1, ...] (x_T first, the sample last) and the
    per-step log-probs [B, K] of each transition. Runs under the caller's grad mode; a sampler
    normally wraps it in `torch.no_grad()`."""
    timesteps = _check_timesteps(timesteps)
    x, states, logps = x_T, [x_T], []
    for k in range(timesteps.numel() - 1):
        t, t_next = timesteps[k], timesteps[k + 1]
        v = velocity_fn(x, _time_batch(t, x.shape[0], x))
        x, mean, std = sde_step(x, v, float(t), float(t_next - t), eta, generator=generator,
                                noise_schedule=noise_schedule)
        logps.append(gaussian_logprob(x, mean, std))
        states.append(x)
    return torch.stack(states, 1), torch.stack(logps, 1)


def recompute_logprobs(velocity_fn: VelocityFn, states: torch.Tensor, timesteps: torch.Tensor, eta: float,
                       batched: bool = False, noise_schedule: str = "flow_grpo") -> torch.Tensor:
    """Teacher-forced log-probs [B, K] of the transitions states[:, k] -> states[:, k+1], with the
    gradient flowing through `velocity_fn`.

    `batched=False` calls velocity_fn once per step on B rows (the sampler's batch layout).
    `batched=True` makes one call on B*K rows, sample-major (row b*K + k is sample b at step k), so
    per-sample conditioning expands with `repeat_interleave(K)`."""
    timesteps = _check_timesteps(timesteps).to(states.device)
    K = timesteps.numel() - 1
    if states.dim() < 2 or states.shape[1] != K + 1:
        raise ValueError(f"states must be [B, K+1={K + 1}, ...], got shape {tuple(states.shape)}")
    B = states.shape[0]
    t, dt = timesteps[:-1], timesteps[1:] - timesteps[:-1]
    if batched:
        x = states[:, :-1].reshape(B * K, *states.shape[2:])
        t_rows, dt_rows = t.repeat(B).to(x.dtype), dt.repeat(B).to(x.dtype)
        v = velocity_fn(x, t_rows)
        _, mean, std = sde_step(x, v, t_rows, dt_rows, eta, noise=torch.zeros_like(x), noise_schedule=noise_schedule)
        x_next = states[:, 1:].reshape(B * K, *states.shape[2:])
        return gaussian_logprob(x_next, mean, std).view(B, K)
    out = []
    for k in range(K):
        x = states[:, k]
        v = velocity_fn(x, _time_batch(t[k], B, x))
        _, mean, std = sde_step(x, v, float(t[k]), float(dt[k]), eta, noise=torch.zeros_like(x),
                                noise_schedule=noise_schedule)
        out.append(gaussian_logprob(states[:, k + 1], mean, std))
    return torch.stack(out, 1)


# ----------------------------------------------------------------------------- diffusion chains (DPPO)


def test_timesteps_schedule():
    t = flow_timesteps(4)
    assert torch.allclose(t, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    shifted = flow_timesteps(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0 and bool((shifted[1:-1] > t[1:-1]).all())
    with pytest.raises(ValueError, match="num_steps"):
        flow_timesteps(0)


def test_small_eta_mean_is_the_euler_step():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(5, 3, 2, generator=g), torch.randn(5, 3, 2, generator=g)
    for t, dt in [(1.0, -0.1), (0.5, -0.1), (0.1, -0.1)]:
        _, mean, std = sde_step(x, v, t, dt, eta=1e-7)
        assert torch.allclose(mean, ode_step(x, v, dt), atol=1e-6)
        assert float(std.max()) < 1e-5
    # eta = 0 exactly: the ODE step itself, and no density.
    x_next, mean, std = sde_step(x, v, 0.5, -0.1, eta=0.0)
    assert torch.equal(x_next, mean) and torch.allclose(mean, ode_step(x, v, -0.1))
    with pytest.raises(ValueError, match="std must be > 0"):
        gaussian_logprob(x_next, mean, std)


def test_logprob_is_the_normal_density_averaged_over_elements():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(4, 8, 7, generator=g), torch.randn(4, 8, 7, generator=g)
    t = torch.tensor([1.0, 0.7, 0.4, 0.2])  # per-sample times, t = 1 included (the guard)
    x_next, mean, std = sde_step(x, v, t, -0.1, eta=0.7, generator=g)
    assert torch.isfinite(mean).all() and bool((std > 0).all())
    per_element = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x_next)
    # Flow-GRPO's and DanceGRPO's per-element mean (the default), and the full density on request
    assert torch.allclose(gaussian_logprob(x_next, mean, std), per_element.mean((1, 2)), atol=1e-5)
    assert torch.allclose(gaussian_logprob(x_next, mean, std, reduce="sum"), per_element.sum((1, 2)), atol=1e-4)
    assert torch.allclose(gaussian_logprob(x_next, mean, std, reduce_dims=(2,)), per_element.mean(2), atol=1e-5)
    with pytest.raises(ValueError, match="unknown reduce 'max'; valid: mean, sum"):
        gaussian_logprob(x_next, mean, std, reduce="max")
    with pytest.raises(ValueError, match="dt must be < 0"):
        sde_step(x, v, 0.5, 0.1, eta=0.7)


def _upsample(y: torch.Tensor) -> torch.Tensor:
    """[B, K+1, C, F, H, W] or [B, C, F, H, W]: every pixel repeated 2 x 2 (the same video at twice the size)."""
    return y.repeat_interleave(2, -1).repeat_interleave(2, -2)


def test_log_ratios_do_not_depend_on_the_latent_size():
    """The same video at twice the latent size (each element repeated 2 x 2, the same per-element
    velocity) gives the same step log-probs and so the same PPO ratios: the per-element mean. The
    sum would multiply every log-ratio by 4."""
    ts = flow_timesteps(4, shift=5.0)

    def velocity(scale: float):  # pointwise in x, so the upsampled latent gets the upsampled velocity
        return lambda x, t: scale * torch.tanh(x) - (1 - t.view(-1, 1, 1, 1, 1)) * x

    old, new = velocity(1.0), velocity(1.05)
    x_T = torch.randn(3, 2, 2, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        states, logp_old = sample_sde(old, x_T, ts, eta=0.7, generator=torch.Generator().manual_seed(1))
    big = _upsample(states)
    assert big.shape == (3, 5, 2, 2, 8, 8)
    ratios = {}
    for name, st in (("small", states), ("big", big)):
        lo, ln = recompute_logprobs(old, st, ts, eta=0.7), recompute_logprobs(new, st, ts, eta=0.7)
        ratios[name] = (ln - lo).exp()
        assert torch.allclose(lo, logp_old, atol=1e-10)  # the same log-probs at both sizes
    assert (ratios["small"] - 1).abs().max() > 1e-3  # the perturbation moves the ratios
    assert torch.allclose(ratios["big"], ratios["small"], atol=1e-10)
    # What the sum did: the bigger latent's log-ratio 4 times the smaller's (first step, from t = 1).
    t0, dt0 = ts[:1].double().expand(3), float(ts[1] - ts[0])

    def sum_log_ratio(st):
        (_, m_old, std), (_, m_new, _) = (sde_step(st[:, 0], f(st[:, 0], t0), 1.0, dt0, 0.7) for f in (old, new))
        return (gaussian_logprob(st[:, 1], m_new, std, reduce="sum")
                - gaussian_logprob(st[:, 1], m_old, std, reduce="sum"))

    assert torch.allclose(sum_log_ratio(big), 4 * sum_log_ratio(states), atol=1e-8)


def _flow_grpo_sde_step(sample, model_output, sigmas, index, noise_level, prev_sample):
    """Flow-GRPO's `sde_step_with_logprob` (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py,
    yifan123/flow_grpo), re-implemented here for the test: (prev_sample_mean, std, log_prob)."""
    sigma, sigma_prev = sigmas[index], sigmas[index + 1]
    sigma_max = sigmas[1]
    dt = sigma_prev - sigma
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level
    prev_sample_mean = (sample * (1 + std_dev_t ** 2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt)
    std = std_dev_t * math.sqrt(-dt)
    log_prob = (-((prev_sample - prev_sample_mean) ** 2) / (2 * std ** 2) - math.log(std)
                - math.log(math.sqrt(2 * math.pi)))
    return prev_sample_mean, std, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def test_sde_step_is_flow_grpos_step_on_a_shifted_grid():
    """On the shifted grid of configs/video_wan_gpu.yaml (4 steps, shift 5) every step's mean, std
    and log-prob equal Flow-GRPO's own formula: the exact 1 - t for t < 1, its sigma_max clamp at t = 1."""
    shift, eta = 5.0, 0.7
    sigmas = [shift * u / (1 + (shift - 1) * u) for u in (1.0, 0.75, 0.5, 0.25, 0.0)]  # SD3's time shift
    grid = torch.tensor(sigmas, dtype=torch.float64)
    assert torch.allclose(flow_timesteps(4, shift=shift).double(), grid, atol=1e-7) and sigmas[0] == 1.0
    g = torch.Generator().manual_seed(0)
    B = 3
    x = torch.randn(B, 4, 2, 3, 3, generator=g, dtype=torch.float64)
    for k in range(4):
        v = torch.randn(x.shape, generator=g, dtype=torch.float64)
        x_next, mean, std = sde_step(x, v, sigmas[k], sigmas[k + 1] - sigmas[k], eta, generator=g)
        ref_mean, ref_std, ref_logp = _flow_grpo_sde_step(x, v, sigmas, k, eta, x_next)
        assert (mean - ref_mean).abs().max() < 1e-6, k
        assert abs(float(std) - ref_std) < 1e-6, (k, float(std), ref_std)
        assert (gaussian_logprob(x_next, mean, std) - ref_logp).abs().max() < 1e-6, k
        x = x_next
    # The step from t = 0.9375 (1 - t = 0.0625 < |dt| = 0.104): the exact std, no longer 1 - t floored at -dt.
    _, _, std = sde_step(x, x, sigmas[1], sigmas[2] - sigmas[1], eta)
    assert float(std) == pytest.approx(0.875, abs=1e-3)
    # Per-sample times mixing t = 1 and t < 1 in one call (the batched recompute's layout) take each rule.
    t = torch.tensor(sigmas[:4], dtype=torch.float64)
    dt = torch.tensor(sigmas[1:], dtype=torch.float64) - t
    xs = torch.randn(4, 5, generator=g, dtype=torch.float64)
    vs = torch.randn(4, 5, generator=g, dtype=torch.float64)
    _, mean, std = sde_step(xs, vs, t, dt, eta, noise=torch.zeros_like(xs))
    for k in range(4):
        ref_mean, ref_std, _ = _flow_grpo_sde_step(xs[k:k + 1], vs[k:k + 1], sigmas, k, eta, xs[k:k + 1])
        assert (mean[k] - ref_mean[0]).abs().max() < 1e-6 and abs(float(std[k]) - ref_std) < 1e-6, k


def test_constant_noise_schedule_is_dancegrpo_step():
    # DanceGRPO: std = eta sqrt(-dt); mean = x + [v + eta^2 / (2t) (x + (1 - t) v)] dt, by hand at
    # x = 1, v = 2, t = 0.5, dt = -0.25, eta = 0.4: mean = 1 + [2 + 0.16 (1 + 1)] (-0.25) = 0.42.
    x, v = torch.ones(1, 1), torch.full((1, 1), 2.0)
    _, mean, std = sde_step(x, v, 0.5, -0.25, eta=0.4, noise_schedule="constant")
    assert torch.allclose(mean, torch.tensor([[0.42]])) and torch.allclose(std, torch.tensor(0.2))
    # Flow-GRPO at the same point: s^2 = 0.16 * 0.5 / 0.5 = 0.16, the same drift here, std 0.2 too;
    # at t = 0.6 the two differ (s^2 = 0.16 * 0.6 / 0.4 = 0.24 vs 0.16).
    _, _, std_fg = sde_step(x, v, 0.6, -0.25, eta=0.4)
    _, _, std_c = sde_step(x, v, 0.6, -0.25, eta=0.4, noise_schedule="constant")
    assert torch.allclose(std_fg, torch.tensor(0.06).sqrt()) and torch.allclose(std_c, torch.tensor(0.2))
    with pytest.raises(ValueError, match="unknown noise_schedule 'dance'; valid: flow_grpo, constant"):
        sde_step(x, v, 0.5, -0.25, eta=0.4, noise_schedule="dance")


class TinyVelocity(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))

    def forward(self, x, t):
        return self.net(torch.cat([x, t.view(-1, 1, 1).expand(*x.shape[:2], 1)], -1))


@pytest.mark.parametrize("batched", [False, True])
def test_sampling_logprobs_equal_recompute(batched):
    torch.manual_seed(0)
    model = TinyVelocity()
    x_T = torch.randn(6, 5, 3, generator=torch.Generator().manual_seed(2))
    ts = flow_timesteps(10, shift=2.0)
    with torch.no_grad():
        states, logp = sample_sde(model, x_T, ts, eta=0.7, generator=torch.Generator().manual_seed(3))
    assert states.shape == (6, 11, 5, 3) and logp.shape == (6, 10)
    re = recompute_logprobs(model, states, ts, eta=0.7, batched=batched)
    assert (re - logp).abs().max().item() < 1e-5
    re.sum().backward()  # the gradient reaches the velocity model
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def _gaussian_velocity(mu: float, s0: float):
    """Exact v(x, t) = E[eps - x0 | x_t] for x0 ~ N(mu, s0^2), x_t = (1-t) x0 + t eps."""

    def v(x, t):
        t = t.view(-1, *([1] * (x.dim() - 1)))
        m, var = (1 - t) * mu, (1 - t) ** 2 * s0 ** 2 + t ** 2
        e_eps = t / var * (x - m)
        e_x0 = mu + (1 - t) * s0 ** 2 / var * (x - m)
        return e_eps - e_x0

    return v


@pytest.mark.parametrize("schedule", ["flow_grpo", "constant"])
def test_sde_keeps_the_marginals_on_a_gaussian(schedule):
    mu, s0, n, K = 1.5, 0.4, 40_000, 50
    v = _gaussian_velocity(mu, s0)
    ts = flow_timesteps(K)
    x_T = torch.randn(n, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    states, logp = sample_sde(v, x_T, ts, eta=0.8, generator=torch.Generator().manual_seed(1),
                              noise_schedule=schedule)
    assert torch.isfinite(logp).all()
    for k in (10, 25, 40, K):  # intermediate marginals and the final one
        t = float(ts[k])
        want_mean, want_std = (1 - t) * mu, math.sqrt((1 - t) ** 2 * s0 ** 2 + t ** 2)
        got = states[:, k, 0]
        assert abs(got.mean().item() - want_mean) < 0.05, (k, got.mean().item(), want_mean)
        assert abs(got.std().item() - want_std) < 0.06, (k, got.std().item(), want_std)
    # The ODE reaches the same marginal (sanity of the closed-form velocity).
    ode = sample_ode(v, x_T, ts)
    assert abs(ode.mean().item() - mu) < 0.03 and abs(ode.std().item() - s0) < 0.03


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
@pytest.mark.parametrize("num_steps", [100, 10])
def test_diffusion_step_is_the_diffusers_ddpm_and_ddim_step(prediction_type, num_steps):
    """`diffusion_step` with eta = 1 is DDPMScheduler.step (any step spacing), with any eta it is
    DDIMScheduler.step (eps re-derived from the clipped x0), and its std is floored at min_std."""
    from diffusers import DDIMScheduler, DDPMScheduler

    from mmrl.flow import diffusion_chain, diffusion_step

    kw = dict(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True, clip_sample_range=1.0,
              prediction_type=prediction_type)
    g = torch.Generator().manual_seed(0)
    x = 2 * torch.randn(3, 8, 2, generator=g)
    ddpm = DDPMScheduler(**kw)
    timesteps, ab, ab_prev = diffusion_chain(ddpm, num_steps)
    assert timesteps.tolist() == ddpm.timesteps.tolist() and ab_prev[-1] == 1.0
    for k, t in enumerate(timesteps.tolist()):
        out = torch.randn(x.shape, generator=g)
        ref = ddpm.step(out, t, x, generator=torch.Generator().manual_seed(k)).prev_sample
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(k)) if t > 0 else torch.zeros_like(x)
        _, mean, std = diffusion_step(x, out, ab[k], ab_prev[k], eta=1.0, prediction_type=prediction_type,
                                      clip_sample=1.0, noise=noise)
        assert (mean + std * noise - ref).abs().max() < 1e-4, (k, t)
    ddim = DDIMScheduler(**kw)
    timesteps, ab, ab_prev = diffusion_chain(ddim, num_steps)
    for eta in (0.0, 0.5, 1.0):
        for k, t in enumerate(timesteps.tolist()):
            out, noise = torch.randn(x.shape, generator=g), torch.randn(x.shape, generator=g)
            ref = ddim.step(out, t, x, eta=eta, variance_noise=noise, use_clipped_model_output=True).prev_sample
            x_prev, _, std = diffusion_step(x, out, ab[k], ab_prev[k], eta=eta, prediction_type=prediction_type,
                                            clip_sample=1.0, noise=noise)
            assert (x_prev - ref).abs().max() < 1e-4, (eta, k)
    # The last step has no noise of its own: the floor is its std, and the log-prob exists.
    _, mean, std = diffusion_step(x, out, ab[-1], ab_prev[-1], eta=1.0, min_std=0.1, noise=torch.zeros_like(x))
    assert float(std) == pytest.approx(0.1)
    assert torch.isfinite(gaussian_logprob(mean + 0.1, mean, std)).all()
    with pytest.raises(ValueError, match="unknown prediction_type 'x0'; valid: epsilon, sample, v_prediction"):
        diffusion_step(x, out, ab[0], ab_prev[0], prediction_type="x0")
    with pytest.raises(ValueError, match="alpha_bar"):
        diffusion_step(x, out, ab_prev[0], ab[0])
