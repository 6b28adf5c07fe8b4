"""bench/real_shapes.py, model `qwen2_5_vl_3b`: Qwen2.5-VL-3B-Instruct at its real width
(`configs/real_shapes/qwen2_5_vl_3b.json`, the public config.json sizes), LM and vision depth cut to L,
on `configs/vqa_geometry3k_gpu.yaml` with synthetic VQA records at the config's image size.

A shapes module gives `prepare(work, base, layers, width, caps) -> overrides` (builds what the config
loads, returns the config overrides that point at it) and `param_counts() -> dict` (the full-depth
model's parameters, on the meta device)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "configs" / "real_shapes" / "qwen2_5_vl_3b.json"

# Tiny widths of the same architecture for --smoke and the tests (vocabulary: the tokenizer's).
SMOKE_SHAPES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "vocab_size": 0, "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": True,
                "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
                                  "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112}}
# Small widths where the layers weigh (tests/test_plan.py checks the 4-layer prediction with them).
SMALL_SHAPES = {**SMOKE_SHAPES, "hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 64, "mrope_section": [16, 8, 8],
                "vision_config": {**SMOKE_SHAPES["vision_config"], "hidden_size": 128, "intermediate_size": 256}}


def load_shapes(width: str) -> dict:
    """The model's sizes: `real` (its JSON), or the same architecture at `small` / `tiny` widths."""
    shapes = json.loads(SHAPES.read_text())
    if width != "real":
        over = SMALL_SHAPES if width == "small" else SMOKE_SHAPES
        shapes = {**shapes, **over, "vision_config": {**shapes["vision_config"], **over["vision_config"]}}
    return shapes


def qwen_vl_config(s: dict, layers: int, tokenizer, vocab_size: int | None = None):
    """A Qwen2.5-VL config of sizes `s` (the config.json layout) with `layers` LM and vision blocks."""
    from transformers import Qwen2_5_VLConfig

    v = s["vision_config"]
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    text = dict(vocab_size=vocab_size or max(len(tokenizer), s["vocab_size"]), hidden_size=s["hidden_size"],
                intermediate_size=s["intermediate_size"], num_hidden_layers=layers,
                num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
                head_dim=s["head_dim"], max_position_embeddings=s["max_position_embeddings"],
                rms_norm_eps=s["rms_norm_eps"],
                rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"],
                                 "mrope_section": list(s["mrope_section"])})
    if tokenizer is not None:
        text.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    depth = layers if layers < v.get("depth", 10**9) else v["depth"]
    full = [i for i in v.get("fullatt_block_indexes", []) if i < depth] or [depth - 1]
    vision = dict(depth=depth, hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                  num_heads=v["num_heads"], out_hidden_size=s["hidden_size"], patch_size=v["patch_size"],
                  spatial_merge_size=v["spatial_merge_size"], temporal_patch_size=v["temporal_patch_size"],
                  window_size=v["window_size"], fullatt_block_indexes=full)
    ids = {k: vocab.get(t, i) for i, (k, t) in enumerate([
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")])}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=s["tie_word_embeddings"], **ids)


def qwen_vl_param_counts(shapes: dict) -> dict:
    """Parameters of the full-depth model of sizes `shapes` (built on the meta device: nothing is allocated)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    s = {**shapes, "vision_config": {**shapes["vision_config"]}}
    cfg = qwen_vl_config(s, shapes["num_hidden_layers"], None, vocab_size=shapes["vocab_size"] or 400)
    cfg.vision_config.depth = shapes["vision_config"]["depth"]
    with torch.device("meta"):
        m = Qwen2_5_VLForConditionalGeneration(cfg)
    total = sum(p.numel() for p in m.parameters())
    vision = sum(p.numel() for p in m.model.visual.parameters())
    block = max(sum(p.numel() for p in layer.parameters()) for layer in m.model.language_model.layers)
    # the sampler's KV cache: keys and values of every layer, per token
    kv = 2 * shapes["num_key_value_heads"] * shapes["head_dim"]
    return {"total": total, "vision": vision, "largest_block": block, "trainable": total,
            "layers": shapes["num_hidden_layers"], "kv_values_per_token_layer": kv,
            "vision_depth": shapes["vision_config"]["depth"]}


def param_counts() -> dict:
    return qwen_vl_param_counts(load_shapes("real"))


def build_qwen_vl_folder(out: Path, shapes: dict, layers: int, corpus: list[str], min_tokens: int, max_tokens: int,
                         dtype: str) -> None:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmrl.tiny import build_qwen_vl_processor, build_tokenizer

    tok = build_tokenizer(corpus, vocab_size=400)
    processor = build_qwen_vl_processor(tok, "qwen2_5_vl", min_tokens, max_tokens)
    config = qwen_vl_config(shapes, layers, tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    processor.save_pretrained(out)
    del model


def prepare(work: Path, base, layers: int, width: str, caps: dict) -> list[str]:
    """The model folder at `width` with `layers` blocks, and synthetic VQA records at the config's
    smallest image size (min_pixels; the real data is a hub dataset)."""
    from mmrl.envs import make_task

    smoke = width == "tiny"
    shapes = load_shapes(width)
    pixels = {k: base.task.params[k] for k in ("min_pixels", "max_pixels") if k in base.task.params}
    unit = (shapes["vision_config"]["patch_size"] * shapes["vision_config"]["spatial_merge_size"]) ** 2
    min_tokens = max(1, pixels.get("min_pixels", 256 * unit) // unit)
    max_tokens = max(min_tokens, pixels.get("max_pixels", 256 * unit) // unit)
    image_size = 56 if smoke else int(round((min_tokens * unit) ** 0.5))
    if smoke:
        pixels, min_tokens, max_tokens = {}, 4, 4
    task_params = {"source": "synthetic", "image_size": image_size, "n_train": 16, "n_test": 4, "n_ood": 0,
                   "ood_difficulty": None, "answer_style": base.task.params.get("answer_style", "tag"),
                   "eval_k": 0, **pixels}
    corpus = make_task("vqa", seed=0, **task_params).corpus()
    dtype = "float32" if smoke else base.model.dtype
    build_qwen_vl_folder(work / "model", shapes, layers, corpus, min_tokens, max_tokens, dtype)
    return [f"model.path={work / 'model'}", "model.source=pretrained", f"model.dtype={dtype}", "~task.params",
            f"task.params={json.dumps(task_params)}"]
