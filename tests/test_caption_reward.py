"""The caption_qa reward: shuffled options whose answer letter follows its option, the appended
cannot-answer option, questions sampled per caption, the CapRL++ length term, malformed judge
replies scored 0 with a logged reason, and the lexical judge's refusal on empty or unrelated captions."""

import logging
from collections import Counter

import numpy as np
import pytest
import torch
from mmrl.envs import make_task

from mmrl.rewards import build_reward
from mmrl.rewards.captioning.judges import (
    CANNOT_ANSWER,
    LETTERS,
    JudgeItem,
    JudgeReply,
    LexicalJudge,
    make_judge,
    parse_letter,
)
from mmrl.rewards.captioning.qa import build_item, caption_qa, length_factor

QA = {"question": "What colour is the circle?", "choices": ["red", "green", "blue", "yellow"], "answer": "blue"}


def test_options_are_shuffled_and_the_letter_follows_the_answer():
    rng = np.random.default_rng(0)
    orders, letters = set(), Counter()
    for _ in range(200):
        item, letter = build_item("a caption", QA, rng)
        assert item.options[LETTERS.index(letter)] == "blue"
        assert sorted(item.options[:-1]) == sorted(QA["choices"])
        assert item.options[-1] == CANNOT_ANSWER  # appended last, never shuffled in
        orders.add(tuple(item.options))
        letters[letter] += 1
    assert len(orders) == 24  # every permutation of 4 options shows up
    assert set(letters) == {"A", "B", "C", "D"} and min(letters.values()) > 25
    item, letter = build_item("c", QA, rng, cannot_answer=False)
    assert len(item.options) == 4 and CANNOT_ANSWER not in item.options
    with pytest.raises(ValueError, match="answer 'purple' is not among the choices"):
        build_item("c", {**QA, "answer": "purple"}, rng)


def test_first_valid_letter_counts():
    assert parse_letter("B", 5) == "B"
    assert parse_letter("The answer is C. Not A.", 5) == "C"
    assert parse_letter("I think (D)", 5) == "D"  # "I" is not an option letter with 5 options
    assert parse_letter("F then B", 5) == "B"  # F is past the options: the first *valid* letter counts
    assert parse_letter("Blue", 5) is None and parse_letter("", 5) is None


def test_lexical_judge_cannot_answer_from_empty_or_unrelated_captions():
    judge = LexicalJudge()
    rng = np.random.default_rng(0)
    caption = "top left large blue circle, top right empty, bottom left empty, bottom right small red square"
    for cap, expect in [(caption, "blue"), ("", CANNOT_ANSWER), ("a photo of a cat on a sofa", CANNOT_ANSWER),
                        ("top left large red square, bottom right small red square", CANNOT_ANSWER)]:
        item, _ = build_item(cap, QA, rng)
        (reply,) = judge.judge([item])
        assert item.options[LETTERS.index(reply.letter)] == expect, cap
    # A question outside the templates is never guessed either.
    item, _ = build_item(caption, {"question": "Is it sunny?", "choices": ["yes", "no"], "answer": "yes"}, rng)
    assert item.options[LETTERS.index(judge.judge([item])[0].letter)] == CANNOT_ANSWER


def test_reward_on_synthetic_scenes_true_empty_and_wrong_captions():
    task = make_task("caption", seed=0, n_test=40)
    ctx = task.eval_batch(40)
    true = caption_qa(ctx, [c["target"] for c in ctx], questions_per_caption=4)
    assert torch.equal(true, torch.ones(40))
    assert torch.equal(caption_qa(ctx, [""] * 40), torch.zeros(40))
    wrong = caption_qa(ctx, [ctx[(i + 1) % 40]["target"] for i in range(40)])
    assert 0 < wrong.mean() < 0.5  # another scene's caption answers little (and only by chance)
    # Half the objects described: partial credit.
    half = [", ".join(c["target"].split(", ")[:2]) for c in ctx]
    partial = caption_qa(ctx, half, questions_per_caption=50).mean()
    assert 0.2 < partial < 0.95


class Recorder:
    """A judge that answers "A" and keeps what it was asked."""

    def __init__(self):
        self.items = []

    def judge(self, items):
        self.items += items
        return [JudgeReply("A", "A") for _ in items]


def test_questions_are_sampled_per_caption_and_shared_by_a_group():
    rec = Recorder()
    qa = [{"question": f"q{i}", "choices": ["x", "y"], "answer": "x"} for i in range(10)]
    a, b = {"qa": qa}, {"qa": qa[:2]}
    contexts = [a, a, a, b, b]  # two groups, as the trainer repeats each context object
    caption_qa(contexts, ["c1", "c2", "c3", "d1", "d2"], judge=rec, questions_per_caption=4)
    by_caption: dict[str, list[str]] = {}
    for it in rec.items:
        by_caption.setdefault(it.caption, []).append(it.question)
    assert all(len(v) == 4 for k, v in by_caption.items() if k.startswith("c"))
    assert by_caption["c1"] == by_caption["c2"] == by_caption["c3"]  # the group shares its questions
    assert sorted(by_caption["d1"]) == ["q0", "q1"]  # fewer questions than N: all of them
    # The reward object draws afresh on each call; its state replays the same draws.
    reward = build_reward("caption_qa", {"judge": rec, "questions_per_caption": 4})

    def draws(n):
        out = []
        for _ in range(n):
            rec.items.clear()
            reward(contexts[:1], ["c1"])
            out.append(tuple(it.question for it in rec.items))
        return out

    first = draws(3)
    assert len(set(first)) > 1 and reward.state_dict() == {"draws": 3}
    more = draws(2)
    reward.load_state_dict({"draws": 3})
    assert draws(2) == more
    fresh = build_reward("caption_qa", {"judge": rec, "questions_per_caption": 4})
    reward = fresh
    assert draws(3) == first  # a fresh object starts the same sequence (what evaluation uses)
    with pytest.raises(ValueError, match="unknown parameter 'questions'"):
        build_reward("caption_qa", {"questions": 4})


def test_length_term():
    f = length_factor([0, 10, 20, 21, 25, 30, 100], budget=20, margin=10)
    assert f.tolist() == pytest.approx([1, 1, 1, 0.9, 0.5, 0, 0])
    assert length_factor([500], budget=0, margin=10).tolist() == [1.0]  # off
    task = make_task("caption", seed=0, n_test=8)
    ctx = task.eval_batch(8)
    caps = [c["target"] for c in ctx]
    padded = [c + " and the rest of the picture is plain" * 3 for c in caps]
    r_short = caption_qa(ctx, caps, length_budget=30, length_margin=10)
    r_long = caption_qa(ctx, padded, length_budget=30, length_margin=10)
    n_long = np.array([len(p.split()) for p in padded])
    expect = np.clip(1 - (n_long - 30) / 10, 0, 1)
    assert torch.equal(r_short, torch.ones(8))
    assert r_long.numpy() == pytest.approx(expect)
    with pytest.raises(ValueError, match="length_margin must be > 0"):
        length_factor([1], budget=5, margin=0)


def test_malformed_judge_replies_score_zero_with_a_logged_reason(caplog):
    class Broken:
        def judge(self, items):
            return [JudgeReply(None, "blah", "malformed reply (no option letter A-E): 'blah'") if i % 2 else
                    JudgeReply(None, "", "timeout after 3 attempts") for i, _ in enumerate(items)]

    ctx = make_task("caption", seed=0, n_test=4).eval_batch(4)
    reward = build_reward("caption_qa", {"judge": Broken(), "max_judge_failures": 1.0})  # never a fault
    with caplog.at_level(logging.WARNING, logger="mmrl.rewards.captioning.qa"):
        r = reward(ctx, [c["target"] for c in ctx])
    assert torch.equal(r, torch.zeros(4))
    assert "count as failed (scored 0)" in caplog.text and "timeout" in caplog.text and "malformed" in caplog.text
    assert reward.metrics() == {"judged": 16.0, "judge_failed": 16.0, "judge_failed_share": 1.0}
    with pytest.raises(KeyError, match="context 0 has no 'qa'"):
        caption_qa([{"image": None}], ["x"])


def test_make_judge_errors_name_the_choices():
    with pytest.raises(ValueError, match="unknown name 'gpt'; valid: lexical, hf, http"):
        make_judge({"name": "gpt"})
    with pytest.raises(ValueError, match="judge 'lexical': bad parameters"):
        make_judge({"name": "lexical", "temperature": 0.6})
    with pytest.raises(ValueError, match="unknown mode 'beam'; valid: chat, completions"):
        make_judge({"name": "http", "base_url": "http://127.0.0.1:9", "mode": "beam"})
    assert isinstance(JudgeItem("c", "q", ["a"]).options, list)


def test_caption_draws_do_not_depend_on_how_the_captions_are_split():
    """8 captions (2 images x 4) in one call: the same questions, option orders and rewards as two
    calls of 4 with the same draw counter, which is what 2 ranks do."""
    ctx = make_task("caption", seed=0, n_test=2).eval_batch(2)
    contexts = [c for c in ctx for _ in range(4)]
    captions = [", ".join(c["target"].split(", ")[: 1 + i % 3]) for i, c in enumerate(contexts)]

    def call(lo, hi, draw=5, judge=None):
        rec = judge or Recorder()
        reward = caption_qa(contexts[lo:hi], captions[lo:hi], judge=rec, questions_per_caption=2, draw=draw)
        return reward, [(it.caption, it.question, tuple(it.options)) for it in rec.items]

    whole, asked = call(0, 8)
    first, asked0 = call(0, 4)
    second, asked1 = call(4, 8)
    assert torch.equal(whole, torch.cat([first, second])) and asked == asked0 + asked1
    # The captions of one image share its questions but not their option orders (their index).
    per_caption = [asked[2 * i: 2 * i + 2] for i in range(8)]
    assert len({tuple(q for _, q, _ in p) for p in per_caption[:4]}) == 1
    assert len({tuple(o for _, _, o in p) for p in per_caption[:4]}) > 1
    # Copies of a context (as after pickling between processes) are the same item.
    copies = [dict(c) for c in contexts]
    rec = Recorder()
    caption_qa(copies, captions, judge=rec, questions_per_caption=2, draw=5)
    assert [(it.caption, it.question, tuple(it.options)) for it in rec.items] == asked
    # Another draw asks otherwise; the lexical judge scores the same split alike too.
    assert call(0, 8, draw=6)[1] != asked
    lexical = caption_qa(contexts, captions, questions_per_caption=2, draw=5)
    assert torch.equal(lexical, torch.cat([caption_qa(contexts[:4], captions[:4], questions_per_caption=2, draw=5),
                                           caption_qa(contexts[4:], captions[4:], questions_per_caption=2, draw=5)]))
