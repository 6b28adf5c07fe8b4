"""VQA verifiable rewards (mmrl/rewards/vqa.py): answer accuracy via math-verify, format, IoU,
length, and R1-VL's StepRAR / StepRVR. Every expected value is computed by hand."""

from __future__ import annotations

import threading
import time

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402

pytest.importorskip("math_verify")

from mmrl.rewards import REWARDS, build_reward  # noqa: E402
from mmrl.rewards.vqa import box_iou, extract_answer, match_key_steps, parse_box, step_tokens  # noqa: E402


def tag(ans: str, think: str = "reasoning") -> str:
    return f"<think>{think}</think><answer>{ans}</answer>"


def run(name: str, contexts, outputs, **params):
    reward = build_reward(name, params)
    out = reward(contexts, outputs)
    assert out.dtype == torch.float32 and out.shape == (len(outputs),)
    return out.tolist(), reward.metrics()


def test_registered():
    for name in ("answer_accuracy", "format", "iou", "length", "step_accuracy", "step_validity"):
        assert name in REWARDS


# ------------------------------------------------------------------ answer_accuracy

@pytest.mark.parametrize("gold,pred", [
    ("1/2", "0.5"), ("0.5", "\\frac{1}{2}"), ("\\frac{1}{2}", "1/2"), ("0.5", "1/2"),
    ("3", "3.0"), ("3.0", "3"), ("1000", "1,000"),
    ("\\{1,2\\}", "\\{2,1\\}"), ("{1,2}", "{2,1}"),
    ("[1,2)", "[1, 2)"), ("(0, 1]", "(0,1]"),
    ("\\sqrt{2}", "2^{1/2}"), ("\\frac{\\pi}{2}", "\\pi/2"), ("x^2+2x", "x(x+2)"),
    ("Paris", "paris."), ("the red car", "Red car"), ("yes", "\\text{Yes}"),
])
def test_math_and_text_equivalences(gold, pred):
    assert run("answer_accuracy", [{"answer": gold}], [tag(pred)])[0] == [1.0]


@pytest.mark.parametrize("gold,pred", [
    ("3", "4"), ("1/2", "0.49"), ("(0,1]", "[0,1]"), ("(1,2)", "(2,1)"), ("\\{1,2\\}", "\\{1,3\\}"),
    ("dog", "god"), ("cat", "act"),  # math-verify alone would read words as commuting symbols
    ("Paris", "London"),
])
def test_non_equivalences(gold, pred):
    rewards, m = run("answer_accuracy", [{"answer": gold}], [tag(pred)])
    assert rewards == [0.0] and m["wrong"] == 1.0


def test_boxed_and_last_answer_and_list_of_golds():
    ctx = [{"answer": "3"}] * 4 + [{"answer": ["2", "two"]}]
    outs = ["so \\boxed{3}", "<answer>4</answer> wait <answer>3</answer>",
            "\\boxed{\\frac{6}{2}}", "<answer>\\boxed{3}</answer>", tag("two")]
    assert run("answer_accuracy", ctx, outs)[0] == [1.0] * 5


def test_answer_format_param():
    ctx = [{"answer": "3"}] * 2
    outs = ["\\boxed{3}", tag("3")]
    rewards, m = run("answer_accuracy", ctx, outs, answer_format="tag")
    assert rewards == [0.0, 1.0] and m["no_answer_tag"] == 1.0
    rewards, m = run("answer_accuracy", ctx, outs, answer_format="boxed")
    assert rewards == [1.0, 0.0] and m["no_answer_tag"] == 1.0
    with pytest.raises(ValueError):
        build_reward("answer_accuracy", {"answer_format": "xml"})
    with pytest.raises(ValueError, match="unknown parameter 'bogus'; valid: answer_format, timeout_s"):
        build_reward("answer_accuracy", {"bogus": 1})  # a typo is one line naming the valid ones


def test_multiple_choice():
    ctx = {"answer": "B", "options": ["red", "green", "blue"]}
    right = ["B", "(B)", "B.", "b", "Option B", "option (b)", "green", "Green", "B. green", "(B) green",
             "The answer is B", "\\text{B}"]
    wrong = ["A", "(C)", "red", "B. red", "D"]
    replies = right + wrong + ["purple"]
    rewards, m = run("answer_accuracy", [ctx] * len(replies), [tag(a) for a in replies])
    assert rewards == [1.0] * len(right) + [0.0] * (len(wrong) + 1)
    assert m == {"correct": len(right), "wrong": len(wrong), "unparseable": 1.0, "no_answer_tag": 0.0}


def test_unreadable_replies_score_zero_with_reasons():
    ctx = [{"answer": "3"}] * 8
    outs = ["<answer>3", "just 3", "\\boxed{3", tag(""), tag("\\frac{"), None, tag("three"), tag("1+" * 600)]
    t0 = time.perf_counter()
    rewards, m = run("answer_accuracy", ctx, outs)
    assert rewards == [0.0] * 8
    assert m == {"correct": 0.0, "wrong": 0.0, "unparseable": 4.0, "no_answer_tag": 4.0}
    assert time.perf_counter() - t0 < 1.0  # the 1200-char answer is not sent to math-verify


def test_no_answer_tag_counted():
    rewards, m = run("answer_accuracy", [{"answer": "7"}], ["<think>it is 7</think> 7"], answer_format="tag")
    assert rewards == [0.0] and m["no_answer_tag"] == 1.0


def test_extract_answer_balanced_braces():
    assert extract_answer("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{1} then \\boxed{x^{2}}") == "x^{2}"
    assert extract_answer("\\boxed{1} then \\boxed{x^{2}") == "1"
    assert extract_answer("### The final answer is: 42", "header") == "42"
    assert extract_answer(" 5 ", "raw") == "5"


def test_works_outside_the_main_thread():
    """math-verify's signal timeouts fail off the main thread; the reward turns them off there."""
    reward = build_reward("answer_accuracy")
    result = {}

    def work():
        try:
            result["r"] = reward([{"answer": "1/2"}, {"answer": "3"}], [tag("0.5"), tag("4")]).tolist()
        except Exception as exc:  # pragma: no cover - the failure this test guards
            result["err"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert result == {"r": [1.0, 0.0]}


def grpo_batch(prompts: int = 32, group: int = 8):
    """A GRPO-shaped batch: per prompt 3 replies spell the answer one way, 2 another, 3 are wrong."""
    ctx, outs = [], []
    for i in range(prompts):
        a, b = i + 2, i + 3
        kind = i % 4
        if kind == 0:
            c, forms = {"answer": str(a)}, (str(a), f"{a}.0", f"{a + 1}")
        elif kind == 1:
            c, forms = {"answer": f"\\frac{{{a}}}{{{b}}}"}, (f"{a}/{b}", f"\\dfrac{{{a}}}{{{b}}}", f"{b}/{a}")
        elif kind == 2:
            c, forms = [
                ({"answer": f"\\sqrt{{{a}}}"}, (f"{a}^{{1/2}}", f"\\sqrt{{{a}}}", f"\\sqrt{{{b}}}")),
                ({"answer": f"\\{{{a},{b}\\}}"}, (f"\\{{{b},{a}\\}}", f"\\{{{a}, {b}\\}}", f"\\{{{a},{b + 1}\\}}")),
                ({"answer": f"[{a}, {b})"}, (f"[{a},{b})", f"[{a}, {b})", f"({a}, {b})")),
            ][(i // 4) % 3]
        else:
            c, forms = {"answer": "C", "options": ["cat", "dog", f"cow {i}", "owl"]}, ("(C)", f"cow {i}", "A")
        ctx += [c] * group
        outs += [tag(forms[0])] * 3 + [tag(forms[1])] * 2 + [tag(forms[2])] * (group - 5)
    return ctx, outs


def test_speed_256_replies():
    """256 replies of a GRPO batch (32 prompts x 8) in under 2 s, math-verify included."""
    reward = build_reward("answer_accuracy")
    reward([{"answer": "\\sqrt{2}"}], [tag("2^{1/2}")])  # import math_verify / sympy / antlr once
    ctx, outs = grpo_batch()
    t0 = time.perf_counter()
    rewards = reward(ctx, outs)
    elapsed = time.perf_counter() - t0
    assert rewards.tolist() == ([1.0] * 5 + [0.0] * 3) * 32
    assert elapsed < 2.0, f"256 replies took {elapsed:.2f}s"


# ------------------------------------------------------------------ format

def test_format_think_answer():
    outs = [
        "<think>a</think><answer>b</answer>",
        "  <think>\na\n</think>\n\n<answer> b </answer>\n",
        "<answer>b</answer><think>a</think>",
        "<think>a</think><think>c</think><answer>b</answer>",
        "<think>a</think><answer>b</answer></answer>",
        "<think>a</think>b",
        "Sure! <think>a</think><answer>b</answer>",
        "<think>a</think> so <answer>b</answer>",
        "<think>a<answer>b</answer></think>",
    ]
    rewards, m = run("format", [{}] * len(outs), outs)
    assert rewards == [1.0, 1.0] + [0.0] * 7
    assert m == {"ok": 2.0, "missing_tag": 1.0, "duplicate_tag": 2.0, "out_of_order": 2.0, "text_outside_tags": 2.0}


def test_format_boxed():
    outs = ["thus \\boxed{\\frac{1}{2}}.", "no box", "\\boxed{1} or \\boxed{2}", "\\boxed{\\frac{1}{2}"]
    rewards, m = run("format", [{}] * 4, outs, style="boxed")
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert m == {"ok": 1.0, "no_boxed": 1.0, "multiple_boxed": 1.0, "unbalanced_braces": 1.0}


# ------------------------------------------------------------------ iou

def test_box_iou_hand_computed():
    assert box_iou([0, 0, 2, 2], [1, 1, 3, 3]) == pytest.approx(1 / 7)  # inter 1, union 4 + 4 - 1
    assert box_iou([0, 0, 4, 2], [2, 0, 6, 2]) == pytest.approx(4 / 12)
    assert box_iou([0, 0, 1, 1], [2, 2, 3, 3]) == 0.0
    assert parse_box('{"bbox_2d": [10, 20.5, 30, 40], "label": "cat"}') == [10.0, 20.5, 30.0, 40.0]
    assert parse_box("(1,2),(3,4)") == [1.0, 2.0, 3.0, 4.0]
    assert parse_box("[1, 2, 3]") is None


def test_iou_reward():
    gold = {"bbox": [1, 1, 3, 3]}
    outs = [tag("[0, 0, 2, 2]"), tag("[1.0, 1.0, 3.0, 3.0]"), tag('{"bbox_2d": [5,5,6,6]}'),
            tag("[2, 2, 1, 1]"), tag("the cat"), "[1, 1, 3, 3]", tag("[1,1,3,3]")]
    ctx = [gold] * 6 + [{"answer": "x"}]
    rewards, m = run("iou", ctx, outs)
    assert rewards == pytest.approx([1 / 7, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert m["scored"] == 3.0 and m["invalid_box"] == 1.0 and m["unparseable"] == 1.0
    assert m["no_answer_tag"] == 1.0 and m["no_gold_box"] == 1.0
    assert m["mean_iou"] == pytest.approx((1 / 7 + 1.0) / 3)
    rewards, _ = run("iou", ctx[:3], outs[:3], threshold=0.5)
    assert rewards == [0.0, 1.0, 0.0]
    assert run("iou", [gold], ["[0, 0, 2, 2]"], answer_format="raw")[0] == pytest.approx([1 / 7])


# ------------------------------------------------------------------ length

def test_length_edges():
    outs = ["", "x" * 10, "x" * 11, "x" * 15, "x" * 20, "x" * 35]
    rewards, m = run("length", [{}] * 6, outs, target_chars=10, max_chars=20)
    assert rewards == pytest.approx([0.0, 0.0, -0.1, -0.5, -1.0, -1.0])
    assert m["over_target"] == 4.0 and m["at_max"] == 2.0 and m["mean_chars"] == pytest.approx(91 / 6)
    for bad in ({"target_chars": 20, "max_chars": 20}, {"target_chars": -1, "max_chars": 5}):
        with pytest.raises(ValueError):
            build_reward("length", bad)


# ------------------------------------------------------------------ StepRAR / StepRVR

def test_step_tokens_and_matching():
    assert step_tokens("Area = 12.0 cm, x=1,000") == ["area", "=", "12", "cm", "x", "=", "1000"]
    assert step_tokens("$0.50$") == ["0.5"]
    found, ordered = match_key_steps("x = 15 and y=2", ["x = 5", "y = 2"])
    assert (found, ordered) == (1, True)  # "5" does not match inside "15"
    assert match_key_steps("first b = 2, then a = 1", ["a = 1", "b = 2"]) == (2, False)
    assert match_key_steps("a = 1 then b = 2", ["a = 1", "b = 2"]) == (2, True)
    assert match_key_steps("the radius is r", [["radius 3", "radius is r"]]) == (1, True)  # alternatives


KEY = ["area = 12", "x = 5", "triangle"]
REASON = "The Area = 12.0 here. So x=5."  # 2 of the 3 key steps; "triangle" missing


def test_step_accuracy_paper_rule():
    ctx = [{"answer": "5", "key_steps": KEY}] * 4 + [{"answer": "5"}]
    outs = [tag("5", REASON), tag("6", REASON), f"<think>{REASON}</think>", tag("5.0", "no steps"), tag("5", REASON)]
    rewards, m = run("step_accuracy", ctx, outs)
    assert rewards == pytest.approx([1 + 0.1 * 2 / 3, 0.1 * 2 / 3, 0.0, 1.0, 1.0])
    assert m["correct"] == 3.0 and m["wrong"] == 1.0 and m["no_answer_tag"] == 1.0 and m["no_key_steps"] == 1.0
    assert m["mean_match"] == pytest.approx((2 / 3 + 2 / 3 + 0) / 3)
    rewards, _ = run("step_accuracy", ctx[:1], outs[:1], alpha=0.5)
    assert rewards == pytest.approx([1 + 0.5 * 2 / 3])
    # without <think>, the reasoning is the text before the final answer
    assert run("step_accuracy", ctx[:1], [REASON + " \\boxed{5}"])[0] == pytest.approx([1 + 0.1 * 2 / 3])


def test_step_validity_think_answer():
    ctx = [{"answer": "5", "key_steps": ["a = 1", "b = 2"]}]
    good = tag("5", "Step 1: a = 1\nStep 2: b = 2")
    outs = [
        good,
        tag("5", "Step 1: a = 1\nStep 3: b = 2"),  # steps skip a number
        tag("5", "   "),  # no reasoning
        "<think>Step 1: a = 1</think>",  # no final answer
        "<answer>5</answer><think>Step 1: a = 1</think>",  # answer before reasoning
        tag("5", "Step 1: b = 2\nStep 2: a = 1"),  # key steps out of order
        "a = 1, b = 2, so \\boxed{5}",
    ]
    rewards, m = run("step_validity", ctx * len(outs), outs)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert m == {"valid": 2.0, "incomplete": 2.0, "illogical": 2.0, "out_of_order_steps": 1.0}
    assert run("step_validity", ctx, [outs[5]], key_step_order=False)[0] == [1.0]


R1VL_GOOD = ("### Image Description:\nA triangle with base 4 and height 6.\n### Rationales:\nArea of a triangle.\n"
             "### Let's think step by step.\n### Step 1:\nArea = 1/2 * 4 * 6\n### Step 2:\nArea = 12\n"
             "### The final answer is: 12")


def test_step_validity_r1vl_template():
    outs = [
        R1VL_GOOD,
        R1VL_GOOD.replace("### Rationales:", "### Notes:"),  # incomplete
        R1VL_GOOD.replace("### Step 2:", "### Step 3:"),  # numbering
        "### The final answer is: 12\n" + R1VL_GOOD.replace("### The final answer is: 12", "### Step 3:\nx"),
        R1VL_GOOD.replace(  # rationales before the image description
            "### Image Description:\nA triangle with base 4 and height 6.\n### Rationales:\nArea of a triangle.\n",
            "### Rationales:\nArea of a triangle.\n### Image Description:\nA triangle.\n"),
    ]
    ctx = [{"answer": "12", "key_steps": ["base 4", "area = 12"]}] * len(outs)
    rewards, m = run("step_validity", ctx, outs, template="r1vl")
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert m["valid"] == 1.0 and m["incomplete"] == 1.0 and m["illogical"] == 3.0
    # StepRAR on the R1-VL template, reading its final-answer header
    assert run("step_accuracy", ctx[:1], [R1VL_GOOD], answer_format="header")[0] == pytest.approx([1.1])


# ------------------------------------------------------------------ batches and state

def test_mixed_batch_is_float32_vector():
    ctx = [{"answer": "1/2"}, {"answer": "B", "options": ["x", "y"]}, {"answer": "3"}, {"answer": "dog"},
           {"answer": "3"}]
    outs = [tag("0.5"), tag("(B)"), "nothing", tag("Dog"), tag("[1,2,3")]
    for name in ("answer_accuracy", "format", "iou", "length", "step_accuracy", "step_validity"):
        reward = build_reward(name)
        out = reward(ctx, outs)
        assert out.dtype == torch.float32 and out.shape == (5,)
        assert all(isinstance(v, float) for v in reward.metrics().values())
        assert reward.state_dict() == {}
    assert build_reward("answer_accuracy")(ctx, outs).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
