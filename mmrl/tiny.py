"""Tiny models and locally built tokenizers, for tests and the CPU demo.

Nothing here touches a hub: a byte-level BPE is trained on a corpus with the `tokenizers`
library, and the model is built from a config with random weights. `save_pretrained` output of
both loads back through the same `from_pretrained(local_dir)` path that real checkpoints use.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# The Qwen special tokens, so the same prompts and masks work on a real Qwen checkpoint.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` and wrap it as a transformers fast tokenizer.

    The 256 byte symbols are always in the vocabulary, so any text round-trips.
    """
    tok = Tokenizer(models.BPE())
    # Digits stay single tokens, as in Qwen's tokenizer, so numbers are read digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


# The language-model trunk both tiny models share.
_TINY_LM = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)

TINY_QWEN2 = dict(_TINY_LM, intermediate_size=192, max_position_embeddings=512, tie_word_embeddings=True)


def _seeded_model(model_cls, config, seed: int):
    """`model_cls(config)` with weights drawn from `seed`, leaving the global RNG as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config)


def build_tiny_qwen2(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **overrides):
    """A Qwen2-architecture causal LM with random weights, sized by `overrides`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    params = {**TINY_QWEN2, **overrides}
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **params,
    )
    return _seeded_model(Qwen2ForCausalLM, config, seed)


# ----------------------------------------------------------------------------- tiny Qwen-VL models

# Renders string content, or a list of {"type": "image" | "video" | "text"} items, the way Qwen's
# own template does: each image becomes <|vision_start|><|image_pad|><|vision_end|>, which the
# processor expands to one <|image_pad|> per merged patch.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_VL_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Vision patch size per architecture (the spatial merge is 2 for all three).
_VL_PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}

TINY_QWEN_VL = dict(
    _TINY_LM,
    intermediate_size=128,
    head_dim=16,
    mrope_section=[4, 2, 2],  # must sum to head_dim / 2
    max_position_embeddings=1024,
    vision_depth=2,
    vision_width=32,
    vision_heads=2,
)


def _check_arch(arch: str) -> str:
    if arch not in QWEN_VL_ARCHS:
        raise ValueError(f"unknown Qwen-VL architecture {arch!r}; valid: {', '.join(QWEN_VL_ARCHS)}")
    return arch


def build_qwen_vl_processor(tokenizer: PreTrainedTokenizerFast, arch: str = "qwen2_5_vl", min_tokens: int = 4,
                            max_tokens: int = 16):
    """A Qwen-VL processor from a local tokenizer: images are resized to between `min_tokens` and
    `max_tokens` LM tokens (with Qwen2.5-VL, a 56 px square gives 4 and a 112 px square 16)."""
    from transformers import (Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor)

    _check_arch(arch)
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    patch, merge = _VL_PATCH[arch], 2
    unit = (patch * merge) ** 2  # pixels per LM token
    sizes = dict(min_pixels=min_tokens * unit, max_pixels=max_tokens * unit, patch_size=patch, merge_size=merge)
    image_processor = Qwen2VLImageProcessor(**sizes)
    if arch == "qwen3_vl":
        video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": sizes["min_pixels"],
                                                      "longest_edge": sizes["max_pixels"]},
                                                patch_size=patch, merge_size=merge)
        cls = Qwen3VLProcessor
    else:
        video_processor = Qwen2VLVideoProcessor(**sizes)
        cls = Qwen2_5_VLProcessor if arch == "qwen2_5_vl" else Qwen2VLProcessor
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
               chat_template=VL_CHAT_TEMPLATE)


def build_tiny_qwen_vl(tokenizer: PreTrainedTokenizerFast, arch: str = "qwen2_5_vl", seed: int = 0, **overrides):
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL with random weights (about 200k parameters by default)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)

    _check_arch(arch)
    unknown = set(overrides) - set(TINY_QWEN_VL)
    if unknown:
        raise ValueError(f"unknown tiny Qwen-VL setting(s) {sorted(unknown)}; valid: {', '.join(TINY_QWEN_VL)}")
    p = {**TINY_QWEN_VL, **overrides}
    if sum(p["mrope_section"]) * 2 != p["head_dim"]:
        raise ValueError(f"mrope_section {p['mrope_section']} must sum to head_dim / 2 = {p['head_dim'] // 2}")
    vocab = tokenizer.get_vocab()
    rope = {"rope_type": "default", "rope_theta": p["rope_theta"], "mrope_section": list(p["mrope_section"])}
    if arch == "qwen3_vl":
        rope["mrope_interleaved"] = True
    text = dict(vocab_size=len(tokenizer), hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
                num_hidden_layers=p["num_hidden_layers"], num_attention_heads=p["num_attention_heads"],
                num_key_value_heads=p["num_key_value_heads"], head_dim=p["head_dim"],
                max_position_embeddings=p["max_position_embeddings"], rope_parameters=rope,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    depth, width, heads = p["vision_depth"], p["vision_width"], p["vision_heads"]
    if arch == "qwen2_vl":
        vision = dict(depth=depth, embed_dim=width, hidden_size=p["hidden_size"], num_heads=heads, mlp_ratio=2,
                      patch_size=_VL_PATCH[arch])
        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    elif arch == "qwen2_5_vl":
        vision = dict(depth=depth, hidden_size=width, intermediate_size=2 * width, num_heads=heads,
                      out_hidden_size=p["hidden_size"], patch_size=_VL_PATCH[arch], window_size=112,
                      fullatt_block_indexes=[depth - 1])
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(depth=depth, hidden_size=width, intermediate_size=2 * width, num_heads=heads,
                      out_hidden_size=p["hidden_size"], patch_size=_VL_PATCH[arch], num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        config_cls, model_cls = Qwen3VLConfig, Qwen3VLForConditionalGeneration
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=True,
                        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    return _seeded_model(model_cls, config, seed)


def build_tiny_qwen2_5_vl(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **overrides):
    return build_tiny_qwen_vl(tokenizer, "qwen2_5_vl", seed, **overrides)


def save_clip(out, corpus: Iterable[str], real: bool = False) -> None:
    """A CLIP for the `clip_score` reward, saved with the processor the reward loads offline
    (`CLIPModel` / `CLIPProcessor.from_pretrained(path, local_files_only=True)`), seeded: ViT-L/14's
    widths (vision 1024, text 768, projection 768, 14 px patches of 224 px images) with one layer per
    tower when `real` (the memory bench's depth cut), else a tiny one. Its tokenizer is one trained
    on `corpus` (no hub access)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok = build_tokenizer(corpus, vocab_size=300)
    text = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12) if real else \
        dict(hidden_size=16, intermediate_size=32, num_attention_heads=2)
    vision = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, image_size=224, patch_size=14) \
        if real else dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, image_size=32, patch_size=8)
    cfg = CLIPConfig(text_config={"vocab_size": len(tok), "num_hidden_layers": 1, "max_position_embeddings": 77,
                                  "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, **text},
                     vision_config={"num_hidden_layers": 1, **vision}, projection_dim=768 if real else 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        CLIPModel(cfg).save_pretrained(out)
    side = vision["image_size"]
    images = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(out)
