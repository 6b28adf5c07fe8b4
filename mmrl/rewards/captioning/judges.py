"""Text-only judges that answer multiple-choice questions from a caption (CapRL's reward model).

A judge takes `JudgeItem`s (caption, question, lettered options) and returns one `JudgeReply`
each: the chosen letter, or None with the reason (malformed reply, timeout, HTTP error). Judges
never raise on a bad reply; the reward turns a missing letter into zero, counts it as failed and
raises `JudgeFailure` when too many of a call's replies failed (a judge that is down).

Back-ends (`make_judge({"name": ..., **params})`):

* ``lexical``: deterministic; parses a caption of a synthetic scene and a templated question and
  answers from what the caption states (it cannot answer from an empty or unrelated caption);
* ``hf``: any Hugging Face causal LM from a local directory, by sampled generation (first valid
  letter) or by the log-likelihood of the option letters;
* ``http``: an OpenAI-compatible server (what vLLM serves): `chat` (one request per question, sent
  concurrently) or `completions` (many prompts per request), each request with a timeout,
  retries with backoff, and a deadline for the whole call so the trainer never blocks forever.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from mmrl.rewards import RewardFailure

LETTERS = string.ascii_uppercase
CANNOT_ANSWER = "Cannot answer from the caption"
_LETTER_RE = re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])")


@dataclass
class JudgeItem:
    caption: str
    question: str
    options: list[str]  # shown lettered A, B, ... in this order
    grid: int = 2  # the synthetic scene's grid (the lexical judge reads positions with it)


@dataclass
class JudgeReply:
    letter: str | None
    raw: str = ""
    error: str | None = None  # why there is no letter


def format_prompt(item: JudgeItem) -> str:
    options = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(item.options))
    return (f"Caption: {item.caption}\n\nAnswer the question using only the caption.\n"
            f"Question: {item.question}\n{options}\nAnswer with the letter of one option.\nAnswer:")


def parse_letter(text: str, n_options: int) -> str | None:
    """The first standalone capital letter among the first `n_options` letters (CapRL's rule)."""
    valid = LETTERS[:n_options]
    for m in _LETTER_RE.finditer(text or ""):
        if m.group(1) in valid:
            return m.group(1)
    return None


def reply_from_text(text: str, n_options: int) -> JudgeReply:
    letter = parse_letter(text, n_options)
    if letter is None:
        return JudgeReply(None, text, f"malformed reply (no option letter A-{LETTERS[n_options - 1]}): {text[:60]!r}")
    return JudgeReply(letter, text)


class Judge(Protocol):
    def judge(self, items: list[JudgeItem]) -> list[JudgeReply]: ...


class JudgeFailure(RewardFailure):
    """Too many of one reward call's judge replies failed: the judge is down or broken, and training
    on its all-zero rewards would teach nothing. The message names the judge and the main reason."""


def judge_name(judge: Judge) -> str:
    """What a message says the judge is: its back-end and where it runs (a custom judge: its class)."""
    describe = getattr(judge, "describe", None)
    return describe() if callable(describe) else type(judge).__name__


# ----------------------------------------------------------------------------- lexical


class LexicalJudge:
    """Answers templated questions about synthetic scenes from the objects a caption states.

    The answer is computed with the same query code the generator used on the true scene
    (`mmrl.envs.captioning.scenes.answer_query`) but over the caption's parsed objects; when those
    do not determine it (or the question is not templated), the judge picks the cannot-answer
    option, or, if there is none, the first option."""

    def describe(self) -> str:
        return "lexical"

    def judge(self, items: list[JudgeItem]) -> list[JudgeReply]:
        from mmrl.envs.captioning.scenes import (
            answer_query,
            parse_caption,
            parse_question,
        )

        out = []
        for it in items:
            parsed = parse_question(it.question)
            answer = answer_query(*parsed, parse_caption(it.caption, it.grid), it.grid) if parsed else None
            if answer in it.options:
                idx = it.options.index(answer)
            else:
                idx = it.options.index(CANNOT_ANSWER) if CANNOT_ANSWER in it.options else 0
            out.append(JudgeReply(LETTERS[idx], LETTERS[idx]))
        return out


# ----------------------------------------------------------------------------- Hugging Face


class HFJudge:
    """A local causal LM. `mode="generate"` samples up to `max_new_tokens` at `temperature` and
    takes the first valid letter; `mode="loglik"` reads the next-token logits of the option letters
    (argmax at temperature 0, else a sample from their softmax at `temperature`)."""

    MODES = ("generate", "loglik")

    def __init__(self, path: str | Path, mode: str = "generate", temperature: float = 0.6, max_new_tokens: int = 8,
                 batch_size: int = 32, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 use_chat_template: bool | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if mode not in self.MODES:
            raise ValueError(f"hf judge: unknown mode {mode!r}; valid: {', '.join(self.MODES)}")
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"hf judge: {path} has no config.json (a saved model directory is needed)")
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        self.mode, self.temperature, self.max_new_tokens = mode, float(temperature), int(max_new_tokens)
        self.batch_size, self.device = int(batch_size), torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.cpu_generator = torch.Generator().manual_seed(seed)  # for loglik's letter sampling
        self.chat = bool(self.tokenizer.chat_template) if use_chat_template is None else use_chat_template
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        self.eos_ids = list(dict.fromkeys(i for i in [eos, *gen_eos] if i is not None))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        # Each letter's first token, bare and after a space (what follows "Answer:" in most tokenizers).
        self.letter_ids = [sorted({self.tokenizer.encode(v, add_special_tokens=False)[0] for v in (c, " " + c)})
                           for c in LETTERS]

    def describe(self) -> str:
        return f"hf {self.path} ({self.mode})"

    def _prompt(self, item: JudgeItem) -> str:
        text = format_prompt(item)
        if self.chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return text

    @torch.no_grad()
    def judge(self, items: list[JudgeItem]) -> list[JudgeReply]:
        out: list[JudgeReply] = []
        for lo in range(0, len(items), self.batch_size):
            part = items[lo:lo + self.batch_size]
            enc = self.tokenizer([self._prompt(it) for it in part], return_tensors="pt", padding=True,
                                 padding_side="left", add_special_tokens=False).to(self.device)
            out += self._generate(part, enc) if self.mode == "generate" else self._loglik(part, enc)
        return out

    def _generate(self, part: list[JudgeItem], enc) -> list[JudgeReply]:
        from mmrl.rollout import sample_tokens

        res = sample_tokens(self.model, enc.input_ids, enc.attention_mask, max_new_tokens=self.max_new_tokens,
                            eos_token_ids=self.eos_ids, pad_token_id=self.pad_id, temperature=self.temperature,
                            generator=self.generator)
        texts = self.tokenizer.batch_decode([t[m].tolist() for t, m in zip(res.tokens, res.mask)],
                                            skip_special_tokens=True)
        return [reply_from_text(t, len(it.options)) for t, it in zip(texts, part)]

    def _loglik(self, part: list[JudgeItem], enc) -> list[JudgeReply]:
        from mmrl.rollout import positions_from_mask

        pos = positions_from_mask(enc.attention_mask)
        logits = self.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, position_ids=pos,
                            logits_to_keep=1).logits[:, -1].float().log_softmax(-1)
        out = []
        for row, it in zip(logits, part):
            # A letter's score: log of the summed probability of its token variants.
            scores = torch.stack([row[self.letter_ids[i]].logsumexp(0) for i in range(len(it.options))])
            if self.temperature > 0:
                idx = int(torch.multinomial((scores / self.temperature).softmax(0).cpu(), 1,
                                            generator=self.cpu_generator))
            else:
                idx = int(scores.argmax())
            out.append(JudgeReply(LETTERS[idx], f"loglik {scores.tolist()}"))
        return out


# ----------------------------------------------------------------------------- HTTP (OpenAI-compatible)


class HTTPJudge:
    """An OpenAI-compatible endpoint (`base_url` ends before /chat/completions, e.g.
    http://127.0.0.1:8000/v1). Every request has `timeout` seconds and `retries` retries (timeouts,
    connection errors and 5xx; 4xx is final); the whole `judge` call gives up after `deadline`
    seconds, and every item without a reply by then gets the reason instead of a letter."""

    MODES = ("chat", "completions")

    def __init__(self, base_url: str, model: str = "judge", mode: str = "chat", temperature: float = 0.6,
                 max_tokens: int = 8, batch_size: int = 16, concurrency: int = 8, timeout: float = 10.0,
                 retries: int = 2, backoff: float = 0.2, deadline: float = 60.0, api_key_env: str = "OPENAI_API_KEY"):
        import httpx

        if mode not in self.MODES:
            raise ValueError(f"http judge: unknown mode {mode!r}; valid: {', '.join(self.MODES)}")
        if timeout <= 0 or deadline <= 0 or retries < 0 or concurrency < 1 or batch_size < 1:
            raise ValueError(f"http judge: need timeout > 0, deadline > 0, retries >= 0, concurrency >= 1, "
                             f"batch_size >= 1; got {timeout}, {deadline}, {retries}, {concurrency}, {batch_size}")
        self.url = base_url.rstrip("/") + ("/chat/completions" if mode == "chat" else "/completions")
        self.model, self.mode, self.temperature, self.max_tokens = model, mode, temperature, max_tokens
        self.batch_size, self.concurrency = batch_size, concurrency
        self.retries, self.backoff, self.deadline = retries, backoff, deadline
        key = os.environ.get(api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(timeout=httpx.Timeout(timeout), headers=headers,
                                   limits=httpx.Limits(max_connections=concurrency))

    def describe(self) -> str:
        return f"http {self.url} (model {self.model})"

    def close(self) -> None:
        self.client.close()

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST with retries; raises RuntimeError with the last reason."""
        import httpx

        reason = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                r = self.client.post(self.url, json=payload)
            except httpx.TimeoutException:
                reason = "timeout"
                continue
            except httpx.HTTPError as exc:
                reason = f"connection error: {type(exc).__name__}"
                continue
            if r.status_code >= 500:
                reason = f"http {r.status_code}"
                continue
            if r.status_code >= 400:
                raise RuntimeError(f"http {r.status_code}: {r.text[:80]!r}")
            try:
                return r.json()
            except ValueError:
                raise RuntimeError(f"malformed reply (not JSON): {r.text[:60]!r}") from None
        raise RuntimeError(f"{reason} after {self.retries + 1} attempts")

    def _chat_texts(self, prompts: list[str]) -> list[tuple[str | None, str | None]]:
        """One chat request for a one-prompt part: [(text, None)], or [(None, reason)]."""
        body = self._post({"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                           "messages": [{"role": "user", "content": prompts[0]}]})
        try:
            return [(str(body["choices"][0]["message"]["content"]), None)]
        except (KeyError, IndexError, TypeError):
            return [(None, f"malformed reply (no choices[0].message.content): {str(body)[:60]!r}")]

    def _completion_texts(self, prompts: list[str]) -> list[tuple[str | None, str | None]]:
        """One completions request for a batch of prompts."""
        body = self._post({"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                           "prompt": prompts})
        texts: dict[int, str] = {}
        try:
            for j, c in enumerate(body["choices"]):
                texts[int(c.get("index", j))] = str(c["text"])
        except (KeyError, TypeError, ValueError, AttributeError):
            texts = {}
        return [(texts[j], None) if j in texts else (None, f"malformed reply (no choices[{j}].text)")
                for j in range(len(prompts))]

    def complete(self, prompts: list[str]) -> list[tuple[str | None, str | None]]:
        """The endpoint's text for each prompt as (text, None), or (None, the reason): a timeout, an
        HTTP error, a malformed reply, or the call's deadline passing first. Never raises."""
        size = 1 if self.mode == "chat" else self.batch_size
        parts = [prompts[lo:lo + size] for lo in range(0, len(prompts), size)]
        call = self._chat_texts if self.mode == "chat" else self._completion_texts
        done: list[list[tuple[str | None, str | None]] | None] = [None] * len(parts)
        pool = cf.ThreadPoolExecutor(max_workers=self.concurrency)
        futures = {pool.submit(call, p): i for i, p in enumerate(parts)}
        try:
            for fut in cf.as_completed(futures, timeout=self.deadline):
                i = futures[fut]
                try:
                    done[i] = fut.result()
                except RuntimeError as exc:
                    done[i] = [(None, str(exc))] * len(parts[i])
        except cf.TimeoutError:
            pass  # the parts still missing get the deadline as their reason below
        finally:
            # Requests in flight end at their own timeout; nothing waits for them here.
            pool.shutdown(wait=False, cancel_futures=True)
        late = (None, f"deadline of {self.deadline:g} s passed")
        return [r for i, p in enumerate(parts) for r in (done[i] or [late] * len(p))]

    def judge(self, items: list[JudgeItem]) -> list[JudgeReply]:
        texts = self.complete([format_prompt(it) for it in items])
        return [reply_from_text(text, len(it.options)) if text is not None else JudgeReply(None, "", why)
                for it, (text, why) in zip(items, texts)]


# ----------------------------------------------------------------------------- registry

JUDGES: dict[str, type] = {"lexical": LexicalJudge, "hf": HFJudge, "http": HTTPJudge}


def make_judge(spec: str | dict[str, Any]) -> Judge:
    """A judge from {"name": lexical | hf | http, **its params} (or just the name)."""
    spec = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = spec.pop("name", None)
    if name not in JUDGES:
        raise ValueError(f"judge: unknown name {name!r}; valid: {', '.join(JUDGES)}")
    try:
        return JUDGES[name](**spec)
    except TypeError as exc:
        raise ValueError(f"judge {name!r}: bad parameters {sorted(spec)}: {exc}") from None
