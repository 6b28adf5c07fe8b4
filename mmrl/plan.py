"""`mmrl plan CONFIG --gpus N --gpu-memory GB`: the peak GPU memory per phase of one RL step of CONFIG
at its full depth, replicated and FSDP-sharded over N GPUs, and the largest micro-batch that fits
(`train.max_tokens_per_micro` for the text samplers, `train.micro_batch_size` rows for the video and
the VLA configs, whose rows have the config's fixed size).

The prediction is built from two parts:

* Static (analytic): the full-depth parameter counts (bench/real_shapes.json, counted from the
  model's public config built on the meta device) times the bytes of `model.dtype`: weights, the
  reference copy when `algo.beta` > 0, gradients, and AdamW's two states, which torch keeps in the
  parameter's dtype (bf16 parameters: bf16 states). Replicated: all of it on every GPU. FSDP over N:
  all of it / N, plus the whole weights while sampling (mmrl unshards the policy and its reference
  for generation, `distributed.full_parameters`) and two unsharded blocks in the training passes.
* Dynamic (measured, plus the text sampler's KV cache computed analytically): what each phase adds
  above the static memory, measured on the CPU by `bench/real_shapes.py` at the model's real widths
  with 1 and 2 layers and two sizes n (n counts what one sampler call takes for `sampling`, one
  micro-batch for `old_ref` and `update`: tokens for the text samplers, rows where the config fixes
  a row's size), fitted per phase as dyn(L, n) = (c0 + c1 L) + (d0 + d1 L) n (four points, solved
  exactly), evaluated at the full depth and the config's own n.
* Frozen parts outside the policy's weights (a text encoder, a VAE, a reward model) add their bytes
  (`frozen_extra_bytes`) to every phase; the bench builds them cut down, so only their activations
  are in the measurement.

Plus RUNTIME_GIB for the CUDA context, cuBLAS workspaces and kernels (not measured here), and a
fit needs the peak below (1 - HEADROOM) of the GPU's memory (the caching allocator's fragmentation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmrl.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "bench" / "real_shapes.json"
PHASES = ("sampling", "old_ref", "update")
RUNTIME_GIB = 1.0  # CUDA context + cuBLAS/cuDNN workspaces + kernel images, per GPU
HEADROOM = 0.08  # share of the GPU kept free for the caching allocator's fragmentation
GIB = 2**30
MIB = 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class PhaseFit:
    """dyn(L, n) = (c0 + c1 L) + (d0 + d1 L) n, in MiB (n: tokens)."""

    c0: float
    c1: float
    d0: float
    d1: float

    def __call__(self, layers: float, n: float) -> float:
        return self.c0 + self.c1 * layers + (self.d0 + self.d1 * layers) * n

    @classmethod
    def from_points(cls, y1a: float, y2a: float, y1b: float, y2b: float, na: float, nb: float) -> "PhaseFit":
        """The fit through dyn at (L=1, n=na), (2, na), (1, nb), (2, nb). Slopes are floored at 0
        (memory never shrinks with more layers or tokens; a negative slope is measurement noise)."""
        sa, sb = y2a - y1a, y2b - y1b  # per-layer cost at na, nb
        ia, ib = y1a - sa, y1b - sb  # the L = 0 intercept at na, nb
        if nb == na:
            return cls(ia, max(0.0, sa), 0.0, 0.0)
        d1 = max(0.0, (sb - sa) / (nb - na))
        d0 = max(0.0, (ib - ia) / (nb - na))
        return cls(ia - d0 * na, max(0.0, sa - d1 * na), d0, d1)


def linear_in_layers(m1: float, m2: float, layers: int) -> float:
    """m(L) = m1 + (L - 1)(m2 - m1): the bench's check of the fit (4 layers from 1 and 2)."""
    return m1 + (layers - 1) * (m2 - m1)


def load_measurements(path: str | Path | None = None) -> dict[str, Any]:
    path = Path(path) if path else MEASUREMENTS
    if not path.is_file():
        raise ConfigError(f"no measurements at {path}: run `python bench/real_shapes.py` first")
    return json.loads(path.read_text())


def find_model(measurements: dict[str, Any], config: str | Path) -> tuple[str, dict[str, Any]]:
    """The measured model whose GPU config is `config`."""
    target = Path(config).resolve()
    for name, entry in measurements.get("models", {}).items():
        if (ROOT / entry["config"]).resolve() == target and not entry.get("smoke"):
            return name, entry
    known = ", ".join(sorted(e["config"] for e in measurements.get("models", {}).values() if not e.get("smoke")))
    raise ConfigError(f"{config}: no real-width measurement in bench/real_shapes.json (measured: {known or 'none'}); "
                      f"add the model to bench/real_shapes.py and run it")


def fit_phases(runs: list[dict[str, Any]]) -> dict[str, PhaseFit]:
    by = {(r["layers"], r["size"]): r for r in runs}
    missing = [k for k in [(1, "a"), (2, "a"), (1, "b"), (2, "b")] if k not in by]
    if missing:
        raise ConfigError(f"the measurements lack the settings (layers, size) {missing} the fit needs")
    fits = {}
    for p in PHASES:
        y = {k: by[k]["dyn_mib"][p] for k in by}
        fits[p] = PhaseFit.from_points(y[(1, "a")], y[(2, "a")], y[(1, "b")], y[(2, "b")],
                                       by[(1, "a")]["n"][p], by[(1, "b")]["n"][p])
    return fits


def config_sizes(cfg, unit: str, prompt_tokens: int) -> dict[str, int]:
    """n of each phase under the config (per GPU). `unit` "tokens" (text samplers): a sampler call's
    rows x (prompt + reply budget), and one micro-batch's prompt + reply tokens (its token budget
    when set). "rows" (a row's size fixed by the config: a video, an episode): the rows of a
    sampler call and of a micro-batch."""
    s, t, r = cfg.sampling, cfg.train, cfg.rollout
    G = s.group_size
    rows = t.prompts_per_step * G  # per rank: every rank samples prompts_per_step prompts
    per_call = min(rows, max(1, r.batch_size // G) * G) if r.batch_size > 0 else rows
    micro_rows = t.micro_batch_size or rows
    if unit == "rows":
        return {"sampling": per_call, "old_ref": micro_rows, "update": micro_rows}
    seq = prompt_tokens + s.max_new_tokens
    micro = micro_rows * seq
    if t.max_tokens_per_micro:
        micro = min(micro, max(t.max_tokens_per_micro, seq))  # one row at least, whatever the budget
    return {"sampling": per_call * seq, "old_ref": micro, "update": micro}


def static_gib(params: dict[str, int], cfg, gpus: int, fsdp: bool) -> dict[str, float]:
    """The static bytes per GPU in each phase (GiB)."""
    b = DTYPE_BYTES[cfg.model.dtype]
    total, train = params["total"], params["trainable"]
    ref = total if cfg.algo.beta > 0 and cfg.model.lora_rank == 0 else 0
    frozen_extra = params.get("frozen_extra_bytes", 0)  # e.g. a text encoder and a reward model, never trained
    resident = (total + ref) * b + train * b * 3  # weights, reference, grads, 2 Adam states
    if not fsdp:
        return {p: (resident + frozen_extra) / GIB for p in PHASES}
    shard = resident / gpus + frozen_extra  # frozen parts outside the policy are not sharded
    blocks = 2 * params.get("largest_block", 0) * b  # the block in use and the next one (prefetch)
    return {"sampling": (shard + (total + ref) * b) / GIB, "old_ref": (shard + blocks) / GIB,
            "update": (shard + blocks) / GIB}


def plan(config: str | Path, gpus: int, gpu_memory: float, measurements: str | Path | None = None) -> dict[str, Any]:
    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {gpus}")
    if not gpu_memory > 0:
        raise ConfigError(f"--gpu-memory must be > 0 (GiB per GPU), got {gpu_memory}")
    from mmrl.config import read_config_file, typed_config

    cfg = typed_config(read_config_file(config))  # without the checks that need the model or a GPU
    name, entry = find_model(load_measurements(measurements), config)
    measured = bool(entry["runs"])
    # Not measured yet: the static memory alone (activations, KV cache and sampler buffers not included).
    fits = fit_phases(entry["runs"]) if measured else {p: PhaseFit(0.0, 0.0, 0.0, 0.0) for p in PHASES}
    params = entry["full_params"]
    layers = params["layers"]
    unit = entry.get("unit", "tokens")
    prompt = max(r["prompt_tokens"] for r in entry["runs"]) if measured else 0
    n = config_sizes(cfg, unit, prompt) if measured else {p: 0 for p in PHASES}
    budget = gpu_memory * (1 - HEADROOM)
    out: dict[str, Any] = {"config": str(config), "model": name, "measured": measured, "shapes": entry.get("shapes"), "layers": layers, "params": params["total"],
                           "dtype": cfg.model.dtype, "prompt_tokens": prompt, "unit": unit, "tokens": n, "gpus": gpus,
                           "gpu_memory_gib": gpu_memory, "budget_gib": budget, "modes": {}}
    for mode, fsdp in (("replicated", False), ("fsdp", True)):
        static = static_gib(params, cfg, gpus, fsdp)
        dyn = {p: max(0.0, fits[p](layers, n[p])) * MIB / GIB for p in PHASES}
        # The sampler's KV cache, analytic: at the bench's few thousand tokens it hides in the noise of
        # the measured slope (36 KiB a token for the 3B at full depth, 13 GiB at 378k tokens), so the
        # sampling phase takes the larger of the fit and (its n = 0 part + the cache).
        per_token = params.get("kv_values_per_token_layer", 0) if unit == "tokens" else 0  # rows: in the fit
        kv = per_token * DTYPE_BYTES[cfg.model.dtype] * layers * n["sampling"]
        f = fits["sampling"]
        dyn["sampling"] = max(dyn["sampling"], (max(0.0, f.c0 + f.c1 * layers) * MIB + kv) / GIB)
        peak = {p: static[p] + dyn[p] + RUNTIME_GIB for p in PHASES}
        # The largest micro-batch (tokens, or rows) whose old_ref and update phases fit: solve
        # static + dyn(L, n) + runtime <= budget for n in each, take the smaller.
        limits = [] if measured else [float("inf")]
        for p in ("old_ref", "update") if measured else ():
            f = fits[p]
            room = (budget - static[p] - RUNTIME_GIB) * GIB / MIB - (f.c0 + f.c1 * layers)
            slope = f.d0 + f.d1 * layers
            limits.append(0 if room <= 0 else (room / slope if slope > 0 else float("inf")))
        largest = min(limits)
        if largest != float("inf"):
            largest = int(largest // 1024 * 1024) if unit == "tokens" else int(largest)
        out["modes"][mode] = {
            "static_gib": static, "dyn_gib": dyn, "peak_gib": peak, "max_gib": max(peak.values()),
            "fits": max(peak.values()) <= budget and peak["sampling"] <= budget,
            "sampling_fits": peak["sampling"] <= budget,
            # train.max_tokens_per_micro (tokens), or train.micro_batch_size (rows); None: unbounded
            "max_micro": None if largest == float("inf") else largest,
        }
    out["fsdp_supported"] = cfg.model.policy in __import__("mmrl.config", fromlist=["FSDP_POLICIES"]).FSDP_POLICIES
    return out


def format_plan(p: dict[str, Any]) -> str:
    n = p["tokens"]
    lines = [f"{p['config']}: {p['model']}, {p['params'] / 1e9:.2f}B parameters in {p['dtype']}, {p['layers']} layers; "
             f"{p['gpus']} GPU(s) of {p['gpu_memory_gib']:g} GiB (budget {p['budget_gib']:.1f} GiB each, "
             f"{HEADROOM:.0%} headroom)",
             (f"  tokens per sampler call {n['sampling']:,}, per micro-batch {n['update']:,} "
              f"(prompt ~{p['prompt_tokens']} tokens incl. the image)" if p["unit"] == "tokens" else
              f"  rows per sampler call {n['sampling']:,}, per micro-batch {n['update']:,} (a row's size is the config's)"),
             f"  {'phase':<10}{'replicated GiB':>16}{'FSDP x' + str(p['gpus']) + ' GiB':>16}"]
    if not p["measured"]:
        lines[1] = (f"  NOT MEASURED: static memory only (weights, reference, grads, AdamW states, frozen parts) of "
                    f"{p['shapes']}; activations, KV cache and sampler buffers are not included: a lower bound")
    rep, fs = p["modes"]["replicated"], p["modes"]["fsdp"]
    for ph in PHASES:
        lines.append(f"  {ph:<10}{rep['peak_gib'][ph]:>16.1f}{fs['peak_gib'][ph]:>16.1f}")
    lines.append(f"  {'static':<10}{rep['static_gib']['update']:>16.1f}{fs['static_gib']['update']:>16.1f}"
                 f"   (weights, reference, grads, AdamW states; + {RUNTIME_GIB:g} GiB runtime in each phase)")
    for mode, m in (("replicated", rep), (f"FSDP x{p['gpus']}", fs)):
        tok = m["max_micro"]
        tok_s = ("not measured" if not p["measured"] else "none fits" if tok == 0 else
                 "unbounded" if tok is None else f"{tok:,}")
        key = "train.max_tokens_per_micro" if p["unit"] == "tokens" else "train.micro_batch_size"
        verdict = "fits" if m["fits"] else ("sampling does not fit" if not m["sampling_fits"] else "does not fit")
        if not p["measured"]:
            verdict = "static memory fits (activations not included)" if m["fits"] else "static memory alone does not fit"
        lines.append(f"  {mode}: peak {'>= ' if not p['measured'] else ''}{m['max_gib']:.1f} GiB per GPU: {verdict}; largest "
                     f"{key} that fits: {tok_s}")
    if not p["fsdp_supported"]:
        lines.append("  note: mmrl shards only causal_lm with FSDP (train.fsdp); the FSDP column is what it would take")
    return "\n".join(lines)


def main(args) -> int:
    """The `mmrl plan` subcommand."""
    result = plan(args.config, args.gpus, args.gpu_memory, args.measurements)
    print(format_plan(result))
    if args.json:
        print(json.dumps(result))
    return 0
