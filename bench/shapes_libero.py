"""bench/real_shapes.py, model `libero_action_vla`: the action-token VLA of
`configs/vla_libero_grpo.yaml` (a Qwen2-VL-style model built from the config's `model.tiny` sizes:
Qwen2.5-0.5B's width, a 1,024-wide vision tower), LM and vision depth cut to L, on LIBERO-Spatial at
the config's 224 px camera, with one env worker. Random weights fail every episode, so each row
runs to `max_chunks`: the largest row the config can make."""

from __future__ import annotations

from pathlib import Path

import yaml

from shapes_qwen_vl import qwen_vl_param_counts

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "vla_libero_grpo.yaml"
N_ACTION_TOKENS = 256  # the <act_i> bins the policy adds to its local tokenizer
# --smoke: the same model at tiny widths and short episodes
SMOKE_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "mrope_section": [4, 2, 2], "vision_width": 32, "vision_heads": 2}


def param_counts() -> dict:
    model = yaml.safe_load(CONFIG.read_text())["model"]
    t = model["tiny"]
    vocab = model.get("tokenizer_vocab_size", 320) + N_ACTION_TOKENS
    shapes = {"hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
              "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
              "head_dim": t["head_dim"], "vocab_size": vocab, "max_position_embeddings": t["max_position_embeddings"],
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "mrope_section": t["mrope_section"],
              "tie_word_embeddings": True, "num_hidden_layers": t["num_hidden_layers"],
              "vision_config": {"depth": t["vision_depth"], "hidden_size": t["vision_width"],
                                "intermediate_size": 2 * t["vision_width"], "num_heads": t["vision_heads"],
                                "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                "window_size": 112, "fullatt_block_indexes": [t["vision_depth"] - 1]}}
    return qwen_vl_param_counts(shapes)


def missing() -> str | None:
    """Why this model cannot be measured on this machine (LIBERO's assets are not here), else None."""
    from mmrl.envs.libero.assets import find_assets

    try:
        find_assets()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def prepare(work: Path, base, layers: int, width: str, caps: dict) -> list[str]:
    # random weights fail every episode: no success filter (it would drop every group) and one sampling try
    out = [f"model.tiny.num_hidden_layers={layers}", f"model.tiny.vision_depth={layers}", "task.params.num_workers=1",
           "algo.success_filter=null", "algo.max_sampling_tries=1"]
    if width == "tiny":
        out += [f"model.tiny.{k}={v}" for k, v in SMOKE_TINY.items()]
        out += ["model.params.max_chunks=2", "task.params.image_size=64", "task.params.train_states=2"]
    return out
