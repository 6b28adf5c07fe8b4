"""mmrl.tiny_vlm: every VLM family builds locally, batches two left-padded prompts with one image each,
gives finite logits, generates, runs text-only, and round-trips through save_pretrained offline."""

import numpy as np
import pytest
import torch

from mmrl.tiny_vlm import VLM_FAMILIES, build_tiny_vlm, family_unavailable

CORPUS = ["What colour is the square? It is red.", "How many circles are there? 3", "the cat sat on the mat"] * 4

# What the processor returns besides input_ids and attention_mask, with images (the module docstring's table).
IMAGE_KEYS = {
    "qwen2_5_vl": {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
    "qwen3_vl": {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
    "qwen3_5": {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
    "gemma3": {"pixel_values", "token_type_ids"},
    "gemma4": {"pixel_values", "image_position_ids", "mm_token_type_ids"},
    "internvl": {"pixel_values"},
    "lfm2_vl": {"pixel_values", "pixel_attention_mask", "spatial_shapes"},
    "idefics3": {"pixel_values", "pixel_attention_mask"},
    "smolvlm": {"pixel_values", "pixel_attention_mask"},
}
# Gemma 4's image processor accepts no budget under 70 soft tokens; the others make 4-16.
MAX_IMAGE_TOKENS = {"gemma4": 70}

SYSTEM_IMAGE = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]},
]
IMAGE_ONLY = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "3?"}]}]
TEXT_ONLY = [{"role": "user", "content": "How many circles are there?"}]


def _images():
    """Two uint8 RGB images of different sizes and aspect ratios, within 32-128 px."""
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 100), (128, 32))]


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown VLM family"):
        family_unavailable("nope")


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_tiny_vlm(family, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    reason = family_unavailable(family)
    if reason:
        pytest.skip(reason)
    model, processor = build_tiny_vlm(family, CORPUS, seed=0)
    tok = processor.tokenizer
    text_config = model.config.get_text_config()
    assert text_config.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id is not None
    assert tok.pad_token_id is not None
    assert getattr(text_config, "head_dim", text_config.hidden_size // text_config.num_attention_heads) >= 16

    # The template puts the family's placeholder where the image item is, and renders string content.
    prompts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
               for m in (SYSTEM_IMAGE, IMAGE_ONLY)]
    assert "What colour is the square?" in prompts[0] and "Answer briefly." in prompts[0]
    text_prompt = processor.apply_chat_template(TEXT_ONLY, tokenize=False, add_generation_prompt=True)
    assert "How many circles are there?" in text_prompt

    images = _images()
    enc = processor(text=prompts, images=[[images[0]], [images[1]]], padding=True, padding_side="left",
                    return_tensors="pt")
    assert set(enc) - {"input_ids", "attention_mask"} == IMAGE_KEYS[family]
    ids, mask = enc["input_ids"], enc["attention_mask"]
    # Left padding: both rows end with real tokens; the shorter one starts with pads.
    assert mask[:, -1].all() and not mask[1, 0] and (ids[mask == 0] == tok.pad_token_id).all()
    # The config's image token is the tokenizer's one the processor expands each image into (not always
    # `processor.image_token_id`: Gemma 3's is its placeholder <start_of_image> in newer transformers).
    n_image = (ids == model.config.image_token_id).sum(1)
    assert ((n_image >= 4) & (n_image <= MAX_IMAGE_TOKENS.get(family, 16))).all(), n_image

    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (*ids.shape, len(tok)) and torch.isfinite(logits).all()
    # Left padding changes nothing: each row's next-token logits are those of its prompt alone.
    for i in range(2):
        alone = processor(text=[prompts[i]], images=[[images[i]]], return_tensors="pt")
        with torch.no_grad():
            torch.testing.assert_close(model(**alone).logits[0, -1], logits[i, -1], atol=1e-5, rtol=1e-4)
    out = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert ids.shape[1] < out.shape[1] <= ids.shape[1] + 3 and torch.equal(out[:, :ids.shape[1]], ids)

    # A text-only batch needs no pixels.
    text_enc = processor(text=[text_prompt], return_tensors="pt")
    assert "pixel_values" not in text_enc
    with torch.no_grad():
        assert torch.isfinite(model(**text_enc).logits).all()
    assert model.generate(**text_enc, max_new_tokens=2, do_sample=False).shape[0] == 1

    # The weights are drawn from `seed`.
    other, _ = build_tiny_vlm(family, CORPUS, seed=1)
    with torch.no_grad():
        assert not torch.allclose(other(**enc).logits, logits)

    # save_pretrained -> Auto*.from_pretrained(dir), offline: the same prompts, inputs and logits.
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    processor2 = AutoProcessor.from_pretrained(tmp_path, local_files_only=True)
    model2 = AutoModelForImageTextToText.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(model2) is type(model)
    assert [processor2.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
            for m in (SYSTEM_IMAGE, IMAGE_ONLY)] == prompts
    enc2 = processor2(text=prompts, images=[[images[0]], [images[1]]], padding=True, padding_side="left",
                      return_tensors="pt")
    assert set(enc2) == set(enc)
    for key in enc:
        assert torch.equal(enc2[key], enc[key]), key
    with torch.no_grad():
        torch.testing.assert_close(model2(**enc2).logits, logits)
