"""bench/real_shapes.py, model `wan2_1_t2v_1_3b`: the causal Wan2.1-T2V-1.3B of
`configs/video_wan_gpu.yaml` at its real width (`configs/real_shapes/wan2_1_t2v_1_3b.json`, the
public diffusers config), depth cut to L blocks, with the real Wan VAE, at the config's frames and
resolution."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "configs" / "real_shapes" / "wan2_1_t2v_1_3b.json"


def param_counts() -> dict:
    """Full-depth parameters (meta device) and the frozen parts outside the policy's weights."""
    import torch
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    s = json.loads(SHAPES.read_text())
    tr = {**s["transformer"], "patch_size": tuple(s["transformer"]["patch_size"])}
    with torch.device("meta"):
        wan = WanTransformer3DModel(**tr)
        te = UMT5EncoderModel(UMT5Config(**{k: v for k, v in s["text_encoder"].items() if k != "model_type"}))
    total = sum(p.numel() for p in wan.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in wan.blocks)
    text = sum(p.numel() for p in te.parameters())
    # Frozen and outside the policy's weights: the UMT5-XXL text encoder (loaded in its checkpoint's
    # bf16), the Wan VAE (~127M, float32) and the CLIP ViT-L/14 reward (~428M, float32).
    extra = text * 2 + 127_000_000 * 4 + 428_000_000 * 4
    return {"total": total, "trainable": total, "largest_block": block, "layers": tr["num_layers"],
            "frozen_extra_bytes": extra, "text_encoder": text}


def _real_parts(corpus: list[str], layers: int, chunk_frames: int, dtype: str) -> tuple:
    """(generator, text encoder, tokenizer, VAE) at the JSON's real sizes: the Wan transformer with
    `layers` blocks and the UMT5 encoder (d_model 4096 = the transformer's text_dim) with one layer,
    both in `dtype` (the checkpoint's), and the Wan2.1 VAE in float32 (as its pipeline runs it)."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from mmrl.policies.video.causal_wan import CausalWan
    from mmrl.tiny import build_tokenizer

    s = json.loads(SHAPES.read_text())
    tr = {**s["transformer"], "patch_size": tuple(s["transformer"]["patch_size"]), "num_layers": layers}
    generator = CausalWan(WanTransformer3DModel(**tr), chunk_frames).to(getattr(torch, dtype))
    # UMT5's 256k vocabulary would only add an embedding table that is looked up, never multiplied:
    # the local tokenizer's ~300 tokens keep the saved folder small (the full table is in
    # frozen_extra_bytes).
    tokenizer = build_tokenizer(corpus, vocab_size=300)
    te = {k: v for k, v in s["text_encoder"].items() if k not in ("model_type", "vocab_size", "num_layers")}
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                               num_layers=1, **te)).to(getattr(torch, dtype))
    # The JSON's sizes; the rest (dim_mult, res blocks, latents_mean / std of 16 channels) are the
    # class defaults, which are Wan2.1's VAE.
    vae = AutoencoderKLWan(**s["vae"])
    return generator, text_encoder, tokenizer, vae


def prepare(work: Path, base, layers: int, width: str, caps: dict) -> list[str]:
    """A Wan pipeline folder (`VideoGenPolicy.save`: transformer/ of `layers` blocks + causal_wan.json,
    text_encoder/, tokenizer/, vae/, mmrl_video.json) in `work/model` and a CLIP in `work/clip`.

    Real: `_real_parts` at the config's 33 frames of 256 px (9 latent frames of 32 x 32, 3 chunks)
    and `model.params` as configured. Tiny (--smoke): `build_tiny_parts`' latent model (a tiny Wan VAE
    with the real 4x / 8x compression) at the config's 33 frames but 32 px (9 latent frames of 4 x 4:
    still 3 chunks, so the smoke runs the KV-cache path the real step does)."""
    import torch

    from mmrl.envs import make_task
    from mmrl.policies.video.configuration import VideoGenConfig
    from mmrl.policies.video.modeling import VideoGenPolicy, build_tiny_parts
    from mmrl.tiny import save_clip

    real = width != "tiny"
    params = dict(base.model.params)
    task_params = dict(base.task.params)
    prompts = Path(task_params["prompt_file"])  # relative to the repository (a child may run from bench/)
    task_params["prompt_file"] = str(prompts if prompts.is_absolute() else ROOT / prompts)
    if not real:
        task_params["image_size"] = 32
    corpus = make_task(base.task.name, seed=0, **task_params).corpus()
    dtype = base.model.dtype if real else "float32"  # tiny: float32, as the other smoke models
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if real:
            generator, text_encoder, tokenizer, vae = _real_parts(corpus, layers, params["chunk_frames"], dtype)
        else:
            generator, text_encoder, tokenizer, vae = build_tiny_parts(
                corpus, chunk_frames=params["chunk_frames"], latent=True, patch_size=(1, 2, 2), num_layers=layers)
    # the policy's own checks (model frames split into chunks, VAE compression) run here, at build time
    policy = VideoGenPolicy(generator, text_encoder, tokenizer, VideoGenConfig(**params),
                            num_frames=task_params["num_frames"], height=task_params["image_size"],
                            width=task_params["image_size"], vae=vae)
    policy.save(work / "model")
    del policy, generator, text_encoder, vae  # the child measures from a clean RSS
    save_clip(work / "clip", corpus, real)
    return [f"model.path={work / 'model'}", "model.source=pretrained", f"model.dtype={dtype}",
            f"task.params={json.dumps(task_params)}", f"rewards.0.params.path={work / 'clip'}",
            "rewards.0.params.device=cpu"]
