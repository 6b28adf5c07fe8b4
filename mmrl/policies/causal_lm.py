"""Policy adapter for a Hugging Face causal LM: sample with log-probs, recompute them teacher-forced.

The only piece of the text domain that knows a model. The trainer calls `sample`, `logprobs`,
`decode`, `sft_loss` and `save`; the same code runs a tiny model built from a config (tests, CPU
demo) or any local checkpoint loaded with `from_pretrained(dir)`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mmrl.policies.base import PolicyBase, apply_lora
from mmrl.policies.fast_decode import FastDecoder, completion_logprobs
from mmrl.rollout import Rollout, sample_tokens


class CausalLMPolicy(PolicyBase):
    def __init__(self, model: nn.Module, tokenizer, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, max_new_tokens: int = 16, use_chat_template: bool = False,
                 fast_decode: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.use_chat_template = use_chat_template
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # Vision placeholders must never be sampled: a stray <|image_pad|> breaks the forward.
        special = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
        vocab = tokenizer.get_vocab()
        self.suppress_token_ids = [vocab[t] for t in special if t in vocab]
        self._suppress = torch.tensor(self.suppress_token_ids, dtype=torch.long)
        self.reference = None
        self._fast = None
        if fast_decode:
            self._fast = FastDecoder.maybe(model)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg, task, device="cpu") -> CausalLMPolicy:
        corpus = task.corpus() if cfg.model.source == "tiny" else None
        return cls.from_model_config(cfg.model, cfg.sampling, corpus=corpus, seed=cfg.train.seed, device=device)

    @classmethod
    def from_model_config(cls, model_cfg, sampling_cfg, corpus=None, seed: int = 0, device="cpu") -> CausalLMPolicy:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = getattr(torch, model_cfg.dtype)
        if model_cfg.source == "pretrained":
            path = Path(model_cfg.path)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"model.path {path} has no config.json: not a saved checkpoint directory")
            tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        else:
            from mmrl.tiny import build_tiny_qwen2, build_tokenizer

            if corpus is None:
                raise ValueError("a tiny model needs the task's corpus to train its tokenizer")
            tokenizer = build_tokenizer(corpus, vocab_size=model_cfg.tokenizer_vocab_size)
            model = build_tiny_qwen2(tokenizer, seed=seed, **model_cfg.tiny).to(dtype)
        model = apply_lora(model, model_cfg).to(device)
        return cls(model, tokenizer, temperature=sampling_cfg.temperature, top_k=sampling_cfg.top_k,
                   top_p=sampling_cfg.top_p, max_new_tokens=sampling_cfg.max_new_tokens,
                   use_chat_template=model_cfg.use_chat_template, fast_decode=model_cfg.fast_decode and model_cfg.lora_rank == 0)

    def save(self, directory: str | Path) -> None:
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    # ------------------------------------------------------------------ tokenisation

    def _prompt_text(self, prompt: str) -> str:
        if not self.use_chat_template:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

    def encode_prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer([self._prompt_text(p) for p in prompts], return_tensors="pt", padding=True,
                             padding_side="left", add_special_tokens=False)
        return enc.input_ids.to(self.device), enc.attention_mask.to(self.device)

    def decode(self, rollout: Rollout) -> list[str]:
        rows = [u[m].tolist() for u, m in zip(rollout.units.cpu(), rollout.mask.cpu())]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    # ------------------------------------------------------------------ sampling

    def sample(self, contexts: list[dict], group_size: int, generator: torch.Generator | None = None,
               group_offset: int = 0, temperature: float | None = None) -> Rollout:
        prompt_ids, prompt_mask = self.encode_prompts([c["prompt"] for c in contexts])
        prompt_ids = prompt_ids.repeat_interleave(group_size, 0)
        prompt_mask = prompt_mask.repeat_interleave(group_size, 0)
        kwargs = dict(max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos_token_ids,
                      pad_token_id=self.pad_token_id,
                      temperature=self.temperature if temperature is None else temperature, top_k=self.top_k,
                      top_p=self.top_p, suppress_token_ids=self.suppress_token_ids, generator=generator)
        was_training = self.model.training
        self.model.eval()
        if self._fast is not None:
            out = self._fast.sample(prompt_ids, prompt_mask, **kwargs)
        else:
            out = sample_tokens(self.model, prompt_ids, prompt_mask, **kwargs)
        self.model.train(was_training)
        n = len(contexts)
        group_ids = torch.arange(group_offset, group_offset + n, device=self.device).repeat_interleave(group_size)
        return Rollout(
            group_ids=group_ids,
            units=out.tokens,
            logp_old=out.logp,
            mask=out.mask,
            truncated=out.truncated,
            contexts=[c for c in contexts for _ in range(group_size)],
            extras={"prompt_ids": prompt_ids, "prompt_mask": prompt_mask},
        )

    # ------------------------------------------------------------------ teacher forcing

    def _token_logprobs(self, model: nn.Module, prompt_ids, prompt_mask, units, with_entropy: bool,
                        temperature: float | None = None):
        return completion_logprobs(model, self._fast, prompt_ids, prompt_mask, units,
                                   temperature=self.temperature if temperature is None else temperature,
                                   suppress=self._suppress, with_entropy=with_entropy)

    def logprobs(self, rollout: Rollout, with_entropy: bool = False):
        e = rollout.extras
        return self._token_logprobs(self.model, e["prompt_ids"], e["prompt_mask"], rollout.units, with_entropy)

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        e = rollout.extras
        with self.reference_module() as ref:
            return self._token_logprobs(ref, e["prompt_ids"], e["prompt_mask"], rollout.units, False)[0]

    def sft_loss(self, contexts: list[dict]) -> torch.Tensor:
        """Token-mean negative log-likelihood of `target` + EOS after each prompt."""
        prompt_ids, prompt_mask = self.encode_prompts([c["prompt"] for c in contexts])
        eos = self.tokenizer.eos_token
        enc = self.tokenizer([c["target"] + eos for c in contexts], return_tensors="pt", padding=True,
                             padding_side="right", add_special_tokens=False)
        units, mask = enc.input_ids.to(self.device), enc.attention_mask.bool().to(self.device)
        logp, _ = self._token_logprobs(self.model, prompt_ids, prompt_mask, units, False, temperature=1.0)
        return -torch.where(mask, logp, 0.0).sum() / mask.sum()
