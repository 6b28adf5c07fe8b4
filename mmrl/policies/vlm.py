"""Policy adapter for any Hugging Face vision-language model: image(s) + text in, text out.

`model.policy: vlm` takes whatever `AutoModelForImageTextToText` and `AutoProcessor` load (Gemma 3,
InternVL, LFM2-VL, SmolVLM / Idefics3, Qwen3.5, the Qwen-VLs, ...), as TRL's GRPO does. The
model's own forward is the general path; a Qwen2-VL / Qwen2.5-VL / Qwen3-VL gets the Qwen-VL
adapter's fast paths instead (`mmrl.policies.qwen_vl`: vision tower once per image, the lean
decoder), picked when the model loads (`vlm_policy_class`).

Contexts are dicts with a text prompt (`prompt_key`, default "prompt") and an image or a list of
images (`image_key`, default "frame": uint8 HxWx3 arrays, PIL images or file paths; None for a
text-only context). Each is rendered as one user turn of the processor's chat template, the images
where the prompt's `<image>` placeholders stand, else before the text.

The general path, and why its log-probs agree between sampling and training:
* Vision inputs differ in shape from one family to the next (flat patches and grids, per-image
  crops, tiles with masks), so the rollout keeps each context's chat text and images
  (`VLMPrompt`, shared by its G rows) and the processor itself batches the rows it is given, the
  same way for sampling and for every teacher-forced micro-batch. Its token columns (the prompt,
  Gemma's `token_type_ids`, ...) are checked against the rollout's prompt, so a processor that
  tokenised differently the second time cannot go unnoticed.
* Positions are the model's own (from the cache position, as in `generate`); a row's are shifted
  by its left padding, which differs between sampling and training: the rotary embeddings these
  models use see only position differences. A multimodal-RoPE model (`get_rope_index`: Qwen3.5,
  GLM-4V) keeps its images' positions as state between calls when not given them, so the adapter
  computes them with the model's own rule and always passes them (`mrope_positions`).
* Sampling prefills each context once (vision + prompt) and repeats its KV cache for the G
  samples (every prompt G times where the cache cannot be repeated, e.g. a hybrid conv cache).
* Teacher forcing runs the model's multimodal body (`model.model`) for final hidden states, then
  the output head a chunk of tokens at a time (`head_logprobs`): no [N, T, V] logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmrl.policies.base import TextPolicyBase, apply_lora, checkpoint_dir, sampling_settings
from mmrl.hf_compat import cache_kwargs, cache_of
from mmrl.policies.vllm_engine import attach_engine
from mmrl.rollout import Rollout, head_logprobs, sample_tokens

IMAGE_PLACEHOLDER = "<image>"  # where a prompt places an image (EasyR1, Geometry3K, MathVerse layouts)
# Qwen-VLs, whose adapter has fast paths (mmrl.policies.qwen_vl).
QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Config ids that are text, not vision placeholders (the rest of `*_token_id(x)` are suppressed).
_TEXT_TOKEN_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id")


@dataclass
class VLMConfig:
    """`model.params` of `vlm`: what the policy reads from contexts, the processor's settings and
    how `from_config` builds the model."""

    image_key: str = "frame"
    prompt_key: str = "prompt"
    target_key: str = "target"
    target_join: str = " "  # joins a list target into one string
    system_prompt: str | None = None
    # More arguments of every processor call on images (the family's image-size settings, e.g.
    # Qwen's max_pixels, SmolVLM's do_image_splitting).
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    arch: str = "gemma3"  # a tiny build's family (mmrl.tiny_vlm.VLM_FAMILIES)
    freeze_vision: bool = False

    def __post_init__(self):
        from mmrl.tiny_vlm import VLM_FAMILIES

        if self.arch not in VLM_FAMILIES:
            raise ValueError(f"model.params.arch: unknown tiny VLM family {self.arch!r}; valid: {', '.join(VLM_FAMILIES)}")


@dataclass(frozen=True, eq=False)
class VLMPrompt:
    """A context as the processor reads it: its chat text and images. The G rows of a context share
    one object; `mask_images` gives a row its own."""

    text: str
    images: tuple = ()


def to_image(x: Any, where: str):
    """A PIL RGB image from an HxWx3 uint8 array, a PIL image or a file path."""
    from PIL import Image

    if isinstance(x, Image.Image):
        return x.convert("RGB")
    if isinstance(x, (str, Path)):
        return Image.open(x).convert("RGB")
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        if x.dtype != np.uint8 or x.ndim != 3 or x.shape[-1] != 3:
            raise ValueError(f"{where}: expected a uint8 HxWx3 image, got dtype {x.dtype} shape {x.shape}")
        return Image.fromarray(x)
    raise TypeError(f"{where}: expected a uint8 HxWx3 array, a PIL image or a path, got {type(x).__name__}")


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def multimodal_body(model: nn.Module) -> nn.Module:
    """The model without its output head (`model.model` of a `...ForConditionalGeneration`): vision
    inputs in, final hidden states out."""
    hf = hf_model(model)
    body = getattr(hf, "model", None)
    if body is None or hf.get_output_embeddings() is None:
        raise TypeError(f"model type {hf.config.model_type!r} ({type(hf).__name__}) has no body + output head "
                        "(model.model, get_output_embeddings()) to score tokens with; accepted: a Hugging Face "
                        "...ForConditionalGeneration vision-language model")
    return body


def is_qwen_vl(model: nn.Module) -> bool:
    return hf_model(model).config.model_type in QWEN_VL_MODEL_TYPES


def vlm_policy_class(model: nn.Module) -> type[VLMPolicy]:
    """The adapter for `model`: the Qwen-VL one (its fast paths) for a Qwen-VL, else the general one."""
    if is_qwen_vl(model):
        from mmrl.policies.qwen_vl import QwenVLPolicy

        return QwenVLPolicy
    return VLMPolicy


def load_vlm(path: str | Path, dtype: torch.dtype = torch.float32):
    """A saved vision-language model and its processor, each failure one line: not a VLM
    transformers can load, or a processor without a chat template."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    path = checkpoint_dir(path)
    config = AutoConfig.from_pretrained(path)
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise ValueError(f"model.path {path}: model type {config.model_type!r} is not a vision-language model "
                         "transformers can load (AutoModelForImageTextToText); accepted: a model type of "
                         "transformers' image-text-to-text models (Gemma 3, Qwen-VL, SmolVLM, InternVL, ...); "
                         "a text-only model takes model.policy: causal_lm") from None
    processor = AutoProcessor.from_pretrained(path)
    check_chat_template(processor, f"model.path {path}")
    return model, processor


def check_chat_template(processor, where: str) -> None:
    if getattr(processor, "chat_template", None) is None or not hasattr(processor, "image_processor"):
        what = "has no chat template" if hasattr(processor, "image_processor") else "is not a multimodal processor"
        raise ValueError(f"{where}: its processor ({type(processor).__name__}) {what}; accepted: a processor "
                         "with an image processor and a chat template (chat_template.jinja or the processor "
                         "config's chat_template), as the model's instruct releases ship")


def rope_index_owner(model: nn.Module) -> nn.Module | None:
    """The module with `get_rope_index` (multimodal RoPE: Qwen3.5, GLM-4V, ...), or None. Such a model
    keeps the positions of a prompt's images as state between calls (`rope_deltas`) when it is not
    given them, so the adapter computes them itself and always passes them."""
    hf = hf_model(model)
    for m in (hf, getattr(hf, "model", None)):
        if m is not None and hasattr(m, "get_rope_index"):
            return m
    return None


def mrope_positions(owner: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    inputs: dict[str, Any]) -> torch.Tensor:
    """The 3-D positions [3, B, S] of left-padded rows (pads get 0) from the model's own rule."""
    types = inputs.get("mm_token_type_ids")
    types = torch.zeros_like(input_ids) if types is None else types
    pos, _ = owner.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=inputs.get("image_grid_thw"),
                                  attention_mask=attention_mask)
    return pos


def repeatable(cache) -> bool:
    """Whether `cache.batch_repeat_interleave` works: every layer's cache has it (a linear-attention
    or conv layer's state may not)."""
    return hasattr(cache, "batch_repeat_interleave") and all(
        hasattr(layer, "batch_repeat_interleave") for layer in getattr(cache, "layers", ()))


class VLMStepper:
    """Next-token logits for `sample_tokens` from the model's own forward: vision inputs at prefill,
    which runs once per context (rows `::group_size`); its KV cache is then repeated for the G
    samples. A cache that cannot be repeated (`batch_repeat_interleave`) gets every row prefilled."""

    def __init__(self, model: nn.Module, context_inputs: dict, row_inputs, group_size: int):
        self.model = model
        self.context_inputs = context_inputs  # the processor's vision and token columns, a row per context
        self.row_inputs = row_inputs  # () -> the same, a row per sample (the rare fallback)
        self.group_size = group_size
        self.rope_owner = rope_index_owner(model)
        self.next_pos = None  # multimodal RoPE: each row's next position (text: the same on every axis)

    def _prefill(self, input_ids, attention_mask, inputs):
        if self.rope_owner is not None:
            pos = mrope_positions(self.rope_owner, input_ids, attention_mask, inputs)
            # Text after the prompt continues at max(position) + 1 on every axis (get_rope_index's rule).
            self.next_pos = pos.amax(dim=(0, 2)) + 1
            inputs = {**inputs, "position_ids": pos}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1, **inputs)
        return out.logits[:, -1, :].float(), cache_of(out)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        G = self.group_size
        self.attn = attention_mask
        logits, cache = self._prefill(input_ids[::G], attention_mask[::G], self.context_inputs)
        if G == 1:
            self.cache = cache
            return logits
        if repeatable(cache):
            cache.batch_repeat_interleave(G)
            self.cache = cache
            if self.next_pos is not None:
                self.next_pos = self.next_pos.repeat_interleave(G)
            return logits.repeat_interleave(G, 0)
        logits, self.cache = self._prefill(input_ids, attention_mask, self.row_inputs())
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        # Tokens fed after a row's EOS come after all its real tokens; causal attention keeps them
        # away from anything trained, so they can stay attendable.
        self.attn = torch.cat([self.attn, self.attn.new_ones(self.attn.shape[0], 1)], dim=1)
        pos = {}
        if self.next_pos is not None:
            pos = {"position_ids": self.next_pos.view(1, -1, 1).expand(3, -1, 1)}
            self.next_pos = self.next_pos + 1
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attn, use_cache=True,
                         **cache_kwargs(self.model, self.cache), **pos)
        self.cache = cache_of(out)
        return out.logits[:, -1, :].float()


class VLMPolicy(TextPolicyBase):
    CONFIG = VLMConfig
    can_mask_images = True

    def __init__(self, model: nn.Module, processor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 max_new_tokens: int = 16, image_key: str = "frame", prompt_key: str = "prompt",
                 target_key: str = "target", target_join: str = " ", system_prompt: str | None = None,
                 processor_kwargs: dict[str, Any] | None = None):
        super().__init__(model, processor.tokenizer, processor=processor, temperature=temperature, top_k=top_k,
                         top_p=top_p, max_new_tokens=max_new_tokens)
        check_chat_template(processor, type(hf_model(model).config).__name__)
        multimodal_body(model)  # a model this adapter cannot score is refused here, in one line
        self.image_key = image_key
        self.prompt_key = prompt_key
        self.target_key = target_key
        self.target_join = target_join
        self.system_prompt = system_prompt
        self.image_kwargs = dict(processor_kwargs or {})
        tok = self.tokenizer
        gen_eos = getattr(getattr(hf_model(model), "generation_config", None), "eos_token_id", None)
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        # The tokenizer's EOS first (it ends SFT targets); then the checkpoint's other stop ids.
        self.eos_token_ids = list(dict.fromkeys(i for i in [tok.eos_token_id, *gen_eos] if i is not None))
        if not self.eos_token_ids:
            raise ValueError("the tokenizer has no eos_token and the model's generation_config no eos_token_id")
        self.suppress_token_ids = self._suppressed_ids()

    def _suppressed_ids(self) -> list[int]:
        """Vision placeholders (the processor's image token, the config's `*_token_id` / `*_token_index`
        other than text ones: a sampled one breaks the next forward) and the padded vocabulary rows past
        the tokenizer, which no text decodes to."""
        cfg, vocab = hf_model(self.model).config, self.tokenizer.get_vocab()
        ids = {v for k, v in cfg.to_dict().items() if k.endswith(("_token_id", "_token_index"))
               and k not in _TEXT_TOKEN_KEYS and isinstance(v, int)}
        for attr in ("image_token", "boi_token", "eoi_token", "video_token", "fake_image_token", "global_image_token"):
            token = getattr(self.processor, attr, None)
            if isinstance(token, str) and token in vocab:
                ids.add(vocab[token])
        ids -= set(self.eos_token_ids)
        n_vocab = self.model.get_output_embeddings().weight.shape[0]
        ids |= set(range(len(self.tokenizer), n_vocab))
        return sorted(i for i in ids if 0 <= i < n_vocab)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg, task, device="cpu") -> VLMPolicy:
        """`model.source: tiny` builds a tiny model of `model.params.arch` (mmrl.tiny_vlm) with a tokenizer
        trained on the task's text; `pretrained` loads `model.path`. The adapter is the Qwen-VL one for
        a Qwen-VL (`vlm_policy_class`), else this one."""
        m, params = cfg.model, dict(cfg.model.params)
        cls.check_params(params)
        arch = params.pop("arch", cls.CONFIG.arch)
        freeze_vision = params.pop("freeze_vision", False)
        model, processor = cls.build_model(cfg, task, arch, params)
        if freeze_vision:
            freeze_vision_tower(model)
        # The default LoRA targets (q_proj, ...) name only language-model layers.
        model = apply_lora(model, m).to(device)
        adapter = vlm_policy_class(model) if cls is VLMPolicy else cls
        policy = adapter(model, processor, **sampling_settings(cfg.sampling), **adapter.extra_settings(cfg), **params)
        attach_engine(policy, cfg)
        return policy

    @classmethod
    def build_model(cls, cfg, task, arch: str, params: dict):
        m = cfg.model
        dtype = getattr(torch, m.dtype)
        if m.source == "pretrained":
            return load_vlm(m.path, dtype)
        from mmrl.tiny_vlm import build_tiny_vlm

        if m.tiny:
            raise ValueError(f"model.tiny {dict(m.tiny)} cannot size model.policy vlm's tiny families (mmrl.tiny_vlm "
                             "builds each at one size); drop model.tiny")
        corpus = task.corpus() or corpus_from_sft(task, params)
        model, processor = build_tiny_vlm(arch, corpus, seed=cfg.train.seed, vocab_size=m.tokenizer_vocab_size)
        return model.to(dtype), processor

    @classmethod
    def extra_settings(cls, cfg) -> dict:
        """Constructor arguments from the config beyond sampling and `model.params`."""
        return {}

    @classmethod
    def from_pretrained(cls, path: str | Path, device="cpu", dtype: torch.dtype = torch.float32, **kwargs) -> VLMPolicy:
        model, processor = load_vlm(path, dtype)
        adapter = vlm_policy_class(model) if cls is VLMPolicy else cls
        return adapter(model.to(device), processor, **kwargs)

    # ------------------------------------------------------------------ encoding

    def _images(self, context: dict, i: int) -> list:
        value = context_field(context, self.image_key, i, "image_key")
        if value is None:
            return []
        items = value if isinstance(value, (list, tuple)) else [value]
        return [to_image(x, f"context {i} {self.image_key!r}") for x in items]

    def _chat_text(self, prompt: str, n_images: int, where: str = "context") -> str:
        """One user turn: the images where the prompt's `<image>` placeholders stand (EasyR1 /
        Geometry3K layout), or all of them before the text when it has none."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        pieces = prompt.split(IMAGE_PLACEHOLDER)
        if len(pieces) == 1:
            content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": prompt}]
        elif len(pieces) - 1 == n_images:
            content = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
            for text in pieces[1:]:
                content += [{"type": "image"}] + ([{"type": "text", "text": text}] if text else [])
        else:
            raise ValueError(f"{where}: the prompt has {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholder(s) for "
                             f"{n_images} image(s); give one per image, or none (images go first)")
        messages.append({"role": "user", "content": content})
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompts(self, contexts: list[dict]) -> list[VLMPrompt]:
        """Each context's chat text and images."""
        out = []
        for i, c in enumerate(contexts):
            imgs = self._images(c, i)
            text = self._chat_text(str(context_field(c, self.prompt_key, i, "prompt_key")), len(imgs), f"context {i}")
            out.append(VLMPrompt(text, tuple(imgs)))
        return out

    def engine_prompts(self, contexts: list[dict]) -> list[dict]:
        """Chat text (one placeholder per image; the engine expands it) with the images and the
        processor settings of `encode`, so engine and trainer see the same tokens."""
        out = []
        for p in self.prompts(contexts):
            prompt = {"prompt": p.text}
            if p.images:
                prompt["multi_modal_data"] = {"image": list(p.images)}
                prompt["mm_processor_kwargs"] = dict(self.image_kwargs)
            out.append(prompt)
        return out

    def processor_inputs(self, prompts: list[VLMPrompt]) -> dict[str, Any]:
        """The processor's left-padded batch of `prompts`: input_ids, attention_mask, the vision inputs
        and any other token columns, on the policy's device."""
        images = [list(p.images) for p in prompts]
        has_images = any(images)
        enc = self.processor(text=[p.text for p in prompts], images=images if has_images else None, padding=True,
                             padding_side="left", return_tensors="pt", **(self.image_kwargs if has_images else {}))
        dev = self.device
        return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in enc.items()}

    def encode(self, contexts: list[dict]) -> dict[str, Any]:
        """Left-padded prompt tensors [n, P] and each context's `VLMPrompt` (its rows share it)."""
        prompts = self.prompts(contexts)
        enc = self.processor_inputs(prompts)
        return {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"], "vlm_prompt": prompts}

    def model_inputs(self, prompts: list[VLMPrompt], prompt_ids: torch.Tensor, units: torch.Tensor | None = None
                     ) -> dict[str, Any]:
        """What the model's forward takes besides input_ids / attention_mask for rows of `prompts`
        whose prompt is `prompt_ids` [n, P] (left-padded) followed by `units` [n, T]: the vision
        inputs, and the processor's other token columns (e.g. Gemma's token_type_ids) padded to
        P + T (the units are text: 0)."""
        enc = self.processor_inputs(prompts)
        ids = enc.pop("input_ids")
        enc.pop("attention_mask")
        pad = prompt_ids.shape[1] - ids.shape[1]
        if pad < 0 or not torch.equal(ids, prompt_ids[:, pad:]):
            raise RuntimeError(f"{type(self.processor).__name__} tokenised the prompts differently from when they were "
                               "sampled (the rollout's prompt_ids); the processor must be deterministic")
        T = 0 if units is None else units.shape[1]
        for k, v in enc.items():
            if isinstance(v, torch.Tensor) and v.shape == ids.shape:  # a token column
                enc[k] = torch.nn.functional.pad(v, (pad, T))
        return enc

    # ------------------------------------------------------------------ sampling

    def _generate(self, enc, rows, group_size, kwargs):
        """Prefill each context once (`VLMStepper`), then its KV cache serves the G samples."""
        prompts = enc["vlm_prompt"]
        stepper = VLMStepper(self.model, self.model_inputs(prompts, enc["prompt_ids"]),
                             lambda: self.model_inputs(rows["vlm_prompt"], rows["prompt_ids"]), group_size)
        return sample_tokens(self.model, rows["prompt_ids"], rows["prompt_mask"], stepper=stepper, **kwargs)

    # ------------------------------------------------------------------ teacher forcing

    def _token_logprobs(self, model: nn.Module, extras: dict[str, Any], units: torch.Tensor, with_entropy: bool,
                        temperature: float | None = None, window: slice | None = None):
        """Log-probs (and entropy) of `units[:, window]` (default: all), teacher-forced after the prompts."""
        start, stop, _ = (window or slice(None)).indices(units.shape[1])
        units, T = units[:, :stop], stop - start  # later units cannot change a causal model's scores
        ids = torch.cat([extras["prompt_ids"], units], 1)
        attn = torch.cat([extras["prompt_mask"], torch.ones_like(units)], 1)
        inputs = self.model_inputs(extras["vlm_prompt"], extras["prompt_ids"], units)
        owner = rope_index_owner(model)
        if owner is not None:
            inputs["position_ids"] = mrope_positions(owner, ids, attn, inputs)
        # The final hidden states of the T positions that predict a unit of the window, through the
        # output head a chunk of tokens at a time: no [N, T, V] logits.
        hidden = multimodal_body(model)(input_ids=ids, attention_mask=attn, use_cache=False,
                                        **inputs).last_hidden_state[:, -(T + 1):-1]
        return self.head_scores(model, hidden, units[:, start:], with_entropy, temperature)

    def head_scores(self, model: nn.Module, hidden: torch.Tensor, units: torch.Tensor, with_entropy: bool,
                    temperature: float | None = None):
        """Log-probs (and entropy) of `units` [N, T] from the final hidden states [N, T, H] that predict
        them, through the output head a chunk of tokens at a time (`head_logprobs`), the suppressed
        ids masked as in sampling."""
        head = model.get_output_embeddings()
        suppress = torch.tensor(self.suppress_token_ids, dtype=torch.long, device=hidden.device)
        return head_logprobs(hidden, head.weight, units, bias=head.bias, suppress=suppress,
                             temperature=self.temperature if temperature is None else temperature,
                             with_entropy=with_entropy, chunk=self.logprob_chunk)

    def mask_images(self, rollout: Rollout, prob: float, generator: torch.Generator | None = None) -> Rollout:
        """The rollout with each square of every image (the vision encoder's patch size, 14 px where
        the processor does not say) blacked with probability `prob`, independently per row (PAPO's
        random patch masking, on the images before the processor); the units are unchanged."""
        from PIL import Image

        if not any(p.images for p in rollout.extras["vlm_prompt"]):
            raise ValueError(f"{type(self).__name__}: this rollout carries no images to mask")
        s = getattr(self.processor.image_processor, "patch_size", None)
        s = s.get("height", 14) if isinstance(s, dict) else s if isinstance(s, int) else 14
        masked = []
        for p in rollout.extras["vlm_prompt"]:
            images = []
            for img in p.images:
                pixels = np.array(img)
                h, w = -(-pixels.shape[0] // s), -(-pixels.shape[1] // s)
                keep = (torch.rand(h, w, generator=generator) >= prob).numpy()
                keep = keep.repeat(s, 0).repeat(s, 1)[:pixels.shape[0], :pixels.shape[1]]
                images.append(Image.fromarray(pixels * keep[..., None].astype(pixels.dtype)))
            masked.append(VLMPrompt(p.text, tuple(images)))
        return replace(rollout, extras={**rollout.extras, "vlm_prompt": masked})

    def target_text(self, context: dict, i: int = 0) -> str:
        t = context_field(context, self.target_key, i, "target_key")
        return self.target_join.join(map(str, t)) if isinstance(t, (list, tuple)) else str(t)


def freeze_vision_tower(model: nn.Module) -> None:
    """No gradient to the vision encoder (its usual names across families)."""
    body = getattr(hf_model(model), "model", hf_model(model))
    towers = [getattr(body, name) for name in ("visual", "vision_tower", "vision_model") if hasattr(body, name)]
    if not towers:
        raise ValueError(f"model.params.freeze_vision: {type(body).__name__} has no vision tower named visual, "
                         "vision_tower or vision_model")
    for tower in towers:
        tower.requires_grad_(False)


def context_field(context: dict, key: str, i: int, param: str) -> Any:
    if key not in context:
        raise KeyError(f"context {i} has no {key!r} (model.params.{param}); its keys: {', '.join(sorted(context))}")
    return context[key]


def corpus_from_sft(task, params: dict) -> list[str]:
    """Prompts and targets of a few SFT contexts: a tokenizer corpus for tasks without `corpus()`."""
    contexts = task.sft_batch(256, np.random.default_rng(0))
    prompt_key, target_key = params.get("prompt_key", "prompt"), params.get("target_key", "target")
    join = params.get("target_join", " ")

    def text(v) -> str:
        return join.join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    return [text(c.get(prompt_key, "")) + " " + text(c.get(target_key, "")) for c in contexts]
