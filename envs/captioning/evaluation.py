"""The captioner's held-out metrics (Prism-style): a text-only judge answers each image's questions
from its captions. The task's `evaluate` reports them during training; mmrl.evals.caption_eval
writes them, with a gallery, for a checkpoint (its module doc lists the metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mmrl.rewards.captioning.qa import cached_judge, judge_captions


def judged_accuracy(judge, captions: Sequence[str], contexts: Sequence[dict], rng: np.random.Generator,
              max_questions: int | None, tally: dict[str, Any]) -> np.ndarray:
    """Each caption's judged accuracy; `tally` adds up the judged and failed replies over calls
    (and holds the reasons already warned about, said once per evaluation)."""
    qa = [c["qa"][:max_questions] for c in contexts]
    stats: dict[str, Any] = {}
    per = judge_captions(judge, captions, qa, [int(c.get("grid", 2)) for c in contexts], rng, stats=stats,
                         warned=tally.setdefault("warned", set()))
    tally["judged"] = tally.get("judged", 0) + stats.get("judged", 0)
    tally["failed"] = tally.get("failed", 0) + stats.get("failed", 0)
    return np.array([a.mean() if a.size else 0.0 for a in per])


@torch.no_grad()
def captions_of(policy, contexts: Sequence[dict], k: int, temperature: float | None = None, seed: int = 0,
                batch_size: int = 32) -> list[list[str]]:
    """k captions per context (greedy when temperature == 0), batch by batch."""
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    out: list[list[str]] = []
    for lo in range(0, len(contexts), batch_size):
        part = list(contexts[lo:lo + batch_size])
        texts = policy.decode(policy.sample(part, k, generator=gen, temperature=temperature))
        out += [texts[i * k:(i + 1) * k] for i in range(len(part))]
    return out


def evaluate_captioner(policy, contexts: Sequence[dict], judge_spec: str | dict[str, Any] = "lexical", k: int = 4,
                       max_questions: int | None = None, seed: int = 0) -> tuple[dict[str, float], dict[str, Any]]:
    """(metrics, raw captions) on `contexts` (see the module doc for the metrics)."""
    if not contexts:
        raise ValueError("caption eval: no held-out contexts")
    judge = cached_judge(judge_spec)
    rng = np.random.default_rng(seed)
    n = len(contexts)
    sampled = captions_of(policy, contexts, k, seed=seed)
    greedy = [c[0] for c in captions_of(policy, contexts, 1, temperature=0.0, seed=seed)]
    tally: dict[str, Any] = {}
    acc = judged_accuracy(judge, [c for caps in sampled for c in caps], [x for x in contexts for _ in range(k)], rng,
                    max_questions, tally).reshape(n, k)
    greedy_acc = judged_accuracy(judge, greedy, contexts, rng, max_questions, tally)
    # Grounding check: image i's questions judged from the greedy caption of image i+1.
    shuffled = (judged_accuracy(judge, greedy[1:] + greedy[:1], contexts, rng, max_questions, tally) if n > 1
                else greedy_acc)
    floor = judged_accuracy(judge, [""] * n, contexts, rng, max_questions, tally)
    lengths = np.array([len(c.split()) for caps in sampled for c in caps])
    metrics = {
        "caption_acc_mean": float(acc.mean()), f"caption_acc_best_of_{k}": float(acc.max(1).mean()),
        "caption_acc_greedy": float(greedy_acc.mean()), "caption_acc_shuffled_images": float(shuffled.mean()),
        "caption_acc_no_caption": float(floor.mean()),
        "caption_len_mean": float(lengths.mean()), "caption_len_median": float(np.median(lengths)),
        "caption_len_max": float(lengths.max()), "caption_len_std": float(lengths.std()),
        "n_images": float(n), "n_questions": float(sum(len(c["qa"][:max_questions]) for c in contexts)),
    }
    if all(c.get("target") for c in contexts):
        metrics["caption_acc_reference"] = float(judged_accuracy(judge, [c["target"] for c in contexts], contexts, rng,
                                                           max_questions, tally).mean())
    # The replies the judge could not give (scored 0 above): a judge that is down shows here, not as a bad captioner.
    metrics["judge_unjudged_share"] = tally["failed"] / tally["judged"] if tally["judged"] else 0.0
    raw = {"sampled": sampled, "greedy": greedy, "acc": acc.tolist(), "greedy_acc": greedy_acc.tolist()}
    return metrics, raw
