"""`mmrl eval --benchmark NAME --model DIR_OR_HUB_ID`: any saved VLM on a public VQA benchmark, no config.

    mmrl eval --benchmark mathvista --model Qwen/Qwen2.5-VL-3B-Instruct --data AI4Math/MathVista
    mmrl eval --benchmark mathverse --model runs/vqa/final --data ~/data/MathVerse --judge http://127.0.0.1:8000/v1
    mmrl eval --compare a/mathvista.json b/mathvista.json

The model is a Hugging Face VLM folder or hub id (any AutoModelForImageTextToText: Qwen-VL, Gemma 3,
SmolVLM, InternVL, ...), a run's `final/` export, or a run folder / `step_NNNNNN` checkpoint (rebuilt from the run's own config.yaml). Each benchmark is
asked with its own prompt construction and graded by a rule grader that follows its official
scorer (`mmrl.evals.bench_official`); `--judge URL` adds the papers' LLM answer extraction through
an OpenAI-compatible endpoint, reported beside the rule score, never mixed with it.

Writes `<output>/<benchmark>.json` (scores, the papers' breakdowns, every item's extraction and
verdict, and the provenance: weight and data hashes, prompt template, grader version, sampling,
packages, seed), `<benchmark>.md`, `replies.html` (questions with their images and the replies)
and `replies.jsonl` (every reply in full). Under torchrun each rank answers its share of the items
and rank 0 writes the gathered result.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.evals.bench_official import SYNTHETIC

SHOWN = 200  # cards on the HTML page (replies.jsonl keeps every reply)
BOOTSTRAP = 2000


# ---------------------------------------------------------------- arguments

def add_arguments(parser) -> None:
    parser.add_argument("--data", help="the benchmark's local file or folder, or a hub dataset id (not needed "
                        "for the synthetic sets)")
    parser.add_argument("--split", help="the split of a folder holding several (default: the benchmark's "
                        "evaluation split, e.g. testmini)")
    parser.add_argument("--image-root", help="where relative image paths are read from (default: the data "
                        "file's folder)")
    parser.add_argument("--limit", type=int, help="evaluate the first N items only")
    parser.add_argument("--style", help="prompt style where the benchmark has several (mathverse: cot, direct)")
    parser.add_argument("--batch-size", type=int, default=16, help="items generated per call (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="reply budget in tokens (default 1024)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="weights' dtype for a Hugging Face folder (default bfloat16)")
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"), help="who generates: the policy's own "
                        "sampler (hf, default) or a vLLM engine on the GPU (pip install 'mmrl[vllm]')")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, or auto (default)")
    parser.add_argument("--judge", help="OpenAI-compatible endpoint (ends before /chat/completions) for LLM "
                        "answer extraction, reported beside the rule score")
    parser.add_argument("--judge-model", default="judge", help="the model name the judge endpoint serves")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                        help="compare two evaluation JSONs of the same benchmark, data and grader")


# ---------------------------------------------------------------- the model

def load_policy(model: str, device: str, dtype: str, max_new_tokens: int, engine: str = "hf", seed: int = 0):
    """(policy, folder whose weights are hashed) for `--model`: a run folder or step checkpoint
    (rebuilt from the run's config), else a Hugging Face VLM folder or hub id; with `engine` vllm a
    vLLM engine generates (all of the GPU it may take: nothing trains beside it)."""
    import torch

    from mmrl.checkpoint import RUN_CONFIG, load_weights, resolve_checkpoint, run_dir_of
    from mmrl.hub import resolve
    from mmrl.policies.vlm import VLMPolicy

    local = Path(model).expanduser()
    if local.is_dir() and not (local / "config.json").is_file() and (run_dir_of(local) / RUN_CONFIG).is_file():
        from mmrl.assemble import build
        from mmrl.config import eval_config

        cfg = eval_config(local, None, [f"train.device={_device(device)}", f"sampling.max_new_tokens={max_new_tokens}",
                                        "rollout.engine=hf"])  # --engine decides, not the run's training setting
        if cfg.model.policy not in ("vlm", "qwen_vl"):
            raise ValueError(f"--model {model}: a run of policy {cfg.model.policy!r}; the VQA benchmarks "
                             f"evaluate image question answering models (policy vlm or qwen_vl)")
        _, policy = build(cfg)
        ckpt = resolve_checkpoint(local)[1]
        load_weights(ckpt, policy.model)  # the weights only: the trainer state is not read
        return _with_engine(policy, engine, "bfloat16" if cfg.train.bf16 else cfg.model.dtype, seed), ckpt
    folder = resolve(model, "model", "--model")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--model {model}: neither a Hugging Face model folder (no config.json) nor a "
                                f"run folder (no {RUN_CONFIG} beside checkpoints/)")
    # Any Hugging Face VLM; a Qwen-VL gets its fast paths (vlm_policy_class).
    policy = VLMPolicy.from_pretrained(folder, device=_device(device), dtype=getattr(torch, dtype),
                                       image_key="images", prompt_key="prompt", max_new_tokens=max_new_tokens)
    return _with_engine(policy, engine, dtype, seed), folder


def _with_engine(policy, engine: str, dtype: str, seed: int):
    if engine == "vllm":
        import torch

        from mmrl.policies.vllm_engine import EngineSettings, VLLMEngine

        if not torch.cuda.is_available():
            raise ValueError("--engine vllm needs a CUDA GPU and none is visible; accepted here: --engine hf")
        policy.engine = VLLMEngine(policy.model, policy.processor, dtype=dtype,
                                   settings=EngineSettings(memory=0.85, sleep=False), seed=seed)
    return policy


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device here; accepted: cpu, auto, or cuda[:N] on a GPU machine")
    return name


# ---------------------------------------------------------------- the items

def load_items(args) -> tuple[list[dict[str, Any]], list[Path]]:
    """(records, the data files they came from) for `--benchmark`."""
    if args.benchmark in SYNTHETIC:
        if args.data:
            raise ValueError(f"--data: the {args.benchmark} set is generated (the vqa task's defaults, data_seed 0); "
                             f"give no --data")
        from mmrl.envs.vqa.synthetic import make_splits

        # The default synthetic task's splits (its train set is drawn so the test set avoids it).
        splits = make_splits(0, 2000, 200, 100)
        return splits["test" if args.benchmark == "synthetic" else "ood"][: args.limit], []
    if not args.data:
        raise ValueError(f"--benchmark {args.benchmark} needs --data: its local file or folder, or a hub dataset id")
    from mmrl.envs.vqa.benchmarks import DEFAULT_SPLITS, load_benchmark
    from mmrl.envs.vqa.records import data_files
    from mmrl.hub import resolve

    path = resolve(args.data, "dataset", "--data")
    records = load_benchmark(args.benchmark, path, args.limit, split=args.split, image_root=args.image_root)
    return records, data_files(path, args.split, DEFAULT_SPLITS[args.benchmark])


def prompt_of(benchmark: str, record: dict[str, Any], style: str | None) -> str:
    """The question as the benchmark asks it, with one <image> per image (where the source put them,
    else first, as the Qwen-VL chat template shows images before the text)."""
    from mmrl.envs.vqa.records import IMAGE_TOKEN
    from mmrl.evals.bench_official import build_prompt

    text = build_prompt(benchmark, record, style)
    n = len(record["images"])
    return text if text.count(IMAGE_TOKEN) == n else IMAGE_TOKEN * n + text.replace(IMAGE_TOKEN, "")


def item_groups(benchmark: str, record: dict[str, Any]) -> list[str]:
    """The breakdown cells one item counts in ("task/FQA", "skill/ARI", ...), for --compare."""
    from mmrl.evals.bench_official import breakdowns

    return [f"{table}/{cell}" for table, cells in breakdowns(benchmark, [record], [True]).items() for cell in cells]


# ---------------------------------------------------------------- answering

def answer(policy, contexts: list[dict], batch_size: int, temperature: float, seed: int, show: bool) -> list[str]:
    """The policy's replies, `batch_size` items a call, with a progress bar."""
    import torch
    from tqdm.auto import tqdm

    gen = torch.Generator(device=policy.device).manual_seed(seed)
    out: list[str] = []
    with torch.no_grad(), tqdm(total=len(contexts), desc="answering", unit="item", disable=not show) as bar:
        for lo in range(0, len(contexts), batch_size):
            rollout = policy.sample(contexts[lo:lo + batch_size], 1, generator=gen, temperature=temperature)
            out += policy.decode(rollout)
            bar.update(min(batch_size, len(contexts) - lo))
    return out


EXTRACTION_PROMPT = """Read the question and a model's response to it, then write only the final answer the \
response gives, in the form the question asks for (an option letter for multiple choice, a number for a \
numeric question, a list for a list question). Write nothing else.

Question: What is the total length of the two marked segments? (Unit: cm)
Response: Adding them gives 3.5 + 2 = 5.5, so the total length is 5.5 cm.
Extracted answer: 5.5

Question: Which bar is the tallest?
Choices:
(A) red
(B) blue
(C) green
Response: Looking at the chart, the blue bar reaches the highest value, so the answer is (B).
Extracted answer: B

Question: How many people are wearing hats?
Response: I count two people with hats near the door and one by the window, three in all.
Extracted answer: 3

"""


def judge_extract(url: str, model: str, records: list[dict], prompts: list[str], replies: list[str]
                  ) -> tuple[list[str | None], list[str | None]]:
    """(extractions, failure reasons): the judge's answer extraction for each reply (MathVista's and
    MathVerse's papers extract with an LLM); an item the judge could not answer has a reason."""
    from mmrl.envs.vqa.records import IMAGE_TOKEN
    from mmrl.rewards.captioning.judges import HTTPJudge

    judge = HTTPJudge(url, model=model, temperature=0.0, max_tokens=64, deadline=max(60.0, 2.0 * len(records)))
    try:
        texts = [f"{EXTRACTION_PROMPT}Question: {p.replace(IMAGE_TOKEN, '').strip()}\nResponse: {r}\nExtracted answer:"
                 for p, r in zip(prompts, replies)]
        done = judge.complete(texts)
    finally:
        judge.close()
    extracted = [None if text is None else text.strip().splitlines()[0].strip() if text.strip() else "" for text, _ in done]
    return extracted, [why for _, why in done]


# ---------------------------------------------------------------- the run

def main(args) -> int:
    if args.compare:
        print(compare(*args.compare), end="")
        return 0
    from mmrl import distributed
    from mmrl.evals.provenance import provenance

    if args.model is None:
        raise ValueError("--benchmark needs --model: a Hugging Face VLM folder or hub id, a final/ export, or a run folder")
    if args.batch_size < 1 or args.max_new_tokens < 1 or args.temperature < 0:
        raise ValueError(f"need --batch-size >= 1, --max-new-tokens >= 1, --temperature >= 0; got "
                         f"{args.batch_size}, {args.max_new_tokens}, {args.temperature}")
    records, files = load_items(args)
    if not records:
        raise ValueError(f"--benchmark {args.benchmark}: no items to evaluate")
    prompts = [prompt_of(args.benchmark, r, args.style) for r in records]
    dist = distributed.setup(_device(args.device), 1800.0)
    policy, weights = load_policy(args.model, args.device, args.dtype, args.max_new_tokens, args.engine, args.seed)
    policy.model.eval()
    mine = list(range(dist.rank, len(records), dist.world))  # each rank answers every world-th item
    contexts = [{**records[i], "prompt": prompts[i]} for i in mine]
    replies = dict(zip(mine, answer(policy, contexts, args.batch_size, args.temperature, args.seed + dist.rank,
                                    show=dist.is_main)))
    if dist.active:
        every: list[dict[int, str]] = [{} for _ in range(dist.world)]
        import torch.distributed as tdist

        tdist.all_gather_object(every, replies)
        replies = {i: r for part in every for i, r in part.items()}
        if not dist.is_main:
            return 0
    ordered = [replies[i] for i in range(len(records))]
    from mmrl.evals.bench_official import VERSIONS

    sampling = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                "style": args.style, "dtype": args.dtype, "engine": args.engine, "ranks": dist.world}
    record = score(records, prompts, ordered, args)
    template, grader = VERSIONS[args.benchmark]
    template += f"/{args.style}" if args.style else ""
    record["provenance"] = provenance(benchmark=args.benchmark, model=args.model, data_files=files,
                                      prompt_template=template, grader=grader,
                                      sampling=sampling, seed=args.seed, weights_dir=str(weights),
                                      split=args.split, limit=args.limit)
    if files == [] and args.benchmark in SYNTHETIC:  # a generated set: its identity is the generator's
        record["provenance"]["data_sha256"] = f"{args.benchmark}:data_seed=0:n={len(records)}"
    out = write(record, records, prompts, ordered, args)
    print(markdown(record), end="")
    print(f"written: {out}")
    return 0


def score(records: list[dict], prompts: list[str], replies: list[str], args) -> dict[str, Any]:
    """Rule scores (and judged scores with --judge), the breakdowns, and every item's verdict."""
    from mmrl.evals.bench_official import breakdowns, extract, grade

    name = args.benchmark
    extracted = [extract(name, r, reply) for r, reply in zip(records, replies)]
    correct = [grade(name, r, e) for r, e in zip(records, extracted)]
    result: dict[str, Any] = {"benchmark": args.benchmark, "model": args.model, "n": len(records),
                              "scores": {"rule": {"accuracy": float(np.mean(correct)),
                                                  "extracted": float(np.mean([e is not None for e in extracted])),
                                                  "breakdowns": breakdowns(name, records, correct)}}}
    items = [{"id": r["id"], "answer": r["answer"], "extracted": e, "correct": ok, "groups": item_groups(name, r)}
             for r, e, ok in zip(records, extracted, correct)]
    if args.judge:
        judged, failed = judge_extract(args.judge, args.judge_model, records, prompts, replies)
        judged_ok = [why is None and grade(name, r, e) for r, e, why in zip(records, judged, failed)]
        unjudged = float(np.mean([why is not None for why in failed]))
        result["scores"]["judge"] = {"accuracy": float(np.mean(judged_ok)), "unjudged": unjudged,
                                     "judge": {"url": args.judge, "model": args.judge_model},
                                     "breakdowns": breakdowns(name, records, judged_ok)}
        for item, e, ok, why in zip(items, judged, judged_ok, failed):
            item.update(judge_extracted=e, judge_correct=ok, **({"judge_failed": why} if why else {}))
        if unjudged > 0:
            reasons = sorted({w for w in failed if w})
            print(f"mmrl: warning: the judge at {args.judge} could not extract {unjudged:.0%} of the answers "
                  f"({reasons[0]}{'; ...' if len(reasons) > 1 else ''}); they count as wrong in the judged score",
                  file=sys.stderr)
    result["items"] = items
    return result


def write(result: dict[str, Any], records: list[dict], prompts: list[str], replies: list[str], args) -> Path:
    from mmrl.checkpoint import atomic_write_text
    from mmrl.evals.vqa_eval import samples_page

    name = Path(str(args.model).rstrip("/")).name or "model"
    out = Path(args.output or Path("runs") / "eval" / f"{args.benchmark}-{name}")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "replies.jsonl", "".join(
        json.dumps({"id": r["id"], "prompt": p, "reply": reply}) + "\n" for r, p, reply in zip(records, prompts, replies)))
    shown = [{**r, "problem": p} for r, p in zip(records[:SHOWN], prompts)]
    correct = np.array([it["correct"] for it in result["items"][:SHOWN]])
    atomic_write_text(out / "replies.html", samples_page(shown, replies[:SHOWN], correct, 0).replace(
        "step 0", f"{args.benchmark}, rule-graded"))
    atomic_write_text(out / f"{args.benchmark}.md", markdown(result))
    atomic_write_text(out / f"{args.benchmark}.json", json.dumps(result, indent=1))
    return out / f"{args.benchmark}.json"


def markdown(result: dict[str, Any]) -> str:
    scores = result["scores"]
    kinds = [k for k in ("rule", "judge") if k in scores]
    head = " | ".join("rule-based (extracted by rules)" if k == "rule" else "judged (extracted by the LLM judge)"
                      for k in kinds)
    lines = [f"### {result['benchmark']}: {result['model']} ({result['n']} items)", "",
             f"| | {head} |", "| --- |" + " ---: |" * len(kinds),
             "| accuracy | " + " | ".join(f"{100 * scores[k]['accuracy']:.1f}" for k in kinds) + " |"]
    if "judge" in scores:
        lines.append(f"| could not be judged | — | {100 * scores['judge']['unjudged']:.1f} % |")
    for table, cells in scores["rule"]["breakdowns"].items():
        lines += ["", f"| {table} | n | " + " | ".join(kinds) + " |", "| --- | ---: |" + " ---: |" * len(kinds)]
        for cell, v in cells.items():
            vals = [scores[k]["breakdowns"][table][cell]["accuracy"] for k in kinds]
            lines.append(f"| {cell} | {v['n']} | " + " | ".join(f"{100 * x:.1f}" for x in vals) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- comparing two evaluations

def bootstrap_ci(diff: np.ndarray, n_boot: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of the mean of paired per-item differences."""
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), (n_boot, len(diff)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def compare(path_a: str, path_b: str) -> str:
    """B minus A, overall and per breakdown cell, on the items both evaluated, with a paired
    bootstrap interval; refused when the two differ in data, prompt or grader."""
    from mmrl.evals.provenance import comparable

    a, b = (_read_eval(p) for p in (path_a, path_b))
    why = comparable(a["provenance"], b["provenance"])
    if why:
        raise ValueError(f"--compare: {path_a} and {path_b} cannot be compared: {why}")
    items_a = {it["id"]: it for it in a["items"]}
    common = [it for it in b["items"] if it["id"] in items_a]
    if not common:
        raise ValueError(f"--compare: {path_a} and {path_b} share no item ids")
    cells: dict[str, list[float]] = defaultdict(list)
    for it in common:
        d = float(it["correct"]) - float(items_a[it["id"]]["correct"])
        for cell in ["all", *it["groups"]]:
            cells[cell].append(d)
    lines = [f"### {a['benchmark']}: {b['model']} minus {a['model']} ({len(common)} shared items, rule-based, "
             f"95 % paired bootstrap)", "", "| cell | n | A | B | B - A | 95 % interval |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for cell, diffs in cells.items():
        ids = [it["id"] for it in common if cell == "all" or cell in it["groups"]]
        acc_a = np.mean([items_a[i]["correct"] for i in ids])
        acc_b = acc_a + np.mean(diffs)
        lo, hi = bootstrap_ci(np.asarray(diffs))
        lines.append(f"| {cell} | {len(diffs)} | {100 * acc_a:.1f} | {100 * acc_b:.1f} | {100 * np.mean(diffs):+.1f} "
                     f"| [{100 * lo:+.1f}, {100 * hi:+.1f}] |")
    return "\n".join(lines) + "\n"


def _read_eval(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--compare: {path}: no such file; accepted: a <benchmark>.json that "
                                f"`mmrl eval --benchmark` wrote") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--compare: {path} is not JSON ({exc}); accepted: a <benchmark>.json that "
                         f"`mmrl eval --benchmark` wrote") from None
    if not isinstance(data, dict) or not {"provenance", "items", "benchmark"} <= set(data):
        raise ValueError(f"--compare: {path} is not an evaluation JSON of `mmrl eval --benchmark` "
                         f"(needs provenance, items and benchmark)")
    return data
