"""Policy adapter for a Hugging Face causal LM: sample with log-probs, recompute them teacher-forced.

The only piece of the text domain that knows a model. The trainer calls `sample`, `logprobs`,
`decode`, `sft_loss` and `save`; the same code runs a tiny model built from a config (tests, CPU
demo) or any local checkpoint loaded with `from_pretrained(dir)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmrl.policies.base import TextPolicyBase, apply_lora, checkpoint_dir, sampling_settings
from mmrl.policies.fast_decode import FastDecoder, completion_logprobs
from mmrl.policies.vllm_engine import attach_engine
from mmrl.rollout import sample_tokens


@dataclass
class CausalLMConfig:
    """`model.params` of `causal_lm`: none (the model, tokenizer and sampling come from `model` and
    `sampling`)."""


class CausalLMPolicy(TextPolicyBase):
    CONFIG = CausalLMConfig

    def __init__(self, model: nn.Module, tokenizer, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, max_new_tokens: int = 16, use_chat_template: bool = False,
                 fast_decode: bool = True):
        super().__init__(model, tokenizer, temperature=temperature, top_k=top_k, top_p=top_p,
                         max_new_tokens=max_new_tokens)
        self.use_chat_template = use_chat_template
        self.eos_token_ids = [tokenizer.eos_token_id]
        # Vision placeholders must never be sampled: a stray <|image_pad|> breaks the forward.
        special = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
        vocab = tokenizer.get_vocab()
        self.suppress_token_ids = [vocab[t] for t in special if t in vocab]
        self._fast = None
        if fast_decode:
            self._fast = FastDecoder.maybe(model)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg, task, device="cpu") -> CausalLMPolicy:
        corpus = task.corpus() if cfg.model.source == "tiny" else None
        policy = cls.from_model_config(cfg.model, cfg.sampling, corpus=corpus, seed=cfg.train.seed, device=device)
        attach_engine(policy, cfg)
        return policy

    @classmethod
    def from_model_config(cls, model_cfg, sampling_cfg, corpus=None, seed: int = 0, device="cpu") -> CausalLMPolicy:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = getattr(torch, model_cfg.dtype)
        if model_cfg.source == "pretrained":
            path = checkpoint_dir(model_cfg.path)
            tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        else:
            from mmrl.tiny import build_tiny_qwen2, build_tokenizer

            if corpus is None:
                raise ValueError("a tiny model needs the task's corpus to train its tokenizer")
            tokenizer = build_tokenizer(corpus, vocab_size=model_cfg.tokenizer_vocab_size)
            model = build_tiny_qwen2(tokenizer, seed=seed, **model_cfg.tiny).to(dtype)
        model = apply_lora(model, model_cfg).to(device)
        return cls(model, tokenizer, **sampling_settings(sampling_cfg), use_chat_template=model_cfg.use_chat_template,
                   fast_decode=model_cfg.fast_decode and model_cfg.lora_rank == 0)

    # ------------------------------------------------------------------ tokenisation

    def _prompt_text(self, prompt: str) -> str:
        if not self.use_chat_template:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

    def encode(self, contexts: list[dict]) -> dict[str, torch.Tensor]:
        """Left-padded prompt tensors [n, P] of the contexts' `prompt`s."""
        enc = self.tokenizer([self._prompt_text(c["prompt"]) for c in contexts], return_tensors="pt", padding=True,
                             padding_side="left", add_special_tokens=False)
        return {"prompt_ids": enc.input_ids.to(self.device), "prompt_mask": enc.attention_mask.to(self.device)}

    def engine_prompts(self, contexts: list[dict]) -> list[dict]:
        return [{"prompt_token_ids": self.tokenizer(self._prompt_text(c["prompt"]), add_special_tokens=False).input_ids}
                for c in contexts]

    def target_text(self, context: dict, i: int = 0) -> str:
        return context["target"]

    # ------------------------------------------------------------------ sampling

    def _generate(self, enc, rows, group_size, kwargs):
        if self._fast is not None:
            return self._fast.sample(rows["prompt_ids"], rows["prompt_mask"], **kwargs)
        return sample_tokens(self.model, rows["prompt_ids"], rows["prompt_mask"], **kwargs)

    # ------------------------------------------------------------------ teacher forcing

    def _token_logprobs(self, model: nn.Module, prompts: dict[str, torch.Tensor], units, with_entropy: bool,
                        temperature: float | None = None, window: slice | None = None):
        return completion_logprobs(model, self._fast, prompts["prompt_ids"], prompts["prompt_mask"], units,
                                   temperature=self.temperature if temperature is None else temperature,
                                   # read at each call: sampling and scoring suppress the same ids
                                   suppress=torch.tensor(self.suppress_token_ids, dtype=torch.long),
                                   with_entropy=with_entropy, window=window,
                                   chunk=self.logprob_chunk)
