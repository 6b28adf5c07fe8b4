"""A procedurally generated, verifiable text task: integer arithmetic, `a+b=` -> `c`.

Every problem of the space is enumerated once and shuffled by the seed; the first `test_fraction`
of that order is held out, so train and test are disjoint by problem. Training reads the rest as a
stream whose cursor is the whole state (saved in checkpoints for exact resume).
"""

from __future__ import annotations

import numpy as np

from mmrl.envs import TaskBase, register_task
from mmrl.envs.base import Headline, headline_rows

_OPS = {"+": np.add, "-": np.subtract, "*": np.multiply}
# The exact-answer rewards a text config trains on; the trainer logs each as eval/<name>.
EXACT_REWARDS = ("exact_match", "arithmetic_exact")


@register_task("arithmetic")
class ArithmeticTask(TaskBase):
    def __init__(self, seed: int = 0, max_operand: int = 99, ops: tuple[str, ...] | list[str] = ("+",),
                 test_fraction: float = 0.1):
        bad = [op for op in ops if op not in _OPS]
        if bad:
            raise ValueError(f"task.params.ops: unknown operator {bad[0]!r}; valid: {', '.join(_OPS)}")
        if max_operand < 1:
            raise ValueError(f"task.params.max_operand must be >= 1, got {max_operand}")
        if not 0 < test_fraction < 1:
            raise ValueError(f"task.params.test_fraction must be in (0, 1), got {test_fraction}")
        n = max_operand + 1
        a, op, b = np.meshgrid(np.arange(n), np.arange(len(ops)), np.arange(n), indexing="ij")
        space = np.stack([a.ravel(), op.ravel(), b.ravel()], 1)
        order = np.random.default_rng(seed).permutation(len(space))
        n_test = max(1, int(len(space) * test_fraction))
        self.ops = list(ops)
        self.test = space[order[:n_test]]
        self.train = space[order[n_test:]]
        self.cursor = 0

    def _contexts(self, rows: np.ndarray) -> list[dict]:
        out = []
        for a, op, b in rows.tolist():
            sym = self.ops[op]
            answer = int(_OPS[sym](a, b))
            out.append({"prompt": f"{a}{sym}{b}=", "answer": answer, "target": str(answer)})
        return out

    def next_batch(self, n: int) -> list[dict]:
        idx = (self.cursor + np.arange(n)) % len(self.train)
        self.cursor += n
        return self._contexts(self.train[idx])

    def eval_batch(self, n: int) -> list[dict]:
        return self._contexts(self.test[: min(n, len(self.test))])

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[dict]:
        return self._contexts(self.train[rng.integers(0, len(self.train), n)])

    def corpus(self) -> list[str]:
        return [c["prompt"] + c["target"] for c in self._contexts(self.train[:5000])]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    def headline(self, before: dict, after: dict) -> list[Headline]:
        """Held-out exact match, greedy and sampled at the training temperature (README's rows)."""
        name = next((r for r in EXACT_REWARDS if f"eval/{r}" in after), EXACT_REWARDS[0])
        return headline_rows(before, after, [("greedy exact match", f"eval/{name}", ".3f"),
                                             ("sampled exact match", f"eval/sampled_{name}", ".3f")])


@register_task("digit_sort")
class DigitSortTask(ArithmeticTask):
    """Sort a string of digits: `sort 50281=` -> `01258`. Held-out strings are disjoint from
    training ones; the skill (counting by attention) generalises, so a short SFT gives partial
    accuracy that RL can raise."""

    def __init__(self, seed: int = 0, length: int = 5, test_fraction: float = 0.02):
        if not 2 <= length <= 8:
            raise ValueError(f"task.params.length must be in [2, 8], got {length}")
        if not 0 < test_fraction < 1:
            raise ValueError(f"task.params.test_fraction must be in (0, 1), got {test_fraction}")
        order = np.random.default_rng(seed).permutation(10**length)
        n_test = max(1, int(len(order) * test_fraction))
        self.length = length
        self.test, self.train = order[:n_test], order[n_test:]
        self.cursor = 0

    def _contexts(self, rows: np.ndarray) -> list[dict]:
        out = []
        for value in rows.tolist():
            digits = str(value).zfill(self.length)
            answer = "".join(sorted(digits))
            out.append({"prompt": f"sort {digits}=", "answer": answer, "target": answer})
        return out
