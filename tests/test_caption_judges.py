"""Judge back-ends: an OpenAI-compatible HTTP server started on loopback (batched, timeouts,
deadline, retries, malformed replies) and a Hugging Face causal LM saved to disk (generation and
log-likelihood of the option letters)."""

import time

import numpy as np
import pytest
import torch
from mmrl.envs import make_task

from mmrl.rewards.captioning.judge_server import JudgeServer
from mmrl.rewards.captioning.judges import (
    LETTERS,
    HFJudge,
    HTTPJudge,
    JudgeItem,
    LexicalJudge,
    format_prompt,
)
from mmrl.rewards.captioning.qa import build_item, caption_qa, count_tokens
from mmrl.tiny import build_tiny_qwen2, build_tokenizer

torch.set_num_threads(1)


def _items(n: int = 12) -> list[JudgeItem]:
    ctx = make_task("caption", seed=0, n_test=n).eval_batch(n)
    rng = np.random.default_rng(0)
    caps = [c["target"] if i % 3 else "" for i, c in enumerate(ctx)]  # some empty captions: cannot answer
    return [build_item(cap, c["qa"][0], rng)[0] for cap, c in zip(caps, ctx)]


@pytest.mark.parametrize("mode", ["chat", "completions"])
def test_http_judge_answers_like_the_lexical_judge(mode):
    items = _items(12)
    with JudgeServer() as srv:
        judge = HTTPJudge(srv.url, mode=mode, batch_size=5, concurrency=4, timeout=5)
        replies = judge.judge(items)
        judge.close()
        # chat: one request per question; completions: ceil(12 / 5) = 3 batched requests.
        assert srv.requests == (12 if mode == "chat" else 3) and srv.prompts == 12
    assert [r.letter for r in replies] == [r.letter for r in LexicalJudge().judge(items)]
    assert all(r.error is None for r in replies)


def test_http_judge_times_out_and_meets_its_deadline():
    items = _items(4)
    with JudgeServer(delay=1.5) as srv:
        judge = HTTPJudge(srv.url, timeout=0.2, retries=1, backoff=0.05, deadline=30)
        t0 = time.perf_counter()
        replies = judge.judge(items)
        took = time.perf_counter() - t0
        assert took < 1.2  # 2 attempts x 0.2 s + backoff, never the server's 1.5 s
        assert all(r.letter is None and r.error.startswith("timeout after 2 attempts") for r in replies)
        # The deadline bounds the whole call even when each request's timeout is long.
        judge = HTTPJudge(srv.url, timeout=10, retries=0, deadline=0.3)
        t0 = time.perf_counter()
        replies = judge.judge(items)
        assert time.perf_counter() - t0 < 1.0
        assert all(r.letter is None and "deadline of 0.3 s passed" in r.error for r in replies)


@pytest.mark.parametrize("behaviour,reason", [("malformed", "malformed reply (no option letter"),
                                              ("broken_json", "malformed reply (not JSON)")])
def test_http_judge_malformed_replies_give_reasons_and_zero_reward(behaviour, reason):
    ctx = make_task("caption", seed=0, n_test=4).eval_batch(4)
    with JudgeServer(behaviour=behaviour) as srv:
        replies = HTTPJudge(srv.url, retries=0).judge(_items(3))
        assert all(r.letter is None and r.error.startswith(reason) for r in replies)
        r = caption_qa(ctx, [c["target"] for c in ctx], judge={"name": "http", "base_url": srv.url, "retries": 0},
                       max_judge_failures=1.0)  # every reply fails: no fault raised at a share of 1
    assert torch.equal(r, torch.zeros(4))


def test_http_judge_retries_server_errors_and_scores_through_the_reward():
    ctx = make_task("caption", seed=0, n_test=6).eval_batch(6)
    with JudgeServer(behaviour="flaky", flaky_failures=2) as srv:
        spec = {"name": "http", "base_url": srv.url, "mode": "completions", "batch_size": 32, "retries": 2, "backoff": 0.01,
                "concurrency": 1}
        r = caption_qa(ctx, [c["target"] for c in ctx], judge=spec)
        assert srv.requests == 3  # two 503s, then the batched request that answers
    assert torch.equal(r, torch.ones(6))
    with JudgeServer() as srv:  # nothing listens on a closed port: a connection error, not a hang
        url = srv.url
    replies = HTTPJudge(url, timeout=1, retries=1, backoff=0.01).judge(_items(2))
    assert all(r.letter is None and r.error.startswith("connection error") for r in replies)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    items = _items(4)
    tok = build_tokenizer([format_prompt(it) for it in items] + list(LETTERS[:5]), vocab_size=300)
    model = build_tiny_qwen2(tok, seed=0)
    out = tmp_path_factory.mktemp("judge")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_hf_judge_loglik_picks_the_most_likely_letter(hf_dir):
    items = _items(4)
    judge = HFJudge(hf_dir, mode="loglik", temperature=0.0)
    replies = judge.judge(items)
    for it, rep in zip(items, replies):
        enc = judge.tokenizer(judge._prompt(it), return_tensors="pt", add_special_tokens=False)
        logp = judge.model(**enc).logits[0, -1].log_softmax(-1)
        scores = [logp[judge.letter_ids[i]].logsumexp(0).item() for i in range(len(it.options))]
        assert rep.letter == LETTERS[int(np.argmax(scores))]
    sampled = HFJudge(hf_dir, mode="loglik", temperature=5.0, seed=1).judge(items * 10)
    assert len({r.letter for r in sampled}) > 1  # sampling at a temperature spreads the choices
    with pytest.raises(ValueError, match="unknown mode 'vote'; valid: generate, loglik"):
        HFJudge(hf_dir, mode="vote")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        HFJudge(hf_dir / "nothing")


def test_hf_judge_generation_never_crashes_on_a_random_model(hf_dir):
    items = _items(6)
    replies = HFJudge(hf_dir, mode="generate", temperature=0.6, max_new_tokens=6, batch_size=4).judge(items)
    assert len(replies) == 6
    for it, r in zip(items, replies):
        if r.letter is None:
            assert r.error.startswith("malformed reply")
        else:
            assert r.letter in LETTERS[:len(it.options)] and r.error is None
    ctx = make_task("caption", seed=0, n_test=3).eval_batch(3)
    reward = caption_qa(ctx, ["x"] * 3, judge={"name": "hf", "path": str(hf_dir), "max_new_tokens": 4},
                        max_judge_failures=1.0)  # a random model's replies are mostly malformed
    assert reward.shape == (3,) and ((reward >= 0) & (reward <= 1)).all()
    # The length term can count tokens of a local tokenizer instead of words.
    tok = HFJudge(hf_dir, mode="loglik").tokenizer
    assert count_tokens(["top left large red circle"], str(hf_dir)).tolist() == \
        [len(tok.encode("top left large red circle", add_special_tokens=False))]
    with pytest.raises(FileNotFoundError, match="length_tokenizer directory not found"):
        count_tokens(["x"], str(hf_dir / "none"))
