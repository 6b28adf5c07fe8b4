"""What a run shows a person: each domain's README metric as the headline of `mmrl train` and of
report.md, labelled curves, captioned VLA videos, a colour legend on plan GIFs, and why the
out-of-distribution planning rows are 0. The eval dicts use the keys the trainer and each task's
`evaluate` really log (see results.json of a run)."""

import json
from pathlib import Path

import numpy as np
import pytest
from mmrl.envs import make_task
from mmrl.envs.base import Headline
from mmrl.envs.robot_task import RobotTask
from mmrl.evals.reports import summarize

ROOT = Path(__file__).resolve().parents[1]


def texts(rows: list[Headline]) -> list[tuple[str, str, str]]:
    return [(r.label, r.show(r.before), r.show(r.after)) for r in rows]


# ----------------------------------------------------------------------------- the headline hooks


def test_vqa_headline_is_greedy_accuracy_and_mean_at_k():
    task = make_task("vqa", 0, n_train=16, n_test=4, n_ood=4, image_size=56)
    ev = lambda step, acc, mean: {"step": step, "eval/answer_accuracy": acc, "eval/format": 1.0, "eval/total": acc + 0.2,
                                  "eval/len_mean": 40.0, "eval/accuracy": acc, "eval/format_rate": 1.0,
                                  "eval/acc/counting": 0.3, "eval/mean@4": mean, "eval/pass@4": 0.7}
    rows = task.headline(ev(0, 0.41, 0.367), ev(100, 0.478, 0.465))
    assert texts(rows) == [("greedy accuracy", "0.410", "0.478"),
                           ("accuracy, mean of 4 sampled replies", "0.367", "0.465")]
    assert [r.key for r in rows] == ["eval/accuracy", "eval/mean@4"]


def test_planning_headline_is_em_and_pr_in_percent_and_a_text_planner_falls_back_to_the_reward():
    task = make_task("planning", 0, sizes=[3], n_train=4, n_test=2)
    ev = lambda step, em, pr: {"step": step, "eval/vprl_progress": 0.5, "eval/total": 0.5, "eval/len_mean": 25.0,
                               "eval/exact_match": em, "eval/progress_rate": pr, "eval/success_rate": em,
                               "eval/n": 300.0, "eval/exact_match_L3": 0.9, "eval/progress_rate_L3": 0.95}
    assert texts(task.headline(ev(0, 0.853, 0.864), ev(300, 0.893, 0.904))) == [
        ("exact match (EM)", "85.3%", "89.3%"), ("progress rate (PR)", "86.4%", "90.4%")]
    # the one-shot text planner has no closed-loop plans, so no EM key: its reward is the headline
    text = lambda step, r: {"step": step, "eval/vprl_text_plan": r, "eval/total": r, "eval/len_mean": 9.0}
    assert texts(task.headline(text(0, 0.25), text(10, 0.5))) == [("held-out reward", "0.250", "0.500")]


def test_vla_headline_is_sampled_and_greedy_success_percent():
    # eval_mode sampled (the demo): greedy success is the trainer's own pass of the `success` reward
    before = {"step": 0, "eval/success": 0.0, "eval/total": 0.0, "eval/len_mean": 12.0,
              "eval/sampled/success": 0.227, "eval/sampled/success/reach": 0.227, "eval/sampled/episode_len": 30.0}
    after = {**before, "step": 60, "eval/success": 0.125, "eval/sampled/success": 0.281}
    rows = RobotTask().headline(before, after)
    assert texts(rows) == [("sampled success", "22.7%", "28.1%"), ("greedy success", "0.0%", "12.5%")]
    # eval_mode both: the task's own greedy episodes
    both = {**after, "eval/greedy/success": 0.5}
    assert RobotTask().headline(before, both)[1].key == "eval/greedy/success"


def test_text_headline_is_exact_match_whichever_exact_reward_the_config_trains():
    sort = {"step": 0, "eval/exact_match": 0.749, "eval/position_match": 0.9, "eval/total": 0.749,
            "eval/len_mean": 6.0, "eval/sampled_exact_match": 0.654, "eval/sampled_total": 0.654}
    assert texts(make_task("digit_sort", 0).headline(sort, {**sort, "eval/exact_match": 0.956})) == [
        ("greedy exact match", "0.749", "0.956"), ("sampled exact match", "0.654", "0.654")]
    add = {"step": 0, "eval/arithmetic_exact": 0.3, "eval/total": 0.3, "eval/len_mean": 3.0}
    assert texts(make_task("arithmetic", 0).headline(add, {**add, "eval/arithmetic_exact": 0.6})) == [
        ("greedy exact match", "0.300", "0.600")]


def test_caption_and_video_headlines():
    cap = {"step": 0, "eval/caption_qa": 0.4, "eval/total": 0.4, "eval/caption_acc_mean": 0.372,
           "eval/caption_acc_best_of_4": 0.6, "eval/caption_acc_greedy": 0.388}
    assert texts(make_task("caption", 0, n_test=4).headline(cap, cap)) == [
        ("judge accuracy, mean of 4 sampled captions", "0.372", "0.372"),
        ("judge accuracy, greedy caption", "0.388", "0.388")]
    vid = {"step": 0, "eval/video_colour": 0.08, "eval/video_motion": 0.02, "eval/video_smoothness": 0.9,
           "eval/total": 0.1, "eval/temporal_consistency": 0.95, "eval/len_mean": 8.0, "eval/sampled_total": 0.09}
    video = make_task("video", 0)
    assert [r.label for r in video.headline(vid, vid)] == [
        "held-out reward (total)", "colour reward", "motion reward", "smoothness reward"]
    # the summary lists what the headline leaves out, not the components again
    summary = summarize(video, {"eval_before": vid, "eval_after": vid}, "unused")
    assert "| temporal_consistency | 0.950 | 0.950 |" in summary and "video_colour" not in summary


# ----------------------------------------------------------------------------- report.md and curves


def fake_run(run: Path, before: dict, after: dict, sft_steps: int = 300) -> None:
    run.mkdir(parents=True)
    results = {"eval_before": before, "eval_after": after, "eval_history": [before, after],
               "config": {"sft": {"steps": sft_steps}}}
    (run / "results.json").write_text(json.dumps(results))
    train = [{"step": s, "reward/total": 0.1 * s, "train/entropy": 1.0, "train/approx_kl": 0.02,
              "train/clip_frac": 0.001, "len/mean": 20.0, "len/truncated_frac": 0.1} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [before, *train, after]) + "\n")


def test_report_md_opens_with_the_headline_and_holds_the_planning_table(tmp_path):
    task = make_task("planning", 0, sizes=[3], n_train=4, n_test=2)
    ev = lambda step, em: {"step": step, "eval/total": 0.5, "eval/len_mean": 25.0, "eval/exact_match": em,
                           "eval/progress_rate": em, "eval/success_rate": em, "eval/n": 2.0,
                           "eval/exact_match_L3": em, "eval/progress_rate_L3": em}
    before, after = ev(0, 0.5), ev(2, 1.0)
    fake_run(tmp_path / "run", before, after)
    from mmrl.evals.report import write_report

    summary = summarize(task, {"eval_before": before, "eval_after": after}, tmp_path / "run")
    md = write_report(tmp_path / "run", task.headline(before, after), summary).read_text()
    head = md.splitlines()
    assert head[2] == "| metric | step 0: before RL (after SFT) | step 2: after RL |"
    assert head[4:6] == ["| exact match (EM) | 50.0% | 100.0% |", "| progress rate (PR) | 50.0% | 100.0% |"]
    assert "| after RL | 2 | 3x3 | 100.0 |" in md  # the EM / PR table by size (before_after.md's)
    assert (tmp_path / "run" / "before_after.md").read_text().strip() in md
    assert "| 2 | 100.0% | 100.0% | 0.500 | 25.0 |" in md  # the evaluation history, headline first
    assert "![training curves](curves.png)" in md and (tmp_path / "run" / "curves.png").is_file()


def test_report_md_without_a_task_headline_reports_the_held_out_reward(tmp_path):
    ev = lambda step, r: {"step": step, "eval/total": r, "eval/len_mean": 5.0}
    fake_run(tmp_path / "run", ev(0, 0.25), ev(2, 0.75), sft_steps=0)
    from mmrl.evals.report import write_report

    md = write_report(tmp_path / "run").read_text()
    assert "| metric | step 0: before RL | step 2: after RL |" in md and "| held-out reward | 0.250 | 0.750 |" in md


def test_curves_label_every_axis_and_keep_small_shares_off_larger_scales():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmrl.evals.report import curves_figure

    rows = [{"step": 0, "eval/total": 0.2, "eval/exact_match": 0.5},
            {"step": 1, "reward/total": 0.3, "train/entropy": 1.2, "train/approx_kl": 0.05, "train/kl_ref": 0.1,
             "train/clip_frac": 0.002, "len/mean": 30.0, "len/truncated_frac": 0.25},
            {"step": 2, "eval/total": 0.4, "eval/exact_match": 0.9}]
    headline = [Headline("exact match (EM)", 0.5, 0.9, ".1%", "eval/exact_match")]
    fig = curves_figure(rows, headline)
    axis_of = {line.get_label(): ax for ax in fig.axes for line in ax.get_lines()}
    assert all(ax.get_ylabel() for ax in fig.axes)
    assert axis_of["clip fraction"] is not axis_of["KL to sampler"]
    assert axis_of["truncated share"] is not axis_of["mean length"]
    assert axis_of["truncated share"].get_ylim() == pytest.approx((-0.02, 1.02))
    em = axis_of["exact match (EM)"]  # the headline panel, in the percent the headline prints
    assert em.get_ylabel() == "exact match (EM) (%)" and list(em.get_lines()[0].get_ydata()) == [50.0, 90.0]
    plt.close(fig)


# ----------------------------------------------------------------------------- media and notes


@pytest.mark.robot  # its VLA part needs lerobot's stack
def test_vla_gif_frames_show_the_instruction_in_a_band_above(tmp_path):
    import imageio.v2 as imageio

    from mmrl.evals.vla_eval import write_videos

    frames = np.full((2, 16, 16, 3), 90, np.uint8)
    outputs = [{"success": True, "frames": frames, "instruction": "touch the red ball", "length": 9}]
    gif = next(p for p in write_videos([{"task": "reach", "init_state_id": 1}], outputs, tmp_path, n=1)
               if p.suffix == ".gif")
    frame = np.asarray(imageio.mimread(gif)[0])[..., :3]
    band = frame[: frame.shape[0] - 16 * 3]  # the frames are drawn 3x; the rest is the caption band
    assert band.shape[0] >= 12
    assert (band > 200).all(-1).mean() > 0.7 and (band < 80).all(-1).any()  # dark text on white
    assert (frame[band.shape[0] + 8:-8, 8:-8] == 90).all()  # the scene itself is untouched


def test_plan_gif_legend_names_the_colours_of_the_layout(tmp_path):
    import imageio.v2 as imageio

    from mmrl.envs.planning import shortest_path
    from mmrl.envs.planning.render import PALETTE, Colour
    from mmrl.evals.planning_eval import legend_entries, plan_gif

    task = make_task("planning", 1, env="frozenlake", sizes=[4], n_train=4, n_test=2)
    context = task.eval_batch(1)[0]
    names = dict(legend_entries(context["layout"]))
    assert {"ice", "goal", "hole", "agent (red disc)"} <= set(names) and "table" not in names
    assert names["hole"] == tuple(PALETTE[Colour.HOLE])
    plan = {"states": np.stack(shortest_path(context["layout"], context["state"])), "frames": []}
    frame = np.asarray(imageio.mimread(plan_gif(context, plan, tmp_path / "p.gif", cell_size=task.cell_size))[0])
    legend = frame[14 + 2 * context["frame"].shape[0]:, :, :3]  # under the 14 px name strip and the 2x panels
    assert legend.shape[0] >= 10 and (np.abs(legend.astype(int) - PALETTE[Colour.HOLE]).sum(-1) < 30).any()


def test_ood_rows_that_score_zero_say_why():
    from mmrl.evals.planning_eval import split_markdown

    level = lambda em: {"n": 4.0, "exact_match": em, "progress_rate": em, "success_rate": em,
                        "invalid_share_of_failures": 1.0}
    split = lambda em: {**level(em), "by_level": {"7": level(em), "9": level(em)}}
    md = split_markdown({"test": {**level(0.8), "by_level": {"5": level(0.8)}}, "ood": split(0.0)},
                        train_sizes=[3, 4, 5])
    assert "| ood (1) | 7 | 4 | 0.0 |" in md
    assert "(1) 7x7 / 9x9 score 0 by construction" in md and "5x5" in md and "docs/vprl_experiments.md" in md
    assert "(1)" not in split_markdown({"ood": split(0.25)}, train_sizes=[3, 4, 5])


# ----------------------------------------------------------------------------- end to end


def test_mmrl_train_prints_the_headline_first_and_writes_it_to_report_md(tmp_path, capsys):
    from mmrl.cli import main

    run = tmp_path / "run"
    assert main(["train", str(ROOT / "configs" / "digit_sort_grpo.yaml"), "train.steps=2", "sft.steps=2",
                 "train.eval_size=8", "train.threads=1", "train.prompts_per_step=2", "sampling.group_size=2",
                 f"train.output_dir={run}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("greedy exact match: ") and out[0].endswith("(held-out, step 0 -> 2)")
    assert out[1].startswith("sampled exact match: ")
    assert out[-1].startswith("results: ")
    report = (run / "report.md").read_text()
    assert "| greedy exact match |" in report and "| sampled exact match |" in report
