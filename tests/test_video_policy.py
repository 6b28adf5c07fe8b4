"""The `video_gen` policy: chunk-by-chunk SDE sampling with a KV cache whose log-probs the
teacher-forced recompute reproduces (Flow-GRPO and DanceGRPO noise, with and without guidance),
timestep subsampling, the per-step update equal to the one-pass update, the checkpoint round trip
through `model.path`, pretraining, and the one-line errors."""

import numpy as np
import pytest
import torch

import mmrl
from mmrl.config import ConfigError
from mmrl.trainer import Trainer

torch.set_num_threads(1)

SMALL = ["task.params.num_frames=4", "task.params.image_size=8", "task.params.n_sft=64",
         "model.params.num_steps=4", "model.params.tiny.patch_size=[1, 2, 2]", "model.params.tiny.ffn_dim=32",
         "sampling.group_size=3", "train.prompts_per_step=2", "train.eval_size=4", "train.grad_clip=1e9"]


def small_cfg(tmp_path, *overrides):
    return mmrl.load_config("configs/video_flowgrpo.yaml", [*SMALL, f"train.output_dir={tmp_path}", *overrides])


def small_policy(tmp_path, *overrides):
    return mmrl.build(small_cfg(tmp_path, *overrides))


@pytest.mark.parametrize("schedule,guidance", [("flow_grpo", 1.0), ("constant", 1.0), ("flow_grpo", 3.0)])
def test_sampled_logprobs_equal_the_teacher_forced_recompute(tmp_path, schedule, guidance):
    task, policy = small_policy(tmp_path, f"model.params.noise_schedule={schedule}",
                                f"model.params.guidance_scale={guidance}")
    rollout = policy.sample(task.next_batch(2), 3, torch.Generator().manual_seed(0))
    K, C = 4, policy.num_chunks  # 4 steps x 4 one-frame chunks
    assert rollout.units.shape == (6, K * C) and rollout.max_units == K * C
    assert rollout.extras["states"].shape == (6, K + 1, 3, 4, 8, 8)
    recomputed, _ = policy.logprobs(rollout)
    trained = rollout.mask
    assert bool(trained.any())
    assert torch.allclose(recomputed[trained], rollout.logp_old[trained], atol=2e-3, rtol=1e-5)
    # the gradient reaches the generator through the step and the history it attended to
    recomputed[trained].sum().backward()
    grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_the_sde_noise_is_the_configured_schedule(tmp_path):
    # DanceGRPO's constant level gives the same std at every step; Flow-GRPO's shrinks with t.
    # log N(x; m, s^2) summed over D dims with x = m + s z: -D log s - |z|^2 / 2 - D/2 log 2 pi,
    # so the mean log-prob per step moves with -D log s.
    stds = {}
    for schedule in ("flow_grpo", "constant"):
        task, policy = small_policy(tmp_path / schedule, f"model.params.noise_schedule={schedule}")
        rollout = policy.sample(task.next_batch(4), 2, torch.Generator().manual_seed(1))
        per_step = rollout.logp_old.view(8, 4, policy.num_chunks).mean((0, 2))  # [K]
        stds[schedule] = per_step
    assert float(stds["constant"].std()) < 0.1 * float(stds["flow_grpo"].std())


def test_temperature_zero_samples_the_ode_deterministically(tmp_path):
    task, policy = small_policy(tmp_path)
    contexts = task.eval_batch(3)
    a = policy.generate(contexts, torch.Generator().manual_seed(5))
    b = policy.generate(contexts, torch.Generator().manual_seed(5))
    c = policy.generate(contexts, torch.Generator().manual_seed(6))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert a[0].shape == (4, 8, 8, 3) and a[0].dtype == np.uint8


def test_timestep_subsampling_trains_a_share_of_the_steps_and_skips_the_rest(tmp_path):
    task, policy = small_policy(tmp_path, "model.params.train_fraction=0.5")
    rollout = policy.sample(task.next_batch(2), 3, torch.Generator().manual_seed(2))
    steps = rollout.mask.view(6, 4, policy.num_chunks)
    assert steps.all(-1).equal(steps.any(-1))  # a step is trained for every chunk or none
    assert int(steps[0].any(-1).sum()) == 2 and bool((steps == steps[:1]).all())  # 2 of 4 steps, same rows
    logp, _ = policy.logprobs(rollout)
    assert bool((logp[~rollout.mask] == 0).all())  # untrained steps cost nothing
    other = policy.sample(task.next_batch(2), 3, torch.Generator().manual_seed(3))
    assert not torch.equal(other.mask, rollout.mask) or not torch.equal(
        policy.sample(task.next_batch(2), 3, torch.Generator().manual_seed(4)).mask, rollout.mask)


def test_sde_only_on_the_trained_steps_takes_ode_steps_elsewhere(tmp_path):
    """sde_only_trained (Flow-GRPO-Fast): the untrained steps are exact ODE steps, so rows of one
    prompt that share their noise before the first trained step are identical there; the trained
    steps' sampled log-probs are the recompute's."""
    from mmrl.flow import ode_step

    task, policy = small_policy(tmp_path, "model.params.train_fraction=0.5", "model.params.sde_only_trained=true")
    rollout = policy.sample(task.next_batch(2), 3, torch.Generator().manual_seed(2))
    C = policy.num_chunks
    trained = rollout.mask.view(6, 4, C)[0, :, 0]
    assert int(trained.sum()) == 2
    states, text = rollout.extras["states"], rollout.extras["text"]
    ts = policy.timesteps.tolist()
    assert bool((rollout.logp_old.view(6, 4, C)[:, ~trained] == 0).all())
    assert bool((rollout.logp_old.view(6, 4, C)[:, trained] != 0).all())
    with torch.no_grad():  # every untrained step of the last chunk is the ODE step from its state
        for j in torch.nonzero(~trained).flatten().tolist():
            v = policy.model.forward_teacher_forced(states[:, -1], states[:, j], torch.full((6, C), ts[j]), text)
            expected = ode_step(states[:, j], v, ts[j + 1] - ts[j])
            torch.testing.assert_close(states[:, j + 1, :, -1:], expected[:, :, -1:], atol=1e-4, rtol=1e-4)
    recomputed, _ = policy.logprobs(rollout)
    assert torch.allclose(recomputed[rollout.mask], rollout.logp_old[rollout.mask], atol=2e-3, rtol=1e-5)


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_per_step_update_equals_the_one_pass_update(tmp_path, loss):
    cfg = small_cfg(tmp_path, f"algo.loss={loss}", "algo.beta=0.05")
    task, policy = mmrl.build(cfg)
    trainer = Trainer(cfg, policy, task)
    rollout, _ = trainer.collect()
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}

    def update(unit_chunk):
        policy.model.load_state_dict(state)
        trainer.cfg.train.unit_chunk = unit_chunk
        metrics = trainer.update(rollout)
        return metrics, {k: p.grad.clone() for k, p in policy.model.named_parameters() if p.grad is not None}

    one_metrics, one = update(0)
    assert one and any(float(g.abs().sum()) > 0 for g in one.values())
    for chunk in (policy.num_chunks, 1):  # one denoising step of every chunk at a time; one unit at a time
        metrics, chunked = update(chunk)
        assert metrics["train/loss"] == pytest.approx(one_metrics["train/loss"], rel=1e-4, abs=1e-6)
        for k in one:
            assert torch.allclose(one[k], chunked[k], atol=1e-6, rtol=1e-3), (chunk, k)


def test_a_saved_policy_loads_back_through_model_path(tmp_path):
    task, policy = small_policy(tmp_path / "run")
    policy.save(tmp_path / "ckpt")
    cfg = small_cfg(tmp_path / "run2", "model.source=pretrained", f"model.path={tmp_path / 'ckpt'}")
    _, loaded = mmrl.build(cfg)
    contexts = task.eval_batch(2)
    a = policy.generate(contexts, torch.Generator().manual_seed(0))
    b = loaded.generate(contexts, torch.Generator().manual_seed(0))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    (tmp_path / "ckpt" / "tokenizer").rename(tmp_path / "ckpt" / "tok")
    with pytest.raises(FileNotFoundError, match="has no tokenizer/ folder"):
        mmrl.build(cfg)


def test_pretraining_fits_the_clips(tmp_path):
    task, policy = small_policy(tmp_path, "model.params.cfg_dropout=0.0")
    batch = task.sft_batch(8, np.random.default_rng(0))
    opt = torch.optim.Adam(policy.model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    first = None
    for _ in range(40):
        torch.manual_seed(0)  # the same t and noise each step: the loss of one fixed problem
        loss = policy.sft_loss(batch)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_bad_video_settings_get_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match="noise_schedule: invalid value 'dance'; valid: flow_grpo, constant"):
        small_policy(tmp_path, "model.params.noise_schedule=dance")
    with pytest.raises(ConfigError, match="exploration: invalid value 'noise'; valid: sde, kv_routing"):
        small_policy(tmp_path, "model.params.exploration=noise")
    with pytest.raises((ValueError, ConfigError), match="do not split into chunks of chunk_frames=3"):
        small_policy(tmp_path, "model.params.chunk_frames=3")
    with pytest.raises(ValueError, match="sft_loss needs a 'target' clip"):
        task, policy = small_policy(tmp_path)
        policy.sft_loss(task.next_batch(2))


KVPO = ["model.params.exploration=kv_routing", "model.params.keep_nearest=1", "task.params.num_frames=8",
        "sampling.group_size=4", "algo.advantage=kvpo_anchor"]  # 8 one-frame chunks: sink 1, window 2


def test_kvpo_anchor_is_plain_generation_and_branches_reroute_history(tmp_path):
    task, policy = small_policy(tmp_path, *KVPO)
    contexts = task.next_batch(2)
    rollout = policy.sample(contexts, 4, torch.Generator().manual_seed(0))
    states, routed = rollout.extras["states"], rollout.extras["routed"]
    anchors = rollout.extras["is_anchor"]
    assert anchors.tolist() == [True, False, False, False] * 2 and rollout.mask[:, 0].equal(~anchors)
    # The anchor row is what plain (unrouted) ODE generation makes from the same noise (to float
    # rounding: a batch of 2 rows against one of 8).
    noise = states[::4, 0]
    with torch.no_grad():
        plain, _, never = policy.denoise(policy.model, policy.encode_prompts([c["prompt"] for c in contexts]), noise,
                                         0.0)
    assert torch.allclose(plain, states[::4], atol=1e-5, rtol=0) and not never.any() and not routed[anchors].any()
    # Branches share the anchor's noise; a branch equals the anchor up to its first re-routed frame,
    # and routing is possible once a frame has an older frame to re-route to (frame 3 onwards).
    assert torch.equal(states[:, 0], noise.repeat_interleave(4, 0))
    assert not routed[:, :3].any() and routed[~anchors].any()
    for row in torch.nonzero(~anchors).squeeze(1).tolist():
        first = int(torch.nonzero(routed[row])[0]) if routed[row].any() else 8
        anchor_video, video = states[row - row % 4, -1], states[row, -1]
        assert torch.equal(video[:, :first], anchor_video[:, :first])
        if first < 8:
            assert (video[:, first] - anchor_video[:, first]).abs().max() > 1e-4


def test_kvpo_branch_logprobs_are_a_group_softmax_the_recompute_reproduces(tmp_path):
    task, policy = small_policy(tmp_path, *KVPO)
    rollout = policy.sample(task.next_batch(2), 4, torch.Generator().manual_seed(1)).stamp_groups(4)
    logp = rollout.logp_old[:, 0]
    branches = ~rollout.extras["is_anchor"]
    assert torch.allclose(logp[branches].exp().view(2, 3).sum(1), torch.ones(2), atol=1e-5)
    recomputed, _ = policy.logprobs(rollout)
    assert torch.allclose(recomputed, rollout.logp_old, atol=1e-5)
    recomputed[branches].sum().backward()  # softmax rows sum to a constant: use one branch instead
    policy.model.zero_grad()
    policy.logprobs(rollout)[0][1, 0].backward()
    assert any(float(p.grad.abs().sum()) > 0 for p in policy.model.parameters() if p.grad is not None)
    with pytest.raises(ValueError, match="whole groups together"):
        policy.logprobs(rollout.select(torch.tensor([0, 1, 2, 4])))


def test_a_kvpo_step_trains_on_branches_against_their_anchor(tmp_path):
    cfg = small_cfg(tmp_path, *KVPO, "algo.loss_params={eps_low: 0.1, eps_high: 0.2}")
    task, policy = mmrl.build(cfg)
    trainer = Trainer(cfg, policy, task)
    rollout, _ = trainer.collect()
    adv, _ = trainer.advantages(rollout)
    assert bool((adv[rollout.extras["is_anchor"]] == 0).all())
    total = rollout.rewards["total"].view(-1, 4)
    better = (total[:, 1:] > total[:, :1]).flatten()
    assert torch.equal(adv.view(-1, 4)[:, 1:].flatten() > 0, better)  # the sign is the reward against the anchor
    metrics = trainer.update(rollout)
    assert metrics["train/grad_norm"] > 0


@pytest.mark.parametrize("overrides,message", [
    (["task.params.prompt_file={missing}"], "prompt_file: {missing} does not exist"),
    (["task.params.prompt_file={short}"], "has 2 prompts; need more than eval_prompts=8"),
    (["rewards=[{{name: video_color}}]"], "unknown reward 'video_color'; valid: "),
    (["model.source=pretrained", "model.path={missing}"], "model.path: '{missing}' is not a model folder (not found)"),
    (["model.source=pretrained", "model.path={empty}"], "model.path {empty} has no transformer/ folder"),
])
def test_bad_video_runs_end_with_one_line(tmp_path, capsys, overrides, message):
    from mmrl.cli import main

    (tmp_path / "short.txt").write_text("# two prompts\na red square moves left slowly\na dog runs\n")
    paths = {"missing": tmp_path / "nope", "short": tmp_path / "short.txt", "empty": tmp_path / "empty"}
    paths["empty"].mkdir()
    args = [*SMALL, f"train.output_dir={tmp_path / 'run'}", *(o.format(**paths) for o in overrides)]
    assert main(["train", "configs/video_flowgrpo.yaml", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(**paths) in err[0], err


def test_a_prompt_file_gives_free_and_procedural_prompts(tmp_path):
    lines = [f"a {c} square moves left slowly" for c in ("red", "green", "blue")] + ["a dog runs on a beach"]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n")
    task, _ = small_policy(tmp_path / "run", f"task.params.prompt_file={tmp_path / 'p.txt'}",
                           "task.params.eval_prompts=1")
    assert [c["prompt"] for c in task.eval_batch(1)] == ["a dog runs on a beach"]
    assert task.eval_batch(1)[0]["spec"] is None and task.next_batch(1)[0]["spec"] is not None
    assert "a dog runs on a beach" in task.corpus()


def test_train_then_eval_write_results_and_labelled_video_grids(tmp_path):
    import json

    import imageio.v3 as iio

    from mmrl.cli import main

    run = tmp_path / "run"
    args = [*SMALL, f"train.output_dir={run}", "sft.steps=2", "train.steps=2", "train.eval_every=2"]
    assert main(["train", "configs/video_flowgrpo.yaml", *args]) == 0
    results = json.loads((run / "results.json").read_text())
    for stage in ("eval_before", "eval_after"):
        assert {"eval/video_colour", "eval/video_motion", "eval/video_smoothness",
                "eval/temporal_consistency"} <= set(results[stage])
    grid = iio.imread(run / "videos_before_after.gif", index=None)
    assert grid.shape[0] == 4  # one grid per frame: 4 frames
    assert grid.shape[1] > 2 * 8 * 4  # two rows (before, after) of 8 px frames shown 4x, plus labels
    assert main(["eval", "configs/video_flowgrpo.yaml", "--checkpoint", str(run), *args]) == 0
    assert json.loads((run / "eval.json").read_text())["step"] == 2
    assert (run / "videos.gif").is_file() and (run / "videos.png").is_file()


def test_a_latent_generator_samples_and_pretrains_through_a_tiny_wan_vae(tmp_path):
    # Wan's VAE compresses 4x in time (plus the first frame) and 8x in space: 9 frames of 32 px are
    # 3 latent frames of 4 x 4; frames come back decoded, and pretraining encodes the target clips.
    task, policy = small_policy(tmp_path, "model.params.tiny.latent=true", "task.params.num_frames=9",
                                "task.params.image_size=32", "model.params.num_steps=2")
    assert policy.vae is not None and policy.shape == (4, 3, 4, 4)
    rollout = policy.sample(task.next_batch(1), 2, torch.Generator().manual_seed(0))
    videos = policy.decode(rollout)
    assert videos[0].shape == (9, 32, 32, 3) and videos[0].dtype == np.uint8
    recomputed, _ = policy.logprobs(rollout)
    assert torch.allclose(recomputed[rollout.mask], rollout.logp_old[rollout.mask], atol=2e-3, rtol=1e-5)
    loss = policy.sft_loss(task.sft_batch(2, np.random.default_rng(0)))
    assert torch.isfinite(loss) and loss.requires_grad
    with pytest.raises(ValueError, match="num_frames - 1 must be a multiple of 4"):
        small_policy(tmp_path / "bad", "model.params.tiny.latent=true", "task.params.num_frames=8",
                     "task.params.image_size=32")


def test_an_evaluation_generates_the_held_out_videos_once(tmp_path, monkeypatch):
    """The task's metrics (temporal consistency, the grid's videos) come from the videos the
    trainer's greedy evaluation generated and scored, not from a second generation."""
    from mmrl.rewards.video import temporal_consistency

    task, policy = small_policy(tmp_path)
    trainer = Trainer(small_cfg(tmp_path), policy, task)
    calls, decoded = [], []
    denoise, decode = policy.denoise, policy.decode
    monkeypatch.setattr(policy, "denoise", lambda *a, **k: calls.append(1) or denoise(*a, **k))
    monkeypatch.setattr(policy, "decode", lambda r: decoded.append(decode(r)) or decoded[-1])
    result = trainer.evaluate()
    assert len(calls) == 1 and len(decoded) == 1  # one generation, decoded once
    videos = decoded[-1]
    assert len(videos) == 4
    assert result["eval/temporal_consistency"] == pytest.approx(float(np.mean(temporal_consistency(videos))))
    assert len(task.eval_videos[-1]) == 4 and all(np.array_equal(a, b) for a, b in zip(task.eval_videos[-1], videos))
    assert task.shown_prompts == [c["prompt"] for c in task.eval_batch(4)]
    assert task.shown_rows(96) == [0, 14, 27, 41, 54, 68, 81, 95]  # spread over the prompt list
