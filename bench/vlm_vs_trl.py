"""VLM GRPO step time: mmrl's Trainer on a `qwen_vl` policy vs TRL's GRPOTrainer, same tiny Qwen2.5-VL.

What is compared: one GRPO step (sample G completions for each of P image+question prompts, score
them, one optimizer update) of

* mmrl: `configs/vqa_grpo.yaml` through `mmrl.load_config` + `mmrl.build` + `mmrl.trainer.Trainer`
  (`model.source: pretrained`, SFT off);
* TRL: `GRPOTrainer` (transformers `generate`, `use_vllm=False`, CPU, fp32, `loss_type="grpo"`).

Both load the same weights and processor from one temp dir (the config's tiny Qwen2.5-VL, built once
and saved), train on the same records (`mmrl.envs.vqa.synthetic.generate` through the `vqa` task:
one 56 px image = 4 LM tokens, the task's prompt), the same P x G, temperature 1, beta 0, lr, grad
clip 1, and the same reward: 1 if the text inside <answer></answer> equals the record's answer, else 0
(with random weights it is 0 everywhere; neither side skips zero-advantage groups, so both run the
full update). Completion budget: both are forced to generate exactly `--max-tokens` tokens per
completion (mmrl: EOS added to the sampler's suppressed ids; TRL: `min_new_tokens` = the budget);
the JSON reports the tokens each side actually generated per step.

Interleaving: one process, one thread pool; TRL's own training loop runs, and a callback at the end
of each of its steps runs one mmrl step. So steps alternate TRL, mmrl, TRL, ... and load from other
jobs hits both alike. A TRL step is timed from the end of the previous mmrl step to its
`on_step_end` (its data loading included). The first `--warmup` steps of each are dropped.

Output: the last line is JSON with `mmrl_step_s`, `trl_step_s` (medians of the timed steps),
`speedup` = TRL / mmrl (> 1: mmrl is faster), `speedup_min` / `speedup_max` (the spread of the
per-repeat ratios of adjacent steps), the same for process CPU time (`*_cpu_step_s`,
`cpu_speedup`), the per-step lists, generated tokens per step of each, and the 1-min load average.
If TRL fails, `trl_error` holds its exception and only mmrl's numbers are reported.

    python bench/vlm_vs_trl.py --repeats 3     # the measured run (~40 s on 2 slow cores)
    python bench/vlm_vs_trl.py --smoke         # tiny sizes, 1 repeat (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REWARD_NAME = "bench_answer_match"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def answer_match(reply: str, answer: str) -> float:
    """1.0 when the text inside the first <answer></answer> equals the answer (stripped), else 0.0."""
    m = _ANSWER.search(reply)
    return float(m is not None and m.group(1).strip() == str(answer).strip())


def mmrl_config(args, out: Path, model_dir: Path | None):
    import mmrl

    model = ["model.source=pretrained", f"model.path={model_dir}"] if model_dir is not None else []
    overrides = [
        *model,
        f"task.params.n_train={args.records}", "task.params.n_test=4", "task.params.n_ood=0",
        "task.params.ood_difficulty=null",
        f"rewards=[{{name: {REWARD_NAME}}}]",
        f"sampling.group_size={args.group}", f"sampling.max_new_tokens={args.max_tokens}",
        "sft.steps=0", f"train.prompts_per_step={args.prompts}", f"train.steps={args.warmup + args.repeats}",
        "train.warmup_steps=0", "train.eval_every=0", "train.progress=false", "train.device=cpu",
        f"train.threads={args.threads}", f"train.output_dir={out}",
    ]
    return mmrl.load_config(str(ROOT / "configs" / "vqa_grpo.yaml"), overrides)


def register_reward() -> None:
    import torch

    from mmrl.rewards import REWARDS
    from mmrl.rewards import register_reward as reg

    if REWARD_NAME not in REWARDS:
        @reg(REWARD_NAME)
        def _answer_match(contexts, outputs):
            return torch.tensor([answer_match(o, c["answer"]) for c, o in zip(contexts, outputs)])


def build_mmrl(args, tmp: Path):
    """The tiny model as the config builds it, saved to `tmp/model`; then the trainer that loads it."""
    import mmrl
    from mmrl.trainer import Trainer

    register_reward()
    _, tiny_policy = mmrl.build(mmrl_config(args, tmp / "tiny_run", None))
    tiny_policy.save(tmp / "model")
    del tiny_policy
    cfg = mmrl_config(args, tmp / "mmrl_run", tmp / "model")
    task, policy = mmrl.build(cfg)
    # Force the full budget: EOS is never drawn (and is masked the same way in the update).
    policy.suppress_token_ids = sorted(set(policy.suppress_token_ids) | set(policy.eos_token_ids))
    return Trainer(cfg, policy, task), task


def trl_dataset(task):
    """The task's training contexts in TRL's vision layout: a conversational prompt (string content;
    TRL puts the image before the text, as mmrl's policy does for a leading <image>) and `images`."""
    from datasets import Dataset
    from PIL import Image

    rows = {"prompt": [], "images": [], "answer": []}
    for c in task.train:
        text = c["prompt"]
        assert text.startswith("<image>") and text.count("<image>") == 1, text[:40]
        rows["prompt"].append([{"role": "user", "content": text[len("<image>"):]}])
        rows["images"].append([Image.fromarray(im) for im in c["images"]])
        rows["answer"].append(str(c["answer"]))
    return Dataset.from_dict(rows)


def run(args) -> dict:
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="vlm_vs_trl_"))
    trainer, task = build_mmrl(args, tmp)
    steps = args.warmup + args.repeats
    res = {"mmrl": {"t": [], "cpu": [], "tokens": []}, "trl": {"t": [], "cpu": [], "tokens": []}}
    n_rows = args.prompts * args.group

    def mmrl_step():
        t0, c0 = time.perf_counter(), time.process_time()
        m = trainer.train_step()
        res["mmrl"]["t"].append(time.perf_counter() - t0)
        res["mmrl"]["cpu"].append(time.process_time() - c0)
        res["mmrl"]["tokens"].append(int(round(m["len/mean"] * n_rows)))

    trl_error = None
    try:
        from transformers import AutoModelForImageTextToText, AutoProcessor
        from trl import GRPOConfig, GRPOTrainer

        processor = AutoProcessor.from_pretrained(tmp / "model")
        model = AutoModelForImageTextToText.from_pretrained(tmp / "model", dtype=torch.float32)

        def reward(completions, answer, completion_ids=None, **_):
            res["trl"]["tokens"].append(sum(len(c) for c in completion_ids))
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [answer_match(t, a) for t, a in zip(texts, answer)]

        class Interleave(TrainerCallback):
            """Times TRL's steps end to end and runs one mmrl step after each."""

            def on_train_begin(self, *a, **k):
                self.t0, self.c0 = time.perf_counter(), time.process_time()

            def on_step_end(self, *a, **k):
                res["trl"]["t"].append(time.perf_counter() - self.t0)
                res["trl"]["cpu"].append(time.process_time() - self.c0)
                mmrl_step()
                self.t0, self.c0 = time.perf_counter(), time.process_time()

        cfg = trainer.cfg
        gcfg = GRPOConfig(
            output_dir=str(tmp / "trl_run"), per_device_train_batch_size=n_rows, num_generations=args.group,
            max_completion_length=args.max_tokens, generation_kwargs={"min_new_tokens": args.max_tokens},
            max_steps=steps, learning_rate=cfg.train.lr, beta=0.0, loss_type="grpo", temperature=1.0, top_k=0,
            top_p=1.0, max_grad_norm=cfg.train.grad_clip, bf16=False, gradient_checkpointing=False, use_cpu=True,
            use_vllm=False, report_to="none", save_strategy="no", logging_steps=10_000, seed=0,
            dataloader_num_workers=0, disable_tqdm=True,
        )
        trl_trainer = GRPOTrainer(model=model, reward_funcs=reward, args=gcfg, processing_class=processor,
                                  train_dataset=trl_dataset(task), callbacks=[Interleave()])
        torch.set_num_threads(args.threads)
        trl_trainer.train()
    except Exception as exc:  # report mmrl alone, with TRL's exact error
        trl_error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        for k in res["trl"]:
            res["trl"][k] = []
    while len(res["mmrl"]["t"]) < steps:  # TRL failed (or stopped early): mmrl's steps alone
        mmrl_step()

    w = args.warmup
    m_t, m_c = res["mmrl"]["t"][w:], res["mmrl"]["cpu"][w:]
    out = {
        "mmrl_step_s": round(statistics.median(m_t), 4),
        "mmrl_cpu_step_s": round(statistics.median(m_c), 4),
        "mmrl_tokens_per_step": statistics.mean(res["mmrl"]["tokens"][w:]),
        "mmrl_steps_s": [round(x, 4) for x in m_t],
    }
    if trl_error is None:
        t_t, t_c = res["trl"]["t"][w:], res["trl"]["cpu"][w:]
        ratios = [a / b for a, b in zip(t_t, m_t)]
        out.update({
            "trl_step_s": round(statistics.median(t_t), 4),
            "trl_cpu_step_s": round(statistics.median(t_c), 4),
            "trl_tokens_per_step": statistics.mean(res["trl"]["tokens"][w:]),
            "trl_steps_s": [round(x, 4) for x in t_t],
            "speedup": round(statistics.median(t_t) / statistics.median(m_t), 3),
            "speedup_min": round(min(ratios), 3), "speedup_max": round(max(ratios), 3),
            "cpu_speedup": round(statistics.median(t_c) / statistics.median(m_c), 3),
        })
    else:
        out["trl_error"] = trl_error
    out.update({"prompts": args.prompts, "group": args.group, "completions_per_step": n_rows,
                "max_new_tokens": args.max_tokens, "repeats": args.repeats, "warmup": args.warmup,
                "threads": args.threads, "smoke": args.smoke, "load_avg_1min": round(os.getloadavg()[0], 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="timed steps of each side (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each side first")
    # Defaults: configs/vqa_grpo.yaml's train.prompts_per_step, sampling.group_size and max_new_tokens.
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (P)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-tokens", type=int, default=56, help="completion budget, generated in full by both")
    p.add_argument("--records", type=int, default=64, help="synthetic VQA records in the training pool")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat (CI)")
    a = p.parse_args(argv)
    if a.smoke:
        a.repeats, a.warmup, a.prompts, a.group, a.max_tokens, a.records = 1, 1, 2, 2, 8, 8
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = run(a)
    if "speedup" in out:
        print(f"mmrl {out['mmrl_step_s']:.3f} s/step vs TRL {out['trl_step_s']:.3f} s/step: {out['speedup']:.2f}x "
              f"(per repeat {out['speedup_min']:.2f}-{out['speedup_max']:.2f}x; CPU time {out['cpu_speedup']:.2f}x)")
    else:
        print(f"mmrl {out['mmrl_step_s']:.3f} s/step; TRL failed: {out['trl_error']}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
