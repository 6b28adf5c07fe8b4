"""VPRL visual mode: VQ tokenizer, the planning task, the vprl_progress reward and the visual planner."""

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mmrl.envs import make_task
from mmrl.envs.planning import Layout, parse_batch_array, render_state
from mmrl.envs.planning.frozenlake import from_text

from mmrl.config import ConfigError, config_from_dict
from mmrl.policies import build_policy
from mmrl.policies.visual_planner import VQConfig, train_vq
from mmrl.policies.visual_planner.modeling import VisualPlannerPolicy
from mmrl.rewards import get_reward
from mmrl.trainer import Trainer

torch.set_num_threads(1)

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1}


def make_cfg(tmp_path, **sections):
    base = {
        "model": {"policy": "visual_planner", "tiny": TINY,
                  "params": {"codebook_size": 32, "vq_steps": 600, "vq_layouts": 30, "vq_hidden": 64}},
        "task": {"name": "planning", "params": {"env": "frozenlake", "sizes": [3, 4], "n_train": 40, "n_test": 6}},
        "rewards": [{"name": "vprl_progress"}],
        "sampling": {"group_size": 4, "max_new_tokens": 16},
        "sft": {"steps": 2, "batch_size": 8},
        "train": {"steps": 2, "prompts_per_step": 4, "eval_every": 0, "eval_size": 6, "progress": False,
                  "output_dir": str(tmp_path / "run"), "seed": 0, "device": "cpu"},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return config_from_dict(base)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory.mktemp("vp"))
    task = make_task("planning", seed=0, **cfg.task.params)
    return cfg, task, build_policy(cfg, task, torch.device("cpu"))


# ----------------------------------------------------------------------------- the task


def test_task_contexts_and_targets():
    task = make_task("planning", seed=0, env="frozenlake", sizes=[3, 4], n_train=30, n_test=5)
    keys = {"layout", "state", "frame", "prompt", "target_state", "target_frame", "target_actions", "target",
            "level", "optimal_length", "env", "layout_id"}
    for c in task.next_batch(6) + task.eval_batch(4) + task.sft_batch(6, np.random.default_rng(0)):
        assert keys <= set(c)
        lay: Layout = c["layout"]
        assert c["frame"].dtype == np.uint8 and c["frame"].shape == (lay.shape[0] * 16, lay.shape[1] * 16, 3)
        assert (parse_batch_array(c["frame"][None], [lay])[0] == c["state"]).all()
        assert (parse_batch_array(c["target_frame"][None], [lay])[0] == c["target_state"]).all()
        assert len(c["target_actions"]) == c["optimal_length"] == lay.dist_of(c["state"])
        assert not lay.is_terminal(c["state"])
    # eval contexts start at the start and step optimally; layouts interleave sizes
    ev = task.eval_batch(4)
    assert [c["level"] for c in ev] == [3, 4, 3, 4]
    for c in ev:
        assert (c["state"] == c["layout"].start_state()).all()
        assert c["layout"].dist_of(c["target_state"]) == c["optimal_length"] - 1
    # random-walk SFT targets are valid moves (one cell, never a hole), not always optimal
    from mmrl.envs.planning.judge import step_rewards

    ctx = task.sft_batch(200, np.random.default_rng(1))
    r = step_rewards(np.stack([c["state"] for c in ctx]), np.stack([c["target_state"] for c in ctx]),
                     [c["layout"] for c in ctx])
    assert (r >= 0).all() and (r == 0).any() and (r == 1).any()
    opt = make_task("planning", seed=0, env="frozenlake", sizes=[3, 4], n_train=30, n_test=5, sft_mode="optimal")
    ctx = opt.sft_batch(100, np.random.default_rng(1))
    for c in ctx:
        assert c["layout"].dist_of(c["target_state"]) == c["layout"].dist_of(c["state"]) - 1
    # sft_random_move_prob: states still along optimal plans, a share of the labels any valid move
    mixed = make_task("planning", seed=0, env="frozenlake", sizes=[3, 4], n_train=30, n_test=5, sft_mode="optimal",
                      sft_random_move_prob=0.5)
    ctx = mixed.sft_batch(400, np.random.default_rng(1))
    r = step_rewards(np.stack([c["state"] for c in ctx]), np.stack([c["target_state"] for c in ctx]),
                     [c["layout"] for c in ctx])
    assert (r >= 0).all()  # never an invalid move
    # P(label makes no progress) = 0.5 * mean share of non-optimal valid moves (about 1/2 here)
    assert 0.12 < (r == 0).mean() < 0.38
    same = make_task("planning", seed=0, env="frozenlake", sizes=[3, 4], n_train=30, n_test=5, sft_mode="optimal",
                     sft_random_move_prob=0.0)
    a, b = opt.sft_batch(50, np.random.default_rng(2)), same.sft_batch(50, np.random.default_rng(2))
    assert all((x["target_state"] == y["target_state"]).all() for x, y in zip(a, b))  # 0: VPFT's stream unchanged
    with pytest.raises(ValueError, match="sft_random_move_prob"):
        make_task("planning", seed=0, sft_random_move_prob=1.5, n_train=2, n_test=1)


def _steps_from_start(task, c) -> int:
    """BFS distance from the layout's start to the context's state over the task's state graph."""
    g = task.graph(c["layout_id"], c["layout"])
    target = int(np.flatnonzero((g.states == c["state"]).all(1))[0])
    seen, frontier, steps = {0}, {0}, 0
    while target not in frontier:
        frontier = {int(t) for s in frontier for t in g.next[s] if t >= 0} - seen
        seen |= frontier
        steps += 1
    return steps


def test_rl_states_on_optimal_paths():
    """rl_states=optimal_path: every RL state lies on a shortest plan from its layout's start."""
    kw = dict(seed=0, env="frozenlake", sizes=[4, 5], n_train=30, n_test=5, rl_start_prob=0.0)
    task = make_task("planning", rl_states="optimal_path", **kw)
    moved = []
    for c in task.next_batch(100):
        start_dist = c["layout"].dist_of(c["layout"].start_state())
        moved.append(_steps_from_start(task, c))
        assert moved[-1] + c["optimal_length"] == start_dist  # on a shortest plan
    assert min(moved) == 0 and max(moved) >= 3  # the whole path, not only the start
    reach = make_task("planning", **kw)  # the default draws any reachable state, off the path too
    assert any(_steps_from_start(reach, c) + c["optimal_length"] > c["layout"].dist_of(c["layout"].start_state())
               for c in reach.next_batch(100))
    with pytest.raises(ValueError, match="rl_states.*reachable, optimal_path"):
        make_task("planning", seed=0, rl_states="on_policy", n_train=2, n_test=1)


def test_task_resume_and_other_envs():
    a = make_task("planning", seed=3, env="maze", sizes=[3], n_train=20, n_test=3)
    a.next_batch(5)
    state = json.loads(json.dumps(a.state_dict()))
    expect = a.next_batch(4)
    b = make_task("planning", seed=3, env="maze", sizes=[3], n_train=20, n_test=3)
    b.load_state_dict(state)
    got = b.next_batch(4)
    assert [c["layout_id"] for c in got] == [c["layout_id"] for c in expect]
    assert all((x["state"] == y["state"]).all() for x, y in zip(got, expect))
    mb = make_task("planning", seed=0, env="minibehavior", sizes=[4], n_train=10, n_test=2)
    c = mb.sft_batch(3, np.random.default_rng(0))[0]
    assert set(c["target_actions"]) <= {"up", "down", "left", "right", "pick", "drop"}
    assert "pick" in mb.eval_batch(1)[0]["target_actions"]
    assert len(mb.corpus()) > 3


def test_task_errors_name_bad_values():
    with pytest.raises(ValueError, match="sft_mode"):
        make_task("planning", seed=0, sft_mode="greedy", n_train=2, n_test=1)
    with pytest.raises(ValueError, match="cell_size"):
        make_task("planning", seed=0, env="maze", cell_size=8, n_train=2, n_test=1)
    with pytest.raises(ValueError, match="unknown planning task"):
        make_task("planning", seed=0, env="sokoban", n_train=2, n_test=1)


def test_evaluate_with_an_oracle_planner():
    """task.evaluate on plans that follow / break the optimal path (duck-typed `plan`)."""
    from mmrl.envs.planning import shortest_path

    class Oracle:
        def __init__(self, broken: bool):
            self.broken = broken

        def plan(self, contexts, max_steps):
            out = []
            for c in contexts:
                path = shortest_path(c["layout"], c["state"])
                if self.broken:
                    path = np.concatenate([path[:1], path[:1]])  # a no-op: invalid
                out.append({"states": path, "frames": []})
            return out

    task = make_task("planning", seed=0, env="frozenlake", sizes=[3, 4], n_train=5, n_test=5)
    good = task.evaluate(Oracle(False), 10)
    assert good["exact_match"] == good["progress_rate"] == good["success_rate"] == 1.0
    assert good["exact_match_L3"] == good["exact_match_L4"] == 1.0
    bad = task.evaluate(Oracle(True), 10)
    assert bad["exact_match"] == bad["progress_rate"] == 0.0 and bad["invalid_share_of_failures"] == 1.0


# ----------------------------------------------------------------------------- the reward


def test_vprl_progress_reward_on_hand_made_frames():
    lay = from_text(["SFF", "FHF", "FFG"])
    start = lay.start_state()
    ctx = {"layout": lay, "state": start}

    def frame(rc):
        return render_state(lay, np.array([rc[0], rc[1], 0, -1, -1]), 16)

    noise = np.random.default_rng(0).integers(0, 256, frame((0, 0)).shape, dtype=np.uint8)
    outputs = [frame((0, 1)),  # right: progress
               frame((1, 0)),  # down: progress too (both are shortest)
               frame((0, 0)),  # nothing moved: invalid
               frame((0, 2)),  # two cells: teleport
               noise]  # unparseable
    r = get_reward("vprl_progress")([ctx] * len(outputs), outputs)
    assert r.tolist() == [1.0, 1.0, -5.0, -5.0, -5.0]
    # from (0, 1): back left is valid without progress, down into the hole is invalid
    ctx2 = {"layout": lay, "state": np.array([0, 1, 0, -1, -1])}
    r2 = get_reward("vprl_progress")([ctx2] * 3, [frame((0, 0)), frame((1, 1)), frame((0, 2))])
    assert r2.tolist() == [0.0, -5.0, 1.0]
    assert r2.dtype == torch.float32


# ----------------------------------------------------------------------------- the VQ tokenizer


@pytest.mark.parametrize("env,sizes", [("frozenlake", [3, 4, 5]), ("maze", [3, 4]), ("minibehavior", [4])])
def test_vq_round_trip_through_the_parser(env, sizes, tmp_path):
    task = make_task("planning", seed=0, env=env, sizes=sizes, n_train=60, n_test=4)
    vq = train_vq(task.tokenizer_frames(60), steps=600, config=VQConfig(patch_size=16, codebook_size=96))
    bad = total = 0
    for lid, lay in task.test:
        states = task.graph(lid, lay).states
        frames = np.stack([task.render(lay, s) for s in states])
        codes = vq.encode(frames)
        assert codes.shape == (len(frames), lay.shape[0] * lay.shape[1])
        parsed = parse_batch_array(vq.decode(codes, vq.grid_shape(frames.shape[1:])), [lay] * len(frames))
        bad += int((parsed != states).any(1).sum())
        total += len(frames)
    assert bad <= 0.02 * total, f"{bad}/{total} held-out states lost in the VQ round trip"
    vq.save_pretrained(tmp_path / "vq")
    again = type(vq).from_pretrained(tmp_path / "vq")
    assert torch.equal(again.encode(frames), vq.encode(frames))
    with pytest.raises(ValueError, match="multiple of the VQ patch size"):
        vq.encode(np.zeros((1, 20, 20, 3), np.uint8))


# ----------------------------------------------------------------------------- the policy


@pytest.mark.parametrize("fast", [True, False])
def test_sampler_matches_teacher_forced_logprobs(built, fast):
    cfg, task, policy = built
    saved = policy._fast
    if not fast:
        policy._fast = None
    try:
        ctx = task.eval_batch(2) + task.next_batch(2)  # mixed 3x3 and 4x4 frames in one batch
        gen = torch.Generator().manual_seed(0)
        for temp in (1.0, 0.7):
            ro = policy.sample(ctx, 3, generator=gen, temperature=temp)
            assert policy.vocab.canvas == 4  # the largest train grid, one code per cell
            assert ro.mask.all() and ro.units.shape[1] == 16 and not ro.truncated.any()
            assert ro.units.max() <= policy.vocab.void  # only codes and VOID are drawn
            policy.temperature = temp
            with torch.no_grad():
                lp, ent = policy.logprobs(ro, with_entropy=True)
            policy.temperature = cfg.sampling.temperature
            diff = torch.where(ro.mask, lp - ro.logp_old, 0.0).abs().max().item()
            assert diff < 1e-5, diff
            assert torch.isfinite(ent[ro.mask]).all()
        frames = policy.decode(ro)
        assert [f.shape for f in frames] == [c["frame"].shape for c in ro.contexts]
        assert [id(c) for c in ro.contexts] == [id(c) for c in ctx for _ in range(3)]  # rows context-major
    finally:
        policy._fast = saved


def test_canvas_layout_and_void_decoding(built):
    """Frames sit at the top left of a fixed canvas (VOID around them); a VOID inside the frame's
    region decodes to a grey patch the parser rejects, codes outside the region are cropped."""
    _, task, policy = built
    c3 = task.eval_batch(1)[0]  # a 3x3 layout on the 4x4 canvas
    ids, _, grids = policy.prompts([c3["frame"]])
    v = policy.vocab
    assert ids[0, :3].tolist() == [v.bos, v.height_token(3), v.width_token(3)] and ids[0, -1] == v.sep
    canvas = ids[0, 3:-1].reshape(4, 4)
    assert (canvas[3] == v.void).all() and (canvas[:, 3] == v.void).all() and (canvas[:3, :3] < v.codebook_size).all()
    units = canvas.flatten()[None].clone()
    frame = policy.decode_units(units, grids)[0]
    assert (parse_batch_array(frame[None], [c3["layout"]])[0] == c3["state"]).all()
    units[0, 15] = 0  # a code outside the frame: cropped away
    assert (parse_batch_array(policy.decode_units(units, grids)[0][None], [c3["layout"]])[0] == c3["state"]).all()
    units[0, 0] = v.void  # VOID inside the frame: unreadable
    assert parse_batch_array(policy.decode_units(units, grids)[0][None], [c3["layout"]])[0][0] == -1


def test_closed_loop_plan_and_evaluate_untrained(built):
    _, task, policy = built
    ctx = task.eval_batch(4)
    plans = policy.plan(ctx, [c["optimal_length"] + 2 for c in ctx])
    assert len(plans) == 4
    for c, p in zip(ctx, plans):
        assert p["states"].shape[1] == 5 and (p["states"][0] == c["state"]).all()
        assert len(p["frames"]) == len(p["states"]) - 1 >= 1
        assert p["stop"] in ("goal", "invalid", "unparseable", "max_steps")
        assert all(f.shape == c["frame"].shape and f.dtype == np.uint8 for f in p["frames"])
    m = task.evaluate(policy, 6)
    for k in ("exact_match", "progress_rate", "success_rate", "invalid_share_of_failures"):
        assert 0.0 <= m[k] <= 1.0
    assert "exact_match_L3" in m and "progress_rate_L4" in m


def test_sft_then_grpo_through_the_trainer(tmp_path):
    cfg = make_cfg(tmp_path, algo={"loss": "grpo", "beta": 0.01})
    task = make_task("planning", seed=0, **cfg.task.params)
    policy = build_policy(cfg, task, torch.device("cpu"))
    before = {k: v.clone() for k, v in policy.model.lm.state_dict().items()}
    vq_before = {k: v.clone() for k, v in policy.model.vq.state_dict().items()}
    results = Trainer(cfg, policy, task).train(resume=False)
    after = policy.model.lm.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(vq_before[k], v) for k, v in policy.model.vq.state_dict().items())  # VQ frozen
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sft_rows = [r for r in rows if "sft/loss" in r]
    rl_rows = [r for r in rows if "reward/total" in r]
    assert len(sft_rows) == 2 and len(rl_rows) == 2
    for r in sft_rows + rl_rows:
        assert all(np.isfinite(v) for v in r.values() if isinstance(v, float))
    assert "eval/exact_match" in results["eval_after"] and "eval/vprl_progress" in results["eval_after"]
    assert (tmp_path / "run" / "final" / "vq" / "vq.safetensors").is_file()


def test_sft_stops_at_its_cpu_budget(built, tmp_path):
    """sft.max_cpu_s: the SFT loop stops once it has used that much process time (a VPFT baseline
    trained for the CPU-seconds of another run), and says how far it got."""
    cfg, task, policy = built
    cfg = make_cfg(tmp_path, sft={"steps": 100_000, "batch_size": 4, "max_cpu_s": 1.0}, train={"steps": 0})
    trainer = Trainer(cfg, copy.deepcopy(policy), task)
    trainer.sft()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    done = [r for r in rows if "sft/steps_done" in r][-1]
    assert 1 <= done["sft/steps_done"] < 100_000
    assert done["sft/steps_done"] == len([r for r in rows if "sft/loss" in r])
    assert 1.0 <= done["sft/cpu_s"] < 30.0  # stops at the first step past the budget
    with pytest.raises(ConfigError, match="sft.max_cpu_s"):
        make_cfg(tmp_path, sft={"max_cpu_s": -1})


def _sft_lrs(built, tmp_path, **sft) -> list[float]:
    """The learning rate of every SFT step (lr 1e-3, train.min_lr_ratio 0.1), as logged."""
    _, task, policy = built
    cfg = make_cfg(tmp_path, sft={"batch_size": 2, "lr": 1e-3, **sft}, train={"steps": 0, "min_lr_ratio": 0.1})
    Trainer(cfg, copy.deepcopy(policy), task).sft()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r["sft/lr"] for r in rows if "sft/lr" in r]


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_sft_lr_schedule(built, tmp_path, schedule):
    lrs = _sft_lrs(built, tmp_path, steps=5, lr_schedule=schedule)
    assert len(lrs) == 5 and lrs[0] == pytest.approx(1e-3)
    if schedule == "constant":
        assert lrs == [pytest.approx(1e-3)] * 5
    else:  # cosine from lr towards lr * min_lr_ratio, falling at every step
        assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.8)))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_sft_warmup(built, tmp_path, schedule):
    lrs = _sft_lrs(built, tmp_path, steps=6, lr_schedule=schedule, warmup_steps=3)
    assert len(lrs) == 6 and lrs[:3] == [pytest.approx(1e-3 / 3), pytest.approx(2e-3 / 3), pytest.approx(1e-3)]  # linear ramp
    if schedule == "constant":
        assert lrs[3:] == [pytest.approx(1e-3)] * 3
    else:  # the cosine starts from the peak after the ramp
        assert lrs[3] == pytest.approx(1e-3) and lrs[3] > lrs[4] > lrs[5] > 1e-4
    with pytest.raises(ConfigError, match="sft.warmup_steps"):
        make_cfg(tmp_path, sft={"warmup_steps": -1})


def test_from_pretrained_round_trip(built, tmp_path):
    _, task, policy = built
    policy.save(tmp_path / "planner")
    again = VisualPlannerPolicy.from_pretrained(tmp_path / "planner", temperature=policy.temperature)
    ro = policy.sample(task.eval_batch(3), 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, _ = policy.logprobs(ro)
        b, _ = again.logprobs(ro)
    assert torch.equal(a, b)
    assert again.vocab == policy.vocab
    frames = [c["frame"] for c in ro.contexts]
    assert all(torch.equal(x, y) for x, y in zip(again.encode_frames(frames)[0], policy.encode_frames(frames)[0]))
    # and through the config path (model.source: pretrained)
    cfg2 = make_cfg(tmp_path, model={"source": "pretrained", "path": str(tmp_path / "planner")})
    third = build_policy(cfg2, task, torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(third.logprobs(ro)[0], a)
    with pytest.raises(FileNotFoundError, match="not a saved visual planner"):
        VisualPlannerPolicy.from_pretrained(tmp_path)


def test_planning_eval_report(built, tmp_path):
    from mmrl.evals.planning_eval import table1, write_planner_report

    _, task, policy = built
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "eval/exact_match": 0.1 * s, "eval/progress_rate": 0.2 * s, "eval/success_rate": 0.1 * s,
             "eval/exact_match_L3": 0.1} for s in (0, 1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = write_planner_report(policy, task, tmp_path / "eval", "stage1", splits=("test", "ood", "paper"), n=4,
                               run_dir=run, n_gifs=2)
    assert rec["env"] == "frozenlake" and set(rec["splits"]) == {"test", "ood", "paper"}
    assert "skipped" in rec["splits"]["ood"] and "skipped" in rec["splits"]["paper"]
    test = rec["splits"]["test"]
    assert test["n"] == 4 and set(test["by_level"]) == {"3", "4"} and 0 <= test["exact_match"] <= 1
    for name in ("planning_eval.json", "planning_eval.md", "em_pr.png"):
        assert (tmp_path / "eval" / name).is_file()
    assert len(list((tmp_path / "eval" / "plans").glob("*.gif"))) >= 1
    other = {"method": "vpft", "env": "maze", "splits": {"test": {"exact_match": 0.5, "progress_rate": 0.75}}}
    table = table1([rec, other]).splitlines()
    assert table[0].startswith("| method | FrozenLake EM | FrozenLake PR | Maze EM")
    assert table[3] == "| vpft | — | — | 50.0 | 75.0 | — | — |"


def test_em_pr_plot_is_labelled_and_no_line_hides_another():
    import matplotlib

    matplotlib.use("Agg")
    from mmrl.evals.planning_eval import em_pr_figure

    rows = [{"step": s, "eval/exact_match": 0.3, "eval/progress_rate": 0.4, "eval/success_rate": 0.3} for s in (0, 50)]
    ax = em_pr_figure(rows).axes[0]
    assert ax.get_xlabel() and ax.get_ylabel()
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["exact match (EM)", "progress rate (PR)", "success"]
    # EM and success coincide here: they must still differ in marker and line style
    assert len({(line.get_marker(), line.get_linestyle()) for line in lines}) == 3


def test_plan_gifs_label_their_panels(built, tmp_path):
    import imageio.v2 as imageio

    from mmrl.evals.planning_eval import plan_gif

    _, task, policy = built
    contexts, plans = task.rollout_plans(policy, 1)
    frames = imageio.mimread(plan_gif(contexts[0], plans[0], tmp_path / "p.gif", cell_size=task.cell_size))
    strip = np.asarray(frames[0])[:14, :, :3]
    assert (strip < 100).any() and (strip > 200).mean() > 0.7  # dark text on a white strip
    assert not np.array_equal(np.asarray(frames[0])[:14], np.asarray(frames[1])[:14])  # the step counter moves


def test_missing_paper_split_folder_errors_only_when_used(tmp_path):
    """A machine without the paper's metadata trains on the same split; evaluating on it says why not."""
    missing = tmp_path / "no_vprl_here"
    task = make_task("planning", seed=0, env="frozenlake", sizes=[3], n_train=4, n_test=2, paper_split=str(missing))
    plain = make_task("planning", seed=0, env="frozenlake", sizes=[3], n_train=4, n_test=2)
    assert [lay.key() for _, lay in task.train] == [lay.key() for _, lay in plain.train]
    with pytest.raises(FileNotFoundError, match="task.params.paper_split"):
        task.paper_split()


def test_paper_split_evaluation(built, shared_input):
    """The paper's own FrozenLake test split (from ../shared/vprl), when it is there: an evaluation
    input only (the training split is the same without it) whose overlap with training is reported."""
    path = shared_input("vprl")
    _, _, policy = built
    kwargs = dict(seed=0, env="frozenlake", sizes=[3, 4], n_train=200, n_test=4)
    paper = make_task("planning", paper_split=str(path), **kwargs)
    plain = make_task("planning", **kwargs)
    train_keys = [lay.key() for _, lay in paper.train]
    assert train_keys == [lay.key() for _, lay in plain.train]
    in_train = sum(lay.key() in set(train_keys) for lay in paper.paper_split().layouts)
    assert paper.paper_overlap() == in_train > 0  # 3x3 layouts are few: 200 draws meet the paper's
    m = paper.evaluate(policy, 8, split="paper")
    assert m["n"] == 8 and 0 <= m["progress_rate"] <= 1


def test_bad_policy_params_are_named(tmp_path):
    with pytest.raises(ValueError, match="codebok_size"):  # at config load, before anything is built
        make_cfg(tmp_path, model={"params": {"codebok_size": 3}})


# ----------------------------------------------------------------------------- the CLI main job


def test_cli_train_prints_before_after_table_and_eval_writes_planner_report(tmp_path, capsys):
    """`mmrl train` on a planning config prints and saves the held-out table before and after RL;
    `mmrl eval --checkpoint RUN` writes the Table-1 report (JSON, Markdown, GIFs)."""
    import yaml

    from mmrl.cli import main

    cfg = make_cfg(tmp_path, train={"eval_size": 4})
    path = tmp_path / "vprl.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert main(["train", str(path), "--no-resume"]) == 0
    out = capsys.readouterr().out
    table = (tmp_path / "run" / "before_after.md").read_text()
    assert table in out
    assert "before RL (after SFT)" in table and "after RL" in table and "| 3x3 |" in table
    saved = json.loads((tmp_path / "run" / "before_after.json").read_text())
    assert saved["before"]["step"] == 0 and saved["after"]["step"] == 2
    assert 0 < saved["train_cpu_s"]

    report = tmp_path / "report"
    assert main(["eval", str(path), "--checkpoint", str(tmp_path / "run"), "--output", str(report)]) == 0
    out = capsys.readouterr().out
    assert "FrozenLake EM" in out and "written:" in out
    record = json.loads((report / "planning_eval.json").read_text())
    assert record["method"] == "run" and record["splits"]["test"]["n"] == 12  # every held-out layout (2 sizes x 6)
    assert (report / "planning_eval.md").is_file() and list((report / "plans").glob("*.gif"))


def test_before_after_table_without_rl_has_one_stage():
    from mmrl.evals.planning_eval import before_after_markdown

    ev = {"step": 0, "eval/n": 10.0, "eval/exact_match": 0.5, "eval/progress_rate": 0.75,
          "eval/exact_match_L3": 0.25, "eval/progress_rate_L3": 0.5}
    md = before_after_markdown(ev, ev, train_cpu_s=12.0)
    assert "after RL" not in md and "| before RL (after SFT) | 0 | all | 50.0 | 75.0 |" in md
    assert "| 3x3 | 25.0 | 50.0 |" in md and "CPU-seconds (SFT + RL, evaluations excluded): 12" in md


@pytest.mark.parametrize("name", ["vprl_maze_grpo.yaml", "vprl_minibehavior_grpo.yaml"])
def test_maze_and_minibehavior_configs_run_two_steps(name, tmp_path):
    """The shipped Maze / MiniBehavior configs, shrunk: build, 2 SFT + 2 GRPO steps, closed-loop eval."""
    from mmrl.config import load_config

    path = Path(__file__).parent.parent / "configs" / name
    cfg = load_config(path, [
        "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=1",
        "model.params.vq_steps=30", "model.params.vq_layouts=4", "model.params.codebook_size=32",
        "task.params.n_train=8", "task.params.n_test=2", "task.params.ood_sizes=[]",
        "sft.steps=2", "sft.batch_size=4", "train.steps=2", "train.prompts_per_step=2", "sampling.group_size=2",
        "train.eval_every=0", "train.eval_size=2", "train.progress=false", f"train.output_dir={tmp_path / 'run'}"])
    task = make_task("planning", seed=0, **cfg.task.params)
    policy = build_policy(cfg, task, torch.device("cpu"))
    results = Trainer(cfg, policy, task).train(resume=False)
    assert results["eval_after"]["step"] == 2 and "eval/exact_match" in results["eval_after"]
