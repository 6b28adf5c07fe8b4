"""The action-token VLA on a tiny Qwen2.5-VL: bins round-trip, only action tokens are sampled,
sampled log-probs equal teacher-forced ones per chunk and over whole trajectories (through the real
vector-env code with an in-process toy env), SFT learns, checkpoints round-trip, and the trainer
runs trajectory-level GRPO with the success and SRPO rewards."""

from functools import partial

import numpy as np
import pytest
import torch

from mmrl.config import config_from_dict
from mmrl.envs import TaskBase
from mmrl.envs.vector import SyncVectorEnv
from mmrl.policies import policy_class
from mmrl.policies.vla.modeling_action_tokens import ActionTokenVLAPolicy
from mmrl.policies.vla.processor import ActionBins, add_action_tokens
from mmrl.rewards import get_reward
from mmrl.rollout import Rollout
from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer
from mmrl.trainer import Trainer

torch.set_num_threads(1)


class DotEnv:
    """A toy env with the tabletop interface: a dot moves by 0.25 * action[:2] per sub-step and
    succeeds within 0.5 of the goal; the front camera draws it on a 32x32 image."""

    def __init__(self, task: str = "dot", max_episode_steps: int = 6):
        self.task, self.max_episode_steps = task, max_episode_steps
        self.instruction = ""
        self._success = False

    @property
    def success(self) -> bool:
        return self._success

    def reset(self, *, seed=None, options=None):
        sid = (options or {}).get("init_state_id", seed) or 0
        rng = np.random.default_rng(int(sid))
        self.pos, self.goal = rng.uniform(-1, 1, 2), np.zeros(2)
        self.t, self._success = 0, False
        self.instruction = f"move the dot to the centre {sid % 2}"
        return self._obs(), {}

    def _obs(self):
        img = np.zeros((32, 32, 3), np.uint8)
        x, y = ((self.pos + 1) / 2 * 27).round().astype(int)
        img[y:y + 5, x:x + 5] = 255
        img[14:18, 14:18, 1] = 128
        return {"images": {"front": img}, "state": self.pos.astype(np.float32)}

    def step(self, a):
        self.pos = np.clip(self.pos + 0.25 * np.asarray(a)[:2], -1, 1)
        self.t += 1
        self._success = self._success or bool(np.linalg.norm(self.pos - self.goal) < 0.5)
        return self._obs(), float(self._success), self._success, self.t >= self.max_episode_steps, {}

    def step_chunk(self, actions):
        total, n = 0.0, 0
        for a in actions:
            obs, r, term, trunc, _ = self.step(a)
            total, n = total + r, n + 1
            if term or trunc:
                break
        return obs, total, term, trunc, {"steps_executed": n}

    def close(self):
        pass


def dot_envs(rows):
    return SyncVectorEnv([partial(DotEnv, max_episode_steps=r.get("max_steps", 6)) for r in rows])


@pytest.fixture(scope="module")
def parts():
    tok = add_action_tokens(build_tokenizer(["What action should the robot take to move the dot to the centre 0 1?"],
                                            vocab_size=300), 256)
    return build_tiny_qwen_vl(tok, "qwen2_5_vl", seed=0).eval(), build_qwen_vl_processor(tok, "qwen2_5_vl", 4, 4)


def make_policy(parts, **kw):
    kw = {"action_dim": 3, "chunk_size": 2, "temperature": 1.6, "env_factory": dot_envs, "max_chunks": 5, **kw}
    return ActionTokenVLAPolicy(*parts, **kw)


def _obs(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"images": {"front": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)}}


def test_bins_round_trip():
    bins = ActionBins([-1, 0, -2], [1, 1, 2], 256, 3)
    b = torch.randint(0, 256, (5, 4, 3))
    assert torch.equal(bins.to_bins(bins.to_actions(b)), b)
    a = torch.tensor([[-5.0, 0.0, 2.0], [1.0, 0.999, -1.99]])
    assert torch.equal(bins.to_bins(a), torch.tensor([[0, 0, 255], [255, 255, 0]]))
    with pytest.raises(ValueError, match="high > low"):
        ActionBins(1, 1, 256, 2)


def test_act_only_action_tokens_and_logprob_parity(parts):
    policy = make_policy(parts, action_dim=7, chunk_size=8)
    assert policy_class("action_vla") is ActionTokenVLAPolicy
    lo = policy.token_start
    assert policy.tokenizer.convert_ids_to_tokens(lo) == "<act_0>"
    obs, instr = _obs(3), ["move the dot to the centre 0", "move", "move the dot"]
    out = policy.act(obs, instr, generator=torch.Generator().manual_seed(0))
    assert out.tokens.shape == (3, 56) and out.actions.shape == (3, 8, 7)
    assert bool(((out.tokens >= lo) & (out.tokens < lo + 256)).all())
    assert bool((out.actions.abs() < 1).all())
    with torch.no_grad():
        logp, ent = policy.logprobs_of(obs, instr, out.tokens, with_entropy=True)
    assert (logp - out.logp).abs().max().item() < 1e-5
    assert bool((ent > 0).all()) and bool((ent <= np.log(256) + 1e-4).all())
    greedy = [policy.act(obs, instr, temperature=0.0).tokens for _ in range(2)]
    assert torch.equal(*greedy)


def test_vocab_tail_tokens(parts):
    policy = make_policy(parts, action_tokens="vocab_tail")
    n_rows = policy.model.get_output_embeddings().weight.shape[0]
    assert policy.token_start == n_rows - 256
    out = policy.act(_obs(2), ["a", "b"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (policy.logprobs_of(_obs(2), ["a", "b"], out.tokens)[0] - out.logp).abs().max() < 1e-5


def test_trajectory_rollout_and_parity(parts):
    policy = make_policy(parts)
    contexts = [{"task": "dot", "init_state_id": 3}, {"task": "dot", "init_state_id": 8, "max_steps": 3}]
    ro = policy.sample(contexts, 3, generator=torch.Generator().manual_seed(0))
    L = policy.tokens_per_chunk
    assert ro.units.shape[1] % L == 0 and ro.units.shape == ro.mask.shape == ro.logp_old.shape
    assert ro.max_units == policy.max_chunks * L  # the budget: every chunk an episode may take
    S = ro.units.shape[1] // L
    chunks_acted = ro.mask.view(6, S, L).any(-1).sum(1)
    for i, out in enumerate(policy.decode(ro)):
        n_obs = ro.extras["obs_images"][i].shape[0]
        assert n_obs == chunks_acted[i] + 1 and out["frames"].shape == (n_obs, 32, 32, 3)
        assert out["frames"].dtype == np.uint8 and 0 < out["length"] <= 6
    # Trajectories of the second context end after 3 env steps: 2 chunks, the second half-executed.
    assert chunks_acted[3:].tolist() == [2, 2, 2]
    assert ro.mask.view(6, S, 2, 3)[3:, 1].tolist() == [[[True] * 3, [False] * 3]] * 3
    assert ro.contexts[0]["instruction"] == "move the dot to the centre 1"
    with torch.no_grad():
        logp, ent = policy.logprobs(ro, with_entropy=True)
    assert ent is not None and torch.equal(ent[~ro.mask], torch.zeros(int((~ro.mask).sum())))
    assert torch.where(ro.mask, logp - ro.logp_old, 0.0).abs().max().item() < 1e-5
    assert torch.equal(logp[~ro.mask], torch.zeros(int((~ro.mask).sum())))
    # A window of units (train.unit_chunk) scores exactly those units, aligned with chunks or not.
    for window in (slice(0, L), slice(L, 2 * L), slice(L // 2, L + 3)):
        with torch.no_grad():
            part, part_ent = policy.logprobs(ro, with_entropy=True, units=window)
        assert torch.allclose(part, logp[:, window], atol=1e-6) and torch.allclose(part_ent, ent[:, window], atol=1e-6)
    # Select + concat (the success filter's path) keep chunks and images aligned.
    other = policy.sample(contexts[1:], 2, generator=torch.Generator().manual_seed(1))
    both = Rollout.concat([ro.select(torch.tensor([0, 4])), other])
    with torch.no_grad():
        lp2 = policy.logprobs(both)[0]
    assert torch.where(both.mask, lp2 - both.logp_old, 0.0).abs().max().item() < 1e-5
    rewards = get_reward("success")(both.contexts, policy.decode(both))
    assert rewards.shape == (4,)


class CappedDotEnvs:
    """`dot_envs` with a `max_envs` bound, recording the size of every env set it builds."""

    def __init__(self, max_envs):
        self.max_envs, self.sizes = max_envs, []

    def __call__(self, rows):
        self.sizes.append(len(rows))
        return dot_envs(rows)


def test_a_batch_larger_than_max_envs_runs_in_slices(parts):
    """Env memory is bounded by the factory's max_envs, whatever the batch: the episodes run slice by
    slice (whole groups), and the joined rollout is the one-shot one (greedy is deterministic) and
    re-scores to its sampled log-probs."""
    contexts = [{"task": "dot", "init_state_id": 3}, {"task": "dot", "init_state_id": 8, "max_steps": 3},
                {"task": "dot", "init_state_id": 5}]
    whole = make_policy(parts).sample(contexts, 2, temperature=0.0)
    capped = CappedDotEnvs(max_envs=5)
    policy = make_policy(parts, env_factory=capped)
    ro = policy.sample(contexts, 2, temperature=0.0)
    assert capped.sizes == [4, 2]  # 2 contexts x G=2, then the last context
    assert len(ro) == 6 and [c["init_state_id"] for c in ro.contexts] == [3, 3, 8, 8, 5, 5]
    T = whole.units.shape[1]
    assert ro.units.shape[1] == T and torch.equal(ro.mask, whole.mask)
    assert torch.equal(torch.where(ro.mask, ro.units, 0), torch.where(whole.mask, whole.units, 0))
    assert torch.equal(ro.extras["success"], whole.extras["success"])
    sampled = policy.sample(contexts, 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = policy.logprobs(sampled)[0]
    assert torch.where(sampled.mask, logp - sampled.logp_old, 0.0).abs().max().item() < 1e-5
    assert [o["length"] for o in policy.decode(sampled)] == sampled.extras["env_steps"].tolist()


def test_sft_learns_and_checkpoint_round_trip(parts, tmp_path):
    policy = make_policy(parts)
    policy.model = build_tiny_qwen_vl(policy.tokenizer, "qwen2_5_vl", seed=1)
    rng = np.random.default_rng(0)
    contexts = [{"images": {"front": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)},
                 "instruction": "move the dot", "actions": rng.uniform(-1, 1, (2, 3)).astype(np.float32),
                 "action_is_pad": np.array([False, i % 2 == 1])} for i in range(4)]
    opt = torch.optim.AdamW(policy.model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = policy.sft_loss(contexts)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    policy.save(tmp_path)
    back = ActionTokenVLAPolicy.from_pretrained(tmp_path, temperature=1.6)
    assert (back.chunk_size, back.action_dim, back.token_start) == (2, 3, policy.token_start)
    out = policy.act(_obs(2), ["a", "b"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back.logprobs_of(_obs(2), ["a", "b"], out.tokens)[0] - out.logp).abs().max() < 1e-5


class DotTask(TaskBase):  # TaskBase: the hooks a task does not override (corpus, evaluate, ...)
    make_vector_env = staticmethod(dot_envs)  # the env hook from_config looks for

    def __init__(self):
        self.cursor = 0

    def next_batch(self, n):
        self.cursor += n
        return [{"task": "dot", "init_state_id": self.cursor + i} for i in range(n)]

    def eval_batch(self, n):
        return [{"task": "dot", "init_state_id": 1000 + i} for i in range(n)]

    def sft_batch(self, n, rng):
        return []

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, s):
        self.cursor = s["cursor"]


def test_mask_images_blacks_whole_squares_of_the_frames(parts):
    """PAPO's masked context for episodes: squares of the processor's patch side blacked per frame
    with the given probability; units untouched; the masked frames change the log-probs."""
    policy = make_policy(parts)
    ro = policy.sample([{"task": "dot", "init_state_id": 3}, {"task": "dot", "init_state_id": 4}], 2,
                       generator=torch.Generator().manual_seed(0))
    side = policy.processor.image_processor.patch_size
    masked = policy.mask_images(ro, 0.5, torch.Generator().manual_seed(1))
    assert masked.units is ro.units and masked.extras["success"] is ro.extras["success"]
    dropped = []
    for f, m in zip(ro.extras["obs_images"], masked.extras["obs_images"]):
        assert m.shape == f.shape and m.dtype == torch.uint8
        for y in range(0, f.shape[-3], side):
            for x in range(0, f.shape[-2], side):
                a, b = f[..., y:y + side, x:x + side, :], m[..., y:y + side, x:x + side, :]
                gone = (b == 0).flatten(1).all(1)  # per frame: is this square black?
                assert torch.equal(b[~gone], a[~gone])  # a square is either kept whole or blacked
                dropped += gone[(a.flatten(1) != 0).any(1)].tolist()
    assert 0.3 < np.mean(dropped) < 0.7  # squares that held something were blacked about half the time
    assert all(torch.equal(m, f) for f, m in zip(ro.extras["obs_images"], policy.mask_images(ro, 0.0).extras["obs_images"]))
    assert all(int(m.max()) == 0 for m in policy.mask_images(ro, 1.0).extras["obs_images"])
    with torch.no_grad():
        own, other = policy.logprobs(ro)[0], policy.logprobs(masked)[0]
    assert not torch.allclose(own[ro.mask], other[ro.mask])
    with pytest.raises(ValueError, match="mask probability"):
        policy.mask_images(ro, 1.5)


@pytest.mark.parametrize("srpo,papo", [(False, False), (True, False), (False, True)])
def test_trainer_runs_trajectory_grpo(parts, tmp_path, srpo, papo):
    rewards = [{"name": "success", "weight": 0.0 if srpo else 1.0}]
    if srpo:
        rewards.append({"name": "srpo_progress", "weight": 1.0, "params": {"encoder_params": {"size": 4}}})
    cfg = config_from_dict({
        "model": {"policy": "action_vla"}, "rewards": rewards,
        "sampling": {"group_size": 3, "temperature": 1.6},
        "algo": {"loss": "grpo", "loss_params": {"eps_low": 0.2, "eps_high": 0.28}, "papo_gamma": 0.02 if papo else 0.0},
        "train": {"steps": 1, "prompts_per_step": 2, "eval_every": 0, "eval_size": 2, "device": "cpu",
                  "output_dir": str(tmp_path), "progress": False, "lr": 1e-3},
    })
    policy = make_policy(parts)
    policy.model = build_tiny_qwen_vl(policy.tokenizer, "qwen2_5_vl", seed=2)  # seed 2: mixed outcomes
    trainer = Trainer(cfg, policy, DotTask())
    before = [p.detach().clone() for p in policy.model.parameters()]
    metrics = trainer.train_step()
    assert np.isfinite(metrics["train/loss"]) and "reward/success" in metrics
    if srpo:
        assert "reward/srpo_progress" in metrics
    assert 0 < metrics["reward/success"] < 1 and metrics["adv/std"] > 0  # a mixed batch: a learning signal
    if srpo:  # failures earn a graded reward in (0, 0.8), successes 1
        assert metrics["reward/success"] < metrics["reward/srpo_progress"] < 1
    # PAPO: the episodes are scored again on masked frames, and the two distributions differ
    assert (metrics.get("train/perception_kl", 0.0) > 0) == papo
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))


def test_from_config_builds_a_tiny_policy(tmp_path):
    from mmrl.policies import build_policy

    cfg = config_from_dict({
        "model": {"policy": "action_vla", "params": {"action_dim": 3, "chunk_size": 2, "max_chunks": 2,
                                                     "action_low": [-1, -1, 0], "max_image_tokens": 4}},
        "sampling": {"temperature": 1.6}, "train": {"device": "cpu", "output_dir": str(tmp_path)},
    })
    policy = build_policy(cfg, DotTask(), "cpu")
    assert isinstance(policy, ActionTokenVLAPolicy) and policy.temperature == 1.6
    assert policy.bins.low.tolist() == [-1, -1, 0]
    ro = policy.sample(DotTask().eval_batch(1), 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.where(ro.mask, policy.logprobs(ro)[0] - ro.logp_old, 0.0).abs().max() < 1e-5
    with pytest.raises(ValueError, match="unknown key"):  # at config load, before anything is built
        config_from_dict({"model": {"policy": "action_vla", "params": {"chunk": 2}}})
