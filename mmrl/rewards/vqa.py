"""Verifiable rewards for image question answering (the R1-V / EasyR1 / VLM-R1 / R1-VL workflow).

`outputs` are decoded reply strings; `contexts` are dicts with
  - "answer": the reference answer (str; a list of str accepts any of them). With "options" it is
    the letter of the right option ("A".."Z").
  - "options" (optional): the option texts of a multiple-choice question, in letter order.
  - "bbox" (optional): the reference box [x1, y1, x2, y2] for grounding (`iou`), in the same
    coordinate frame the model answers in.
  - "key_steps" (optional): the reference reasoning's key steps for R1-VL's StepRAR / StepRVR;
    each a string, or a list of equivalent strings (R1-VL's augmented key steps).

Replies are `<think>...</think><answer>...</answer>` or hold a `\\boxed{...}`. Every reward here is a
`Reward` whose `metrics()` counts the outcomes of its last call (logged as reward/<name>/<key>); a
reply that cannot be read scores 0 with a counted reason and never raises (a malformed record, e.g.
a multiple-choice answer that is neither an option letter nor an option text, raises ValueError).

Registered names and parameters:
  answer_accuracy  answer_format="either", timeout_s=5
  format           style="think_answer"
  iou              threshold=0.0, answer_format="either"
  length           target_chars=1024, max_chars=2048
  step_accuracy    alpha=0.1, answer_format="either", timeout_s=5
  step_validity    template="think_answer", key_step_order=True, answer_format="either"

`answer_format` picks where the final answer is read: "tag" (the last <answer>...</answer>),
"boxed" (the last balanced \\boxed{...}), "either" (tag, else boxed), "header" (what follows R1-VL's
last "### The final answer is:"), "raw" (the whole reply).
"""

from __future__ import annotations

import importlib.util
import re
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

import torch

from mmrl.config_checks import ConfigError
from mmrl.rewards import Reward, register_reward

ANSWER_FORMATS = ("tag", "boxed", "either", "header", "raw")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_TAG = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\s*\{")
_HEADER = "### The final answer is:"
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def check_choice(value: Any, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


# ---------------------------------------------------------------- answer extraction

def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` with balanced braces, in order (unbalanced ones skipped)."""
    found = []
    for m in _BOXED.finditer(text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[start:i])
                    break
    return found


def extract_answer(text: str, answer_format: str = "either") -> str | None:
    """The reply's final answer (stripped), or None when the reply has none in `answer_format`.

    A `\\boxed{}` inside an <answer> tag is unwrapped, so `<answer>\\boxed{3}</answer>` reads as "3".
    """
    if not isinstance(text, str):
        return None
    ans = None
    if answer_format in ("tag", "either"):
        tags = _ANSWER_TAG.findall(text)
        if tags:
            ans = tags[-1]
            inner = boxed_contents(ans)
            if inner:
                ans = inner[-1]
    if ans is None and answer_format in ("boxed", "either"):
        boxes = boxed_contents(text)
        if boxes:
            ans = boxes[-1]
    if answer_format == "header":
        at = text.rfind(_HEADER)
        if at >= 0:
            ans = text[at + len(_HEADER):]
    if answer_format == "raw":
        ans = text
    return None if ans is None else ans.strip()


def reasoning_text(text: str, answer_format: str = "either") -> str:
    """The reasoning part of a reply: the last <think> block when there is one, else the text
    before the final answer (before R1-VL's final-answer header, the last <answer>, or the last
    \\boxed)."""
    thinks = _THINK_TAG.findall(text)
    if thinks:
        return thinks[-1]
    cut = len(text)
    if answer_format == "header" and text.rfind(_HEADER) >= 0:
        cut = text.rfind(_HEADER)
    elif answer_format in ("tag", "either") and text.rfind("<answer>") >= 0:
        cut = text.rfind("<answer>")
    elif answer_format in ("boxed", "either") and text.rfind("\\boxed") >= 0:
        cut = text.rfind("\\boxed")
    return text[:cut]


# ---------------------------------------------------------------- answer comparison

_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_LATEX_CMD = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")
_MATH_WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "sqrt", "pi", "inf", "infty", "oo"}
_ARTICLE = re.compile(r"^(?:the|a|an)\s+")


def normalize_text(s: str) -> str:
    """Lower case, \\text{..} unwrapped, $ dropped, whitespace collapsed, a leading article and
    trailing full stops dropped: the plain string comparison's canonical form."""
    s = _TEXT_CMD.sub(r"\1", str(s))
    s = s.replace("$", "").replace("\\(", "").replace("\\)", "").strip().lower()
    s = re.sub(r"\s+", " ", s).rstrip(" .").strip()
    return _ARTICLE.sub("", s)


def is_textual(s: str) -> bool:
    """Whether an answer is words ("red", "Paris") rather than math: math-verify reads a word as a
    product of one-letter symbols ("dog" == "god"), so words are compared as strings only."""
    s = _LATEX_CMD.sub(" ", _TEXT_CMD.sub(r"\1", str(s)))
    return any(w.lower() not in _MATH_WORDS for w in _WORD.findall(s))


def _timeouts_allowed() -> bool:
    # math-verify's timeouts use signal.alarm, which only the main thread may set
    return threading.current_thread() is threading.main_thread()


class MathJudge:
    """math-verify with its signal timeouts on in the main thread and off elsewhere, parses cached."""

    def __init__(self, timeout_s: int = 5):
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError("the VQA rewards need math-verify: pip install 'mmrl[vision]' (or math-verify)")
        self.timeout_s = int(timeout_s) if timeout_s else None
        self.cache: dict[str, list] = {}  # parses, and verdicts by (gold, reply): a group repeats both
        self.verdicts: dict[tuple[str, str], str] = {}

    def _timeout(self) -> int | None:
        return self.timeout_s if self.timeout_s and _timeouts_allowed() else None

    def parse(self, s: str) -> list:
        """math-verify's parse of `s` (as inline LaTeX, then as plain text): [] when it yields no
        sympy expression."""
        if s in self.cache:
            return self.cache[s]
        from math_verify import parse
        from sympy import Basic, MatrixBase

        out: list = []
        body = s.strip().strip("$").strip()
        for cand in (f"${body}$", body):
            try:
                got = parse(cand, parsing_timeout=self._timeout())
            except BaseException as exc:  # noqa: BLE001  (TimeoutException is a BaseException)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                got = []
            if any(isinstance(g, (Basic, MatrixBase)) for g in got):
                out = got
                break
        if len(self.cache) > 4096:
            self.cache.clear()
        self.cache[s] = out
        return out

    def verify(self, gold: list, pred: list) -> bool:
        from math_verify import verify

        try:
            return bool(verify(gold, pred, timeout_seconds=self._timeout()))
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return False


MAX_MATH_CHARS = 1000  # longer answers are not sent to math-verify (its parse time grows with length)
_DEC = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+"
_PLAIN_NUM = re.compile(rf"^(?:{_DEC})$")
_PLAIN_FRAC = re.compile(r"^([+-]?)(?:\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}|(\d+)\s*/\s*(\d+))$")


def plain_number(s: str) -> tuple[Fraction, bool] | None:
    """(value, written as a decimal) for a plain number: an integer or decimal (thousands commas
    allowed), `a/b` or `\\frac{a}{b}`; None for anything else."""
    s = s.strip().strip("$").strip()
    if _PLAIN_NUM.match(s):
        return Fraction(s.replace(",", "")), "." in s
    m = _PLAIN_FRAC.match(s)
    if m is None:
        return None
    num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
    if int(den) == 0:
        return None
    return Fraction(int(num), int(den)) * (-1 if m.group(1) == "-" else 1), False


# Units a quantity may end with: spelling -> canonical name. Lengths also come squared / cubed
# ("cm^2", "cm²", "square cm", "cubic cm"). Matched case-insensitively, after \\text{} unwrapping.
_LENGTHS = {"mm": ("mm", "millimeter", "millimeters", "millimetre", "millimetres"),
            "cm": ("cm", "centimeter", "centimeters", "centimetre", "centimetres"),
            "m": ("m", "meter", "meters", "metre", "metres"),
            "km": ("km", "kilometer", "kilometers", "kilometre", "kilometres"),
            "in": ("in", "inch", "inches"), "ft": ("ft", "foot", "feet"), "yd": ("yd", "yard", "yards"),
            "mi": ("mi", "mile", "miles"), "unit": ("unit", "units")}
_OTHER_UNITS = {"°": ("°", "^\\circ", "^{\\circ}", "\\circ", "degree", "degrees", "deg"),
                "%": ("%", "\\%", "percent"), "rad": ("rad", "radian", "radians"),
                "g": ("g", "gram", "grams"), "kg": ("kg", "kilogram", "kilograms"),
                "lb": ("lb", "lbs", "pound", "pounds"), "s": ("s", "sec", "second", "seconds"),
                "min": ("min", "minute", "minutes"), "h": ("h", "hr", "hour", "hours"), "day": ("day", "days"),
                "year": ("year", "years"), "dollar": ("dollar", "dollars"), "cent": ("cent", "cents")}


def _unit_spellings() -> dict[str, str]:
    out: dict[str, str] = {}
    for canon, names in _OTHER_UNITS.items():
        out.update({n.lower(): canon for n in names})
    for canon, names in _LENGTHS.items():
        for n in names:
            out[n] = canon
            for power, marks in ((2, ("^2", "^{2}", "²")), (3, ("^3", "^{3}", "³"))):
                out.update({f"{n}{m}": f"{canon}^{power}" for m in marks})
            out[f"square {n}"] = out[f"sq {n}"] = f"{canon}^2"
            out[f"cubic {n}"] = f"{canon}^3"
    return out


UNITS = _unit_spellings()
# The unit must not continue a word ("5 x cm" keeps "x"): an alphabetic unit follows no letter or backslash.
_UNIT_AT_END = re.compile(
    r"^(?P<value>.*?)\s*(?<![A-Za-z\\])(?P<unit>"
    + "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True)) + r")\s*\.?$", re.IGNORECASE)
_SPACING = re.compile(r"\\[,;:! ]|~")
_LABEL = re.compile(r"^\s*[A-Za-z][A-Za-z ]*[A-Za-z]\s*=\s*")  # "Area = 113.1 cm^2": the name of the quantity
_MATH_READS_UNIT = {"°", "%"}  # math-verify reads these itself ("25%" == "0.25")


def split_unit(s: str) -> tuple[str, str] | None:
    """(quantity, canonical unit) for a quantity followed by a unit ("12 cm" -> ("12", "cm"),
    "3 \\text{cm}^2" -> ("3", "cm^2"), "60 degrees" -> ("60", "°"), "Area = 9 \\pi cm^2" -> ("9 \\pi",
    "cm^2"): a leading name of two letters or more and "=" is dropped); None when `s` does not end with a
    known unit after a number (`UNITS`). A one-letter unit (m, g, s, h) counts only after a plain
    number and a space ("12 m"), so algebra such as "3m" or "2x m" stays whole."""
    text = _SPACING.sub(" ", _TEXT_CMD.sub(r"\1", str(s))).replace("$", "").strip()
    text = re.sub(r"\s+(?=\^)", "", text)  # "\\text { units }^2" -> "units^2"
    m = _UNIT_AT_END.match(text)
    if m is None:
        return None
    value, unit = _LABEL.sub("", m.group("value")).strip(), UNITS[re.sub(r"\s+", " ", m.group("unit").lower())]
    if not value or is_textual(value) or not re.search(r"\d|\\pi|\\sqrt", value):
        return None
    if len(m.group("unit")) == 1 and m.group("unit").isalpha():  # "12 m" is metres, "3m" may be 3 times m
        spaced = text[: m.start("unit")].endswith((" ", "\t"))
        if not spaced or plain_number(value) is None:
            return None
    return value, unit


def compare_open(pred: str, gold: str, judge: MathJudge) -> str:
    """'correct', 'wrong' or 'unparseable' for an open answer.

    Equal normalised strings are correct. A gold quantity with a unit ("12 cm", "90 degrees", "3
    square units"; `split_unit`) compares by its quantity: a reply with the same quantity, bare or
    with the same unit, is correct, one with another unit or another quantity wrong (no unit
    conversion). A textual gold (words) is otherwise compared only as a string. Math golds go
    through math-verify ("0.5" == "1/2" == "\\frac{1}{2}", "{1,2}" == "{2,1}", intervals, LaTeX);
    plain numbers on both sides compare directly (`plain_number`); when math-verify cannot parse a
    side the string comparison stands, and a reply it cannot parse (or words without a number, or
    over MAX_MATH_CHARS) is 'unparseable'.
    """
    if normalize_text(pred) == normalize_text(gold) and normalize_text(gold):
        return "correct"
    gold_unit = split_unit(gold)
    if gold_unit is not None:
        pred_unit = split_unit(pred)
        if pred_unit is not None and pred_unit[1] != gold_unit[1]:
            return "wrong"
        verdict = compare_open(pred if pred_unit is None else pred_unit[0], gold_unit[0], judge)
        # "°" and "%" golds also go to math-verify below, which reads them ("25%" == "0.25")
        if verdict == "correct" or gold_unit[1] not in _MATH_READS_UNIT:
            return verdict
    if is_textual(gold):
        return "wrong"
    gn, pn = plain_number(gold), plain_number(pred)
    if gn is not None and pn is not None:
        # plain numbers skip the (slow) LaTeX parser and compare as math-verify does: rounded to
        # its 6 decimals when either side is written as a decimal, exactly otherwise
        if gn[1] or pn[1]:
            return "correct" if round(gn[0], 6) == round(pn[0], 6) else "wrong"
        return "correct" if gn[0] == pn[0] else "wrong"
    if len(pred) > MAX_MATH_CHARS or (is_textual(pred) and not re.search(r"\d", pred)):
        return "unparseable"  # words without numbers, or too long to be a final answer: no math to read
    key = (gold, pred)
    if key not in judge.verdicts:
        g, p = judge.parse(gold), judge.parse(pred)
        if len(judge.verdicts) > 4096:
            judge.verdicts.clear()
        judge.verdicts[key] = "unparseable" if not p else "wrong" if not g else (
            "correct" if judge.verify(g, p) else "wrong")
    return judge.verdicts[key]


_LETTER_ONLY = re.compile(
    r"^(?:the\s+)?(?:correct\s+)?(?:(?:option|answer|choice)\s*(?:is\s*)?[:\-]?\s*)?"
    r"[\(\[]?([A-Za-z])[\)\]]?\s*[.:)]?$", re.IGNORECASE)
_LETTER_TEXT = re.compile(r"^(?:(?:option|answer|choice)\s*)?[\(\[]?([A-Za-z])(?:[\)\]]\s*[.:]?|[.:])\s+(.+)$",
                          re.IGNORECASE | re.DOTALL)


def _plain(s: str) -> str:
    return normalize_text(s).strip("*").strip()


def compare_choice(pred: str, gold: str, options: list[str]) -> str:
    """'correct', 'wrong' or 'unparseable' for a multiple-choice answer: the letter ("B", "(B)",
    "B.", "Option B"), "B. <option text>", or the option text itself, case-insensitive."""
    opts = [_plain(o) for o in options]
    g = _LETTER_ONLY.match(_plain(gold))
    if g is not None and ord(g.group(1).upper()) - 65 < len(options):
        want = ord(g.group(1).upper()) - 65
    elif _plain(gold) in opts:
        want = opts.index(_plain(gold))
    else:
        raise ValueError(f"multiple-choice answer {gold!r} is neither an option letter nor an option text")
    p = _plain(pred)
    if p in opts:  # the option text itself (checked first: an option may be a single letter)
        return "correct" if opts.index(p) == want else "wrong"
    m = _LETTER_ONLY.match(p)
    if m is not None:
        got = ord(m.group(1).upper()) - 65
        return "correct" if got == want else "wrong"
    m = _LETTER_TEXT.match(p)
    if m is not None:
        got = ord(m.group(1).upper()) - 65
        text_ok = got < len(opts) and _plain(m.group(2)) == opts[got]
        return "correct" if got == want and text_ok else "wrong"
    return "unparseable"


def judge_answer(ctx: dict, answer: str, judge: MathJudge) -> str:
    """'correct', 'wrong' or 'unparseable' for an extracted answer against the record."""
    if not answer:
        return "unparseable"
    options = ctx.get("options")
    if options:
        return compare_choice(answer, str(ctx["answer"]), list(options))
    golds = ctx["answer"] if isinstance(ctx["answer"], (list, tuple)) else [ctx["answer"]]
    verdicts = [compare_open(answer, str(g), judge) for g in golds]
    if "correct" in verdicts:
        return "correct"
    return "wrong" if "wrong" in verdicts else "unparseable"


class Counting(Reward):
    """A reward counting the outcome of each reply of its last call: a subclass scores one reply
    in `_one(context, reply)` (counting its outcome) and resets any other per-call state in `_reset`."""

    REASONS: tuple[str, ...] = ()

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.counts = dict.fromkeys(self.REASONS, 0)

    def _one(self, ctx: dict, text: str) -> float:
        raise NotImplementedError

    def __call__(self, contexts: list[dict], outputs: list[str]) -> torch.Tensor:
        self._reset()
        return torch.tensor([self._one(c, o) for c, o in zip(contexts, outputs, strict=True)], dtype=torch.float32)

    def _count(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counts.items()}

    def counted_metrics(self) -> tuple[str, ...]:
        return tuple(self.counts)


@register_reward("answer_accuracy")
class AnswerAccuracy(Counting):
    """1 when the reply's final answer matches the record's, else 0 (R1-V / EasyR1 accuracy reward).

    The answer is the last <answer>...</answer>, else the last balanced \\boxed{...}
    (`answer_format`). Open answers compare as math with math-verify (numbers, fractions, LaTeX,
    sets, intervals), words as normalised strings; multiple choice accepts the letter in the usual
    spellings or the option text. `timeout_s` bounds each math-verify parse/compare in the main
    thread (signal based; off in other threads). Metrics: correct, wrong, unparseable, no_answer_tag.
    """

    REASONS = ("correct", "wrong", "unparseable", "no_answer_tag")

    def __init__(self, answer_format: str = "either", timeout_s: int = 5):
        check_choice(answer_format, ANSWER_FORMATS, "answer_accuracy.answer_format")
        super().__init__()
        self.answer_format, self.judge = answer_format, MathJudge(timeout_s)

    def _one(self, ctx: dict, text: str) -> float:
        ans = extract_answer(text, self.answer_format)
        verdict = "no_answer_tag" if ans is None else judge_answer(ctx, ans, self.judge)
        self._count(verdict)
        return float(verdict == "correct")


@register_reward("format")
class Format(Counting):
    """1 for a well-formed reply, else 0.

    style="think_answer": <think>, </think>, <answer>, </answer> each exactly once, in that order,
    and nothing but whitespace outside the two blocks. style="boxed": exactly one \\boxed{...} with
    balanced braces. Metrics: ok, missing_tag, duplicate_tag, out_of_order, text_outside_tags
    (think_answer); ok, no_boxed, multiple_boxed, unbalanced_braces (boxed).
    """

    STYLES = ("think_answer", "boxed")
    _FULL = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)

    def __init__(self, style: str = "think_answer"):
        check_choice(style, self.STYLES, "format.style")
        self.style = style
        self.REASONS = (("ok", "missing_tag", "duplicate_tag", "out_of_order", "text_outside_tags")
                        if style == "think_answer" else ("ok", "no_boxed", "multiple_boxed", "unbalanced_braces"))
        super().__init__()

    def check(self, text: str) -> str:
        if not isinstance(text, str):
            return "missing_tag" if self.style == "think_answer" else "no_boxed"
        if self.style == "boxed":
            n = len(_BOXED.findall(text))
            if n == 0:
                return "no_boxed"
            if n > 1:
                return "multiple_boxed"
            return "ok" if len(boxed_contents(text)) == 1 else "unbalanced_braces"
        counts = [text.count(t) for t in _TAGS]
        if min(counts) == 0:
            return "missing_tag"
        if max(counts) > 1:
            return "duplicate_tag"
        pos = [text.index(t) for t in _TAGS]
        if pos != sorted(pos):
            return "out_of_order"
        return "ok" if self._FULL.fullmatch(text) else "text_outside_tags"

    def _one(self, ctx: dict, text: str) -> float:
        reason = self.check(text)
        self._count(reason)
        return float(reason == "ok")


_NUM = r"(-?\d+(?:\.\d+)?)"
_BOX_LIST = re.compile(rf"\[\s*{_NUM}\s*,\s*{_NUM}\s*,\s*{_NUM}\s*,\s*{_NUM}\s*\]")
_BOX_PAIRS = re.compile(rf"\(\s*{_NUM}\s*,\s*{_NUM}\s*\)\s*,?\s*\(\s*{_NUM}\s*,\s*{_NUM}\s*\)")


def parse_box(text: str) -> list[float] | None:
    """The first box in `text`: `[x1, y1, x2, y2]` (ints or floats, e.g. inside Qwen2.5-VL's
    {"bbox_2d": [...]}) or `(x1, y1), (x2, y2)`; None when there is none."""
    hits = [m for m in (_BOX_LIST.search(text), _BOX_PAIRS.search(text)) if m is not None]
    if not hits:
        return None
    m = min(hits, key=lambda h: h.start())
    return [float(v) for v in m.groups()]


def box_iou(a: list[float], b: list[float]) -> float:
    """Intersection over union of two [x1, y1, x2, y2] boxes (0 when the union is empty)."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


@register_reward("iou")
class IoU(Counting):
    """IoU of the answer's box with the record's "bbox" (VLM-R1's grounding reward).

    The box is read from the final answer (`answer_format`, "raw" for the whole reply). With
    `threshold` > 0 the reward is 1 when IoU >= threshold, else 0. A box with x2 <= x1 or y2 <= y1
    scores 0 (invalid_box); a record without "bbox" scores 0 (no_gold_box). Metrics: scored,
    mean_iou (over scored replies), no_answer_tag, unparseable, invalid_box, no_gold_box.
    """

    REASONS = ("scored", "no_answer_tag", "unparseable", "invalid_box", "no_gold_box")

    def __init__(self, threshold: float = 0.0, answer_format: str = "either"):
        check_choice(answer_format, ANSWER_FORMATS, "iou.answer_format")
        if not 0.0 <= float(threshold) <= 1.0:
            raise ConfigError(f"iou.threshold must be in [0, 1], got {threshold}")
        super().__init__()
        self.threshold, self.answer_format = float(threshold), answer_format

    def _reset(self) -> None:
        super()._reset()
        self.ious: list[float] = []

    def _one(self, ctx: dict, text: str) -> float:
        gold = ctx.get("bbox")
        if gold is None or len(gold) != 4:
            self._count("no_gold_box")
            return 0.0
        ans = extract_answer(text, self.answer_format)
        if ans is None:
            self._count("no_answer_tag")
            return 0.0
        box = parse_box(ans)
        if box is None:
            self._count("unparseable")
            return 0.0
        if box[2] <= box[0] or box[3] <= box[1]:
            self._count("invalid_box")
            return 0.0
        iou = box_iou(box, [float(v) for v in gold])
        self._count("scored")
        self.ious.append(iou)
        return float(iou >= self.threshold) if self.threshold > 0 else iou

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "mean_iou": sum(self.ious) / len(self.ious) if self.ious else 0.0}

    def metric_weights(self) -> dict[str, float]:
        return {"mean_iou": float(len(self.ious))}


@register_reward("length")
class Length(Counting):
    """A length penalty on the reply's characters: 0 up to `target_chars`, then linear down to -1
    at `max_chars`, and -1 beyond. Add it with a small weight next to the accuracy reward to curb
    runaway reasoning. Metrics: mean_chars, over_target, at_max."""

    REASONS = ("over_target", "at_max")

    def __init__(self, target_chars: int = 1024, max_chars: int = 2048):
        if not 0 <= int(target_chars) < int(max_chars):
            raise ConfigError(f"length: need 0 <= target_chars < max_chars, got {target_chars}, {max_chars}")
        super().__init__()
        self.target, self.max = int(target_chars), int(max_chars)

    def _reset(self) -> None:
        super()._reset()
        self.lengths: list[int] = []

    def _one(self, ctx: dict, text: str) -> float:
        n = len(text) if isinstance(text, str) else 0
        self.lengths.append(n)
        if n > self.target:
            self._count("over_target")
        if n >= self.max:
            self._count("at_max")
        return -min(1.0, max(0, n - self.target) / (self.max - self.target))

    def metrics(self) -> dict[str, float]:
        mean_chars = sum(self.lengths) / len(self.lengths) if self.lengths else 0.0
        return {**super().metrics(), "mean_chars": mean_chars}

    def metric_weights(self) -> dict[str, float]:
        return {"mean_chars": float(len(self.lengths))}


# ---------------------------------------------------------------- R1-VL's StepGRPO rewards

_TOKEN = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d*\.\d+|\d+|[^\W\d_]+|[^\s\w]", re.UNICODE)
_DROP = set(".,;:!?\"'`*")


def _canon_number(tok: str) -> str:
    try:
        d = Decimal(tok.replace(",", ""))
    except InvalidOperation:
        return tok
    return str(int(d)) if d == d.to_integral_value() else format(d.normalize(), "f")


def step_tokens(text: str) -> list[str]:
    """Tokens for key-step matching: lower case, $ dropped, numbers canonical ("3.0" -> "3",
    "1,000" -> "1000", "0.50" -> "0.5"), words, and single symbols (punctuation dropped), so
    "x = 5" matches "x=5" and "5" does not match inside "15"."""
    text = text.lower().replace("$", " ").replace("\\(", " ").replace("\\)", " ")
    out = []
    for t in _TOKEN.findall(text):
        if t[0].isdigit() or (t[0] == "." and len(t) > 1):
            out.append(_canon_number(t))
        elif t not in _DROP:
            out.append(t)
    return out


def _find(hay: list[str], needle: list[str], start: int = 0) -> int:
    """First index >= start where `needle` occurs contiguously in `hay`, or -1."""
    n = len(needle)
    if n == 0:
        return -1
    first = needle[0]
    for i in range(start, len(hay) - n + 1):
        if hay[i] == first and hay[i:i + n] == needle:
            return i
    return -1


def _alternatives(step: Any) -> list[list[str]]:
    alts = step if isinstance(step, (list, tuple)) else [step]
    return [t for t in (step_tokens(str(a)) for a in alts) if t]


def match_key_steps(reasoning: str, key_steps: list) -> tuple[int, bool]:
    """(number of key steps found in `reasoning`, whether the found ones appear in key_steps order).

    A key step is found when any of its alternatives occurs as a contiguous token run (see
    `step_tokens`). Order: scanning key_steps in order, each found step must occur at or after the
    previous found step's occurrence.
    """
    hay = step_tokens(reasoning)
    matched, ordered, cursor = 0, True, 0
    for step in key_steps:
        alts = _alternatives(step)
        if not any(_find(hay, a) >= 0 for a in alts):
            continue
        matched += 1
        after = [p for p in (_find(hay, a, cursor) for a in alts) if p >= 0]
        if after:
            cursor = min(after)
        else:
            ordered = False
    return matched, ordered


@register_reward("step_accuracy")
class StepAccuracy(Counting):
    """R1-VL's step-wise reasoning accuracy reward, StepRAR (Zhang et al. 2025, arXiv 2503.12937, §3.2).

    With K the record's key steps and k the number found in the reply's reasoning by soft
    key-step matching (`match_key_steps`: normalised tokens, numbers as numbers, any of a step's
    equivalent alternatives):
        r = 1 + alpha * k / |K|   when the final answer is correct,
        r =     alpha * k / |K|   when there is a final answer but it is wrong,
        r = 0                     when the reply has no final answer.
    alpha = 0.1 as in the paper (R1-VL's released accuracy reward adds 0.1 x the match ratio to the
    0/1 answer reward). A record without key steps gives the answer term alone (no_key_steps).
    The answer is judged as `answer_accuracy` does. Metrics: correct, wrong, unparseable,
    no_answer_tag, no_key_steps, mean_match (mean k/|K| over replies with an answer and key steps).
    """

    REASONS = ("correct", "wrong", "unparseable", "no_answer_tag", "no_key_steps")

    def __init__(self, alpha: float = 0.1, answer_format: str = "either", timeout_s: int = 5):
        check_choice(answer_format, ANSWER_FORMATS, "step_accuracy.answer_format")
        if float(alpha) < 0:
            raise ConfigError(f"step_accuracy.alpha must be >= 0, got {alpha}")
        super().__init__()
        self.alpha, self.answer_format, self.judge = float(alpha), answer_format, MathJudge(timeout_s)

    def _reset(self) -> None:
        super()._reset()
        self.ratios: list[float] = []

    def _one(self, ctx: dict, text: str) -> float:
        ans = extract_answer(text, self.answer_format)
        if ans is None:
            self._count("no_answer_tag")
            return 0.0
        verdict = judge_answer(ctx, ans, self.judge)
        self._count(verdict)
        key_steps = ctx.get("key_steps") or []
        if not key_steps:
            self._count("no_key_steps")
            ratio = 0.0
        else:
            ratio = match_key_steps(reasoning_text(text, self.answer_format), key_steps)[0] / len(key_steps)
            self.ratios.append(ratio)
        return float(verdict == "correct") + self.alpha * ratio

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "mean_match": sum(self.ratios) / len(self.ratios) if self.ratios else 0.0}

    def metric_weights(self) -> dict[str, float]:
        return {"mean_match": float(len(self.ratios))}


_R1VL_SECTIONS = ("### Image Description:", "### Rationales:", "### Step 1:", _HEADER)
_R1VL_STEP = re.compile(r"### Step (\d+):")
_STEP = re.compile(r"(?im)^\s*(?:#+\s*|\*\*)?step\s*(\d+)\b")


@register_reward("step_validity")
class StepValidity(Counting):
    """R1-VL's step-wise reasoning validity reward, StepRVR (Zhang et al. 2025, arXiv 2503.12937, §3.2):
    1 when the reply is both complete and logical, else 0.

    The paper's rule, for its template (`template="r1vl"`): *completeness* = the reply holds a
    background analysis (### Image Description:, ### Rationales:), a step-by-step reasoning (### Step
    1: ...) and a final answer (### The final answer is:); *logic* = these come in that order, the
    steps are numbered 1, 2, ... consecutively and the final answer follows the last step.

    For tagged replies (`template="think_answer"`): completeness = a non-empty reasoning part
    (<think>, or text before the answer) and a final answer (`answer_format`); logic = the answer
    follows the reasoning and any numbered steps ("Step 1", "Step 2", ...) run 1, 2, ...

    `key_step_order` (on by default; off gives the paper's rule exactly) adds to the logic check
    that the key steps found in the reasoning (as `step_accuracy` matches them) appear in the order
    of the record's key_steps. Metrics: valid, incomplete, illogical, out_of_order_steps.
    """

    TEMPLATES = ("think_answer", "r1vl")
    REASONS = ("valid", "incomplete", "illogical", "out_of_order_steps")

    def __init__(self, template: str = "think_answer", key_step_order: bool = True, answer_format: str = "either"):
        check_choice(template, self.TEMPLATES, "step_validity.template")
        check_choice(answer_format, ANSWER_FORMATS, "step_validity.answer_format")
        super().__init__()
        self.template, self.key_step_order, self.answer_format = template, bool(key_step_order), answer_format

    @staticmethod
    def _consecutive(numbers: list[str]) -> bool:
        return [int(n) for n in numbers] == list(range(1, len(numbers) + 1))

    def _r1vl(self, text: str) -> str:
        if any(s not in text for s in _R1VL_SECTIONS):
            return "incomplete"
        pos = [text.find(s) for s in _R1VL_SECTIONS[:3]]
        steps = list(_R1VL_STEP.finditer(text))
        final = text.rfind(_HEADER)
        if pos != sorted(pos) or final < steps[-1].end() or not self._consecutive([m.group(1) for m in steps]):
            return "illogical"
        return "valid"

    def _tagged(self, text: str) -> str:
        ans = extract_answer(text, self.answer_format)
        reasoning = reasoning_text(text, self.answer_format)
        if ans is None or not ans or not reasoning.strip():
            return "incomplete"
        thinks = list(_THINK_TAG.finditer(text))
        if thinks and self.answer_format in ("tag", "either") and "<answer>" in text:
            if text.rfind("<answer>") < thinks[-1].end():
                return "illogical"
        if not self._consecutive(_STEP.findall(reasoning)):
            return "illogical"
        return "valid"

    def check(self, ctx: dict, text: str) -> str:
        if not isinstance(text, str):
            return "incomplete"
        verdict = self._r1vl(text) if self.template == "r1vl" else self._tagged(text)
        if verdict == "valid" and self.key_step_order and ctx.get("key_steps"):
            cut = text.rfind(_HEADER) if self.template == "r1vl" else -1
            reasoning = text[:cut] if cut >= 0 else reasoning_text(text, self.answer_format)
            if not match_key_steps(reasoning, ctx["key_steps"])[1]:
                return "out_of_order_steps"
        return verdict

    def _one(self, ctx: dict, text: str) -> float:
        verdict = self.check(ctx, text)
        self._count(verdict)
        return float(verdict == "valid")
