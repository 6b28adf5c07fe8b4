"""Flow-matching samplers as stochastic policies: one shared SDE module for every flow model
(SmolVLA's action expert here, video generators later).

Convention (rectified flow, as lerobot's SmolVLA/pi0 and diffusers' flow-match schedulers use it):

    x_t = (1 - t) x0 + t eps,   the model predicts v = eps - x0,   t runs 1 (noise) -> 0 (data).

So every step has dt = t_next - t < 0 and the ODE (Euler) step is `x + v dt`.

Flow-GRPO (arXiv 2505.05470) turns each step into a Gaussian with a computable log-prob, using the
reverse SDE that keeps the ODE's marginals. With eps_hat = x + (1 - t) v the model's noise
estimate, the score is -eps_hat / t, and the step is

    mean = x + [v + s^2 / (2t) (x + (1 - t) v)] dt,   std = s sqrt(-dt),   s = eta sqrt(t / (1 - t)).

This is Flow-GRPO's `sde_step_with_logprob` term for term (tested against a re-implementation of it
on a shifted grid).

Edges, and what we do about them:
* s^2 / (2t) = eta^2 / (2 (1 - t)): t cancels, so t = 0 needs no guard (the drift is computed in this
  form).
* At t = 1, 1 - t = 0 and s is infinite. There (and only there) we replace 1 - t by -dt = 1 - t_next,
  in s and in the drift's s^2 / (2t); the (1 - t) v term keeps its exact 0. This is Flow-GRPO's own
  clamp, `1 - where(sigma == 1, sigma_max, sigma)` with sigma_max = sigmas[1], the grid's second
  time: only a step from t = 1 is the first step of a grid, so its t_next is sigmas[1]. Every step
  from t < 1 uses the exact 1 - t, on uniform and shifted grids alike.
* eta = 0 makes std 0: the step is the ODE step and has no density. `sde_step` allows it (the mean is
  still right) but `gaussian_logprob` refuses a zero std.

The log-prob of a step is the per-element MEAN of the Gaussian's log-density over the latent (or
chunk), as Flow-GRPO (`log_prob.mean(dim=tuple(range(1, log_prob.ndim)))`), DanceGRPO and DPPO
(its per-element log-probs averaged over the action chunk) compute it, so the PPO ratio's scale does
not grow with the latent's size: a sum over N elements would move the log-ratio N times as far
for the same per-element change. `gaussian_logprob(..., reduce="sum")` gives the full density.

DanceGRPO (arXiv 2505.07818) uses the same reverse SDE with a constant noise level s = eta
(`noise_schedule="constant"`): std = eta sqrt(-dt), drift term eta^2 / (2t) (x + (1 - t) v).

Each denoising step is one decision "unit" for the loss registry: a rollout of K steps has units
[B, K] with log-probs `sample_sde` returns and `recompute_logprobs` recomputes teacher-forced.

Diffusion (DDPM / DDIM) chains are Gaussian policies the same way (DPPO, arXiv 2409.00588: the
denoising steps of a diffusion policy as the inner level of a two-level MDP). `diffusion_step` is
the DDIM step with noise level eta from alpha_bar_t to alpha_bar_prev,

    x0 = the model's clean estimate (clipped),   eps = (x - sqrt(ab_t) x0) / sqrt(1 - ab_t)
    (re-derived from the clipped x0, as DPPO does and diffusers' DDIM with use_clipped_model_output),
    var = eta^2 (1 - ab_prev) / (1 - ab_t) (1 - ab_t / ab_prev),
    mean = sqrt(ab_prev) x0 + sqrt(1 - ab_prev - var) eps,   std = max(sqrt(var), min_std).

eta = 1 is DDPM's posterior q(x_prev | x_t, x0) (with "fixed_small" variance), for any step spacing;
eta = 0 is the deterministic DDIM sampler. DPPO's floor `min_std` keeps exploring where the chain's
own noise vanishes and gives the last step (ab_prev = 1, var = 0) a density. The log-prob is
`gaussian_logprob` (the per-element mean, as DPPO's code takes it; DPPO also clamps each element's
log-prob to [-5, 2] before the mean, which the diffusion policy does not), shared with the flow steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

LOGPROB_REDUCTIONS = ("mean", "sum")  # gaussian_logprob: per-element mean (Flow-GRPO, DPPO) or the full density
NOISE_SCHEDULES = ("flow_grpo", "constant")  # s = eta sqrt(t / (1 - t)) (Flow-GRPO), s = eta (DanceGRPO)
VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [B, ...], t [B]) -> v [B, ...]

PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")  # what a diffusion model's output is (diffusers' names)

__all__ = [
    "LOGPROB_REDUCTIONS",
    "NOISE_SCHEDULES",
    "PREDICTION_TYPES",
    "diffusion_chain",
    "diffusion_step",
    "flow_timesteps",
    "gaussian_kl",
    "gaussian_logprob",
    "ode_step",
    "sde_step",
]


def _broadcast_time(t: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A scalar or per-sample [B] time as a tensor that broadcasts against x [B, ...]."""
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    if t.dim() == 0:
        return t
    if t.dim() != 1 or t.shape[0] != x.shape[0]:
        raise ValueError(f"time must be a scalar or one value per sample [{x.shape[0]}], got shape {tuple(t.shape)}")
    return t.view(-1, *([1] * (x.dim() - 1)))


def flow_timesteps(num_steps: int, shift: float = 1.0, t_max: float = 1.0, t_min: float = 0.0,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """`num_steps + 1` times from `t_max` down to `t_min`, uniform in t, then warped by the SD3
    `shift` (t' = shift t / (1 + (shift - 1) t); shift > 1 spends more steps near the noise)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not 0.0 <= t_min < t_max <= 1.0:
        raise ValueError(f"need 0 <= t_min < t_max <= 1, got t_min={t_min}, t_max={t_max}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    t = torch.linspace(t_max, t_min, num_steps + 1, dtype=torch.float64)
    if shift != 1.0:
        t = (shift * t / (1 + (shift - 1) * t)).clamp(max=1.0)  # t = 1 stays exactly 1 (the sde_step guard)
    return t.to(torch.float32).to(device)


def ode_step(x: torch.Tensor, v: torch.Tensor, dt: float | torch.Tensor) -> torch.Tensor:
    """The deterministic Euler step x + v dt (dt < 0 towards the data)."""
    return x + v * _broadcast_time(dt, x)


def sde_step(x: torch.Tensor, v: torch.Tensor, t: float | torch.Tensor, dt: float | torch.Tensor, eta: float,
             noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
             noise_schedule: str = "flow_grpo") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One reverse-SDE step from time t to t + dt: returns (x_next, mean, std).

    `noise_schedule` picks the noise level s (module docstring): "flow_grpo" or "constant"
    (DanceGRPO). `noise` (standard normal, shape of x) is drawn from `generator` when not given;
    `std` broadcasts against x (a scalar or [B, 1, ...] tensor)."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if noise_schedule not in NOISE_SCHEDULES:
        raise ValueError(f"unknown noise_schedule {noise_schedule!r}; valid: {', '.join(NOISE_SCHEDULES)}")
    tt, dtt = _broadcast_time(t, x), _broadcast_time(dt, x)
    if bool((dtt >= 0).any()):
        raise ValueError("dt must be < 0: the sampler integrates from t = 1 (noise) to t = 0 (data)")
    # the t = 1 guard (module docstring): Flow-GRPO's sigma_max clamp there, the exact 1 - t elsewhere
    one_minus_t = torch.where(tt >= 1, -dtt, 1 - tt)
    if noise_schedule == "flow_grpo":
        s2 = eta ** 2 * tt / one_minus_t  # s^2
        half_s2_over_t = eta ** 2 / (2 * one_minus_t)  # s^2 / (2t) written without 1/t
    else:
        s2 = torch.full_like(tt, eta ** 2)
        half_s2_over_t = eta ** 2 / (2 * tt)  # steps start at t > 0, so no guard is needed
    mean = x + (v + half_s2_over_t * (x + (1 - tt) * v)) * dtt
    std = (s2 * -dtt).sqrt()
    if noise is None:
        noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return mean + std * noise, mean, std


def gaussian_logprob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float,
                     reduce_dims: Sequence[int] | None = None, reduce: str = "mean") -> torch.Tensor:
    """log N(x_next; mean, std^2) per element, averaged (`reduce="mean"`, Flow-GRPO's and DPPO's
    per-element mean: module docstring) or summed (`"sum"`, the full density) over `reduce_dims`
    (default: every dim but the first) -> [B]."""
    if reduce not in LOGPROB_REDUCTIONS:
        raise ValueError(f"unknown reduce {reduce!r}; valid: {', '.join(LOGPROB_REDUCTIONS)}")
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    if bool((std <= 0).any()):
        raise ValueError("std must be > 0 for a log-prob (eta = 0 makes the step deterministic)")
    z = (x_next - mean) / std
    logp = -0.5 * z.pow(2) - std.log() - 0.5 * math.log(2 * math.pi)
    dims = tuple(range(1, x_next.dim())) if reduce_dims is None else tuple(reduce_dims)
    if not dims:
        return logp
    return logp.mean(dims) if reduce == "mean" else logp.sum(dims)


def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor | float,
                reduce_dims: Sequence[int] | None = None) -> torch.Tensor:
    """KL(N(mean, std^2) || N(mean_ref, std^2)) per element, averaged over `reduce_dims` (default:
    every dim but the first) -> [B]: (mean - mean_ref)^2 / (2 std^2), the exact KL of one step to the
    reference's step from the same state (both share the schedule's std). Flow-GRPO's KL term; at
    the scale of the per-element mean log-prob, so it does not grow with the latent either. The
    k1/k2/k3 estimators on mean log-probs see this N-element average only through a sampled
    log-ratio whose size falls as 1 / sqrt(N), so their KL is ~N times weaker."""
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    kl = (mean - mean_ref.detach()).pow(2) / (2 * std.pow(2))
    dims = tuple(range(1, mean.dim())) if reduce_dims is None else tuple(reduce_dims)
    return kl.mean(dims) if dims else kl


def diffusion_chain(scheduler, num_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A diffusers DDPM / DDIM scheduler's inference chain of `num_steps` steps: (timesteps [K] long,
    alpha_bar_t [K], alpha_bar_prev [K]), each step going from timesteps[k] to the next one (the
    last to the scheduler's final alpha_bar: 1 unless a DDIM has `set_alpha_to_one=False`)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler.set_timesteps(num_steps)
    timesteps = torch.as_tensor(scheduler.timesteps).long().cpu()
    alphas = torch.as_tensor(scheduler.alphas_cumprod, dtype=torch.float64).cpu()
    final = torch.as_tensor(getattr(scheduler, "final_alpha_cumprod", 1.0), dtype=torch.float64).reshape(1)
    alpha_bar = alphas[timesteps]
    alpha_bar_prev = torch.cat([alphas[timesteps[1:]], final])
    return timesteps, alpha_bar.float(), alpha_bar_prev.float()


def diffusion_step(x: torch.Tensor, model_output: torch.Tensor, alpha_bar: float | torch.Tensor,
                   alpha_bar_prev: float | torch.Tensor, eta: float = 1.0, prediction_type: str = "epsilon",
                   clip_sample: float | None = None, min_std: float = 0.0, noise: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One DDIM step with noise level eta (module docstring) from x at alpha_bar to alpha_bar_prev:
    returns (x_prev, mean, std). `alpha_bar*` are scalars or one value per sample [B];
    `clip_sample` clips the clean estimate to [-c, c] (lerobot's `clip_sample_range`)."""
    if eta < 0 or min_std < 0:
        raise ValueError(f"eta and min_std must be >= 0, got eta={eta}, min_std={min_std}")
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"unknown prediction_type {prediction_type!r}; valid: {', '.join(PREDICTION_TYPES)}")
    ab, ab_prev = _broadcast_time(alpha_bar, x), _broadcast_time(alpha_bar_prev, x)
    if bool((ab <= 0).any() or (ab >= 1).any() or (ab_prev < ab).any() or (ab_prev > 1).any()):
        raise ValueError("need 0 < alpha_bar < 1 and alpha_bar <= alpha_bar_prev <= 1 (a step towards the data)")
    sqrt_ab, sqrt_1m_ab = ab.sqrt(), (1 - ab).sqrt()
    if prediction_type == "epsilon":
        x0 = (x - sqrt_1m_ab * model_output) / sqrt_ab
    elif prediction_type == "sample":
        x0 = model_output
    else:
        x0 = sqrt_ab * x - sqrt_1m_ab * model_output
    if clip_sample is not None:
        x0 = x0.clamp(-clip_sample, clip_sample)
    eps = (x - sqrt_ab * x0) / sqrt_1m_ab  # consistent with the (clipped) clean estimate
    var = eta ** 2 * (1 - ab_prev) / (1 - ab) * (1 - ab / ab_prev)
    mean = ab_prev.sqrt() * x0 + (1 - ab_prev - var).clamp_min(0).sqrt() * eps
    std = var.sqrt().clamp_min(min_std)
    if noise is None:
        noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return mean + std * noise, mean, std
