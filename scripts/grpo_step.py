"""One GRPO step on a Hugging Face causal LM with `mmrl.algos` alone, top to bottom (CleanRL-style).

    python scripts/grpo_step.py                                  # a tiny random Qwen2 built here, offline
    python scripts/grpo_step.py --model Qwen/Qwen2.5-0.5B-Instruct --lr 1e-6

Task: "how many letters are in WORD?"; reward 1 / (1 + |n - len(WORD)|) for the completion's first
number n, 0 without one. G sampled completions per prompt -> group advantages -> the clipped loss
over `--epochs` passes of the batch (the first at ratio 1, later ones off-policy) -> AdamW steps.
"""

import argparse
import random
import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mmrl.algos import agg_denominator, compute_advantages, get_loss_spec, make_groups, policy_loss

p = argparse.ArgumentParser(description="One GRPO step with mmrl.algos")
p.add_argument("--model", help="local folder or hub id (default: a tiny random Qwen2)")
p.add_argument("--prompts", type=int, default=4)
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=16)
p.add_argument("--epochs", type=int, default=2, help="passes over the batch; the first is on-policy")
p.add_argument("--micro-batch", type=int, default=8, help="rows whose logits exist at once")
p.add_argument("--loss", default="grpo", help="a loss of `mmrl algos`: grpo, dapo, gspo, cispo, ...")
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
torch.manual_seed(args.seed)
device = "cuda" if torch.cuda.is_available() else "cpu"
WORDS = ["apple", "cat", "banana", "sky", "planet", "on", "river", "keyboard"]
if args.model is None:
    from mmrl.tiny import build_tiny_qwen2, build_tokenizer
    tokenizer = build_tokenizer([f"How many letters are in the word '{w}'? {len(w)}" for w in WORDS])
    model = build_tiny_qwen2(tokenizer, seed=args.seed)
else:
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
model.to(device).eval()  # no dropout: old and new log-probs are the same function of the weights
# No weight decay: with all-zero advantages the step must leave the weights alone.
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

# 1. Prompts and G completions each; generate repeats prompt i as rows i*G .. i*G+G-1.
G = args.group_size
words = random.Random(args.seed).choices(WORDS, k=args.prompts)
chats = [[{"role": "user", "content": f"How many letters are in the word '{w}'? Answer with a number."}] for w in words]
texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
with torch.no_grad():  # plain temperature-1 sampling (top_k 0, top_p 1): the log-probs below are its own
    seqs = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=G,
                          max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
n_prompt, completion = enc.input_ids.shape[1], seqs[:, enc.input_ids.shape[1]:]
eos_ids = torch.tensor(model.generation_config.eos_token_id or tokenizer.eos_token_id, device=device).reshape(-1)
is_eos = torch.isin(completion, eos_ids).long()
mask = (is_eos.cumsum(1) - is_eos) == 0  # every token up to and including the first end-of-sequence
attn = torch.cat([enc.attention_mask.repeat_interleave(G, 0), mask.long()], 1)

# 2. Verifiable reward and group advantages.
def reward(text: str, word: str) -> float:
    number = re.search(r"\d+", text)
    return 0.0 if number is None else 1.0 / (1.0 + abs(int(number.group()) - len(word)))

answers = tokenizer.batch_decode(completion.masked_fill(~mask, tokenizer.pad_token_id), skip_special_tokens=True)
rewards = torch.tensor([reward(a, words[i // G]) for i, a in enumerate(answers)])
group_ids = torch.arange(args.prompts).repeat_interleave(G)
learning = int((make_groups(group_ids).std(rewards) > 0).sum())  # groups whose rewards differ
adv = compute_advantages("grpo", rewards, group_ids).to(device)
print(f"reward_mean={rewards.mean():.4f} groups_with_signal={learning}/{args.prompts}")

# 3. Per-token log-probs, one micro-batch of rows at a time: [rows, T, vocab] float32 logits never
# exist for the whole batch.
micro_batches = torch.arange(len(seqs), device=device).split(args.micro_batch)

def completion_logprobs(rows: torch.Tensor) -> torch.Tensor:
    ids, am = seqs[rows], attn[rows]
    positions = (am.cumsum(1) - 1).clamp_min(0)  # left padding: count real tokens, as generate does
    logits = model(input_ids=ids, attention_mask=am, position_ids=positions).logits[:, n_prompt - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, n_prompt:, None]).squeeze(-1)

with torch.no_grad():
    old_logp = torch.cat([completion_logprobs(rows) for rows in micro_batches])

# 4. Loss, backward, step. One global denominator makes the micro-batch losses sum to the batch's.
agg = get_loss_spec(args.loss).default_agg
denominator = agg_denominator(mask, agg, max_response_len=args.max_new_tokens)
for epoch in range(args.epochs):
    optimizer.zero_grad()
    total, stats = 0.0, {"approx_kl": 0.0, "clip_frac": 0.0}
    for rows in micro_batches:
        loss, metrics = policy_loss(args.loss, completion_logprobs(rows), old_logp[rows], adv[rows], mask[rows],
                                    denominator=denominator, max_response_len=args.max_new_tokens)
        loss.backward()
        total += float(loss.detach())
        share = float(mask[rows].sum() / mask.sum())  # the metrics are token means of their micro-batch
        stats = {k: stats[k] + share * float(metrics[k]) for k in stats}
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    print(f"epoch={epoch} loss={total:.6f} approx_kl={stats['approx_kl']:.3e} "
          f"clip_frac={stats['clip_frac']:.4f} grad_norm={grad_norm:.4e}")
