"""Judged questions per second through the HTTP judge back-end: batched versus one request per question.

A lexical judge is served OpenAI-style on loopback (`mmrl.rewards.captioning.judge_server`). The same
questions (true captions of held-out synthetic scenes, 4 questions each) are judged twice by `HTTPJudge`:

* one request per question, one at a time (`mode: chat`, concurrency 1);
* batched: `--batch` prompts per `/v1/completions` request, `--concurrency` requests in flight.

Both must give the same letters. The server's per-request latency (`--delay`, default 0) models a
judge server's fixed cost per request; with 0 the figure is the HTTP + JSON overhead alone. The
last line is JSON with both rates and their ratio.

    python bench/judge.py [--questions 2048] [--batch 64] [--concurrency 4] [--delay 0] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mmrl.envs import make_task

from mmrl.rewards.captioning.judge_server import JudgeServer
from mmrl.rewards.captioning.judges import HTTPJudge
from mmrl.rewards.captioning.qa import build_item


def questions(n: int, seed: int = 0) -> list:
    task = make_task("caption", seed=seed, n_test=max(1, n // 4 + 1))
    rng = np.random.default_rng(seed)
    items = []
    for c in task.eval_batch(len(task.test)):
        for qa in c["qa"][:4]:
            items.append(build_item(c["target"], qa, rng)[0])
    return items[:n]


def timed(judge: HTTPJudge, items: list, repeats: int) -> tuple[float, list]:
    best, replies = float("inf"), []
    for _ in range(repeats):  # best of `repeats`: background load on a shared machine only slows a run
        t0 = time.perf_counter()
        replies = judge.judge(items)
        best = min(best, time.perf_counter() - t0)
    return best, replies


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--delay", type=float, default=0.0, help="server latency per request, seconds")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a few questions, one repeat (CI)")
    a = p.parse_args(argv)
    if a.smoke:
        a.questions, a.repeats = 64, 1
    items = questions(a.questions)
    with JudgeServer(delay=a.delay) as srv:
        single = HTTPJudge(srv.url, mode="chat", concurrency=1, timeout=30, deadline=3600)
        batched = HTTPJudge(srv.url, mode="completions", batch_size=a.batch, concurrency=a.concurrency, timeout=30,
                            deadline=3600)
        t_single, r_single = timed(single, items, a.repeats)
        t_batched, r_batched = timed(batched, items, a.repeats)
        single.close()
        batched.close()
    match = [r.letter for r in r_single] == [r.letter for r in r_batched] and all(r.letter for r in r_single)
    result = {"questions": len(items), "batch": a.batch, "concurrency": a.concurrency, "server_delay_s": a.delay,
              "one_per_question_s": t_single, "batched_s": t_batched,
              "one_per_question_qps": len(items) / t_single, "batched_qps": len(items) / t_batched,
              "ratio": t_single / t_batched, "match": match}
    print(f"one request per question: {result['one_per_question_qps']:.0f} questions/s; "
          f"batched ({a.batch} per request, {a.concurrency} in flight): {result['batched_qps']:.0f} questions/s; "
          f"ratio {result['ratio']:.1f}x")
    print(json.dumps(result))
    return 0 if match else 1


if __name__ == "__main__":
    raise SystemExit(main())
