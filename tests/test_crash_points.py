"""A run killed with SIGKILL at any filesystem step, then started again with the same command, ends
with the folder an uninterrupted run writes (tests/crash_points.py; the whole sweep is
scripts/crash_sweep.py, its figure in docs/reliability.md). CI covers one point of each kind."""

from pathlib import Path

import pytest

from crash_points import SHARDED_COMMAND, crash_and_resume, kind_of, reference, run


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    work = tmp_path_factory.mktemp("crash")
    ref, steps = reference(work)
    return work, ref, steps


def point(steps, kind: str, which: str):
    """The first, middle or last step of `kind`."""
    of_kind = [s for s in steps if kind_of(s, steps) == kind]
    assert of_kind, f"the run made no step of kind {kind!r}: {[(s.event, s.path) for s in steps]}"
    return of_kind[{"first": 0, "middle": len(of_kind) // 2, "last": -1}[which]]


# One point of each kind: the most telling one.
POINTS = [
    ("temporary folder made", "first"),  # the first checkpoint's folder, nothing in it yet
    ("rename into place", "last"),  # the last step's second save renamed in; the first still aside
    ("latest replaced", "first"),
    ("rotation", "middle"),  # an old checkpoint half deleted (renamed aside first)
    ("final/", "last"),  # final/ in place, the final evaluation not yet run
    ("second save of the last step", "first"),  # between its two renames: no step_000008 at all
]


@pytest.mark.parametrize("kind,which", POINTS)
def test_a_kill_after_a_step_resumes_to_the_uninterrupted_folder(uninterrupted, kind, which):
    work, ref, steps = uninterrupted
    step, said = point(steps, kind, which), []
    assert crash_and_resume(ref, work, step.index, said=said) == [], f"after step {step.index}: {step}"
    if kind == "temporary folder made":  # a leftover: removed, and said
        assert f"removed what an interrupted write left in {work / f'crash_{step.index:03d}'}" in said[0]
        assert step.path in said[0]


def test_a_kill_between_the_final_evaluation_and_its_save_logs_it_once(uninterrupted):
    """The final evaluation is logged, then the last step saved again with it: a kill in between
    resumes from the first save of that step, whose log rows end before the evaluation's."""
    work, ref, steps = uninterrupted
    second = point(steps, "second save of the last step", "first")
    before = steps[second.index - 3]  # the rename of final/ (then the evaluation, then the save's folder)
    assert before.path.endswith("-> final")
    assert crash_and_resume(ref, work, before.index) == []


def test_the_command_of_a_finished_run_changes_nothing(uninterrupted):
    work, ref, _ = uninterrupted

    def snapshot(folder: Path):
        return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
                for p in folder.rglob("*")}

    before = snapshot(ref)
    again = run(ref)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"the run in {ref} is finished (step 8 of 8)" in again.stderr
    assert "greedy exact match" in again.stdout  # the headline is still printed
    assert snapshot(ref) == before


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    work = tmp_path_factory.mktemp("sharded")
    ref, steps = reference(work, SHARDED_COMMAND, nproc=2)
    return work, ref, steps


@pytest.mark.parametrize("kind,which", [("rename into place", "first"), ("second save of the last step", "first")])
def test_a_sharded_run_killed_after_a_step_resumes_whole(sharded, kind, which):
    """torchrun, 2 gloo ranks: rank 0 makes every change but the shards, so its steps are the points."""
    work, ref, steps = sharded
    step = point(steps, kind, which)
    assert crash_and_resume(ref, work, step.index, SHARDED_COMMAND, nproc=2) == [], f"after step {step.index}: {step}"
