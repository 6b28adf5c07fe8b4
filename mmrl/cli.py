"""`mmrl train CONFIG [key=value ...]`, `mmrl eval [CONFIG] --checkpoint RUN [key=value ...]`, `mmrl algos`,
`mmrl fetch-assets libero`."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import time
from pathlib import Path


from mmrl import build

def run_training(cfg, resume: bool = True):
    """Build the task and policy of `cfg` and train; returns (task, results, process CPU-s of the
    training call, evaluations included, whether the folder's run had finished before: then nothing
    was trained or written)."""
    from mmrl import distributed
    from mmrl.checkpoint import check_same_run
    from mmrl.trainer import Trainer

    if resume:  # before the (possibly long) build: a folder holding another run is refused at once
        check_same_run(cfg)
    dist = distributed.setup(cfg.train.device, cfg.train.dist_timeout_s, cfg.train.fsdp)  # under torchrun
    task, policy = build(cfg)
    trainer = Trainer(cfg, policy, task, dist=dist)
    cpu0 = time.process_time()
    results = trainer.train(resume=resume)
    return task, results, time.process_time() - cpu0, trainer.already_finished


def cmd_train(args) -> int:
    from mmrl.config import load_config

    from mmrl.trainer import TrainingFailed, TrainingInterrupted

    if args.nproc > 1:
        return launch(args)
    cfg = load_config(args.config, args.overrides)
    try:
        task, results, cpu_s, finished_before = run_training(cfg, resume=not args.no_resume)
    except TrainingInterrupted as stop:
        command = " ".join(["mmrl train", args.config, *args.overrides])
        print(f"mmrl: {stop.signal_name} {stop.where}; checkpoint saved to {stop.checkpoint}. "
              f"Resume with the same command: {command}", file=sys.stderr)
        return 130
    except TrainingFailed as fault:  # e.g. the reward's judge is down: one line, the checkpoint is saved
        print(f"mmrl: error: {fault}", file=sys.stderr)
        return 1
    from mmrl import distributed

    if not distributed.current().is_main:  # rank 0 reports for the run
        return 0
    from mmrl.evals.report import headline_text, write_report
    from mmrl.evals.reports import summarize

    before, after = results["eval_before"], results["eval_after"]
    headline = task.headline(before, after)  # the domain's README metric, e.g. VQA accuracy, VLA success %
    report = Path(cfg.train.output_dir) / "report.md"
    if finished_before and report.is_file():  # the command of a finished run writes nothing: its report stands
        summary = ""
    else:
        summary = summarize(task, results, cfg.train.output_dir, cpu_s=cpu_s)  # e.g. planning's EM / PR table by size
        report = write_report(cfg.train.output_dir, headline, summary)
    print(headline_text(headline, before["step"], after["step"]), end="")
    print(summary, end="")
    print(f"results: {Path(cfg.train.output_dir) / 'results.json'}  report: {report}")
    return 0


def launch(args) -> int:
    """`mmrl train CONFIG --nproc N`: the same command as N processes on this machine under torchrun
    (several machines: run torchrun yourself, README.md, Scaling). A rank that fails or dies ends the
    run; this says so in one line, after torchrun's report of each rank."""
    import subprocess

    from mmrl.checkpoint import find_latest
    from mmrl.config import load_config

    cfg = load_config(args.config, args.overrides)  # a bad config fails here, once, not in N processes
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "--max-restarts=0", "-m", "mmrl.cli", "train", args.config, *args.overrides,
           *(["--no-resume"] if args.no_resume else []), *(["--trust-checkpoint"] if args.trust_checkpoint else [])]
    code = subprocess.call(cmd)
    if code != 0:
        latest = find_latest(cfg.train.output_dir)
        print(f"mmrl: error: training with {args.nproc} processes failed (exit code {code}); each rank's error "
              f"is above. Last complete checkpoint: {latest or 'none'}", file=sys.stderr)
    return code


def cmd_eval(args) -> int:
    from mmrl.config import eval_config

    if args.compare or args.benchmark:
        return cmd_benchmark(args)
    if args.checkpoint is None:
        raise ValueError("mmrl eval needs --checkpoint RUN (a run's held-out evaluation), --benchmark NAME --model "
                         "DIR (a public benchmark, no config) or --compare A.json B.json")
    config, overrides = args.config, list(args.overrides)
    if config is not None and ("=" in config or config.startswith("~")) and not Path(config).exists():
        config, overrides = None, [config, *overrides]  # `eval --checkpoint RUN key=value`: no CONFIG given
    cfg = eval_config(args.checkpoint, config, overrides)  # the run's own config.yaml, or CONFIG if it agrees
    if args.paper_split:
        cfg.task.params["paper_split"] = args.paper_split
    from mmrl.evals.reports import evaluate_checkpoint

    task, policy = build(cfg)
    written = evaluate_checkpoint(cfg, task, policy, args.checkpoint, output=args.output, splits=args.splits)
    print(f"written: {written}")
    return 0


def cmd_benchmark(args) -> int:
    """`mmrl eval --benchmark NAME --model DIR_OR_HUB_ID` (no training config) and `--compare A B`."""
    if args.config is not None or args.overrides:
        raise ValueError(f"--benchmark / --compare take no CONFIG or key=value overrides (got "
                         f"{' '.join([args.config or '', *args.overrides]).strip()!r}); the model folder is the input")
    if args.benchmark == "libero":
        from mmrl.evals.libero_benchmark import main as libero_main

        return libero_main(args)
    from mmrl.evals.vqa_benchmark import main as vqa_main

    return vqa_main(args)


def cmd_fetch_assets(args) -> int:
    from mmrl.envs.libero.assets import fetch

    print(fetch(dest=args.dest, source=args.source))
    return 0


def cmd_algos(args) -> int:
    from mmrl.algos import list_algorithms
    from mmrl.stages import list_stages

    for kind, rows in list_algorithms().items():
        print(f"{kind}:")
        for name, citation, *rest in rows:
            desc = rest[0] if rest else ""
            print(f"  {name:<16} {citation:<28} {desc}")
    print("stages (algo.stages: [{name: ..., <fields>}]; docs/architecture.md):")
    for name, kinds, fields, summary in list_stages():
        print(f"  {name:<20} {kinds:<36} {summary}")
        print(f"  {'':<20} fields: {fields or '(none)'}")
    return 0


def cmd_plan(args) -> int:
    from mmrl.plan import main as plan_main

    return plan_main(args)


def cmd_caption_filter(argv: list[str]) -> int:
    from mmrl.envs.captioning.filter import main as filter_main

    return filter_main(argv)


def cmd_caption_eval(argv: list[str]) -> int:
    from mmrl.evals.caption_eval import main as caption_eval_main

    return caption_eval_main(argv)


TRUST_HELP = ("load checkpoint state with pickle, which runs any code the file holds: only for a run folder you wrote "
              "yourself with an older mmrl (its trainer_state.pt holds numpy state); without it such a file is refused")

# Commands that parse their own arguments (`mmrl caption-filter -h`).
PASSTHROUGH = {"caption-filter": cmd_caption_filter, "caption-eval": cmd_caption_eval}


def main(argv: list[str] | None = None) -> int:
    from mmrl.evals import libero_benchmark, vqa_benchmark
    from mmrl.evals.bench_official import BENCHMARKS

    parser = argparse.ArgumentParser(prog="mmrl", description="RL post-training for multimodal models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train from a YAML config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.loss=gspo train.steps=20")
    p.add_argument("--no-resume", action="store_true", help="start fresh even if the output dir has a checkpoint")
    p.add_argument("--nproc", type=int, default=1, help="train with N processes on this machine (torchrun; "
                   "one per GPU, or CPU ranks with gloo)")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("eval", help="evaluate a checkpoint on the task's held-out set, with its run's own config")
    p.add_argument("config", nargs="?", help="optional: the run's own config.yaml is used; a CONFIG given must "
                   "agree with it on everything the weights were trained with")
    p.add_argument("overrides", nargs="*", help="dotted overrides on top of the run's config, e.g. train.eval_size=8")
    p.add_argument("--checkpoint", help="a run directory (its newest checkpoint) or a step_NNNNNN directory in one")
    p.add_argument("--output", help="where to write the JSON result (planning and robot tasks: the report folder)")
    p.add_argument("--splits", nargs="+", help="planning tasks: the splits to evaluate (test, ood, paper; "
                   "default: test ood, and paper when --paper-split is given)")
    p.add_argument("--paper-split", help="planning tasks: the folder holding the VPRL paper's test metadata "
                   "(vprl_*_test_meta.json), an evaluation-only input")
    p.add_argument("--benchmark", choices=(*BENCHMARKS, "libero"), help="a public benchmark, no training config: "
                   "the VQA sets take --model and --data; libero takes --model and --suites")
    p.add_argument("--model", help="--benchmark: a Hugging Face model folder or hub id, a run's final/ export, or a "
                   "run folder / step_NNNNNN checkpoint")
    p.add_argument("--seed", type=int, default=0, help="--benchmark: the sampling / environment seed (default 0)")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    vqa_benchmark.add_arguments(p)
    libero_benchmark.add_arguments(p)
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("algos", help="list every algorithm name with its citation")
    p.set_defaults(fn=cmd_algos)
    from mmrl.envs.libero.assets import CACHE_HELP, HUB_REPO

    p = sub.add_parser("fetch-assets", help="download simulator assets no pip package ships (LIBERO's), "
                       "where mmrl finds them (docs/libero.md)")
    p.add_argument("what", choices=["libero"])
    p.add_argument("--dest", help=f"folder to put them in (default: {CACHE_HELP}, where mmrl looks when "
                   f"MMRL_LIBERO_ASSETS is unset)")
    p.add_argument("--source", default=HUB_REPO, help=f"a Hugging Face dataset id to download (default: {HUB_REPO}, "
                   f"the copy lerobot's hf-libero uses) or a local folder to copy (a LIBERO checkout's "
                   f"libero/libero/assets)")
    p.set_defaults(fn=cmd_fetch_assets)
    p = sub.add_parser("plan", help="predict the peak GPU memory per phase of a config at full depth (replicated "
                       "and FSDP) and the largest micro-batch that fits (bench/real_shapes.json)")
    p.add_argument("config")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the run spreads over (default 1)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="memory of one GPU in GiB (default 80)")
    p.add_argument("--measurements", help="the bench's JSON (default: bench/real_shapes.json)")
    p.add_argument("--json", action="store_true", help="also print the plan as one JSON line")
    p.set_defaults(fn=cmd_plan)
    sub.add_parser("caption-filter", help="CapRL's with/without-image QA filter (own arguments: -h)")
    sub.add_parser("caption-eval", help="Prism-style caption eval with a before/after gallery (own arguments: -h)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    if argv and argv[0] in PASSTHROUGH:
        run = lambda: PASSTHROUGH[argv[0]](argv[1:])
    else:
        args = _parse(parser, argv)
        run = lambda: args.fn(args)

    from mmrl.checkpoint import CheckpointError
    from mmrl.config import ConfigError
    from mmrl.envs import MissingExtraError
    from mmrl.rewards import RewardFailure
    from mmrl.rollout import Diverged

    try:
        with trusted_checkpoints(args):
            return run()
    except (ConfigError, CheckpointError, MissingExtraError, FileNotFoundError, ValueError) as exc:
        print(f"mmrl: error: {exc}", file=sys.stderr)
        return 2
    except (Diverged, RewardFailure) as exc:  # outside training (`mmrl eval`): diverged weights, a reward's fault
        print(f"mmrl: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a write that failed for space or I/O outside a checkpoint (the log, results, a report)
        if exc.errno not in WRITE_ERRNOS:
            raise
        print(f"mmrl: error: {write_error_line(exc)}", file=sys.stderr)
        return 2


# A write that fails for space or I/O: no space, a file-size or quota limit, a device error.
WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO, errno.EROFS}


def write_error_line(exc: OSError) -> str:
    """One line for a write that failed for space or I/O: the file, the reason and the space free there."""
    import shutil

    from mmrl.checkpoint import size_text

    where = Path(exc.filename or ".").resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    return (f"could not write {exc.filename or 'a file'}: {exc.strerror}; {size_text(shutil.disk_usage(where).free)} "
            f"are free there. Checkpoints already saved are whole: free space and run the same command again")


@contextlib.contextmanager
def trusted_checkpoints(args: argparse.Namespace | None):
    """`--trust-checkpoint`: the command loads checkpoint state with pickle (mmrl.checkpoint.
    trust_checkpoints), and says so in one line from the process that loads it (rank 0; `--nproc N`
    hands the flag to its ranks); as before the command after it."""
    from mmrl import checkpoint

    trust, before = bool(getattr(args, "trust_checkpoint", False)), checkpoint.TRUST_CHECKPOINT
    if trust and getattr(args, "nproc", 1) <= 1 and os.environ.get("RANK", "0") == "0":
        print(f"mmrl: warning: {checkpoint.TRUST_NOTE}", file=sys.stderr)
    checkpoint.trust_checkpoints(trust or before)
    try:
        yield
    finally:
        checkpoint.trust_checkpoints(before)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    # Overrides may come before or after flags (`train CFG --no-resume a.b=1`).
    args, extra = parser.parse_known_args(argv)
    unknown = [x for x in extra if x.startswith("-") or ("=" not in x and not x.startswith("~"))]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


if __name__ == "__main__":
    code = main() or 0
    from mmrl import distributed

    if distributed.launched():  # a rank under torchrun (`--nproc`)
        distributed.exit_rank(code)
    sys.exit(code)
