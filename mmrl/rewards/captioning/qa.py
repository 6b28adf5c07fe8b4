"""CapRL's reward: how well a text-only judge answers an image's questions from the caption alone.

For each caption, `questions_per_caption` of its image's QA pairs are sampled (the G captions of
one image get the same questions, so their rewards differ only by the captions). Each question's
options are shuffled afresh for every judged (caption, question), and a "cannot answer from the
caption" option is appended last; the answer letter follows its option through the shuffle. The
judge's first valid letter counts. The reward is the share answered correctly, times the CapRL++
length factor: 1 up to `length_budget` tokens, falling linearly to 0 at `length_budget +
length_margin`.

The draws of a caption depend only on (seed, draw, its item, its index among the captions of that
item in the call), never on where the call puts it, so ranks that each score their own groups give
what one process scoring them all gives. The item is a stable hash of the context's uid / id and
its questions.

A judge reply that cannot be scored (no letter, a letter that is not an option, a timeout, an HTTP
error) scores 0 for that question and counts as failed (metric `judge_failed_share`, warned once
per reason); when more than `max_judge_failures` of a call's replies failed, the judge is taken
for down and the call raises `JudgeFailure`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.config_checks import ConfigError, check_params
from mmrl.rewards import Reward, register_reward
from mmrl.rewards.captioning.judges import (CANNOT_ANSWER, LETTERS, Judge, JudgeFailure, JudgeItem, JudgeReply,
                                            judge_name, make_judge)

log = logging.getLogger("mmrl.rewards.captioning.qa")

_JUDGES: dict[str, Judge] = {}
_TOKENIZERS: dict[str, Any] = {}


def cached_judge(spec: str | dict[str, Any] | Judge) -> Judge:
    """One judge per distinct spec for the life of the process (an HF judge loads once); a judge
    object passes through."""
    if hasattr(spec, "judge"):
        return spec
    key = json.dumps(spec, sort_keys=True)
    if key not in _JUDGES:
        _JUDGES[key] = make_judge(spec)
    return _JUDGES[key]


def build_item(caption: str, qa: dict[str, Any], rng: np.random.Generator, cannot_answer: bool = True,
               grid: int = 2) -> tuple[JudgeItem, str]:
    """A judge item with the options shuffled (and the cannot-answer option appended last), and the
    letter of the correct option."""
    choices = list(qa["choices"])
    if qa["answer"] not in choices:
        raise ValueError(f"caption_qa: answer {qa['answer']!r} is not among the choices {choices}")
    options = [choices[i] for i in rng.permutation(len(choices))]
    if cannot_answer:
        options.append(CANNOT_ANSWER)
    if len(options) > len(LETTERS):
        raise ValueError(f"caption_qa: {len(options)} options; at most {len(LETTERS)} can be lettered")
    return JudgeItem(caption, qa["question"], options, grid), LETTERS[options.index(qa["answer"])]


def length_factor(n_tokens: np.ndarray | Sequence[int], budget: int, margin: int) -> np.ndarray:
    """CapRL++: 1 up to `budget`, linear to 0 at `budget + margin`, 0 beyond; budget 0 turns it off."""
    n = np.asarray(n_tokens, dtype=np.float64)
    if budget <= 0:
        return np.ones_like(n)
    if margin <= 0:
        raise ValueError(f"caption_qa: length_margin must be > 0 when length_budget is on, got {margin}")
    return np.clip(1.0 - (n - budget) / margin, 0.0, 1.0)


def count_tokens(texts: Sequence[str], tokenizer: str | None = None) -> np.ndarray:
    """Length of each text in tokens of a local tokenizer directory, or in words without one."""
    if tokenizer is None:
        return np.array([len(t.split()) for t in texts])
    if tokenizer not in _TOKENIZERS:
        from transformers import AutoTokenizer

        if not Path(tokenizer).is_dir():
            raise FileNotFoundError(f"caption_qa: length_tokenizer directory not found: {tokenizer}")
        _TOKENIZERS[tokenizer] = AutoTokenizer.from_pretrained(tokenizer)
    tok = _TOKENIZERS[tokenizer]
    return np.array([len(tok.encode(t, add_special_tokens=False)) for t in texts])


def failure_reason(reply: JudgeReply, n_options: int) -> str | None:
    """Why `reply` cannot be scored (the judge's own reason up to its first colon), None when it can."""
    if reply.letter is None:
        return reply.error.split(":")[0] if reply.error else "no option letter in the reply"
    if reply.letter not in LETTERS[:n_options]:
        return "letter not among the options"
    return None


def score_replies(replies: list[JudgeReply], letters: list[str],
                  n_options: Sequence[int] | None = None) -> tuple[np.ndarray, Counter]:
    """1 for a reply whose letter is the correct one, else 0; and the counts of failure reasons of
    the replies that cannot be scored (`n_options`: each item's number of options; default: any letter)."""
    n_options = n_options if n_options is not None else [len(LETTERS)] * len(letters)
    reasons = [failure_reason(r, n) for r, n in zip(replies, n_options, strict=True)]
    correct = np.array([why is None and r.letter == k for r, k, why in zip(replies, letters, reasons, strict=True)],
                       dtype=np.float64)
    return correct, Counter(why for why in reasons if why is not None)


def _as_rngs(rng: np.random.Generator | Sequence[np.random.Generator], n: int) -> Sequence[np.random.Generator]:
    return [rng] * n if isinstance(rng, np.random.Generator) else rng


def judge_captions(judge: Judge, captions: Sequence[str], qa_lists: Sequence[Sequence[dict]], grids: Sequence[int],
                   rng: np.random.Generator | Sequence[np.random.Generator], cannot_answer: bool = True,
                   stats: dict[str, Any] | None = None, warned: set[str] | None = None) -> list[np.ndarray]:
    """Judge every caption on every question of its list (one batched judge call); per caption, a
    0/1 array over its questions. `rng` shuffles the options: one stream for all captions, or one
    per caption. `stats` receives the judged / failed counts and failure reasons; a failure reason
    is warned once per `warned` set (None: on every call)."""
    items, letters, owner = [], [], []
    rngs = _as_rngs(rng, len(captions))
    for i, (cap, qas, grid, g) in enumerate(zip(captions, qa_lists, grids, rngs, strict=True)):
        for qa in qas:
            item, letter = build_item(cap, qa, g, cannot_answer, grid)
            items.append(item)
            letters.append(letter)
            owner.append(i)
    replies = judge.judge(items) if items else []
    if len(replies) != len(items):
        raise RuntimeError(f"judge returned {len(replies)} replies for {len(items)} questions")
    correct, reasons = score_replies(replies, letters, [len(it.options) for it in items])
    if stats is not None:
        stats.update(judged=len(items), failed=int(sum(reasons.values())), reasons=dict(reasons))
    new = [r for r in reasons if warned is None or r not in warned]
    if new:
        log.warning("caption_qa: %d of %d judge replies could not be scored and count as failed (scored 0): %s "
                    "(metric reward/caption_qa/judge_failed_share%s)", sum(reasons.values()), len(items),
                    dict(reasons), "" if warned is None else "; said once per reason")
        if warned is not None:
            warned.update(new)
    owner_arr = np.array(owner, dtype=np.int64)
    return [correct[owner_arr == i] for i in range(len(captions))]


def item_key(context: dict, qa_key: str = "qa") -> int:
    """A stable 64-bit key of a context's item (the same in every process and run): a hash of its
    uid / id field and its questions."""
    ident = context.get("uid", context.get("id"))
    payload = json.dumps([None if ident is None else str(ident), context[qa_key]], sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(payload.encode(), digest_size=8).digest(), "little")


def check_share(name: str, value: Any) -> None:
    """Refuse, in one line, a parameter that must be a share in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"caption_qa: {name} must be a share in [0, 1], got {value!r}")


def caption_qa(contexts: list[dict], outputs: list[str], judge: str | dict[str, Any] | Judge = "lexical",
               questions_per_caption: int = 4, cannot_answer: bool = True, length_budget: int = 0,
               length_margin: int = 16, length_tokenizer: str | None = None, seed: int = 0,
               qa_key: str = "qa", max_judge_failures: float = 0.5, draw: int = 0,
               stats: dict[str, Any] | None = None, warned: set[str] | None = None) -> torch.Tensor:
    """Judge accuracy of each caption on sampled questions of its image, times the length factor.
    An item's questions come from the stream (`seed`, `draw`, its key), each caption's option
    shuffles from (`seed`, `draw`, its item's key, its index among that item's captions). Raises
    `JudgeFailure` when more than `max_judge_failures` (a share) of the judge's replies failed."""
    if questions_per_caption < 1:
        raise ValueError(f"caption_qa: questions_per_caption must be >= 1, got {questions_per_caption}")
    check_share("max_judge_failures", max_judge_failures)
    keys: dict[int, int] = {}  # id(context) -> its item key (hashed once per call)
    picked: dict[int, list[dict]] = {}  # item key -> its questions for this call, shared by its group
    seen: Counter = Counter()  # item key -> captions of it so far in this call
    qa_lists, rngs = [], []
    for i, c in enumerate(contexts):
        if qa_key not in c:
            raise KeyError(f"caption_qa: context {i} has no {qa_key!r} (its keys: {', '.join(sorted(c))})")
        if id(c) not in keys:
            keys[id(c)] = item_key(c, qa_key)
        key = keys[id(c)]
        if key not in picked:
            qas = list(c[qa_key])
            rng = np.random.default_rng([seed, draw, key, 0])
            take = rng.choice(len(qas), size=min(questions_per_caption, len(qas)), replace=False) if qas else []
            picked[key] = [qas[j] for j in take]
        qa_lists.append(picked[key])
        rngs.append(np.random.default_rng([seed, draw, key, 1, seen[key]]))
        seen[key] += 1
    stats = {} if stats is None else stats
    the_judge = cached_judge(judge)
    per_caption = judge_captions(the_judge, outputs, qa_lists, [int(c.get("grid", 2)) for c in contexts],
                                 rngs, cannot_answer, stats, warned)
    if stats["judged"] and stats["failed"] / stats["judged"] > max_judge_failures:
        reason, count = Counter(stats["reasons"]).most_common(1)[0]
        raise JudgeFailure(f"caption_qa: {stats['failed']} of {stats['judged']} replies of judge "
                           f"{judge_name(the_judge)} failed ({stats['failed'] / stats['judged']:.0%}, more than "
                           f"max_judge_failures {max_judge_failures:g}); most common reason: "
                           f"{' '.join(reason.split())} ({count}x)")
    acc = np.array([a.mean() if a.size else 0.0 for a in per_caption])
    factor = length_factor(count_tokens(outputs, length_tokenizer), length_budget, length_margin)
    return torch.from_numpy(acc * factor).float()


@register_reward("caption_qa")
class CaptionQA(Reward):
    """`caption_qa` as a reward with state: call k draws its questions and option shuffles from
    stream k, and the draw counter is saved with the trainer's checkpoints, so a resumed run judges
    on exactly the questions an uninterrupted one would."""

    def __init__(self, **params: Any):
        check_params(caption_qa, params, "reward 'caption_qa'", skip=2, internal=("draw", "stats", "warned"))
        check_share("max_judge_failures", params.get("max_judge_failures", 0.5))
        self.params, self.draws, self.stats = params, 0, {}
        self.warned: set[str] = set()  # failure reasons already warned about

    def __call__(self, contexts: list[dict], outputs: list[str]) -> torch.Tensor:
        self.stats = {}
        try:
            return caption_qa(contexts, outputs, draw=self.draws, stats=self.stats, warned=self.warned, **self.params)
        finally:  # a call that raised used its draw too (the trainer puts the counter back with the step)
            self.draws += 1

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])

    def metrics(self) -> dict[str, float]:
        judged, failed = self.stats.get("judged", 0), self.stats.get("failed", 0)
        return {"judged": float(judged), "judge_failed": float(failed),
                "judge_failed_share": failed / judged if judged else 0.0}

    def counted_metrics(self) -> tuple[str, ...]:
        return ("judged", "judge_failed")

    def metric_weights(self) -> dict[str, float]:
        """The share's denominator: ranks' shares are combined weighted by it (distributed.reduce_metrics)."""
        return {"judge_failed_share": float(self.stats.get("judged", 0))}
