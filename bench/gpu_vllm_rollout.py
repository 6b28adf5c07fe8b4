"""Rollout throughput: the vLLM engine (`rollout.engine: vllm`) against mmrl's own HF sampler.

One `causal_lm` policy, a Qwen2.5-1.5B-sized model (random weights from a config, bf16; hidden
1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, vocabulary 151936, tied embeddings) or
`--model DIR`, a local checkpoint, and a locally trained tokenizer. Each timed call is
`policy.sample(prompts, G)`, every completion forced to `--max-new-tokens` (EOS suppressed):

* `hf`: the policy's in-process sampler (the lean static-cache decoder, `fast_decode`);
* `vllm`: the colocated engine, timed as training uses it: wake, push the current weights (after a
  perturbation that stands for an optimizer step, so every call pushes), `generate`, sleep.

Both report generated tokens per second (medians over `--steps` calls after `--warmup`), and the
engine's log-probs are compared with the trainer's teacher-forced ones on the same tokens (the
mismatch the `rollout.correction` weights correct): mean |difference| and the mismatch KL.

    python bench/gpu_vllm_rollout.py            # on a GPU machine with vllm (pip install 'mmrl[vllm]')
    python bench/gpu_vllm_rollout.py --smoke    # tiny sizes on the CPU: the HF side only (CI runs it)

Where vllm does not import or no GPU is visible, the `vllm` entry says why it was skipped. The
last line is JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch

# Qwen2.5-1.5B-Instruct's config.json sizes.
LARGE = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
         "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1e6,
         "tie_word_embeddings": True}
SMOKE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 0, "max_position_embeddings": 512, "rope_theta": 1e4,
         "tie_word_embeddings": True}


def build_policy(a, device: torch.device, dtype: torch.dtype):
    from mmrl.policies.causal_lm import CausalLMPolicy

    if a.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(device)
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from mmrl.tiny import build_tokenizer

        tokenizer = build_tokenizer([f"{i} + {j} = {i + j}" for i in range(50) for j in range(50)], vocab_size=400)
        s = SMOKE if a.smoke else LARGE
        config = Qwen2Config(**{**s, "vocab_size": max(len(tokenizer), s["vocab_size"])},
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2ForCausalLM._from_config(config, dtype=dtype)
    policy = CausalLMPolicy(model.eval(), tokenizer, temperature=1.0, max_new_tokens=a.max_new_tokens)
    n_vocab = model.get_output_embeddings().weight.shape[0]
    # Full-length completions; padded vocabulary rows past the tokenizer are never drawn.
    policy.suppress_token_ids = sorted({*policy.suppress_token_ids, *policy.eos_token_ids,
                                        *range(len(tokenizer), n_vocab)})
    return policy


def timed_calls(policy, prompts, a, device) -> tuple[list[dict], object]:
    """`warmup + steps` sampling calls; each one's seconds and generated tokens, and the last rollout."""
    gen = torch.Generator(device=device).manual_seed(0)
    rows, rollout = [], None
    for i in range(a.warmup + a.steps):
        if policy.engine is not None:  # stands for an optimizer step: the engine must take new weights
            with torch.no_grad():
                next(policy.model.parameters()).mul_(1.0 + 1e-3)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rollout = policy.sample(prompts, a.group, generator=gen)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append({"s": time.perf_counter() - t0, "tokens": int(rollout.mask.sum())})
    return rows[a.warmup:], rollout


def summary(rows: list[dict]) -> dict:
    s = statistics.median(r["s"] for r in rows)
    tokens = statistics.median(r["tokens"] for r in rows)
    return {"sample_s": round(s, 3), "tokens_per_call": tokens, "tokens_per_s": round(tokens / s, 1)}


def vllm_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm does not import here (pip install 'mmrl[vllm]')"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a local causal LM checkpoint (default: 1.5B-sized random weights)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per call")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="completion length (generated in full)")
    p.add_argument("--steps", type=int, default=3, help="timed calls per engine")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (CUDA graphs, allocator)")
    p.add_argument("--memory", type=float, default=0.3, help="the engine's share of GPU memory")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, the HF side only (CI)")
    a = p.parse_args(argv)
    if a.smoke:
        a.prompts, a.group, a.max_new_tokens, a.steps, a.warmup = 2, 2, 8, 1, 0
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("bench/gpu_vllm_rollout.py needs a GPU (use --smoke for a CPU check)")
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16

    policy = build_policy(a, device, dtype)
    prompts = [{"prompt": f"{i % 50} + {(7 * i) % 50} ="} for i in range(a.prompts)]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "smoke": a.smoke,
              "model": a.model or ("tiny" if a.smoke else "qwen2.5-1.5b-sized, random weights"),
              "params": sum(p.numel() for p in policy.model.parameters()), "prompts": a.prompts, "group": a.group,
              "max_new_tokens": a.max_new_tokens, "steps": a.steps, "warmup": a.warmup}
    hf_rows, _ = timed_calls(policy, prompts, a, device)
    result["hf"] = summary(hf_rows)

    reason = vllm_skip_reason()
    if reason is not None:
        result["vllm"] = {"skipped": reason}
    else:
        from mmrl.algos import mismatch_weights
        from mmrl.policies.vllm_engine import EngineSettings, VLLMEngine

        t0 = time.perf_counter()
        policy.engine = VLLMEngine(policy.model, policy.tokenizer, dtype="bfloat16",
                                   settings=EngineSettings(memory=a.memory, sleep=True))
        start_s = time.perf_counter() - t0
        vllm_rows, rollout = timed_calls(policy, prompts, a, device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logp = torch.cat([policy.logprobs(rollout.select(torch.arange(i, min(i + 64, len(rollout)))))[0]
                              for i in range(0, len(rollout), 64)])
        _, metrics = mismatch_weights(logp.float(), rollout.logp_beh, rollout.mask, kind="tis", level="token", cap=2.0)
        gap = torch.where(rollout.mask, logp.float() - rollout.logp_beh, 0.0).abs().sum() / rollout.mask.sum()
        result["vllm"] = {**summary(vllm_rows), "engine_start_s": round(start_s, 1),
                          "logp_mean_abs_diff": round(float(gap), 5),
                          **{f"mismatch_{k}": round(float(v), 6) for k, v in metrics.items()}}
        result["vllm_speedup"] = round(result["vllm"]["tokens_per_s"] / result["hf"]["tokens_per_s"], 2)
        policy.engine.close()
    print(f"hf sampler: {result['hf']['tokens_per_s']:.0f} tok/s; vllm: "
          + (result["vllm"]["skipped"] if "skipped" in result["vllm"] else
             f"{result['vllm']['tokens_per_s']:.0f} tok/s ({result['vllm_speedup']}x)"))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
