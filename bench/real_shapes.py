"""Peak memory per phase of one RL step at a GPU config's REAL widths, depth cut to 1-4 layers, on the CPU.

For each GPU config (MODELS: Qwen2.5-VL-3B on vqa_geometry3k_gpu, the causal Wan2.1-1.3B on
video_wan_gpu, SmolVLA on vla_tabletop_smolvla, the action-token VLA on vla_libero_grpo) the model is
built at its real width (`configs/real_shapes/*.json`: the public config.json sizes; LIBERO's VLA: the
config's own `model.tiny`), with its depth cut to L layers, random weights, by its module
`bench/shapes_<model>.py`, and loaded through mmrl's normal path: the config itself with overrides
pointing at what the module built (`mmrl.build`), then `Trainer(cfg, policy, task).train_step()`:
sampling, the reference (and old-log-prob) pass, the update, all on the CPU in the config's dtype.
Frozen parts outside the policy (a text encoder, a reward model) are built cut down; `mmrl plan`
adds their full weights analytically.

Memory per phase. Each setting runs in its own child process, started with
`MALLOC_MMAP_THRESHOLD_=65536` (so every tensor buffer is an mmap that goes back to the OS when freed:
RSS follows the live bytes instead of glibc's cached heap). The child wraps `Trainer.collect`
(phase `sampling`: sampling + rewards), `Updater.in_micro_batches` (phase `old_ref`: the no-grad
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
`mmrl plan` (mmrl/plan.py) can fit dyn(L, n) = (c0 + c1 L) + (d0 + d1 L) n per phase (n: what a
sampler call or one micro-batch takes, in tokens for the text samplers, in rows where the config
fixes a row's size), and L = 4 at size `a` to check the fit's 4-layer prediction (made from L = 1, 2
alone). CPU caps per size (`ModelSpec.caps`; `mmrl plan` scales the measured n to the config's):
prompts per step, group size, max_new_tokens and micro-batch rows. A module's `missing()` names what
this machine lacks to measure it (LIBERO's assets); the model is then skipped and its stored entry kept.

    python bench/real_shapes.py                 # the real-width grid, writes bench/real_shapes.json
    python bench/real_shapes.py --model qwen2_5_vl_3b
    python bench/real_shapes.py --smoke         # tiny widths, 1-2 layers, seconds (CI)

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from child import run_child  # bench/child.py: this folder is on sys.path when a bench runs

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "bench" / "real_shapes.json"


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


# ----------------------------------------------------------------------------- the models


@dataclass(frozen=True)
class ModelSpec:
    """One GPU config's model. `module` (bench/<module>.py) builds it: `prepare(work, base, layers,
    width, caps)` writes what the config loads and returns the overrides that point at it;
    `param_counts()` gives the full-depth model's parameters. `unit` is what n counts: `tokens` for
    the text samplers (a row is prompt + reply tokens, so n = rows x tokens), `rows` where the config
    fixes a row's size (a video of its frames and resolution, an episode of its chunks). `caps` per
    size: prompts per step, micro-batch rows, and optionally the group size and max_new_tokens."""

    config: str
    shapes: str
    module: str
    unit: str
    caps: dict[str, dict[str, int]]
    smoke_caps: dict[str, dict[str, int]]

    def load(self):
        return importlib.import_module(self.module)


# The video and VLA configs fix a row's size (frames and resolution, chunks and image size), so their
# sizes differ in rows alone: one prompt's group of 2, then of 4 (the CPU's few minutes a setting).
ROW_CAPS = {"a": {"prompts": 1, "group_size": 2, "micro_rows": 1}, "b": {"prompts": 1, "group_size": 4, "micro_rows": 2}}
MODELS = {
    "qwen2_5_vl_3b": ModelSpec(
        "configs/vqa_geometry3k_gpu.yaml", "configs/real_shapes/qwen2_5_vl_3b.json", "shapes_qwen_vl", "tokens",
        caps={"a": {"prompts": 1, "max_new_tokens": 32, "micro_rows": 2},
              "b": {"prompts": 2, "max_new_tokens": 96, "micro_rows": 5}},
        smoke_caps={"a": {"prompts": 1, "max_new_tokens": 4, "micro_rows": 2},
                    "b": {"prompts": 2, "max_new_tokens": 8, "micro_rows": 4}}),
    "libero_action_vla": ModelSpec(
        "configs/vla_libero_grpo.yaml", "configs/vla_libero_grpo.yaml (model.tiny)", "shapes_libero", "rows",
        caps=ROW_CAPS, smoke_caps=ROW_CAPS),
    "wan2_1_t2v_1_3b": ModelSpec(  # b: a group of 3, each real VAE decode is ~4 CPU-minutes a video
        "configs/video_wan_gpu.yaml", "configs/real_shapes/wan2_1_t2v_1_3b.json", "shapes_wan", "rows",
        caps={**ROW_CAPS, "b": {"prompts": 1, "group_size": 3, "micro_rows": 2}}, smoke_caps=ROW_CAPS),
    "smolvla": ModelSpec(
        "configs/vla_tabletop_smolvla.yaml", "configs/real_shapes/smolvla.json", "shapes_smolvla", "rows",
        caps=ROW_CAPS, smoke_caps=ROW_CAPS),
}
# (layers, size): the fit's four points, then the check
GRID = [(1, "a"), (2, "a"), (1, "b"), (2, "b"), (4, "a")]
SMOKE_GRID = [(1, "a"), (2, "b")]  # --smoke: two children, the path end to end
FIT_GRID = [(1, "a"), (2, "a"), (1, "b"), (2, "b")]


# ----------------------------------------------------------------------------- one setting (child)


def run_setting(model: str, layers: int, size: str, width: str) -> dict:
    import gc
    import shutil

    import torch

    import mmrl
    from mmrl.config import load_config, read_config_file, typed_config
    from mmrl.plan import PHASES
    from mmrl.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    gc.collect()
    libs = rss_mib()
    spec = MODELS[model]
    caps = (spec.smoke_caps if width == "tiny" else spec.caps)[size]
    base = typed_config(read_config_file(ROOT / spec.config))  # the config as shipped, before machine checks
    work = Path(tempfile.mkdtemp(prefix="real_shapes_"))
    t0 = time.perf_counter()
    overrides = spec.load().prepare(work, base, layers, width, caps)
    G = caps.get("group_size", base.sampling.group_size)
    overrides += [
        f"sampling.group_size={G}", f"train.prompts_per_step={caps['prompts']}",
        f"train.micro_batch_size={caps['micro_rows']}", "train.max_tokens_per_micro=0",
        f"rollout.batch_size={caps['prompts'] * G}", "train.steps=1", "train.eval_every=0", "train.save_every=0",
        "train.progress=false", "train.device=cpu", f"train.output_dir={work / 'run'}",
        *([f"sampling.max_new_tokens={caps['max_new_tokens']}"] if "max_new_tokens" in caps else []),
    ]
    cfg = load_config(ROOT / spec.config, overrides)
    task, policy = mmrl.build(cfg)
    if spec.unit == "tokens":  # every reply runs to max_new_tokens (random weights stop at a sampled EOS at random)
        policy.suppress_token_ids = sorted(set(policy.suppress_token_ids) | set(policy.eos_token_ids))
    trainer = Trainer(cfg, policy, task)
    steady_state(trainer)
    make_resident(policy, *(reward for _, _, reward in trainer.collector.rewards))
    build_s = time.perf_counter() - t0
    meter = PhaseMeter()
    seen = {"micro": 0, "sampling": 0, "prompt_tokens": 0}

    def row_size(rollout) -> int:  # what one row counts in n
        if spec.unit == "rows":
            return 1
        return rollout.extras["prompt_ids"].shape[1] + rollout.units.shape[1]

    collect = trainer.collect

    def counted_collect():
        rollout, stats = collect()
        seen["sampling"] = min(len(rollout), cfg.rollout.batch_size or len(rollout)) * row_size(rollout)
        if spec.unit == "tokens":
            seen["prompt_tokens"] = rollout.extras["prompt_ids"].shape[1]
        seen["units"] = list(rollout.units.shape[1:])
        return rollout, stats

    trainer.collect = counted_collect
    backward_micro = trainer.updater.backward_micro

    def counted_backward(part, *args):
        seen["micro"] = max(seen["micro"], len(part) * row_size(part))
        return backward_micro(part, *args)

    trainer.updater.backward_micro = counted_backward
    meter.wrap(trainer, "collect", "sampling")
    meter.wrap(trainer.updater, "in_micro_batches", "old_ref")
    meter.wrap(trainer, "update", "update")
    gc.collect()
    static = rss_mib()
    meter._flush()
    t1 = time.perf_counter()
    trainer.train_step()
    step_s = time.perf_counter() - t1
    meter._flush()
    n_params = sum(p.numel() for p in policy.model.parameters())
    n_train = sum(p.numel() for p in trainer.updater.params)
    n_ref = sum(p.numel() for p in policy.reference.parameters()) if getattr(policy, "reference", None) is not None else 0
    phases = {k: round(meter.peak.get(k, static) - libs, 1) for k in PHASES}
    shutil.rmtree(work, ignore_errors=True)  # the saved model (GBs at real width)
    return {"model": model, "layers": layers, "size": size, "unit": spec.unit, "libs_mib": round(libs, 1),
            "static_mib": round(static - libs, 1), "peak_mib": phases,
            "dyn_mib": {k: round(v - (static - libs), 1) for k, v in phases.items()},
            "n": {"sampling": seen["sampling"], "old_ref": seen["micro"], "update": seen["micro"]},
            "prompt_tokens": seen["prompt_tokens"], "units": seen.get("units"), "rows": caps["prompts"] * G,
            "max_new_tokens": caps.get("max_new_tokens"), "micro_rows": caps["micro_rows"],
            "params": n_params, "trainable": n_train, "reference_params": n_ref,
            "dtype": cfg.model.dtype, "exact_hwm": meter.exact, "build_s": round(build_s, 1),
            "step_s": round(step_s, 1)}


def make_resident(*owners) -> None:
    """Read every parameter and buffer of the modules `owners` hold (a policy's text encoder, VAE,
    frozen VLM; a reward's model). safetensors maps weights from the file, and a mapped page counts in
    RSS only once read: frozen weights would otherwise land in the first phase that uses them
    instead of in the static memory (~0.9 GiB for the Wan config's cut-down UMT5, VAE and CLIP)."""
    import torch
    from torch import nn

    seen: set[int] = set()
    for owner in owners:
        modules = [owner] if isinstance(owner, nn.Module) else [v for v in vars(owner).values() if isinstance(v, nn.Module)]
        for module in modules:
            for t in (*module.parameters(), *module.buffers()):
                if id(t) not in seen and t.numel():
                    seen.add(id(t))
                    t.detach().reshape(-1)[:: max(1, 4096 // t.element_size())].sum()  # one read per 4 KiB page


def steady_state(trainer) -> None:
    """Gradients for every trainable parameter and AdamW's two states, as after a first step (one
    optimizer step at lr 0: the weights do not move)."""
    import torch

    for p in trainer.updater.params:
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
    from mmrl.plan import PHASES, linear_in_layers

    out = {}
    for phase in PHASES:
        m1, m2, m4 = (by[(L, "a")]["peak_mib"][phase] for L in (1, 2, 4))
        pred = linear_in_layers(m1, m2, 4)
        out[phase] = {"predicted_mib": round(pred, 1), "measured_mib": m4, "error": round(pred / m4 - 1, 4)}
    return out


def run_model(model: str, width: str, grid: list[tuple[int, str]]) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "2"),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    spec = MODELS[model]
    reason = getattr(spec.load(), "missing", lambda: None)()
    if reason:
        print(f"{model}: skipped: {reason}", flush=True)
        return {"config": spec.config, "skipped": reason}
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
    return {"config": spec.config, "shapes": spec.shapes, "unit": spec.unit, "smoke": width != "real",
            "width": width, "full_params": spec.load().param_counts(), "runs": runs,
            "check_4_layers": fit_check(runs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny widths, 1-2 layers (CI)")
    ap.add_argument("--width", choices=["real", "small", "tiny"], help="real (default), small (tests: the 4-layer "
                    "check at widths where layers weigh), tiny (--smoke)")
    ap.add_argument("--grid", choices=["smoke", "fit", "check", "four", "all"], help="smoke: L 1 at a, 2 at b; fit: L 1, 2 "
                    "at sizes a, b; check: L 1, 2, 4 at size a; four: L 4 at size a alone (the check against the "
                    "stored fit points); all (default; --smoke: smoke)")
    ap.add_argument("--model", choices=sorted(MODELS), action="append", help="only these models (repeatable)")
    ap.add_argument("--output", help=f"write the results here (default: {OUT_JSON.relative_to(ROOT)}; "
                    "--smoke writes nothing unless given)")
    ap.add_argument("--child", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int)
    ap.add_argument("--size", choices=["a", "b"])
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(run_setting(a.child, a.layers, a.size, a.width or "real")), flush=True)
        return 0
    t0 = time.perf_counter()
    models = a.model or sorted(MODELS)
    width = a.width or ("tiny" if a.smoke else "real")
    grid = {"smoke": SMOKE_GRID, "fit": FIT_GRID, "check": [(1, "a"), (2, "a"), (4, "a")], "four": [(4, "a")],
            "all": GRID}[a.grid or ("smoke" if a.smoke else "all")]
    results = {"method": "peak RSS per phase (VmHWM reset by clear_refs at each phase boundary), MiB above the "
                         "RSS after imports; MALLOC_MMAP_THRESHOLD_=65536; steady-state step (grads + Adam states "
                         "allocated before it); CPU, config dtype",
               "models": {m: run_model(m, width, grid) for m in models}}
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    output = a.output or (None if width != "real" else OUT_JSON)
    if output:
        previous = json.loads(Path(output).read_text()) if Path(output).is_file() else {}
        models = {**previous.get("models", {})}
        for m, entry in results["models"].items():
            if "skipped" in entry:  # not measured on this machine: the stored entry stays
                continue
            # a setting measured now replaces the stored one of the same (layers, size); the others stay
            kept = [r for r in models.get(m, {}).get("runs", []) if not entry.get("smoke")
                    and (r["layers"], r["size"]) not in {(x["layers"], x["size"]) for x in entry["runs"]}]
            runs = sorted(kept + entry["runs"], key=lambda r: (r["size"], r["layers"]))
            models[m] = {**models.get(m, {}), **entry, "runs": runs, "check_4_layers": fit_check(runs)}
        merged = {**previous, **results, "models": models}
        Path(output).write_text(json.dumps(merged, indent=1) + "\n")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
