"""lerobot's SmolVLA as a flow-matching GRPO policy, on a tiny SmolVLA built offline: with eta -> 0 the
SDE sampler reproduces lerobot's own `sample_actions` from the same noise; sampled per-step
log-probs equal the teacher-forced ones over whole trajectories; SFT, checkpoints and one
trainer step work."""

import numpy as np
import pytest
import torch

from mmrl.config import config_from_dict
from mmrl.policies import policy_class
from mmrl.policies.vla.modeling_smolvla import SmolVLAPolicy, build_tiny_smolvla
from mmrl.rollout import Rollout
from mmrl.trainer import Trainer

pytest.importorskip("lerobot")
torch.set_num_threads(1)

from test_action_vla import DotTask, dot_envs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("smolvla")
    return build_tiny_smolvla(root, ["move the dot to the centre 0 1"], cameras=("front",), state_dim=2,
                              action_dim=2, chunk_size=4, n_action_steps=2, num_steps=4, image_size=32, seed=0)


def make_policy(tiny, **kw):
    model, pre, post = tiny
    return SmolVLAPolicy(model, pre, post, **{"eta": 0.7, "env_factory": dot_envs, "max_chunks": 4, **kw})


def _obs(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"images": {"front": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)},
            "state": rng.normal(size=(n, 2)).astype(np.float32)}


def test_small_eta_reproduces_lerobot_sample_actions(tiny):
    policy = make_policy(tiny, eta=1e-6)
    assert policy_class("smolvla") is SmolVLAPolicy
    obs, instr = _obs(3), ["move the dot", "move the dot to the centre 1", "go"]
    arr = obs["images"]["front"][:, None]
    batch = policy._batch(arr, obs["state"], instr)
    model = policy.model
    noise = torch.randn(3, *policy.chunk_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        images, img_masks = model.prepare_images(batch)
        ref = model.model.sample_actions(images, img_masks, batch["observation.language.tokens"],
                                         batch["observation.language.attention_mask"], model.prepare_state(batch),
                                         noise=noise.clone())
        sde, _ = policy._sample_chunks(batch, torch.Generator().manual_seed(1), stochastic=True, noise=noise)
        ode, _ = policy._sample_chunks(batch, None, stochastic=False, noise=noise)
    assert (ode[:, -1] - ref).abs().max().item() < 1e-6  # the same Euler loop
    assert (sde[:, -1] - ref).abs().max().item() < 1e-5
    assert sde.shape == (3, 5, 4, 2) and torch.equal(sde[:, 0], noise)


def test_trajectory_logprob_parity_and_decode(tiny):
    policy = make_policy(tiny)
    contexts = [{"task": "dot", "init_state_id": 4}, {"task": "dot", "init_state_id": 9, "max_steps": 3}]
    ro = policy.sample(contexts, 2, generator=torch.Generator().manual_seed(0))
    K = policy.num_steps
    S = ro.units.shape[1] // K
    assert ro.units.shape == (4, S * K, 4, 2) and ro.logp_old.shape == ro.mask.shape == (4, S * K)
    acted = ro.mask.view(4, S, K).any(-1).sum(1)
    assert acted[2:].tolist() == [2, 2]  # 3 env steps, 2 actions per chunk
    for i, out in enumerate(policy.decode(ro)):
        assert out["frames"].shape == (acted[i] + 1, 32, 32, 3)
        assert len(ro.extras["x_init"][i]) == acted[i]
    for batched in (True, False):
        policy.batched_recompute = batched
        with torch.no_grad():
            logp, _ = policy.logprobs(ro)
        assert torch.where(ro.mask, logp - ro.logp_old, 0.0).abs().max().item() < 1e-5, batched
        # A window of denoising steps (train.unit_chunk) scores exactly those steps.
        for window in (slice(0, K), slice(K, 2 * K), slice(1, K + 1)):
            with torch.no_grad():
                assert torch.allclose(policy.logprobs(ro, units=window)[0], logp[:, window], atol=1e-5), window
    assert ro.max_units == policy.max_chunks * K
    # Gradient reaches the action expert through the teacher-forced log-probs.
    policy.model.zero_grad()
    policy.logprobs(ro)[0].sum().backward()
    grads = [p.grad for n, p in policy.model.named_parameters() if "lm_expert" in n and p.requires_grad]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)
    both = Rollout.concat([ro.select(torch.tensor([0, 3])), policy.sample(contexts[1:], 1)])
    with torch.no_grad():
        lp = policy.logprobs(both)[0]
    assert torch.where(both.mask, lp - both.logp_old, 0.0).abs().max().item() < 1e-5
    greedy = policy.sample(contexts[:1], 1, temperature=0.0)
    assert torch.equal(greedy.logp_old, torch.zeros_like(greedy.logp_old))


def test_sft_and_checkpoint(tiny, tmp_path):
    policy = make_policy(tiny)
    rng = np.random.default_rng(0)
    contexts = [{"images": {"front": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)},
                 "state": rng.normal(size=2).astype(np.float32), "instruction": "move the dot",
                 "actions": rng.uniform(-1, 1, (3, 2)).astype(np.float32)} for _ in range(3)]
    loss = policy.sft_loss(contexts)
    loss.backward()
    assert torch.isfinite(loss)
    policy.save(tmp_path / "ckpt")
    back = SmolVLAPolicy.from_pretrained(tmp_path / "ckpt", env_factory=dot_envs)
    assert back.num_steps == policy.num_steps and back.eta == policy.eta
    ro = policy.sample([{"task": "dot", "init_state_id": 1}], 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.where(ro.mask, back.logprobs(ro)[0] - ro.logp_old, 0.0).abs().max() < 1e-5


def test_trainer_step(tiny, tmp_path):
    cfg = config_from_dict({
        "model": {"policy": "smolvla"}, "rewards": [{"name": "success"}],
        "sampling": {"group_size": 3},
        "algo": {"loss": "grpo", "loss_params": {"eps_low": 0.2, "eps_high": 0.28}},
        "train": {"steps": 1, "prompts_per_step": 2, "eval_every": 0, "device": "cpu", "output_dir": str(tmp_path),
                  "progress": False},
    })
    policy = make_policy(tiny, eta=1.0)
    metrics = Trainer(cfg, policy, DotTask()).train_step()
    assert np.isfinite(metrics["train/loss"]) and "reward/success" in metrics


def test_from_config_builds_a_tiny_smolvla(tmp_path):
    from mmrl.policies import build_policy

    cfg = config_from_dict({
        "model": {"policy": "smolvla", "params": {"action_dim": 2, "state_dim": 2, "chunk_size": 4, "n_action_steps": 2,
                                                  "num_steps": 3, "image_size": 32, "max_chunks": 2, "eta": 0.5}},
        "train": {"device": "cpu", "output_dir": str(tmp_path)},
    })
    policy = build_policy(cfg, DotTask(), "cpu")
    assert isinstance(policy, SmolVLAPolicy) and (policy.num_steps, policy.eta) == (3, 0.5)
    ro = policy.sample(DotTask().eval_batch(1), 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.where(ro.mask, policy.logprobs(ro)[0] - ro.logp_old, 0.0).abs().max() < 1e-5
