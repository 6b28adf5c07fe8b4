"""`mmrl eval --benchmark libero --model DIR`: a saved robot policy on LIBERO, the published protocol.

    mmrl eval --benchmark libero --model runs/libero --suites all --trials 50 --workers 8
    mmrl eval --benchmark libero --model runs/libero/final --suites spatial goal --output runs/eval/mine

The protocol of OpenVLA-OFT, SimpleVLA-RL and RLinf: every task of each suite (`all`: libero_spatial,
libero_object, libero_goal, libero_10; 10 tasks each) on its first `--trials` official initial states
(50 in the papers), greedily, each env seeded with `--seed`, each episode cut at the suite's
official budget (`mmrl.envs.libero.env.MAX_EPISODE_STEPS`).

`--model` is a run folder (its newest checkpoint), a `step_NNNNNN` checkpoint in one, or a policy's
saved folder (the run's `final/`); the policy is rebuilt from the run's own config.yaml (image size,
cameras, model settings), so no training config is given.

Writes into `--output` (default `runs/eval/libero-<run>`):
- `tasks/<suite>_<NN>.json`, one per task as it finishes (atomically). The same command resumes an
  interrupted evaluation from them; a task file of another evaluation (other weights, trials, seed
  or budget) is refused, never mixed in.
- `libero.json`: per task, per suite and the average over suites, every episode, and the provenance
  (weights and data hashes, grader, sampling, seed, packages); `libero.md`: the papers' table (a
  column per suite, then the average) and a table per suite of its tasks.
- `videos/<suite>/`: a few failed episodes per suite (GIF, and MP4 where FFmpeg is there).

`--workers N` steps each task's episodes in N env worker processes; the policy is built once, in
this process, and acts on all of a task's trials as one batch. (A pool of processes that each build
the policy would hold N copies of it, on the GPU too.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ALL_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
TASKS_PER_SUITE = 10
OFFICIAL_STATES = 50  # official initial states per task
PROMPT_TEMPLATE = "libero task language"
GRADER = "libero env success/v1"
DEFAULT_VIDEOS = 4


# ---------------------------------------------------------------- arguments

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """LIBERO's options of `mmrl eval --benchmark libero` (the CLI adds --model, --output and --seed)."""
    parser.add_argument("--suites", nargs="+", default=["all"],
                        help="--benchmark libero: `all` (spatial, object, goal, 10) or suite names, e.g. spatial "
                        "libero_goal long (default: all)")
    parser.add_argument("--trials", type=int, default=OFFICIAL_STATES,
                        help=f"--benchmark libero: episodes per task, on its first N official initial states "
                        f"(1..{OFFICIAL_STATES}; default {OFFICIAL_STATES}, the papers')")
    parser.add_argument("--workers", type=int, default=1,
                        help="--benchmark libero: env worker processes stepping a task's episodes (default 1: "
                        "in this process)")
    parser.add_argument("--videos", type=int, default=DEFAULT_VIDEOS,
                        help=f"--benchmark libero: failed episodes to film per suite (default {DEFAULT_VIDEOS})")
    parser.add_argument("--task-ids", type=int, nargs="+",
                        help="--benchmark libero: only these task ids of each suite (default: all 10; the "
                        "published numbers need all)")
    parser.add_argument("--max-steps", type=int,
                        help="--benchmark libero: episode budget in env steps for a quick check (default: each "
                        "suite's official budget; a result with another one is marked non-standard)")


def parse_suites(names: list[str]) -> list[str]:
    """`all` or suite names (short ones too: spatial, object, goal, long, 10) -> LIBERO suite names."""
    from mmrl.envs.libero.env import suite_name

    out: list[str] = []
    for name in names:
        for suite in ALL_SUITES if name == "all" else [suite_name(name)]:
            if suite not in out:
                out.append(suite)
    return out


def _check_args(args: argparse.Namespace) -> None:
    """One line naming the first bad value and what is accepted."""
    if not 1 <= args.trials <= OFFICIAL_STATES:
        raise ValueError(f"--trials {args.trials}: a LIBERO task has {OFFICIAL_STATES} official initial states; "
                         f"accepted: 1..{OFFICIAL_STATES}")
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: accepted: an integer >= 1")
    if args.videos < 0:
        raise ValueError(f"--videos {args.videos}: accepted: an integer >= 0")
    bad = [t for t in getattr(args, "task_ids", None) or [] if not 0 <= t < TASKS_PER_SUITE]
    if bad:
        raise ValueError(f"--task-ids {bad[0]}: accepted: 0..{TASKS_PER_SUITE - 1}")
    max_steps = getattr(args, "max_steps", None)
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"--max-steps {max_steps}: accepted: an integer >= 1 (or leave it out: the official budget)")


# ---------------------------------------------------------------- the model

def run_config(model: str) -> tuple[Any, Path, str]:
    """(run config, folder whose weights are evaluated, the run's name) for `--model`: a run folder (its
    newest checkpoint), a step_NNNNNN checkpoint, or a policy's saved folder (a run's final/); the
    config is the run's own config.yaml, the device `auto`."""
    from mmrl.checkpoint import RUN_CONFIG, resolve_checkpoint, run_dir_of
    from mmrl.config import eval_config
    from mmrl.evals.vla_eval import saved_policy_kind

    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"--model {model}: no such folder; accepted: a run folder, a step_NNNNNN "
                                f"checkpoint in one, or a policy's saved folder (a run's final/)")
    saved = saved_policy_kind(path) is not None
    run_dir = path.parent if saved else run_dir_of(path)
    if not (run_dir / RUN_CONFIG).is_file():
        raise FileNotFoundError(f"--model {model}: no {RUN_CONFIG} in {run_dir}, the run folder it belongs to (the "
                                f"policy's image size, cameras and settings are there); give a run folder, a "
                                f"checkpoint in one, or a run's final/ left in its run folder")
    cfg = eval_config(run_dir, None, ["train.device=auto"])  # the run's own config, on a GPU when there is one
    if cfg.task.name != "libero":
        raise ValueError(f"--model {model}: a policy trained on task {cfg.task.name!r}; --benchmark libero "
                         f"evaluates policies trained on LIBERO (task libero)")
    weights = path if saved else resolve_checkpoint(path)[1]
    return cfg, weights, run_dir.name


def _actions_per_chunk(policy) -> int:
    """Env steps one chunk of the policy executes (lerobot adapters: n_action_steps; action tokens: chunk_size)."""
    return int(getattr(policy, "n_action_steps", None) or policy.chunk_size)


# ---------------------------------------------------------------- per-task results (resumable)

def task_file(out: Path, suite: str, task_id: int) -> Path:
    return out / "tasks" / f"{suite}_{task_id:02d}.json"


def read_done(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The finished task at `path`, or None when it is not there (or unreadable: it is redone). A
    task of another evaluation is refused in one line: its numbers must not enter this table."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        stored = record["settings"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        print(f"mmrl: warning: {path} is damaged; that task is run again", file=sys.stderr)
        return None
    diff = [f"{k}: {stored.get(k)!r} there, {settings.get(k)!r} now"
            for k in sorted(settings.keys() | stored.keys()) if stored.get(k) != settings.get(k)]
    if diff:
        raise ValueError(f"{path} holds a result of another evaluation ({'; '.join(diff)}); give this one another "
                         f"--output, or delete {path.parent} to start over")
    return record


def run_task(policy, suite: str, task_id: int, trials: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Greedy episodes of `task_id` on official initial states 0..trials-1, every env seeded with
    `seed`, the policy's noise (flow / diffusion policies) drawn from a generator seeded with `seed`:
    a task's result depends on nothing run before it, so a resumed evaluation equals an uninterrupted
    one. Returns (contexts with their instructions, decoded trajectories)."""
    from mmrl.envs.robot_task import rollout_episodes
    from mmrl.policies.base import eval_mode

    contexts = [{"suite": suite, "task_id": task_id, "init_state_id": i, "seed": seed} for i in range(trials)]
    with eval_mode(policy.model):
        return rollout_episodes(policy, contexts, temperature=0.0, samples=1, seed=seed)


def _write_failure_video(contexts: list[dict], outputs: list[dict], folder: Path, wanted: int) -> list[Path]:
    """A video of this task's first failed episode while the suite has fewer than `wanted`."""
    from mmrl.evals.vla_eval import write_videos

    have = len(list(folder.glob("*.gif"))) if folder.is_dir() else 0
    failed = [i for i, o in enumerate(outputs) if not o["success"]]
    if have >= wanted or not failed:
        return []
    i = failed[0]
    return write_videos([contexts[i]], [outputs[i]], folder, n=1)


def task_record(suite: str, task_id: int, contexts: list[dict], outputs: list[dict], settings: dict[str, Any],
                seconds: float, restarts: int, videos: list[str]) -> dict[str, Any]:
    success = [bool(o["success"]) for o in outputs]
    return {"suite": suite, "task_id": task_id, "instruction": contexts[0].get("instruction", ""),
            "settings": settings, "trials": len(success), "successes": int(sum(success)),
            "success": float(np.mean(success)),
            "episodes": [{"init_state_id": int(c["init_state_id"]), "success": s, "length": int(o["length"])}
                         for c, s, o in zip(contexts, success, outputs)],
            "env_worker_restarts": restarts, "seconds": round(seconds, 2), "videos": videos}


# ---------------------------------------------------------------- tables

def summarize(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per suite: the mean of its tasks' success rates (all tasks run the same trials), and the
    average over suites, as the papers report it."""
    suites = {s: {"success": float(np.mean([r["success"] for r in rs])), "tasks": len(rs),
                  "episodes": sum(r["trials"] for r in rs), "successes": sum(r["successes"] for r in rs)}
              for s, rs in records.items()}
    return {"average": float(np.mean([v["success"] for v in suites.values()])), "suites": suites}


def markdown(result: dict[str, Any]) -> str:
    """The papers' table (a column per suite, then the average; success in %), then one per suite."""
    from mmrl.evals.vla_eval import TITLES

    suites = list(result["suites"])
    p = result["protocol"]
    budget = ", ".join(f"{s.removeprefix('libero_')} {n}" for s, n in p["max_episode_steps"].items())
    lines = [f"# LIBERO: {result['name']}", "",
             f"Greedy, seed {p['seed']}, {p['trials']} trial(s) per task on its official initial states, "
             f"{len(p['task_ids'])} task(s) per suite, episodes of at most {budget} env steps"
             + (" (the official budgets)" if p["official_budget"] else "") + "."
             + ("" if p["standard"] else " Not the published protocol (50 trials, 10 tasks, the official budgets): "
                "not comparable to the papers' numbers."), "",
             "| Model | " + " | ".join(TITLES.get(s, s) for s in suites) + " | Average |",
             "| --- |" + " ---: |" * (len(suites) + 1),
             f"| {result['name']} | " + " | ".join(f"{100 * result['suites'][s]['success']:.1f}" for s in suites)
             + f" | {100 * result['average']:.1f} |"]
    for s in suites:
        lines += ["", f"## {s} ({TITLES.get(s, s)})", "", "| Task | Instruction | Success % | Successes |",
                  "| ---: | --- | ---: | ---: |"]
        lines += [f"| {r['task_id']} | {r['instruction']} | {100 * r['success']:.1f} | {r['successes']}/{r['trials']} |"
                  for r in result["tasks"][s]]
    videos = [v for rs in result["tasks"].values() for r in rs for v in r["videos"] if v.endswith(".gif")]
    if videos:
        lines += ["", f"Failed episodes filmed: {len(videos)}, in `videos/` (instruction above, red border)."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the command

def _data_files(suites: list[str], task_ids: list[int]) -> list[Path]:
    """The init-state and BDDL files of the tasks evaluated (LIBERO must be configured)."""
    from libero.libero import benchmark, get_libero_path

    files = []
    for suite in suites:
        bench = benchmark.get_benchmark_dict()[suite]()
        for t in task_ids:
            task = bench.get_task(t)
            files += [Path(get_libero_path("init_states")) / task.problem_folder / task.init_states_file,
                      Path(get_libero_path("bddl_files")) / task.problem_folder / task.bddl_file]
    return files


def main(args: argparse.Namespace) -> int:
    from mmrl.checkpoint import atomic_write_text
    from mmrl.envs.libero.env import MAX_EPISODE_STEPS, configure_libero
    from mmrl.evals.provenance import provenance
    from mmrl.evals.vla_eval import load_saved_policy

    _check_args(args)
    suites = parse_suites(list(args.suites))
    task_ids = sorted(set(getattr(args, "task_ids", None) or range(TASKS_PER_SUITE)))
    max_steps = getattr(args, "max_steps", None)
    budget = {s: int(max_steps or MAX_EPISODE_STEPS[s]) for s in suites}
    cfg, weights, name = run_config(args.model)
    out = Path(args.output or Path("runs") / "eval" / f"libero-{name}")
    configure_libero(cfg.task.params.get("assets_dir"))  # one line when the assets are missing, before any work
    prov = provenance(benchmark="libero", model=weights, data_files=_data_files(suites, task_ids),
                      prompt_template=PROMPT_TEMPLATE, grader=GRADER,
                      sampling={"mode": "greedy", "temperature": 0.0, "samples_per_state": 1},
                      seed=args.seed, suites=suites, trials=args.trials, task_ids=task_ids,
                      max_episode_steps=budget)

    def settings(suite: str) -> dict[str, Any]:  # what a task's result depends on: a stored one must match
        return {"weights_sha256": prov["weights_sha256"], "trials": args.trials, "seed": args.seed,
                "mode": "greedy", "max_episode_steps": budget[suite]}

    records: dict[str, list[dict | None]] = {
        s: [read_done(task_file(out, s, t), settings(s)) for t in task_ids] for s in suites}
    total = len(suites) * len(task_ids)
    pending = sum(r is None for rs in records.values() for r in rs)
    print(f"LIBERO: {name} on {', '.join(suites)}, {len(task_ids)} task(s) x {args.trials} trial(s) each, greedy, "
          f"seed {args.seed}; {pending} of {total} tasks to run ({total - pending} done before, in {out})", flush=True)
    policy = load_saved_policy(cfg, str(weights))[1] if pending else None
    for suite in suites:
        task = None
        if any(r is None for r in records[suite]):
            task = _suite_task(cfg, suite, task_ids, args, budget[suite])
            policy.env_factory = task.env_factory  # this suite's envs, `--workers` processes of them
            # Chunks enough for the whole budget: the env's time limit, not the policy, ends an episode.
            policy.max_chunks = math.ceil(budget[suite] / _actions_per_chunk(policy))
        for k, t in enumerate(task_ids):
            record, resumed = records[suite][k], records[suite][k] is not None
            if record is None:
                record = records[suite][k] = _run_and_write(policy, task, out, suite, t, args, settings(suite))
            so_far = np.mean([r["success"] for r in records[suite][:k + 1]])
            when = "done before" if resumed else f"{record['seconds']:.0f} s"
            print(f"  {suite} task {t} ({k + 1}/{len(task_ids)}): {record['successes']}/{record['trials']} = "
                  f"{100 * record['success']:.1f}%  | suite so far {100 * so_far:.1f}%  ({when})  "
                  f"{record['instruction']}", flush=True)

    result = {"benchmark": "libero", "model": str(args.model), "name": name,
              "protocol": {"suites": suites, "task_ids": task_ids, "trials": args.trials, "mode": "greedy",
                           "seed": args.seed, "max_episode_steps": budget, "official_budget": max_steps is None,
                           "standard": args.trials == OFFICIAL_STATES and len(task_ids) == TASKS_PER_SUITE
                           and max_steps is None},
              **summarize(records), "tasks": records, "provenance": prov}
    atomic_write_text(out / "libero.json", json.dumps(result, indent=1))
    atomic_write_text(out / "libero.md", markdown(result))
    cols = ", ".join(f"{s.removeprefix('libero_')} {100 * v['success']:.1f}" for s, v in result["suites"].items())
    print(f"LIBERO average success: {100 * result['average']:.1f}% ({cols}); written: {out / 'libero.md'}")
    return 0


def _suite_task(cfg, suite: str, task_ids: list[int], args: argparse.Namespace, budget: int):
    """The run's LIBERO task (its image size, cameras, assets) on `suite`: its env factory builds the
    envs, `--workers` processes of them, each episode cut at `budget` steps."""
    from mmrl.envs import make_task

    params = {**cfg.task.params, "suite": suite, "task_ids": task_ids, "eval_trials": args.trials,
              "num_workers": args.workers if args.workers > 1 else 0, "max_episode_steps": budget,
              "prefetch_resets": False, "eval_grounding": False}
    return make_task("libero", seed=args.seed, **params)


def _run_and_write(policy, task, out: Path, suite: str, task_id: int, args: argparse.Namespace,
                   settings: dict[str, Any]) -> dict[str, Any]:
    """Run one task, film a failure if the suite wants more, and write its result atomically."""
    from mmrl.checkpoint import atomic_write_text

    factory = task.env_factory
    restarts, start = factory.restarts, time.monotonic()
    contexts, outputs = run_task(policy, suite, task_id, args.trials, args.seed)
    factory.close()  # this task's envs are not needed again (each task has its own scene)
    restarts = factory.restarts - restarts
    if restarts:
        print(f"mmrl: warning: {suite} task {task_id}: {restarts} env worker restart(s); the episodes in flight "
              f"on that worker count as failures", file=sys.stderr)
    videos = _write_failure_video(contexts, outputs, out / "videos" / suite, args.videos) if args.videos else []
    record = task_record(suite, task_id, contexts, outputs, settings, time.monotonic() - start, restarts,
                         [str(v.relative_to(out)) for v in videos])
    atomic_write_text(task_file(out, suite, task_id), json.dumps(record, indent=1))
    return record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mmrl.evals.libero_benchmark",
                                description="a saved robot policy on LIBERO, the published protocol")
    p.add_argument("--model", required=True, help="a run folder, a step_NNNNNN checkpoint in one, or a run's final/")
    p.add_argument("--output", help="report folder (default: runs/eval/libero-<run>)")
    p.add_argument("--seed", type=int, default=0, help="env and policy-noise seed (default 0)")
    add_arguments(p)
    return p


if __name__ == "__main__":
    from mmrl.checkpoint import CheckpointError
    from mmrl.config import ConfigError

    try:
        sys.exit(main(_parser().parse_args()))
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"mmrl: error: {exc}", file=sys.stderr)
        sys.exit(2)
