"""CapRL's reward: how well a text-only judge answers an image's questions from the caption alone.

For each caption, `questions_per_caption` of its image's QA pairs are sampled (the G captions of
one image get the same questions, so their rewards differ only by the captions). Each question's
options are shuffled afresh for every judged (caption, question), and a "cannot answer from the
caption" option is appended last; the answer letter follows its option through the shuffle. The
judge's first valid letter counts. The reward is the share answered correctly, times the CapRL++
length factor: 1 up to `length_budget` tokens, falling linearly to 0 at `length_budget +
length_margin`. A judge reply without a valid letter (malformed, timed out, HTTP error) scores 0
for that question and is logged with its reason; it never stops the run.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.config import check_params
from mmrl.rewards import Reward, register_reward
from mmrl.rewards.captioning.judges import CANNOT_ANSWER, LETTERS, Judge, JudgeItem, JudgeReply, make_judge

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


def score_replies(replies: list[JudgeReply], letters: list[str]) -> tuple[np.ndarray, Counter]:
    """1 for a reply whose letter is the correct one, else 0; and the counts of failure reasons."""
    correct = np.array([r.letter is not None and r.letter == k for r, k in zip(replies, letters, strict=True)],
                       dtype=np.float64)
    reasons = Counter(r.error.split(":")[0] for r in replies if r.letter is None and r.error)
    return correct, reasons


def judge_captions(judge: Judge, captions: Sequence[str], qa_lists: Sequence[Sequence[dict]], grids: Sequence[int],
                   rng: np.random.Generator, cannot_answer: bool = True,
                   stats: dict[str, Any] | None = None) -> list[np.ndarray]:
    """Judge every caption on every question of its list (one batched judge call); per caption, a
    0/1 array over its questions. `stats` receives the judged / failed counts and failure reasons."""
    items, letters, owner = [], [], []
    for i, (cap, qas, grid) in enumerate(zip(captions, qa_lists, grids, strict=True)):
        for qa in qas:
            item, letter = build_item(cap, qa, rng, cannot_answer, grid)
            items.append(item)
            letters.append(letter)
            owner.append(i)
    replies = judge.judge(items) if items else []
    if len(replies) != len(items):
        raise RuntimeError(f"judge returned {len(replies)} replies for {len(items)} questions")
    correct, reasons = score_replies(replies, letters)
    if stats is not None:
        stats.update(judged=len(items), failed=int(sum(reasons.values())), reasons=dict(reasons))
    if reasons:
        log.warning("caption_qa: %d of %d judge replies had no valid letter and scored 0: %s",
                    sum(reasons.values()), len(items), dict(reasons))
    owner_arr = np.array(owner, dtype=np.int64)
    return [correct[owner_arr == i] for i in range(len(captions))]


def caption_qa(contexts: list[dict], outputs: list[str], judge: str | dict[str, Any] | Judge = "lexical",
               questions_per_caption: int = 4, cannot_answer: bool = True, length_budget: int = 0,
               length_margin: int = 16, length_tokenizer: str | None = None, seed: int = 0,
               qa_key: str = "qa", draw: int = 0, stats: dict[str, Any] | None = None) -> torch.Tensor:
    """Judge accuracy of each caption on sampled questions of its image, times the length factor.
    The questions and option shuffles come from the stream (`seed`, `draw`)."""
    if questions_per_caption < 1:
        raise ValueError(f"caption_qa: questions_per_caption must be >= 1, got {questions_per_caption}")
    rng = np.random.default_rng([seed, draw])
    picked: dict[int, list[dict]] = {}  # id(context) -> its questions for this call, shared by its group
    qa_lists = []
    for i, c in enumerate(contexts):
        if qa_key not in c:
            raise KeyError(f"caption_qa: context {i} has no {qa_key!r} (its keys: {', '.join(sorted(c))})")
        if id(c) not in picked:
            qas = list(c[qa_key])
            take = rng.choice(len(qas), size=min(questions_per_caption, len(qas)), replace=False) if qas else []
            picked[id(c)] = [qas[j] for j in take]
        qa_lists.append(picked[id(c)])
    per_caption = judge_captions(cached_judge(judge), outputs, qa_lists, [int(c.get("grid", 2)) for c in contexts],
                                 rng, cannot_answer, stats)
    acc = np.array([a.mean() if a.size else 0.0 for a in per_caption])
    factor = length_factor(count_tokens(outputs, length_tokenizer), length_budget, length_margin)
    return torch.from_numpy(acc * factor).float()


@register_reward("caption_qa")
class CaptionQA(Reward):
    """`caption_qa` as a reward with state: call k draws its questions and option shuffles from
    stream k, and the draw counter is saved with the trainer's checkpoints, so a resumed run judges
    on exactly the questions an uninterrupted one would."""

    def __init__(self, **params: Any):
        check_params(caption_qa, params, "reward 'caption_qa'", skip=2, internal=("draw", "stats"))
        self.params, self.draws, self.stats = params, 0, {}

    def __call__(self, contexts: list[dict], outputs: list[str]) -> torch.Tensor:
        self.stats = {}
        reward = caption_qa(contexts, outputs, draw=self.draws, stats=self.stats, **self.params)
        self.draws += 1
        return reward

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])

    def metrics(self) -> dict[str, float]:
        return {"judged": float(self.stats.get("judged", 0)), "judge_failed": float(self.stats.get("failed", 0))}
