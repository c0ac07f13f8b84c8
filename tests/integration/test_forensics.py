"""Hang forensics (run/forensics.py): real 3-rank jobs broken in each way the diagnosis names; each test reads one
run's Flight Recorder dumps. Rank 0 is the odd one out where the fault has one, rank 1 where a rank goes missing,
so blaming the first or the last rank by habit fails. The four faults of scripts/08b_hangs.py are chapter 08b's own
runs (its smoke run, which CI executes anyway: `smoke_chapter`), and so is a skip inside a TP group of a 2 x 2
mesh (the script's --group); the crash, the failed rendezvous and two more faults inside subgroups (the wrong
operation in a DP group, the wrong sizes in a TP group) are launched here, side by side."""
import json
import subprocess
import sys

import pytest

from gpucourse.run import forensics
from gpucourse.run.contract import RUNS_ENV
from gpucourse.run.launcher import launch_all

from tests.conftest import JOBS, ROOT, chapter, chapter_run, run_cli

CHAPTER = ROOT / "notebooks" / "08b_hangs_and_desyncs.ipynb"
pytestmark = chapter(CHAPTER.stem)  # one worker: the chapter and the module's launches are run once
HANGS = ROOT / "scripts" / "08b_hangs.py"
FAULTS = JOBS / "faults.py"
NPROC = 3
CHAPTERS_OWN = ("mismatch", "skip", "shape", "straggler")  # its runs 08-fr-<mode>
# Faults inside a subgroup, 4 ranks as a 2 x 2 mesh ("dp", "tp"): TP groups [0, 1] and [2, 3], DP groups [0, 2]
# and [1, 3]. Each step all-reduces over TP, then over DP; the culprit's peers in the other dimension wait in
# their own group's collective, so the rank every other rank waits on is not the one to blame by habit.
CHAPTERS_SUBGROUP = "tp-skip"  # its run 08-fr-tp-skip: rank 2 skips its TP all_reduce #2 and ends; rank 3 waits
# in it, rank 1 in its DP all_reduce #2 for rank 3
SUBGROUPS = {  # name: (--mode, --group, --rank, --step, --steps)
    "dp-mismatch": ("mismatch", "dp", 3, 0, 2),  # rank 3 all-reduces where rank 1 (and the other DP group) broadcast
    "tp-shape": ("shape", "tp", 1, 1, 3),  # rank 1 all-reduces 4 numbers where rank 0 (and the others) 8
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The module's own launches, side by side: the crash, the failed rendezvous and the subgroup faults."""
    common = {"nproc": NPROC, "check": False, "timeout": 120, "env": {"OMP_NUM_THREADS": "1"}}
    jobs = {"crash": {"script": HANGS, "args": ["--mode", "crash", "--step", "3"], "name": "fr-crash", **common},
            "rendezvous": {"script": FAULTS, "args": ["--mode", "rendezvous"], "name": "fr-rendezvous",
                           **common, "timeout": 30}}
    for name, (mode, group, rank, step, steps) in SUBGROUPS.items():
        jobs[name] = {**common, "script": HANGS, "nproc": 4, "name": f"fr-{name}", "stall_timeout": 8,
                      "args": ["--mode", mode, "--group", group, "--rank", str(rank), "--step", str(step),
                               "--steps", str(steps)]}
    with pytest.MonkeyPatch.context() as env:
        env.setenv(RUNS_ENV, str(tmp_path_factory.mktemp("forensics-runs")))
        return dict(zip(jobs, launch_all(list(jobs.values()))))


@pytest.fixture(scope="module")
def runs(launches, smoke_chapter):
    found = dict(launches)
    _, folder = smoke_chapter(CHAPTER)
    for mode in CHAPTERS_OWN:
        found[mode] = chapter_run(folder, f"08-fr-{mode}")
        assert found[mode].world_size == NPROC, f"chapter 08b's forensics lab no longer runs {NPROC} ranks"
    found[CHAPTERS_SUBGROUP] = chapter_run(folder, f"08-fr-{CHAPTERS_SUBGROUP}")
    return found


@pytest.mark.parametrize("mode, kind, ranks, op, seq_id", [
    ("mismatch", "order", [0], "broadcast", 2),  # rank 0 all-reduces where ranks 1 and 2 broadcast
    ("shape", "shape", [0], "all_reduce", 2),  # rank 0 all-reduces 4 numbers, ranks 1 and 2 eight (gloo aborts it)
    ("skip", "missing", [1], "all_reduce", 4),  # rank 1 skipped one: the others wait in their 4th, it has ended
    ("straggler", "straggler", [1], "barrier", 2),  # rank 1 is busy in its own code
    ("crash", "crash", [1], "all_reduce", 4),  # rank 1 was killed (SIGKILL) as the others entered the 4th
    ("rendezvous", "rendezvous", [0, 1, 2], None, None),  # no process group ever formed
])
def test_the_dumps_name_the_rank_the_collective_and_the_fault(runs, mode, kind, ranks, op, seq_id):
    result = runs[mode]
    assert not result.ok, result.summary()
    found = result.diagnosis()
    assert found is not None, f"no diagnosis: {result.summary()}"
    assert (found.kind, found.ranks, found.op, found.seq_id) == (kind, ranks, op, seq_id), str(found)
    group = (None, []) if kind == "rendezvous" else ("default_pg", list(range(NPROC)))
    assert (found.group, found.group_ranks, found.mesh_dim) == (*group, None), str(found)
    assert f"flight recorder: {kind}" in result.summary()


@pytest.mark.parametrize("name, kind, ranks, op, seq_id, group", [
    ("tp-skip", "missing", [2], "all_reduce", 2, ("mesh_tp", [2, 3], "tp")),
    ("dp-mismatch", "order", [3], "broadcast", 1, ("mesh_dp", [1, 3], "dp")),
    ("tp-shape", "shape", [1], "all_reduce", 2, ("mesh_tp", [0, 1], "tp")),
])
def test_a_hang_inside_a_subgroup_names_the_culprit_and_its_group(runs, name, kind, ranks, op, seq_id, group):
    result = runs[name]
    assert not result.ok, result.summary()
    found = result.diagnosis()
    assert found is not None, f"no diagnosis: {result.summary()}"
    assert (found.kind, found.ranks, found.op, found.seq_id) == (kind, ranks, op, seq_id), str(found)
    assert (found.group, found.group_ranks, found.mesh_dim) == group, str(found)
    assert f"in {group[0]} {group[1]} (mesh dimension {group[2]})" in str(found).splitlines()[0], str(found)
    if name == "tp-skip":  # the command line names the group too: its JSON keeps `ranks`, adds the group's
        out = run_cli("diagnose", result.run_dir, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {**found.to_dict(), "ranks": ranks, "group_ranks": group[1]}


def test_diagnose_prints_json_and_torchs_analyser_reads_the_same_dumps(runs):
    result = runs["straggler"]
    out = run_cli("diagnose", result.run_dir, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == result.diagnosis().to_dict()
    dumps = forensics.fr_file(result.run_dir, 0).parent
    assert sorted(p.name for p in dumps.iterdir()) == [f"rank_{r}" for r in range(NPROC)]
    fr_trace = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
                              capture_output=True, text=True, timeout=120)
    assert fr_trace.returncode == 0, fr_trace.stderr[-2000:]
    report = fr_trace.stdout + fr_trace.stderr  # it reports through logging
    assert "Not all ranks joining collective, sequence number: 2" in report, report
    assert "missing ranks: {1}" in report, report


def test_diagnose_refuses_a_folder_that_is_not_a_run(tmp_path):
    out = run_cli("diagnose", tmp_path)
    assert out.returncode == 2 and "not a gpucourse run directory" in out.stderr, out.stderr
