"""bench/real_shapes.py, model `smolvla`: lerobot's SmolVLA (smolvla_base on SmolVLM2-500M) at its
real width (`configs/real_shapes/smolvla.json`), VLM depth cut to L layers, on
`configs/vla_tabletop_smolvla.yaml`'s task at SmolVLA's own image size and chunk."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "configs" / "real_shapes" / "smolvla.json"


def param_counts() -> dict:
    """Full-depth parameters from the sizes (a formula: building SmolVLA needs its VLM's config).
    Its VLM cut to num_vlm_layers text layers, the SigLIP tower, the connector, the action expert
    (width x expert_width_multiplier, same depth, MLP 2048) and the action/state/time projections."""
    s = json.loads(SHAPES.read_text())
    t, v, c = s["text_config"], s["vision_config"], s["smolvla"]
    d, kv = t["hidden_size"], t["num_key_value_heads"] * t["head_dim"]
    lm_layer = 2 * d * t["num_attention_heads"] * t["head_dim"] + 2 * d * kv + 3 * d * t["intermediate_size"]
    vlm = c["num_vlm_layers"] * lm_layer + 2 * t["vocab_size"] * d
    siglip = v["num_hidden_layers"] * (4 * v["hidden_size"] ** 2 + 2 * v["hidden_size"] * v["intermediate_size"]) \
        + (v["image_size"] // v["patch_size"]) ** 2 * v["hidden_size"] + 3 * v["patch_size"] ** 2 * v["hidden_size"]
    connector = v["hidden_size"] * s["scale_factor"] ** 2 * d
    e = int(d * c["expert_width_multiplier"])
    expert_layer = e * t["num_attention_heads"] * t["head_dim"] * 2 + 2 * kv * e + 3 * e * 2048
    expert = c["num_vlm_layers"] * expert_layer
    heads = 2 * c["max_action_dim"] * e + c["max_state_dim"] * d + 3 * e * e
    total = vlm + siglip + connector + expert + heads
    return {"total": total, "trainable": expert + heads if c["train_expert_only"] else total,
            "largest_block": lm_layer + expert_layer, "layers": c["num_vlm_layers"], "formula": True}


def prepare(work: Path, base, layers: int, width: str, caps: dict) -> list[str]:
    """A saved SmolVLA of `layers` VLM layers (and as many action-expert layers) on a SmolVLM built
    from configs, no hub access. Real: SmolVLM2-500M's text and SigLIP widths, 512 px input, pixel
    shuffle 4, and smolvla_base's settings (chunk 50, 10 flow steps, expert width x 0.75, cross /
    self attention alternating, expert-only training, frozen vision). The vision tower keeps its 12
    layers: SmolVLA cuts only the text model (num_vlm_layers), so the tower's cost is the same at
    every depth and `mmrl plan` must not scale it by the layers. Tiny (--smoke): the tiny builder's sizes."""
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig as LeRobotConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy as LeRobotSmolVLA

    from mmrl.envs import make_task
    from mmrl.policies.vla.configuration import SmolVLAConfig
    from mmrl.policies.vla.lerobot_policy import build_lerobot, robot_features
    from mmrl.policies.vla.processor import instruction_corpus
    from mmrl.policies.vla.modeling_smolvla import SmolVLAPolicy, build_tiny_smolvlm_dir

    real = width != "tiny"
    params = dict(base.model.params)
    cameras = params.get("cameras") or ["front"]
    task = make_task(base.task.name, seed=0, **base.task.params)
    corpus = instruction_corpus(task)
    if real:
        s = json.loads(SHAPES.read_text())
        t, v, c = s["text_config"], s["vision_config"], s["smolvla"]
        text = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "max_position_embeddings", "rope_theta")}
        vision = {k: v[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
        vlm = build_tiny_smolvlm_dir(work / "vlm", corpus, image_size=v["image_size"], patch_size=v["patch_size"],
                                     hidden_size=t["hidden_size"], num_layers=layers, scale=s["scale_factor"],
                                     text=text, vision=vision)
        settings = {k: c[k] for k in ("chunk_size", "n_action_steps", "max_state_dim", "max_action_dim",
                                      "tokenizer_max_length", "num_steps", "expert_width_multiplier",
                                      "self_attn_every_n_layers", "train_expert_only", "freeze_vision_encoder")}
        settings["resize_imgs_with_padding"] = tuple(c["resize_imgs_with_padding"])
    else:
        vlm = build_tiny_smolvlm_dir(work / "vlm", corpus, num_layers=layers)
        settings = {"chunk_size": params["chunk_size"], "n_action_steps": params["n_action_steps"],
                    "max_state_dim": params["state_dim"], "max_action_dim": params["action_dim"],
                    "resize_imgs_with_padding": (32, 32), "num_steps": params["num_steps"]}
    cfg = LeRobotConfig(vlm_model_name=str(vlm), load_vlm_weights=False, num_vlm_layers=layers, device="cpu",
                        **settings, **robot_features(cameras, params["image_size"], params["state_dim"],
                                                     params["action_dim"]))
    model, pre, post = build_lerobot(LeRobotSmolVLA, cfg, seed=0, device="cpu")
    mine = {"eta": params.get("eta", 0.7), "max_chunks": params.get("max_chunks", 64), "cameras": cameras,
            "num_steps": settings["num_steps"], "n_action_steps": settings["n_action_steps"]}
    SmolVLAPolicy(model, pre, post, SmolVLAConfig(**mine)).save(work / "model")
    # random weights fail every episode: no success filter (it would drop every group), one try, no SFT
    return ["model.source=pretrained", f"model.path={work / 'model'}", "~model.params",
            f"model.params={json.dumps(mine)}", "sft.steps=0", "algo.success_filter=null", "algo.max_sampling_tries=1"]
