"""Verifiable rewards on generated text."""

from __future__ import annotations

import re

import torch

from mmrl.rewards import register_reward

_INT = re.compile(r"^\s*(-?\d+)\s*$")


@register_reward("arithmetic_exact")
def arithmetic_exact(contexts: list[dict], outputs: list[str], partial_credit: float = 0.0) -> torch.Tensor:
    """1 for the exact integer answer (and nothing else); `partial_credit` for a well-formed
    wrong integer, which gives a format signal early in training."""
    rewards = []
    for ctx, text in zip(contexts, outputs, strict=True):
        m = _INT.match(text)
        if m is None:
            rewards.append(0.0)
        else:
            rewards.append(1.0 if int(m.group(1)) == ctx["answer"] else partial_credit)
    return torch.tensor(rewards, dtype=torch.float32)


@register_reward("arithmetic_digits")
def arithmetic_digits(contexts: list[dict], outputs: list[str]) -> torch.Tensor:
    """Share of answer digits right, aligned from the units digit, minus a length mismatch.

    A dense signal for small models: 1 only for the exact answer, partial credit for a
    well-formed integer with some digits right, 0 for anything unparseable.
    """
    rewards = []
    for ctx, text in zip(contexts, outputs, strict=True):
        m = _INT.match(text)
        if m is None:
            rewards.append(0.0)
            continue
        got, want = m.group(1)[::-1], str(ctx["answer"])[::-1]
        hits = sum(a == b for a, b in zip(got, want))
        rewards.append(hits / max(len(got), len(want)))
    return torch.tensor(rewards, dtype=torch.float32)


@register_reward("exact_match")
def exact_match(contexts: list[dict], outputs: list[str]) -> torch.Tensor:
    """1 when the stripped completion equals the context's `answer` string."""
    return torch.tensor([float(o.strip() == str(c["answer"])) for c, o in zip(contexts, outputs, strict=True)])


@register_reward("position_match")
def position_match(contexts: list[dict], outputs: list[str]) -> torch.Tensor:
    """Share of characters right at their position, over the longer of answer and output."""
    out = []
    for c, o in zip(contexts, outputs, strict=True):
        got, want = o.strip(), str(c["answer"])
        out.append(sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1))
    return torch.tensor(out)
