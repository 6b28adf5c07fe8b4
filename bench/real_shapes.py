"""Peak memory per phase of one RL step at a GPU config's REAL widths, depth cut to 1-4 layers, on the CPU.

For each GPU config the model is built at its real width from a small config JSON in the repo
(`configs/real_shapes/*.json`: the public config.json sizes), with the language model's depth cut to
L layers (the vision tower's depth cut to L too), random weights, saved to a temporary folder and
loaded back through mmrl's normal path: the config itself with `model.path` pointing there
(`mmrl.build`), then `Trainer(cfg, policy, task).train_step()`: sampling, the reference (and
old-log-prob) pass, the update, all on the CPU in the config's dtype (bf16 for the GPU configs).

Memory per phase. Each setting runs in its own child process, started with
`MALLOC_MMAP_THRESHOLD_=65536` (so every tensor buffer is an mmap that goes back to the OS when freed:
RSS follows the live bytes instead of glibc's cached heap). The child wraps `Trainer.collect`
(phase `sampling`: sampling + rewards), `Trainer.in_micro_batches` (phase `old_ref`: the no-grad
passes of the update, the reference log-probs and, with `train.recompute_old_logp`, the old ones)
and `Trainer.update` (phase `update`: the rest of the update, forward + backward per micro-batch and
the AdamW step). At every phase boundary it reads the kernel's RSS high-water mark (`VmHWM` in
/proc/self/status) into the phase that just ran and resets it (`echo 5 > /proc/self/clear_refs`), so
each phase's figure is its own exact RSS peak, not a sampled one (a 2 ms sampling thread of `VmRSS`
is the fallback where clear_refs is refused). Before the step, every trainable parameter gets a
gradient and AdamW its two states (one optimizer step at lr 0), so the measured step is a steady-state
one (step >= 2: gradients of the last step and Adam's states alive through sampling, as on a GPU).

Every figure is MiB above the process's RSS once torch and mmrl are imported (`libs_mib`, before any
model or data exists): `static_mib` (RSS before the step: weights, reference copy, gradients, Adam
states, data, tokenizer) and each phase's peak; `dyn_mib` = peak - static (what the phase adds).

Settings per model: L in {1, 2} at two sizes (`a`: fewer rows and tokens, `b`: more), so that
`mmrl plan` (mmrl/plan.py) can fit dyn(L, n) = (c0 + c1 L) + (d0 + d1 L) n per phase (n: tokens in
a sampler call, or in one micro-batch), and L = 4 at size `a` to check the fit's 4-layer prediction
(made from L = 1, 2 alone). CPU caps (the GPU config's values are in the JSON; `mmrl plan` scales
the measured n to them): prompts per step, max_new_tokens and micro-batch rows, see CAPS.

    python bench/real_shapes.py                 # the real-width grid, writes bench/real_shapes.json
    python bench/real_shapes.py --model qwen2_5_vl_3b
    python bench/real_shapes.py --smoke         # tiny widths, 1-2 layers, seconds (CI)

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from child import run_child  # bench/child.py: this folder is on sys.path when a bench runs

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "bench" / "real_shapes.json"

# model key -> the GPU config it measures and the JSON of the model's public sizes
MODELS = {
    "qwen2_5_vl_3b": {"config": "configs/vqa_geometry3k_gpu.yaml", "shapes": "configs/real_shapes/qwen2_5_vl_3b.json"},
}
# CPU caps per size: prompts per step (x the config's group size = rows), max_new_tokens, micro-batch rows
CAPS = {
    "qwen2_5_vl_3b": {"a": {"prompts": 1, "max_new_tokens": 32, "micro_rows": 2},
                      "b": {"prompts": 2, "max_new_tokens": 96, "micro_rows": 5}},
}
SMOKE_CAPS = {"a": {"prompts": 1, "max_new_tokens": 4, "micro_rows": 2},
              "b": {"prompts": 2, "max_new_tokens": 8, "micro_rows": 4}}
# (layers, size): the fit's four points, then the check
GRID = [(1, "a"), (2, "a"), (1, "b"), (2, "b"), (4, "a")]
SMOKE_GRID = [(1, "a"), (2, "b")]  # --smoke: two children, the path end to end
FIT_GRID = [(1, "a"), (2, "a"), (1, "b"), (2, "b")]
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


# ----------------------------------------------------------------------------- memory per phase


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


class PhaseMeter:
    """The RSS peak of each named phase (phases nest: an inner one's time is its own, not the
    outer's). Exact via VmHWM + clear_refs; else a sampling thread of VmRSS."""

    def __init__(self):
        self.stack = ["other"]
        self.peak: dict[str, float] = {}
        self.exact = self._reset()
        self._sampled = 0.0
        if not self.exact:
            self._stop = False
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def _sample(self) -> None:
        while not self._stop:
            self._sampled = max(self._sampled, rss_mib())
            time.sleep(0.002)

    def _flush(self) -> None:
        now = _status_kib("VmHWM") / 1024 if self.exact else max(self._sampled, rss_mib())
        name = self.stack[-1]
        self.peak[name] = max(self.peak.get(name, 0.0), now)
        if self.exact:
            self._reset()
        else:
            self._sampled = rss_mib()

    def wrap(self, obj, method: str, phase: str) -> None:
        inner = getattr(obj, method)

        def wrapped(*args, **kwargs):
            self._flush()
            self.stack.append(phase)
            try:
                return inner(*args, **kwargs)
            finally:
                self._flush()
                self.stack.pop()

        setattr(obj, method, wrapped)


# ----------------------------------------------------------------------------- models at real width


def load_shapes(model: str, width: str) -> dict:
    """The model's sizes: `real` (its JSON), or the same architecture at `small` / `tiny` (--smoke) widths."""
    shapes = json.loads((ROOT / MODELS[model]["shapes"]).read_text())
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
    """Parameters of the full-depth model (built on the meta device: nothing is allocated)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    def count(layers_lm: int, vision_depth: int) -> dict:
        s = {**shapes, "vision_config": {**shapes["vision_config"], "depth": vision_depth}}
        cfg = qwen_vl_config(s, layers_lm, None, vocab_size=shapes["vocab_size"] or 400)
        cfg.vision_config.depth = vision_depth
        with torch.device("meta"):
            m = Qwen2_5_VLForConditionalGeneration(cfg)
        total = sum(p.numel() for p in m.parameters())
        vision = sum(p.numel() for p in m.model.visual.parameters())
        block = max(sum(p.numel() for p in layer.parameters()) for layer in m.model.language_model.layers)
        return {"total": total, "vision": vision, "largest_block": block}

    full = count(shapes["num_hidden_layers"], shapes["vision_config"]["depth"])
    # the sampler's KV cache: keys and values of every layer, per token
    kv = 2 * shapes["num_key_value_heads"] * shapes["head_dim"]
    return {**full, "trainable": full["total"], "layers": shapes["num_hidden_layers"], "kv_values_per_token_layer": kv,
            "vision_depth": shapes["vision_config"]["depth"]}


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


# ----------------------------------------------------------------------------- analytic only (not measured yet)

# GPU configs whose step is not measured here yet: `mmrl plan` prints their static memory (weights,
# reference, gradients, AdamW states, frozen parts) from the full-depth parameter counts and says
# that the activations are not included.
ANALYTIC = {
    "libero_action_vla": {"config": "configs/vla_libero_grpo.yaml", "shapes": "configs/vla_libero_grpo.yaml (model.tiny)"},
    "wan2_1_t2v_1_3b": {"config": "configs/video_wan_gpu.yaml", "shapes": "configs/real_shapes/wan2_1_t2v_1_3b.json"},
    "smolvla": {"config": "configs/vla_tabletop_smolvla.yaml", "shapes": "configs/real_shapes/smolvla.json"},
}


def analytic_counts(model: str) -> dict:
    """Full-depth parameter counts (meta device, or the SmolVLA formula below) of an ANALYTIC model."""
    import torch

    if model == "libero_action_vla":
        import yaml

        t = yaml.safe_load((ROOT / ANALYTIC[model]["config"]).read_text())["model"]["tiny"]
        vocab = 320 + 256  # the config's local tokenizer (model.tokenizer_vocab_size) + 256 action tokens
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
    s = json.loads((ROOT / ANALYTIC[model]["shapes"]).read_text())
    if model == "wan2_1_t2v_1_3b":
        from diffusers import WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        tr = {k: v for k, v in s["transformer"].items()}
        tr["patch_size"] = tuple(tr["patch_size"])
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
    # SmolVLA: its VLM cut to num_vlm_layers text layers, the SigLIP tower, the connector, the action
    # expert (width x expert_width_multiplier, same depth, MLP 2048) and the action/state/time projections.
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


# ----------------------------------------------------------------------------- one setting (child)


def run_setting(model: str, layers: int, size: str, width: str) -> dict:
    import gc

    libs = None
    import torch

    import mmrl
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    gc.collect()
    libs = rss_mib()
    smoke = width != "real"
    caps = (SMOKE_CAPS if smoke else CAPS[model])[size]
    spec = MODELS[model]
    shapes = load_shapes(model, width)
    base = load_config(ROOT / spec["config"])
    work = Path(tempfile.mkdtemp(prefix="real_shapes_"))
    t0 = time.perf_counter()
    pixels = {k: base.task.params[k] for k in ("min_pixels", "max_pixels") if k in base.task.params}
    unit = (shapes["vision_config"]["patch_size"] * shapes["vision_config"]["spatial_merge_size"]) ** 2
    min_tokens = max(1, pixels.get("min_pixels", 256 * unit) // unit)
    max_tokens = max(min_tokens, pixels.get("max_pixels", 256 * unit) // unit)
    image_size = 56 if smoke else int(round((min_tokens * unit) ** 0.5))  # the config's smallest image: min_pixels
    if smoke:
        pixels, min_tokens, max_tokens = {}, 4, 4
    # Synthetic VQA records at the config's image size (the real data is a hub dataset); the rest is the config.
    task_params = {"source": "synthetic", "image_size": image_size, "n_train": 16, "n_test": 4, "n_ood": 0,
                   "ood_difficulty": None, "answer_style": base.task.params.get("answer_style", "tag"),
                   "eval_k": 0, **pixels}
    from mmrl.envs import make_task

    corpus = make_task("vqa", seed=0, **task_params).corpus()
    build_qwen_vl_folder(work / "model", shapes, layers, corpus, min_tokens, max_tokens,
                         "float32" if smoke else base.model.dtype)
    G = base.sampling.group_size
    overrides = [
        f"model.path={work / 'model'}", "model.source=pretrained", "~task.params", f"task.params={json.dumps(task_params)}",
        f"sampling.max_new_tokens={caps['max_new_tokens']}", f"train.prompts_per_step={caps['prompts']}",
        f"train.micro_batch_size={caps['micro_rows']}", "train.max_tokens_per_micro=0",
        f"rollout.batch_size={caps['prompts'] * G}", "train.steps=1", "train.eval_every=0", "train.save_every=0",
        "train.progress=false", "train.device=cpu", f"train.output_dir={work / 'run'}",
    ]
    if smoke:
        overrides.append("model.dtype=float32")
    cfg = load_config(ROOT / spec["config"], overrides)
    task, policy = mmrl.build(cfg)
    # Every reply runs to max_new_tokens (random weights would stop at a sampled EOS at random).
    policy.suppress_token_ids = sorted(set(policy.suppress_token_ids) | set(policy.eos_token_ids))
    trainer = Trainer(cfg, policy, task)
    steady_state(trainer)
    build_s = time.perf_counter() - t0
    meter = PhaseMeter()
    seen = {"micro_tokens": 0, "sampler_tokens": 0}
    collect = trainer.collect

    def counted_collect():
        rollout, stats = collect()
        width = rollout.extras["prompt_ids"].shape[1] + rollout.units.shape[1]
        seen["sampler_tokens"] = min(len(rollout), cfg.rollout.batch_size or len(rollout)) * width
        seen["prompt_tokens"] = rollout.extras["prompt_ids"].shape[1]
        return rollout, stats

    trainer.collect = counted_collect
    backward_micro = trainer.backward_micro

    def counted_backward(part, *args):
        seen["micro_tokens"] = max(seen["micro_tokens"], len(part) * (part.extras["prompt_ids"].shape[1]
                                                                       + part.units.shape[1]))
        return backward_micro(part, *args)

    trainer.backward_micro = counted_backward
    meter.wrap(trainer, "collect", "sampling")
    meter.wrap(trainer, "in_micro_batches", "old_ref")
    meter.wrap(trainer, "update", "update")
    gc.collect()
    static = rss_mib()
    meter._flush()
    t1 = time.perf_counter()
    trainer.train_step()
    step_s = time.perf_counter() - t1
    meter._flush()
    n_params = sum(p.numel() for p in policy.model.parameters())
    n_train = sum(p.numel() for p in trainer.params)
    n_ref = sum(p.numel() for p in policy.reference.parameters()) if getattr(policy, "reference", None) is not None else 0
    phases = {k: round(meter.peak.get(k, static) - libs, 1) for k in ("sampling", "old_ref", "update")}
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # the saved model (GBs at real width)
    return {"model": model, "layers": layers, "size": size, "libs_mib": round(libs, 1),
            "static_mib": round(static - libs, 1), "peak_mib": phases,
            "dyn_mib": {k: round(v - (static - libs), 1) for k, v in phases.items()},
            "n": {"sampling": seen["sampler_tokens"], "old_ref": seen["micro_tokens"], "update": seen["micro_tokens"]},
            "prompt_tokens": seen.get("prompt_tokens"), "rows": caps["prompts"] * G,
            "max_new_tokens": caps["max_new_tokens"], "micro_rows": caps["micro_rows"],
            "params": n_params, "trainable": n_train, "reference_params": n_ref,
            "dtype": cfg.model.dtype, "exact_hwm": meter.exact, "build_s": round(build_s, 1),
            "step_s": round(step_s, 1)}


def steady_state(trainer) -> None:
    """Gradients for every trainable parameter and AdamW's two states, as after a first step (one
    optimizer step at lr 0: the weights do not move)."""
    import torch

    for p in trainer.params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in trainer.optimizer.param_groups]
    for g in trainer.optimizer.param_groups:
        g["lr"] = 0.0
    trainer.optimizer.step()
    for g, lr in zip(trainer.optimizer.param_groups, lrs):
        g["lr"] = lr


# ----------------------------------------------------------------------------- driver


def fit_check(runs: list[dict]) -> dict:
    """Per phase: the 4-layer peak predicted from the 1- and 2-layer peaks (size a) against the measured one."""
    by = {(r["layers"], r["size"]): r for r in runs}
    if not all(k in by for k in [(1, "a"), (2, "a"), (4, "a")]):
        return {}
    out = {}
    for phase in ("sampling", "old_ref", "update"):
        m1, m2, m4 = (by[(L, "a")]["peak_mib"][phase] for L in (1, 2, 4))
        pred = m1 + 3 * (m2 - m1)
        out[phase] = {"predicted_mib": round(pred, 1), "measured_mib": m4, "error": round(pred / m4 - 1, 4)}
    return out


def run_model(model: str, width: str, grid: list[tuple[int, str]]) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "2"),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    runs = []
    for layers, size in grid:
        cmd = [sys.executable, __file__, "--child", model, "--layers", str(layers), "--size", size, "--width", width]
        t0 = time.perf_counter()
        one = run_child(cmd, env, f"{model} layers={layers} size={size}", cwd=ROOT)
        one["wall_s"] = round(time.perf_counter() - t0, 1)
        runs.append(one)
        print("RUN " + json.dumps(one), flush=True)  # each setting as it completes (a long grid cut short keeps them)
        print(f"{model} L={layers} size {size}: static {one['static_mib']:.0f} MiB; peak sampling "
              f"{one['peak_mib']['sampling']:.0f} / old_ref {one['peak_mib']['old_ref']:.0f} / update "
              f"{one['peak_mib']['update']:.0f} MiB (n {one['n']}); {one['wall_s']:.0f} s", flush=True)
    shapes = load_shapes(model, width)
    return {"config": MODELS[model]["config"], "shapes": MODELS[model]["shapes"], "smoke": width != "real",
            "width": width, "full_params": qwen_vl_param_counts(shapes), "runs": runs,
            "check_4_layers": fit_check(runs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny widths, 1-2 layers (CI)")
    ap.add_argument("--width", choices=["real", "small", "tiny"], help="real (default), small (tests: the 4-layer "
                    "check at widths where layers weigh), tiny (--smoke)")
    ap.add_argument("--grid", choices=["smoke", "fit", "check", "all"], help="smoke: L 1 at a, 2 at b; fit: L 1, 2 at sizes a, b; check: L 1, 2, 4 at "
                    "size a; all (default; --smoke: smoke)")
    ap.add_argument("--model", choices=sorted(MODELS), action="append", help="only these models (repeatable)")
    ap.add_argument("--output", help=f"write the results here (default: {OUT_JSON.relative_to(ROOT)}; "
                    "--smoke writes nothing unless given)")
    ap.add_argument("--analytic", action="store_true", help="only write the full-depth parameter counts of the "
                    "configs not measured yet (ANALYTIC)")
    ap.add_argument("--child", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int)
    ap.add_argument("--size", choices=["a", "b"])
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(run_setting(a.child, a.layers, a.size, a.width or "real")), flush=True)
        return 0
    if a.analytic:
        entries = {m: {**spec, "smoke": False, "full_params": analytic_counts(m), "runs": []}
                   for m, spec in ANALYTIC.items()}
        path = Path(a.output or OUT_JSON)
        previous = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**previous, "models": {**previous.get("models", {}), **entries}}, indent=1) + "\n")
        print(json.dumps(entries))
        return 0
    t0 = time.perf_counter()
    models = a.model or sorted(MODELS)
    width = a.width or ("tiny" if a.smoke else "real")
    grid = {"smoke": SMOKE_GRID, "fit": FIT_GRID, "check": [(1, "a"), (2, "a"), (4, "a")], "all": GRID}[a.grid or ("smoke" if a.smoke else "all")]
    results = {"method": "peak RSS per phase (VmHWM reset by clear_refs at each phase boundary), MiB above the "
                         "RSS after imports; MALLOC_MMAP_THRESHOLD_=65536; steady-state step (grads + Adam states "
                         "allocated before it); CPU, config dtype",
               "models": {m: run_model(m, width, grid) for m in models}}
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    output = a.output or (None if width != "real" else OUT_JSON)
    if output:
        previous = json.loads(Path(output).read_text()) if Path(output).is_file() else {}
        merged = {**previous, **results, "models": {**previous.get("models", {}), **results["models"]}}
        Path(output).write_text(json.dumps(merged, indent=1) + "\n")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
