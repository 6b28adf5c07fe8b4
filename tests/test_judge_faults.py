"""Judge replies that cannot be scored are counted (and warned about once), and a judge that is down
is a fault: the caption reward raises `JudgeFailure` past `max_judge_failures`, the trainer saves a
checkpoint at that step and `mmrl train` exits non-zero with one line naming the judge and why."""

import argparse
import logging
import socket
from pathlib import Path

import pytest
import torch

from mmrl import build
from mmrl.checkpoint import find_latest, verify_checkpoint
from mmrl.cli import cmd_train
from mmrl.config import ConfigError, load_config
from mmrl.envs import make_task
from mmrl.rewards import build_reward
from mmrl.rewards.captioning.judge_server import JudgeServer
from mmrl.rewards.captioning.judges import JudgeFailure, JudgeReply, LexicalJudge
from mmrl.rewards.captioning.qa import caption_qa
from mmrl.trainer import Trainer, TrainingFailed

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/caption_grpo.yaml")
TINY = ("model.tiny={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
        "num_key_value_heads: 1, head_dim: 16, mrope_section: [4, 2, 2], vision_depth: 1, vision_width: 16, "
        "vision_heads: 1}")
SMALL = [TINY, "task.params.n_test=6", "task.params.eval_k=2", "sampling.group_size=2", "sampling.max_new_tokens=6",
         "sft.steps=2", "sft.batch_size=4", "train.steps=2", "train.prompts_per_step=2", "train.eval_every=1",
         "train.eval_size=3", "train.progress=false"]


def http_judge(port: int) -> str:
    """The override pointing the caption reward at an HTTP judge on `port`, failing fast."""
    return (f'rewards.0.params.judge={{name: http, base_url: "http://127.0.0.1:{port}/v1", timeout: 2, retries: 0, '
            f'deadline: 10}}')


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on leaving: nothing listens there


class Scripted:
    """A judge replying with `script(i, item)` for the i-th item of a call, else the lexical answer."""

    def __init__(self, script):
        self.script, self.lexical = script, LexicalJudge()

    def judge(self, items):
        right = self.lexical.judge(items)
        return [self.script(i, it) or r for i, (it, r) in enumerate(zip(items, right))]


def test_replies_without_a_valid_letter_are_counted_as_failed_and_warned_once(caplog):
    """A custom judge's reply with no letter (and no reason), or with a letter that is not an
    option, used to score 0 silently; now each counts as failed, with its reason."""
    ctx = make_task("caption", seed=0, n_test=4).eval_batch(4)
    script = {0: JudgeReply(None, "hmm"), 1: JudgeReply("F", "F")}  # 4 choices + cannot answer: A-E only
    judge = Scripted(lambda i, it: script.get(i % 4))
    reward = build_reward("caption_qa", {"judge": judge, "questions_per_caption": 4})
    with caplog.at_level(logging.WARNING, logger="mmrl.rewards.captioning.qa"):
        r = reward(ctx, [c["target"] for c in ctx])
        first = caplog.text
        reward(ctx, [c["target"] for c in ctx])
    assert torch.equal(r, torch.full((4,), 0.5))  # the true captions answer the other 2 of 4 right
    assert reward.metrics() == {"judged": 16.0, "judge_failed": 8.0, "judge_failed_share": 0.5}
    assert reward.metric_weights() == {"judge_failed_share": 16.0}
    assert reward.stats["reasons"] == {"no option letter in the reply": 4, "letter not among the options": 4}
    assert "8 of 16 judge replies could not be scored" in first and "letter not among the options" in first
    assert caplog.text == first  # warned once per reason, not on every call


def test_max_judge_failures_is_a_validated_share():
    for bad in (1.5, -0.1):
        with pytest.raises(ConfigError, match=r"max_judge_failures must be a share in \[0, 1\], got"):
            build_reward("caption_qa", {"max_judge_failures": bad})
    for bad in ("half", True):  # not a number: refused by its annotation, before the reward's own check
        with pytest.raises(ConfigError, match=r"max_judge_failures: expected a number, got"):
            build_reward("caption_qa", {"max_judge_failures": bad})
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.params: caption_qa: max_judge_failures must be a share "
                                          r"in \[0, 1\], got 2$"):
        load_config(CONFIG, ["rewards.0.params.max_judge_failures=2"])
    assert load_config(CONFIG, ["rewards.0.params.max_judge_failures=0"]).rewards[0].params["max_judge_failures"] == 0


def test_more_failed_replies_than_the_share_raise_a_judge_failure():
    ctx = make_task("caption", seed=0, n_test=2).eval_batch(2)
    timeout = JudgeReply(None, "", "timeout after 1 attempts")
    three_of_four = Scripted(lambda i, it: timeout if i % 4 else None)
    caps = [c["target"] for c in ctx]
    with pytest.raises(JudgeFailure, match=r"^caption_qa: 6 of 8 replies of judge Scripted failed \(75%, more than "
                                           r"max_judge_failures 0\.5\); most common reason: timeout after 1 attempts "
                                           r"\(6x\)$"):
        caption_qa(ctx, caps, judge=three_of_four)
    assert caption_qa(ctx, caps, judge=three_of_four, max_judge_failures=0.75).tolist() == [0.25, 0.25]  # not more
    with pytest.raises(JudgeFailure):
        caption_qa(ctx, caps, judge=Scripted(lambda i, it: timeout if i == 0 else None), max_judge_failures=0.0)


def test_a_judge_that_is_down_ends_mmrl_train_with_one_line_and_a_checkpoint(tmp_path, capsys):
    """The HTTP judge at a closed port: every reply is a connection error. The first evaluation
    (step 0, after SFT) meets it; the command exits 1 naming the judge, the reason and the checkpoint."""
    port = closed_port()
    run = tmp_path / "run"
    # `mmrl train CONFIG overrides...` as the command line parses it
    args = argparse.Namespace(config=CONFIG, overrides=[*SMALL, http_judge(port), f"train.output_dir={run}"],
                              nproc=1, no_resume=False)
    code = cmd_train(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    line = err[-1]
    assert line.startswith("mmrl: error: caption_qa: 12 of 12 replies of judge "
                           f"http http://127.0.0.1:{port}/v1/chat/completions (model judge) failed (100%"), line
    assert "most common reason: connection error" in line and "stopped at step 0 of 2" in line
    ckpt = find_latest(run)
    assert ckpt is not None and line.endswith(f"checkpoint saved to {ckpt}")
    verify_checkpoint(ckpt)
    cfg = load_config(CONFIG, [*SMALL, http_judge(port), f"train.output_dir={run}"])
    task, policy = build(cfg)
    trainer = Trainer(cfg, policy, task)
    assert trainer.resume() == ckpt and trainer.step == 0 and trainer.sft_done  # SFT is not repeated


def test_a_judge_going_down_mid_run_saves_the_step_start_and_resumes_exactly(tmp_path):
    """The judge answers step 1 and its evaluation, then goes down: step 2 stops before its update
    with a checkpoint of step 1 whose data cursor and reward draws are those at the step's start,
    so resuming once the judge is back gives the uninterrupted run's weights."""
    def trainer_for(out, port):
        cfg = load_config(CONFIG, [*SMALL, http_judge(port), f"train.output_dir={out}"])
        task, policy = build(cfg)
        return Trainer(cfg, policy, task)

    with JudgeServer() as srv:
        straight = trainer_for(tmp_path / "straight", srv.httpd.server_address[1])
        straight.train(resume=False)
    srv = JudgeServer().__enter__()
    port = srv.httpd.server_address[1]
    broken = trainer_for(tmp_path / "broken", port)
    evaluate = broken.evaluate

    def evaluate_then_go_down():
        result = evaluate()
        if broken.step == 1:
            srv.__exit__(None, None, None)
        return result

    broken.evaluate = evaluate_then_go_down
    with pytest.raises(TrainingFailed, match=r"connection error.*stopped at step 1 of 2; checkpoint saved to") as fault:
        broken.train(resume=False)
    state = torch.load(Path(fault.value.checkpoint) / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1 and state["task"] == {"cursor": 2} and state["rewards"] == [{"draws": 1}]
    with JudgeServer(port=port):  # the judge is back, where the config says it is
        resumed = trainer_for(tmp_path / "broken", port)
        resumed.train(resume=True)
    assert resumed.step == 2
    for k, v in straight.policy.model.state_dict().items():
        assert torch.equal(v, resumed.policy.model.state_dict()[k]), k


def test_caption_evaluation_reports_the_share_it_could_not_judge(tiny_captioner):
    """Evaluation does not stop on a bad judge; it says which share of the replies were unusable
    (scored 0), so a judge that is down does not pass for a bad captioner."""
    from mmrl.evals.caption_eval import evaluate_captioner

    task, policy = tiny_captioner
    every_other = Scripted(lambda i, it: JudgeReply(None, "", "timeout") if i % 2 else None)
    metrics, _ = evaluate_captioner(policy, task.eval_batch(3), every_other, k=2)
    assert 0.4 < metrics["judge_unjudged_share"] < 0.6  # odd items of each call failed
    metrics, _ = evaluate_captioner(policy, task.eval_batch(3), LexicalJudge(), k=2)
    assert metrics["judge_unjudged_share"] == 0.0


@pytest.fixture(scope="module")
def tiny_captioner():
    cfg = load_config(CONFIG, SMALL)
    return build(cfg)
