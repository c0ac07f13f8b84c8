"""The graders' defences, checked without a grading run (seconds, not minutes): the communication recorder
(gpucourse/run/comm_recorder.py), the records' own writer and the bans (gpucourse/tools/grading/jobkit.py).

The recorder patches torch.distributed for the whole process, so those checks run in a child process with a
one-rank gloo group (and, for which process group each call ran on, two child processes: a two-rank group).
The mutants (tests/integration/test_mutants.py) prove the same defences end to end.
"""
import importlib
import json
import os
import socket
import subprocess
import sys

import pytest

CHILD = r'''
import importlib, json, os, sys
import torch, torch.distributed as dist
from gpucourse import runtime
ctx = runtime.setup()
from gpucourse.run import comm_recorder
from gpucourse.tools.grading import jobkit
log = jobkit.record_writer()
rec = comm_recorder.install()
out = {"wrapped": [hasattr(f, "__wrapped__") for f in (dist.all_reduce, dist.send, dist.ProcessGroup.allreduce,
                                                         dist.ProcessGroup.send, dist.Work.wait)],
       "names": [dist.isend.__name__, dist.ProcessGroup.allreduce.__name__]}
t = torch.ones(4)
with rec.recording():
    from torch.distributed import all_reduce  # a name taken by the submission: the recorded function
    from torch.distributed import distributed_c10d as c10d
    all_reduce(t)
    c10d.broadcast(t, 0)
    dist.group.WORLD.allreduce([t]).wait()  # the process group, called directly
    dist.barrier()  # the ProcessGroup.barrier inside is not a second event
out["events"] = [[e["via"], e["op"], e["kind"], e["bytes"], e["async"]] for e in rec.events]
dist.all_reduce(t)  # outside recording(): the grader's own, not recorded
out["after"] = len(rec.events)
runtime.log = lambda *a, **k: None  # what a submission could do at import
runtime._write_record = lambda record: None
log(case="kept", value=torch.tensor(2.5))
try:
    jobkit.ban({"torch.nn.parallel:NoSuchWrapper": "-"}, [])
except jobkit.BanError as err:
    out["ban_error"] = str(err)
used = []
jobkit.ban({"torch.nn.parallel:DistributedDataParallel": "write it yourself"}, used)
try:
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
except RuntimeError as err:
    out["refused"] = [str(err), used]
print("RESULT " + json.dumps(out))
runtime.teardown()
'''


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> tuple[dict, list]:
    run_dir = tmp_path_factory.mktemp("guards")
    env = {**os.environ, "GPUCOURSE_RUN_DIR": str(run_dir), "GPUCOURSE_BACKEND": "gloo", "GPUCOURSE_DEVICE": "cpu"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env,
                          timeout=180)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    return json.loads(lines[0].removeprefix("RESULT ")), records


def test_wrappers_hand_out_no_original(child):
    out, _ = child
    assert out["wrapped"] == [False] * 5, "a recorded function exposes __wrapped__ (the unrecorded original)"
    assert out["names"] == ["isend", "allreduce"]  # batch_isend_irecv and P2POp read __name__


def test_every_layer_is_recorded_once_per_call(child):
    out, _ = child
    assert out["events"] == [["dist.all_reduce", "all_reduce", "collective", 16, False],
                             ["dist.broadcast", "broadcast", "collective", 16, False],
                             ["ProcessGroup.allreduce", "all_reduce", "collective", 16, True],
                             ["Work.wait", "wait", "wait", 0, False],
                             ["dist.barrier", "barrier", "collective", 0, False]]
    assert out["after"] == len(out["events"]), "a call outside recording() was recorded"


def test_records_survive_a_replaced_runtime_log(child):
    _, records = child
    kept = [r for r in records if r.get("case") == "kept"]
    assert kept and kept[0]["value"] == 2.5 and kept[0]["rank"] == 0 and "time" in kept[0]


def test_a_ban_that_cannot_bind_stops_the_job(child):
    out, _ = child
    assert "cannot bind" in out["ban_error"] and "NoSuchWrapper" in out["ban_error"]
    assert out["refused"] == ["DistributedDataParallel is not allowed here: write it yourself",
                              ["DistributedDataParallel"]]


PAIR = r'''
import json, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
from gpucourse.run import comm_recorder
import torch.distributed._functional_collectives as funcol
rec = comm_recorder.install()
rank, other = dist.get_rank(), 1 - dist.get_rank()
alone = [dist.new_group([0]), dist.new_group([1])][rank]  # every rank takes part in creating every group
t, got = torch.ones(4), torch.empty(4)
with rec.recording():
    dist.all_reduce(t, group=alone)
    dist.all_reduce(t)
    funcol.all_reduce(t, "sum", alone).wait()  # the dispatcher, not a ProcessGroup method: placed by its argument
    alone._get_backend(torch.device("cpu")).allreduce([t]).wait()  # the backend, called directly
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, other), dist.P2POp(dist.irecv, got, other)]):
        work.wait()
    dist.send(t, 1) if rank == 0 else dist.recv(got, 0)
print("RESULT " + json.dumps([[e["via"], e["groups"], e["peers"]] for e in rec.events if e["kind"] != "wait"]))
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def pair() -> dict[int, list]:
    """{rank: [[via, groups, peers] of each call]} from a two-rank gloo group (two child processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", GLOO_SOCKET_IFNAME="lo")
    procs = {r: subprocess.Popen([sys.executable, "-c", PAIR], env={**base, "RANK": str(r)},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)}
    found = {}
    try:
        for r, proc in procs.items():
            out, err = proc.communicate(timeout=180)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, f"rank {r}: {out[-2000:]}{err[-3000:]}"
            found[r] = json.loads(lines[0].removeprefix("RESULT "))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return found


def test_every_call_is_placed_in_its_process_group(pair):
    """The process group each call ran on, as global ranks, through every layer; a send's and receive's global peer."""
    for rank, other in ((0, 1), (1, 0)):
        assert pair[rank] == [["dist.all_reduce", [[rank]], []],
                              ["dist.all_reduce", [[0, 1]], []],
                              ["functional_collectives.all_reduce", [[rank]], []],
                              ["Backend.allreduce", [[rank]], []],
                              ["dist.batch_isend_irecv", [[0, 1]], [other, other]],
                              ["dist.send" if rank == 0 else "dist.recv", [[0, 1]], [other]]], pair[rank]


@pytest.mark.parametrize("job, name", [("ex02_ddp", "BANNED"), ("ex07_fsdp", "FORBID"),
                                       ("ex07_sharded_optimizer", "FORBID")])
def test_every_graders_ban_binds_in_this_torch(job, name):
    module = importlib.import_module(f"gpucourse.tools.grading.graders.{job}")
    from gpucourse.tools.grading import jobkit

    assert jobkit.ban_targets(getattr(module, name))  # raises BanError, naming the target, when one does not bind
