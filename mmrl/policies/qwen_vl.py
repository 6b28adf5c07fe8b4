"""Policy adapter for Qwen-VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): image(s) + text in, text out.

The general VLM adapter (`mmrl.policies.vlm`, `model.policy: vlm`, which picks this one for a
Qwen-VL) with fast paths into the model's internals, each checked to exist and tested equal to the
model's own forward on every stack CI runs (docs/stacks.md).

Contexts are dicts with a text prompt (`prompt_key`, default "prompt") and an image or a list of
images (`image_key`, default "frame": uint8 HxWx3 arrays, PIL images or file paths; None for a
text-only context). Each is rendered as one user turn of the processor's chat template.

What makes sampled and teacher-forced log-probs agree (tests/test_qwen_vl_policy.py):

* Positions are the model's own 3-D mRoPE positions (`get_rope_index`, from `mm_token_type_ids`
  and `image_grid_thw`), always passed explicitly, so the model's cached `rope_deltas` state is
  never consulted. Text after the prompt continues at max(prompt positions) + 1 on all three axes,
  exactly what `get_rope_index` gives when run over prompt + completion.
* Vision special tokens (and padded vocabulary rows) are suppressed in sampling and masked the same
  way in training; logits are divided by the temperature in both.
* Prompts are left-padded; the completion has `mm_token_type_ids` 0; training runs `use_cache=False`.

Vision inputs are ragged (a flat `[patches, D]` tensor per image), so the rollout keeps them as
per-sample lists (`Rollout.extras` list values), shared by the G samples of a context. Teacher
forcing encodes each distinct image of a micro-batch once and copies its features to the rows that
use it (`vision_language_hidden`), so the vision tower runs once per image, not once per row. Sampling
prefills each context once with the HF forward (vision + prompt) and repeats its KV cache for the G
samples. Every later token is text, whose mRoPE is plain RoPE at its position, so the lean
static-cache decoder of the text policies (`fast_decode.FastDecoder`) takes over from there; the HF
forward decodes where that decoder does not apply (LoRA, an unknown text decoder, `fast_decode=False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmrl.hf_compat import cache_kwargs, cache_of, joined
from mmrl.policies.fast_decode import FastDecoder, causal_body
from mmrl.policies.vlm import QWEN_VL_MODEL_TYPES, VLMConfig, VLMPolicy, is_qwen_vl, load_vlm
from mmrl.rollout import Rollout, sample_tokens

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")
_VISION_TOKEN_CONFIG_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass
class QwenVLConfig(VLMConfig):
    """`model.params` of `qwen_vl` (and `vprl_text`): the general adapter's (`VLMConfig`), the
    processor's image-token bounds, and a tiny build's Qwen-VL architecture."""

    min_image_tokens: int | None = None  # None: the processor's own (a tiny build uses 4 and 16)
    max_image_tokens: int | None = None
    arch: str = "qwen2_5_vl"  # a tiny build's architecture (mmrl.tiny.QWEN_VL_ARCHS)

    def __post_init__(self):
        from mmrl.tiny import QWEN_VL_ARCHS

        if self.arch not in QWEN_VL_ARCHS:
            raise ValueError(f"model.params.arch: unknown Qwen-VL architecture {self.arch!r}; valid: {', '.join(QWEN_VL_ARCHS)}")
        for name in ("min_image_tokens", "max_image_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"model.params.{name} must be >= 1 (or null: the processor's own), got {value}")


def rope_owner(model: nn.Module) -> nn.Module:
    """The inner Qwen-VL model that owns `get_rope_index` (through a PEFT wrapper too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for m in (base, getattr(base, "model", None)):
        if m is not None and hasattr(m, "get_rope_index"):
            return m
    raise TypeError(f"{type(base).__name__} has no get_rope_index: not a Qwen-VL model")


def rope_positions(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """The model's 3-D mRoPE position ids [3, B, S] of left-padded sequences (pads get 0)."""
    pos, _ = rope_owner(model).get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids,
                                               image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    return pos


def vision_inputs(pixel_values: list[torch.Tensor], image_grid_thw: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-sample vision tensors joined into the model's flat `pixel_values` / `image_grid_thw`."""
    keep = [i for i, g in enumerate(image_grid_thw) if g.numel()]
    if not keep:
        return {}
    return {"pixel_values": torch.cat([pixel_values[i] for i in keep]),
            "image_grid_thw": torch.cat([image_grid_thw[i] for i in keep])}


def _joined_grids(image_grid_thw: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows' `image_grid_thw` joined in row order (None when no row has an image)."""
    grids = [g for g in image_grid_thw if g.numel()]
    return torch.cat(grids) if grids else None


_PROBES = 16  # values per image in `distinct_images`'s fingerprints


def distinct_images(pixel_values: list[torch.Tensor], image_grid_thw: list[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """The distinct images among the rows' vision lists: their flat patches [P_u, D] and grids
    [U, 3] (in order of first use), and for every image of every row, in row order (the order of
    the rows' image placeholders), the index of its distinct image. None when no row has an image.

    Two images are one when their patches are equal, found cheaply:
    1. Same memory: patch tensors with the same data pointer, shape, strides, dtype and device (and
       grid) are one image without looking at the values. The G rows of a prompt share one tensor
       object (`repeat_rows`; `Rollout.select` / `to` / `concat` keep the sharing): the usual case.
    2. Otherwise exact equality (`torch.equal`), tried only between images of the same shape, dtype
       and grid whose fingerprints (`_PROBES` values at fixed positions, fetched for all images in
       one transfer) agree, so distinct images cost no pairwise comparison and equal copies (rows
       that lost the sharing) one each. Never approximate: a row whose pixels differ anywhere (PAPO's
       per-row masked copies, `mask_images`) keeps its own image."""
    grids = _joined_grids(image_grid_thw)
    if grids is None:
        return None
    grid_list = [tuple(g) for g in grids.tolist()]  # one host sync for all rows
    # 1. One entry per distinct memory region: (patches, grid, its row in `grids`).
    regions: list[tuple[torch.Tensor, tuple, int]] = []
    by_memory: dict[tuple, int] = {}
    region_of: list[int] = []  # per image, in placeholder order
    k = 0
    for pixels, g in zip(pixel_values, image_grid_thw):
        if not g.numel():
            continue
        mine = grid_list[k:k + len(g)]
        for img, grid in zip(pixels.split([t * h * w for t, h, w in mine]), mine):
            key = (img.data_ptr(), tuple(img.shape), img.stride(), img.dtype, img.device, grid)
            if key not in by_memory:
                by_memory[key] = len(regions)
                regions.append((img, grid, k))
            region_of.append(by_memory[key])
            k += 1
    # 2. Regions with equal values are one image: fingerprints first, then exact comparison.
    rep_of = list(range(len(regions)))
    if len(regions) > 1:
        probes = torch.stack([img.reshape(-1)[torch.linspace(0, img.numel() - 1, _PROBES, device=img.device).long()]
                              .float() for img, _, _ in regions]).tolist()
        buckets: dict[tuple, list[int]] = {}
        for r, ((img, grid, _), probe) in enumerate(zip(regions, probes)):
            same = buckets.setdefault((tuple(img.shape), img.dtype, img.device, grid, tuple(probe)), [])
            match = next((c for c in same if torch.equal(regions[c][0], img)), None)
            if match is None:
                same.append(r)
            else:
                rep_of[r] = match
    # Distinct images in order of first use.
    order: dict[int, int] = {}
    index = [order.setdefault(rep_of[r], len(order)) for r in region_of]
    reps = list(order)
    return torch.cat([regions[r][0] for r in reps]), grids[[regions[r][2] for r in reps]], index


VISION_ONCE_NEEDS = ("get_input_embeddings", "get_image_features", "get_placeholder_mask", "language_model")


def vision_once_applies(model: nn.Module) -> bool:
    """Whether the model's body has what `vision_language_hidden` calls (else its own forward runs)."""
    body = causal_body(model)
    return all(hasattr(body, name) for name in VISION_ONCE_NEEDS)


def vision_language_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor, pixel_values: list[torch.Tensor],
                           image_grid_thw: list[torch.Tensor]) -> torch.Tensor:
    """The final hidden states [B, S, H] of a Qwen-VL's body (vision tower + language model, through a
    PEFT wrapper too) for rows with per-row vision lists, running the vision tower once per distinct
    image (`distinct_images`): the G rows of a prompt share its image, whose features are computed
    once, with autograd, and copied (`index_select`) to each row's image placeholders, so the tower's
    backward also runs once, with the rows' gradients summed. The same values and gradients as the
    HF forward on the rows' joined `pixel_values`, which would encode each image once per row.

    What the HF forward does otherwise: input embeddings with the image features scattered onto the
    `<|image_pad|>` positions (`get_placeholder_mask`, which checks the counts), then the language
    model at the explicit 3-D positions; Qwen3-VL's deepstack features go to the same positions."""
    body = causal_body(model)
    embeds = body.get_input_embeddings()(input_ids)
    extra = {}
    distinct = distinct_images(pixel_values, image_grid_thw)
    if distinct is not None:
        pixels, grids, index = distinct
        out = body.get_image_features(pixels, grids, return_dict=True)
        per_image = out.pooler_output  # one [tokens, H] per distinct image
        starts = np.cumsum([0] + [f.shape[0] for f in per_image])
        # Rows of the distinct images' joined features, image by image in placeholder order.
        take = torch.from_numpy(np.concatenate([np.arange(starts[u], starts[u + 1]) for u in index]))
        take = take.to(embeds.device)
        feats = torch.cat(per_image).to(embeds.device, embeds.dtype).index_select(0, take)
        mask, _ = body.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=feats)
        embeds = embeds.masked_scatter(mask, feats)
        deepstack = getattr(out, "deepstack_features", None)
        if deepstack:  # Qwen3-VL: added to the image positions' hidden states of the first layers
            # One tensor per layer (transformers 5.5), or per layer a tuple of per-image pieces (5.2x).
            extra = {"visual_pos_masks": mask[..., 0],
                     "deepstack_visual_embeds": [joined(d).to(embeds.device).index_select(0, take) for d in deepstack]}
    return body.language_model(input_ids=None, inputs_embeds=embeds, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False, **extra).last_hidden_state


class VLStepper:
    """Next-token logits for `sample_tokens`: vision inputs and mRoPE positions at prefill, which runs
    once per context (rows `::group_size` of the repeated prompts); the KV cache is then repeated.

    With `lean` (a `FastDecoder` stepper) the prefill's keys and values go into its static cache and
    it decodes the rest: the HF forward then runs once per sampling call, not once per token."""

    def __init__(self, model: nn.Module, mm_token_type_ids: torch.Tensor, vision: dict[str, torch.Tensor],
                 group_size: int, lean=None):
        self.model = model
        self.mm_token_type_ids = mm_token_type_ids  # [n, P], one row per context
        self.vision = vision
        self.group_size = group_size
        self.lean = lean

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        G = self.group_size
        ids, attn = input_ids[::G], attention_mask[::G]
        pos = rope_positions(self.model, ids, attn, self.mm_token_type_ids, self.vision.get("image_grid_thw"))
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, mm_token_type_ids=self.mm_token_type_ids,
                         use_cache=True, logits_to_keep=1, **self.vision)
        # Text after the prompt continues at max(position) + 1 on every axis (get_rope_index's rule).
        self.next_pos = (pos.amax(dim=(0, 2)) + 1).repeat_interleave(G)
        logits = out.logits[:, -1, :].float().repeat_interleave(G, 0)
        if self.lean is not None:
            kv = [(layer.keys, layer.values) for layer in cache_of(out).layers]
            self.lean.load_prefix(kv, attention_mask, self.next_pos)
            return logits
        self.past = cache_of(out)
        if G > 1:
            self.past.batch_repeat_interleave(G)
        self.attn = attention_mask
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.lean is not None:
            return self.lean.step(tokens)
        # Tokens fed after a row's EOS come after all its real tokens; causal attention keeps them
        # away from anything trained, so they can stay attendable.
        self.attn = torch.cat([self.attn, self.attn.new_ones(self.attn.shape[0], 1)], dim=1)
        pos = self.next_pos.view(1, -1, 1).expand(3, -1, 1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attn, position_ids=pos, use_cache=True,
                         **cache_kwargs(self.model, self.past))
        self.past, self.next_pos = cache_of(out), self.next_pos + 1
        return out.logits[:, -1, :].float()


class QwenVLPolicy(VLMPolicy):
    """The general VLM adapter with the Qwen-VL fast paths (the module docstring)."""

    CONFIG = QwenVLConfig
    PROMPT_COLUMNS = ("prompt_ids", "prompt_mask", "mm_token_type_ids")

    def __init__(self, model: nn.Module, processor, *, min_image_tokens: int | None = None,
                 max_image_tokens: int | None = None, fast_decode: bool = True, **kwargs):
        if not is_qwen_vl(model):
            model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise ValueError(f"model.policy qwen_vl takes a Qwen-VL ({', '.join(QWEN_VL_MODEL_TYPES)}), got model type "
                             f"{model_type!r}; model.policy: vlm takes any Hugging Face vision-language model")
        super().__init__(model, processor, **kwargs)
        self.image_kwargs = {**self.image_kwargs, **self._image_size_kwargs(min_image_tokens, max_image_tokens)}
        # The lean decoder for the generated text (None: the HF forward decodes, e.g. under LoRA).
        self._fast = FastDecoder.maybe(model) if fast_decode else None
        # Vision once per distinct image where the installed transformers has the pieces it calls.
        self.vision_once = vision_once_applies(model)

    def _image_size_kwargs(self, min_tokens: int | None, max_tokens: int | None) -> dict[str, dict]:
        """The processor override (`size`, pixels per image between `shortest_edge` and `longest_edge`:
        the form every supported transformers takes; min_pixels / max_pixels are deprecated from 5.2x)
        that resizes each image to between min and max LM tokens (None: the processor's own setting)."""
        if min_tokens is None and max_tokens is None:
            return {}
        ip = self.processor.image_processor
        unit = (ip.patch_size * ip.merge_size) ** 2  # pixels per LM token
        low = ip.size["shortest_edge"] if min_tokens is None else int(min_tokens) * unit
        high = ip.size["longest_edge"] if max_tokens is None else int(max_tokens) * unit
        if not 0 < low <= high:
            raise ValueError(f"need 0 < min_image_tokens <= max_image_tokens, got {min_tokens} and {max_tokens}")
        return {"size": {"shortest_edge": low, "longest_edge": high}}

    def _suppressed_ids(self) -> list[int]:
        """Vision placeholders (a sampled <|image_pad|> breaks the next forward) and the padded
        vocabulary rows past the tokenizer, which no text decodes to."""
        cfg = self.model.config
        vocab = self.tokenizer.get_vocab()
        ids = {vocab[t] for t in VISION_TOKENS if t in vocab}
        ids |= {getattr(cfg, k) for k in _VISION_TOKEN_CONFIG_KEYS if getattr(cfg, k, None) is not None}
        n_vocab = self.model.get_output_embeddings().weight.shape[0]
        ids |= set(range(len(self.tokenizer), n_vocab))
        return sorted(i for i in ids if i < n_vocab)

    # ------------------------------------------------------------------ construction

    @classmethod
    def build_model(cls, cfg, task, arch: str, params: dict):
        """`model.source: tiny` builds a tiny Qwen-VL (`arch`, sizes in `model.tiny`) with a tokenizer
        trained on the task's text; `pretrained` loads `model.path`."""
        m = cfg.model
        dtype = getattr(torch, m.dtype)
        if m.source == "pretrained":
            return cls.load_pretrained(m.path, dtype)
        from mmrl.policies.vlm import corpus_from_sft
        from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer

        corpus = task.corpus() or corpus_from_sft(task, params)
        tokenizer = build_tokenizer(corpus, vocab_size=m.tokenizer_vocab_size)
        processor = build_qwen_vl_processor(tokenizer, arch, params.get("min_image_tokens", 4),
                                            params.get("max_image_tokens", 16))
        model = build_tiny_qwen_vl(tokenizer, arch, seed=cfg.train.seed, **m.tiny).to(dtype)
        return model, processor

    @classmethod
    def extra_settings(cls, cfg) -> dict:
        return {"fast_decode": cfg.model.fast_decode and cfg.model.lora_rank == 0}

    @staticmethod
    def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32):
        return load_vlm(path, dtype)

    # ------------------------------------------------------------------ encoding

    def encode(self, contexts: list[dict]) -> dict[str, Any]:
        """Left-padded prompt tensors [n, P] and per-context vision lists for `contexts`."""
        prompts = self.prompts(contexts)
        images = [img for p in prompts for img in p.images]
        counts = [len(p.images) for p in prompts]
        enc = self.processor(text=[p.text for p in prompts], images=images or None, padding=True,
                             padding_side="left", return_tensors="pt", **(self.image_kwargs if images else {}))
        dev = self.device
        grids = enc["image_grid_thw"] if images else torch.zeros(0, 3, dtype=torch.long)
        pixels = enc["pixel_values"] if images else torch.zeros(0)
        # Cut the flat patches at each context's images (patches per image = t * h * w).
        grid_parts = list(grids.split(counts))
        patch_parts = list(pixels.split([int(g.prod(-1).sum()) for g in grid_parts])) if images else \
            [pixels] * len(contexts)
        return {
            "prompt_ids": enc["input_ids"].to(dev),
            "prompt_mask": enc["attention_mask"].to(dev),
            "mm_token_type_ids": enc["mm_token_type_ids"].to(dev),
            "pixel_values": [p.to(dev) for p in patch_parts],
            "image_grid_thw": [g.to(dev) for g in grid_parts],
        }

    # ------------------------------------------------------------------ sampling

    def _generate(self, enc, rows, group_size, kwargs):
        """Prefill each context once (`VLStepper`), then its KV cache serves the G samples."""
        lean = self._fast.stepper(rows["prompt_ids"].shape[1] + kwargs["max_new_tokens"]) if self._fast else None
        stepper = VLStepper(self.model, enc["mm_token_type_ids"],
                            vision_inputs(enc["pixel_values"], enc["image_grid_thw"]), group_size, lean=lean)
        return sample_tokens(self.model, rows["prompt_ids"], rows["prompt_mask"], stepper=stepper, **kwargs)

    # ------------------------------------------------------------------ teacher forcing

    def _token_logprobs(self, model: nn.Module, extras: dict[str, Any], units: torch.Tensor, with_entropy: bool,
                        temperature: float | None = None, window: slice | None = None):
        """Log-probs (and entropy) of `units[:, window]` (default: all), teacher-forced after the prompts."""
        start, stop, _ = (window or slice(None)).indices(units.shape[1])
        units, T = units[:, :stop], stop - start  # later units cannot change a causal model's scores
        ids = torch.cat([extras["prompt_ids"], units], 1)
        attn = torch.cat([extras["prompt_mask"], torch.ones_like(units)], 1)
        mm = torch.cat([extras["mm_token_type_ids"], torch.zeros_like(units)], 1)  # the completion is text
        pixels, grids = extras["pixel_values"], extras["image_grid_thw"]
        pos = rope_positions(model, ids, attn, mm, _joined_grids(grids))
        # The final hidden states of the T positions that predict a unit of the window (the vision
        # tower runs once per distinct image, not once per row; else the model's own forward on the
        # rows' joined images), through the output head a chunk of tokens at a time: no [N, T, V] logits.
        if self.vision_once:
            hidden = vision_language_hidden(model, ids, attn, pos, pixels, grids)
        else:
            hidden = causal_body(model)(input_ids=ids, attention_mask=attn, position_ids=pos, mm_token_type_ids=mm,
                                        use_cache=False, **vision_inputs(pixels, grids)).last_hidden_state
        return self.head_scores(model, hidden[:, -(T + 1):-1], units[:, start:], with_entropy, temperature)

    def black_patch(self) -> torch.Tensor:
        """One flattened vision patch of a black image, as the processor normalises it: rows of
        `pixel_values` are [channel, time, patch, patch], channel-major."""
        ip = self.processor.image_processor
        scale = ip.rescale_factor if ip.do_rescale else 1.0
        mean = torch.as_tensor(ip.image_mean, dtype=torch.float32) if ip.do_normalize else torch.zeros(3)
        std = torch.as_tensor(ip.image_std, dtype=torch.float32) if ip.do_normalize else torch.ones(3)
        per_channel = (0.0 * scale - mean) / std
        return per_channel.repeat_interleave(ip.temporal_patch_size * ip.patch_size ** 2)

    can_mask_images = True

    def mask_images(self, rollout: Rollout, prob: float, generator: torch.Generator | None = None) -> Rollout:
        """The rollout with each image patch blacked with probability `prob`, independently per row
        (PAPO's random patch masking, on the processor's own patches); the units are unchanged."""
        from dataclasses import replace

        from mmrl.algos.perception import mask_patches

        if "pixel_values" not in rollout.extras:
            raise ValueError(f"{type(self).__name__}: this rollout carries no images (pixel_values) to mask")
        black = self.black_patch().to(self.device)
        pixels = [mask_patches(p, black, prob, generator) if p.numel() else p for p in rollout.extras["pixel_values"]]
        return replace(rollout, extras={**rollout.extras, "pixel_values": pixels})
