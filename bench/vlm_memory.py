"""Memory of the general VLM path (`model.policy: vlm`) at a real model's width and vocabulary, on the CPU.

The model is Gemma 3 4B's language model at its real width (hidden 2,560, MLP 10,240, 8 heads of 256,
4 KV heads) and vocabulary (262,208 tokens), cut to one layer, with random weights and the tiny
SigLIP tower of `mmrl.tiny_vlm` (the head dominates the log-probs' memory; the tower is the same on
both sides). One teacher-forced pass with its backward over `--rows` replies of `--T` tokens, each
row with its image:

* `mmrl`: `VLMPolicy.logprobs` (the model's body, then the output head a chunk of tokens at a time);
* `logits`: the model's own forward with its full logits, log-softmax, gather (what a trainer that
  keeps the [rows, T, vocab] logits does).

Each side runs in its own process; its figure is the peak RSS during the pass above the RSS once the
model and batch are built. The last line is JSON.

    .venv/bin/python bench/vlm_memory.py            # 8 rows x 256 tokens (about 3 minutes)
    .venv/bin/python bench/vlm_memory.py --smoke    # hidden 256, vocab 32,000, 2 x 16 (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from child import run_child  # noqa: E402  (bench/child.py: this folder is on sys.path when a bench runs)

REAL = {"hidden_size": 2560, "intermediate_size": 10240, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "vocab_size": 262_208}
SMOKE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 128, "vocab_size": 32_000}


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(sizes: dict, rows: int, T: int):
    """The policy (real-width Gemma 3 text model, one layer) and a rollout of `rows` x `T` units."""
    import numpy as np
    import torch

    from mmrl.policies.base import repeat_rows
    from mmrl.policies.vlm import VLMPolicy
    from mmrl.rollout import Rollout
    from mmrl.tiny_vlm import build_tiny_vlm

    tiny, processor = build_tiny_vlm("gemma3", ["how many red squares are there ?"] * 20, seed=0)
    config = tiny.config
    config.text_config.update({**sizes, "num_hidden_layers": 1})
    torch.manual_seed(0)
    model = type(tiny)(config).eval()
    policy = VLMPolicy(model, processor, max_new_tokens=T)
    rng = np.random.default_rng(0)
    contexts = [{"frame": rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), "prompt": "how many red squares ?"}
                for _ in range(rows)]
    extras = repeat_rows(policy.encode(contexts), 1)
    # Text tokens only: a vision placeholder among the units would ask for image features.
    allowed = torch.tensor(sorted(set(range(len(processor.tokenizer))) - set(policy.suppress_token_ids)))
    units = allowed[torch.randint(0, len(allowed), (rows, T), generator=torch.Generator().manual_seed(0))]
    mask = torch.ones(rows, T, dtype=torch.bool)
    return policy, Rollout(units=units, logp_old=torch.zeros(rows, T), mask=mask, truncated=torch.zeros(rows, dtype=torch.bool),
                           max_units=T, contexts=contexts, extras=extras)


def child(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    policy, rollout = build(SMOKE if a.smoke else REAL, a.rows, a.T)
    model = policy.model
    model.train()
    before = rss_mib()
    if a.child == "mmrl":
        logp, _ = policy.logprobs(rollout)
    else:
        e = rollout.extras
        inputs = policy.model_inputs(e["vlm_prompt"], e["prompt_ids"], rollout.units)
        ids = torch.cat([e["prompt_ids"], rollout.units], 1)
        attn = torch.cat([e["prompt_mask"], torch.ones_like(rollout.units)], 1)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False, **inputs).logits[:, -a.T - 1:-1].float()
        suppress = torch.tensor(policy.suppress_token_ids)
        logits = logits.index_fill(-1, suppress, float("-inf"))
        logp = logits.log_softmax(-1).gather(-1, rollout.units[..., None]).squeeze(-1)
    logp.sum().backward()
    print("RESULT " + json.dumps({"side": a.child, "peak_mib": round(rss_mib() - before, 1),
                                  "params": sum(p.numel() for p in model.parameters())}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--T", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=["mmrl", "logits"])
    ap.add_argument("--out", default="runs/vlm_memory.json")
    a = ap.parse_args()
    a.rows = a.rows or (2 if a.smoke else 8)
    a.T = a.T or (16 if a.smoke else 256)
    if a.child:
        return child(a)
    sizes = SMOKE if a.smoke else REAL
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = {"model": {**sizes, "num_hidden_layers": 1, "family": "gemma3"}, "rows": a.rows, "T": a.T,
           "logits_gib_float32": round(a.rows * a.T * sizes["vocab_size"] * 4 / 2**30, 2)}
    for side in ("mmrl", "logits"):
        cmd = [sys.executable, __file__, "--child", side, "--rows", str(a.rows), "--T", str(a.T),
               "--threads", str(a.threads)] + (["--smoke"] if a.smoke else [])
        out[side] = run_child(cmd, env, f"the {side} side")
        print(f"{side}: peak {out[side]['peak_mib']:,.0f} MiB above the built model")
    out["ratio"] = round(out["logits"]["peak_mib"] / max(out["mmrl"]["peak_mib"], 1.0), 2)
    print(f"the full-logits pass peaks {out['ratio']}x higher than mmrl's (rows {a.rows} x T {a.T}, "
          f"vocabulary {sizes['vocab_size']:,}: {out['logits_gib_float32']} GiB of float32 logits)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
