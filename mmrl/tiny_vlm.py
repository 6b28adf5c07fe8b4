"""Tiny random vision-language models of many Hugging Face families, for tests and CPU demos.

`build_tiny_vlm(family, corpus)` returns `(model, processor)`: an `AutoModelForImageTextToText`
model with random weights (hidden 64, 2 layers, a 1-layer vision tower of width 32) and a processor
built locally (a BPE tokenizer trained on `corpus` plus the family's special tokens, the family's
image processor sized so that an image of 32-128 px becomes a handful of LM tokens, and a chat
template that puts the family's image placeholder where a `{"type": "image"}` item is, as the real
template does). Both round-trip through `save_pretrained` and `AutoModelForImageTextToText` /
`AutoProcessor.from_pretrained(dir)` offline. Nothing touches a hub.

What `processor(text=..., images=..., return_tensors="pt")` returns besides input_ids and
attention_mask (the same on transformers 5.5 and 5.25; tests/test_tiny_vlm.py checks it); keys
marked * come with text-only calls too:

    qwen2_5_vl  pixel_values (all patches, 1176), image_grid_thw (images, 3), mm_token_type_ids*
    qwen3_vl    pixel_values (all patches, 1536), image_grid_thw (images, 3), mm_token_type_ids*
    qwen3_5     as qwen3_vl (Qwen3.5 checkpoints ship a Qwen3VLProcessor)
    gemma3      pixel_values (images, 3, 48, 48), token_type_ids*
    gemma4      pixel_values (images, 280, 48), image_position_ids (images, 280, 2), mm_token_type_ids*
    internvl    pixel_values (images, 3, 48, 48)
    lfm2_vl     pixel_values (images, 64, 192), pixel_attention_mask (images, 64), spatial_shapes (images, 2)
    idefics3    pixel_values (prompts, images, 3, 48, 48), pixel_attention_mask (prompts, images, 48, 48)
    smolvlm     as idefics3

The placeholder the chat template writes for an image, and the LM tokens (`config.image_token_id`)
the processor expands it into for one 32-128 px image, plus 2-3 marker tokens around them:

    qwen*       <|vision_start|><|image_pad|><|vision_end|>   4-16
    gemma3      <start_of_image>                              9
    gemma4      <|image|>                                     56-65 (its image processor takes no budget under 70)
    internvl    <IMG_CONTEXT> and a newline                   9
    lfm2_vl     <image>                                       4-16
    idefics3    <image>                                       9
    smolvlm     <image>                                       9

Count image tokens with `model.config.image_token_id`, not `processor.image_token_id`: Gemma 3's
processor in transformers 5.25 gives its placeholder's id there.

The families a transformers release lacks are reported by `family_unavailable`.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable

import transformers
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from mmrl.tiny import (QWEN_SPECIAL_TOKENS, VL_CHAT_TEMPLATE, _seeded_model, build_qwen_vl_processor,
                       build_tiny_qwen_vl, build_tokenizer)

VLM_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma3", "gemma4", "internvl", "lfm2_vl", "idefics3", "smolvlm")

# family -> (display name, the transformers.models module that holds it)
_FAMILY_INFO = {
    "qwen2_5_vl": ("Qwen2.5-VL", "qwen2_5_vl"),
    "qwen3_vl": ("Qwen3-VL", "qwen3_vl"),
    "qwen3_5": ("Qwen3.5", "qwen3_5"),
    "gemma3": ("Gemma3", "gemma3"),
    "gemma4": ("Gemma4", "gemma4"),
    "internvl": ("InternVL", "internvl"),
    "lfm2_vl": ("LFM2-VL", "lfm2_vl"),
    "idefics3": ("Idefics3", "idefics3"),
    "smolvlm": ("SmolVLM", "smolvlm"),
}

# The language-model trunk of every family: head_dim 16 = 64 / 4 heads.
_LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, max_position_embeddings=1024)
# The vision tower (SigLIP-like) of the families that are not Qwen.
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def family_unavailable(family: str) -> str | None:
    """None when the installed transformers (and what its processor needs) has `family`, else one line why not."""
    if family not in _FAMILY_INFO:
        raise ValueError(f"unknown VLM family {family!r}; valid: {', '.join(VLM_FAMILIES)}")
    name, module = _FAMILY_INFO[family]
    if importlib.util.find_spec(f"transformers.models.{module}") is None:
        return f"transformers {transformers.__version__} has no {name} (transformers.models.{module})"
    if family == "smolvlm" and importlib.util.find_spec("num2words") is None:
        return "SmolVLM's processor needs the num2words package, which is not installed"
    return None


def build_tiny_vlm(family: str, corpus: Iterable[str], seed: int = 0, vocab_size: int = 320):
    """A tiny random model of `family` (an `AutoModelForImageTextToText` class) and its processor
    (with a chat template), both built locally; the weights are drawn from `seed`."""
    reason = family_unavailable(family)
    if reason:
        raise RuntimeError(reason)
    model, processor = _BUILDERS[family](list(corpus), seed, vocab_size)
    tok = processor.tokenizer
    # Generation stops at the end of the assistant turn and pads with the tokenizer's pad.
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    return model.eval(), processor


# ----------------------------------------------------------------------------- shared helpers

def _tokenizer(corpus: list[str], vocab_size: int, *, eos: str, pad: str, bos: str | None = None,
               named: dict[str, str] | None = None, extra: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """`build_tokenizer`'s BPE plus the family's special tokens. `named` ones ({"image_token": "<image>"})
    become tokenizer attributes (`tok.image_token`, `tok.image_token_id`), which the processors read
    and which `save_pretrained` keeps; `extra` ones are only added to the vocabulary."""
    named = named or {}
    backend = build_tokenizer(corpus, vocab_size).backend_tokenizer
    wanted = dict.fromkeys(t for t in (eos, pad, bos, *named.values(), *extra) if t is not None)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in wanted
                                if backend.token_to_id(t) is None])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=pad, bos_token=bos,
                                   unk_token=None, padding_side="left", clean_up_tokenization_spaces=False,
                                   extra_special_tokens=list(extra), **named)


def _chat_template(*, bos: str = "", turn: str, end: str, image: str, generation: str,
                   roles: dict[str, str] | None = None, fold_system: bool = False) -> str:
    """A Jinja chat template: `bos`, then per message `turn` (with `{role}` in it), its content and
    `end`; string content as is, list content item by item, `{"type": "image"}` as `image`; then
    `generation` when `add_generation_prompt`. `roles` renames roles (Gemma's assistant is "model");
    `fold_system` puts a system message's text at the start of the first user turn, as Gemma 3's
    template does (it has no system turn)."""
    role = "message['role']"
    for old, new in (roles or {}).items():
        role = f"('{new}' if message['role'] == '{old}' else {role})"
    head = turn.replace("{role}", "' + " + role + " + '")
    if fold_system:
        setup = ("{% if messages[0]['role'] == 'system' %}"
                 "{% set first = messages[0]['content'] if messages[0]['content'] is string "
                 "else messages[0]['content'][0]['text'] %}{% set first = first + '\n\n' %}"
                 "{% set loop_messages = messages[1:] %}"
                 "{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}")
    else:
        setup = "{% set first = '' %}{% set loop_messages = messages %}"
    return (
        setup + "{{ '" + bos + "' }}{% for message in loop_messages %}{{ '" + head + "' }}"
        "{% if loop.first %}{{ first }}{% endif %}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}{{ '" + image + "' }}"
        "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{{ '" + end + "' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '" + generation + "' }}{% endif %}"
    ).replace("\n", "\\n")


# ChatML, as Qwen's, InternVL's and LFM2's templates write turns.
def _chatml(image: str, bos: str = "") -> str:
    return _chat_template(bos=bos, turn="<|im_start|>{role}\n", end="<|im_end|>\n", image=image,
                          generation="<|im_start|>assistant\n")


def _text_config(tok, **overrides) -> dict:
    """The language model's config fields shared by every family: tiny sizes and the tokenizer's ids."""
    return dict(_LM, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, **overrides)


def _image_processor_class(name: str):
    """The backend of image processor `name` that `AutoProcessor.from_pretrained` picks: the PIL one
    for those that resample with Lanczos where torchvision cannot (transformers 5.5; torchvision >= 0.27
    can), so that the built and the reloaded processor give the same pixels."""
    from transformers.models.auto import image_processing_auto

    pil = name in getattr(image_processing_auto, "DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS", ())
    return getattr(transformers, name + "Pil" if pil else name)


def _model(config, seed: int):
    import torch
    from transformers import AutoModelForImageTextToText

    model = _seeded_model(AutoModelForImageTextToText.from_config, config, seed)
    # Some projections start at zero for training from a pretrained tower (Gemma 3's
    # mm_input_projection_weight): a random model's images would then not reach its text at all.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.02)
    return model


# ----------------------------------------------------------------------------- Qwen families

def _qwen2_5_vl(corpus, seed, vocab_size):
    # mmrl.tiny already builds Qwen-VL; its tokenizer has Qwen's special tokens.
    tok = build_tokenizer(corpus, vocab_size)
    model = build_tiny_qwen_vl(tok, "qwen2_5_vl", seed)
    # Qwen2.5-VL's text config defaults bos to the real vocabulary's 151643, out of this one.
    model.config.get_text_config().bos_token_id = None
    return model, build_qwen_vl_processor(tok, "qwen2_5_vl")


def _qwen3_vl(corpus, seed, vocab_size):
    tok = build_tokenizer(corpus, vocab_size)
    return build_tiny_qwen_vl(tok, "qwen3_vl", seed), build_qwen_vl_processor(tok, "qwen3_vl")


def _qwen3_5_tokenizer(corpus, vocab_size):
    """`build_tokenizer`'s BPE as a `Qwen3_5Tokenizer`: newer transformers load every qwen3_5
    checkpoint's tokenizer as that class (with Qwen's own pre-tokenizer), whatever its
    tokenizer_config says, so building it as one keeps the built and the reloaded tokenizer equal."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    bpe = json.loads(build_tokenizer(corpus, vocab_size).backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe["merges"]]
    return Qwen3_5Tokenizer(vocab=bpe["vocab"], merges=merges, unk_token=None, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>", extra_special_tokens=QWEN_SPECIAL_TOKENS,
                            padding_side="left", chat_template=VL_CHAT_TEMPLATE)


def _qwen3_5(corpus, seed, vocab_size):
    """Qwen3.5: Qwen3-VL's processor and vision tower on a hybrid LM (Gated DeltaNet + gated attention)."""
    from transformers import Qwen3_5Config

    tok = _qwen3_5_tokenizer(corpus, vocab_size)
    processor = build_qwen_vl_processor(tok, "qwen3_vl")  # the processor Qwen3.5 checkpoints ship
    vocab = tok.get_vocab()
    # Rotary on half of head_dim 16; the multimodal sections sum to that half's half.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True,
            "partial_rotary_factor": 0.5}
    text = _text_config(tok, layer_types=["linear_attention", "full_attention"], rope_parameters=rope,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_conv_kernel_dim=4)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=_LM["hidden_size"],
                  patch_size=16, num_position_embeddings=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True,
                           image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                           vision_start_token_id=vocab["<|vision_start|>"],
                           vision_end_token_id=vocab["<|vision_end|>"])
    return _model(config, seed), processor


# ----------------------------------------------------------------------------- Gemma

def _gemma3(corpus, seed, vocab_size):
    """Gemma 3: a SigLIP tower whose 6x6 patches are average-pooled to 3x3 = 9 soft tokens."""
    from transformers import Gemma3Config, Gemma3ImageProcessor, Gemma3Processor

    tok = _tokenizer(corpus, vocab_size, eos="<end_of_turn>", pad="<pad>", bos="<bos>",
                     named={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                            "eoi_token": "<end_of_image>"}, extra=["<start_of_turn>"])
    side, patch, tokens = 48, 8, 9
    template = _chat_template(bos="<bos>", turn="<start_of_turn>{role}\n", end="<end_of_turn>\n",
                              image="<start_of_image>", generation="<start_of_turn>model\n",
                              roles={"assistant": "model"}, fold_system=True)
    images = Gemma3ImageProcessor(size={"height": side, "width": side}, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=tokens,
                                chat_template=template)
    text = _text_config(tok, query_pre_attn_scalar=_LM["head_dim"], sliding_window=64,
                        layer_types=["sliding_attention", "full_attention"])
    config = Gemma3Config(text_config=text, vision_config=dict(_VISION, image_size=side, patch_size=patch),
                          mm_tokens_per_image=tokens, image_token_index=tok.image_token_id,
                          boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id)
    return _model(config, seed), processor


def _gemma4(corpus, seed, vocab_size):
    """Gemma 4: its image processor resizes every image to at most 70 soft tokens (the smallest
    budget it accepts); with 4 px patches, pooled 2x2, an image becomes <= 64 tokens."""
    from transformers import (Gemma4AudioFeatureExtractor, Gemma4Config, Gemma4ImageProcessor, Gemma4Processor,
                              Gemma4VideoProcessor)

    tok = _tokenizer(corpus, vocab_size, eos="<turn|>", pad="<pad>", bos="<bos>",
                     named={"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                            "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"},
                     extra=["<|turn>", "<|video|>"])
    patch, pool = 4, 2
    template = _chat_template(bos="<bos>", turn="<|turn>{role}\n", end="<turn|>\n", image="<|image|>",
                              generation="<|turn>model\n", roles={"assistant": "model"})
    images = Gemma4ImageProcessor(patch_size=patch, max_soft_tokens=70, pooling_kernel_size=pool)
    videos = Gemma4VideoProcessor(patch_size=patch, max_soft_tokens=70, pooling_kernel_size=pool)
    processor = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=images,
                                tokenizer=tok, video_processor=videos, image_seq_length=64, chat_template=template)
    text = _text_config(tok, sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                        global_head_dim=16, vocab_size_per_layer_input=len(tok), hidden_size_per_layer_input=16)
    vision = dict(_VISION, num_key_value_heads=2, head_dim=16, patch_size=patch, pooling_kernel_size=pool,
                  position_embedding_size=64)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                          image_token_id=tok.image_token_id, boi_token_id=tok.boi_token_id,
                          eoi_token_id=tok.eoi_token_id, video_token_id=tok.convert_tokens_to_ids("<|video|>"),
                          audio_token_id=tok.audio_token_id, boa_token_id=tok.boa_token_id,
                          eoa_token_index=tok.eoa_token_id)
    return _model(config, seed), processor


# ----------------------------------------------------------------------------- InternVL, LFM2-VL

def _internvl(corpus, seed, vocab_size):
    """InternVL (the -hf layout): an InternViT whose 6x6 patches are pixel-shuffled to 3x3 = 9 tokens,
    on a Qwen2 LM. One 48 px tile per image (no dynamic tiling)."""
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLProcessor, InternVLVideoProcessor

    tok = _tokenizer(corpus, vocab_size, eos="<|im_end|>", pad="<|endoftext|>",
                     named={"start_image_token": "<img>", "end_image_token": "</img>",
                            "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
    side, patch, tokens = 48, 8, 9
    images = GotOcr2ImageProcessor(size={"height": side, "width": side}, crop_to_patches=False, max_patches=1)
    videos = InternVLVideoProcessor(size={"height": side, "width": side})
    processor = InternVLProcessor(image_processor=images, tokenizer=tok, video_processor=videos,
                                  image_seq_length=tokens, chat_template=_chatml("<IMG_CONTEXT>\n"))
    vision = dict(_VISION, image_size=[side, side], patch_size=[patch, patch])
    config = InternVLConfig(text_config=dict(_text_config(tok), model_type="qwen2"), vision_config=vision,
                            image_token_id=tok.context_image_token_id, image_seq_length=tokens,
                            downsample_ratio=0.5)
    return _model(config, seed), processor


def _lfm2_vl(corpus, seed, vocab_size):
    """LFM2-VL: a SigLIP2 NaFlex tower (8 px patches, pixel-unshuffled 2x2) on LFM2's conv+attention LM;
    images are resized to 4-16 tokens, never tiled."""
    from transformers import Lfm2VlConfig, Lfm2VlImageProcessor, Lfm2VlProcessor

    tok = _tokenizer(corpus, vocab_size, eos="<|im_end|>", pad="<|pad|>", bos="<|startoftext|>",
                     named={"image_token": "<image>", "image_start_token": "<|image_start|>",
                            "image_end_token": "<|image_end|>", "image_thumbnail_token": "<|img_thumbnail|>"})
    patch, min_tokens, max_tokens = 8, 4, 16
    images = Lfm2VlImageProcessor(encoder_patch_size=patch, downsample_factor=2, do_image_splitting=False,
                                  min_image_tokens=min_tokens, max_image_tokens=max_tokens, tile_size=4 * patch,
                                  use_thumbnail=False)
    processor = Lfm2VlProcessor(image_processor=images, tokenizer=tok,
                                chat_template=_chatml("<image>", bos="<|startoftext|>"))
    text = _text_config(tok, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False,
                        model_type="lfm2")
    text.pop("head_dim")  # LFM2 derives it (64 / 4 heads)
    vision = dict(_VISION, patch_size=patch, num_patches=max_tokens * 4, model_type="siglip2_vision_model")
    config = Lfm2VlConfig(text_config=text, vision_config=vision, image_token_id=tok.image_token_id,
                          projector_hidden_size=_LM["hidden_size"], downsample_factor=2)
    return _model(config, seed), processor


# ----------------------------------------------------------------------------- Idefics3, SmolVLM

# The tokens Idefics3 / SmolVLM write around an image; the row/col ones only when splitting images.
_IDEFICS_NAMED = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                  "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}
_IDEFICS_ROW_COL = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]


def _idefics_template(bos: str) -> str:
    """Idefics3's / SmolVLM's template: "User:<image>text<end_of_utterance>\\nAssistant:", with a space
    after the colon when the turn does not open with an image."""
    return (
        "{{ '" + bos + "' }}{% for message in messages %}{{ message['role'] | capitalize }}"
        "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
        "{{ ':' if message['content'][0]['type'] == 'image' else ': ' }}"
        "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<image>' }}"
        "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{{ '<end_of_utterance>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    )


def _idefics_parts(corpus, vocab_size, family: str):
    """The tokenizer, image-processor settings and config of Idefics3 / SmolVLM (the same design):
    a SigLIP tower on a 48 px image, its 6x6 patches pixel-shuffled to 3x3 = 9 tokens."""
    bos = "<|begin_of_text|>" if family == "idefics3" else "<|im_start|>"
    tok = _tokenizer(corpus, vocab_size, eos="<end_of_utterance>", pad="<|endoftext|>", bos=bos,
                     named=dict(_IDEFICS_NAMED, video_token="<video>") if family == "smolvlm" else _IDEFICS_NAMED,
                     extra=_IDEFICS_ROW_COL)
    side, patch, tokens = 48, 8, 9
    image_kwargs = dict(do_image_splitting=False, size={"longest_edge": side}, max_image_size={"longest_edge": side})
    config = dict(vision_config=dict(_VISION, image_size=side, patch_size=patch), scale_factor=2,
                  image_token_id=tok.image_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    return tok, image_kwargs, tokens, config


def _idefics3(corpus, seed, vocab_size):
    from transformers import Idefics3Config, Idefics3Processor

    tok, image_kwargs, tokens, config = _idefics_parts(corpus, vocab_size, "idefics3")
    images = _image_processor_class("Idefics3ImageProcessor")(**image_kwargs)
    processor = Idefics3Processor(image_processor=images, tokenizer=tok,
                                  image_seq_len=tokens, chat_template=_idefics_template("<|begin_of_text|>"))
    text = dict(_text_config(tok), model_type="llama")
    return _model(Idefics3Config(text_config=text, **config), seed), processor


def _smolvlm(corpus, seed, vocab_size):
    from transformers import SmolVLMConfig, SmolVLMProcessor, SmolVLMVideoProcessor

    tok, image_kwargs, tokens, config = _idefics_parts(corpus, vocab_size, "smolvlm")
    images = _image_processor_class("SmolVLMImageProcessor")(**image_kwargs)
    videos = SmolVLMVideoProcessor(size={"longest_edge": 48}, max_image_size={"longest_edge": 48})
    processor = SmolVLMProcessor(image_processor=images, tokenizer=tok,
                                 video_processor=videos, image_seq_len=tokens,
                                 chat_template=_idefics_template("<|im_start|>"))
    text = dict(_text_config(tok), model_type="llama")
    return _model(SmolVLMConfig(text_config=text, **config), seed), processor


_BUILDERS = {
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "qwen3_5": _qwen3_5,
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "internvl": _internvl,
    "lfm2_vl": _lfm2_vl,
    "idefics3": _idefics3,
    "smolvlm": _smolvlm,
}
