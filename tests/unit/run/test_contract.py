"""The one "failed by itself" rule (contract.stopped / failed_by_itself), shared by the launcher's blame (root_rank,
failure_kind) and forensics' reader (diagnose), and the two verdicts of one crash agreeing."""
import json

from gpucourse.run import contract, forensics
from gpucourse.run.contract import OWN, PEER, STOPPED, failed_by_itself, failure_kind, root_rank, stopped


def _failure(rank, exitcode, timestamp=100, message=""):
    return {"rank": rank, "local_rank": rank, "exitcode": exitcode, "pid": 1000 + rank,
            "signal": contract.signal_name(exitcode) or "<N/A>", "timestamp": timestamp, "message": message}


def test_the_rule():
    assert contract.signal_name(-9) == "SIGKILL" and contract.signal_name(1) == "" and contract.signal_name(None) == ""
    # Its own: an exit code, a crash signal, a SIGKILL with nothing stopped yet (or without the timestamps to tell).
    for code in (1, 3, -6, -11):
        assert not stopped(code) and failed_by_itself(code)
    assert not stopped(-9) and not stopped(-9, 100, 100) and not stopped(-9, 99, 100)
    assert not stopped(-9, 101, 100) and not stopped(-9, 110, 100)  # stamped when torchrun noticed: its own still
    # Stopped: torchrun's SIGTERM (or what it forwards), and its SIGKILL after the grace period, later than another
    # rank's failure.
    for code in (-15, -2, -1):
        assert stopped(code) and not failed_by_itself(code)
    assert stopped(-9, 131, 100)
    assert not failed_by_itself(0) and not failed_by_itself(None)


def test_the_grace_period_is_torchruns():
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext
    for f in (LocalElasticAgent._shutdown, PContext.close):
        assert inspect.signature(f).parameters["timeout"].default == contract.TORCHRUN_KILL_AFTER_S


def test_kinds_and_root_rank_follow_the_rule():
    own = {"message": "RuntimeError: boom", "traceback": "..."}
    peer = {"message": "RuntimeError: Connection closed by peer [127.0.0.1]:1234", "traceback": "..."}
    # Rank 1 raised; torchrun SIGTERMed rank 0 and SIGKILLed rank 2 after its grace period: both bystanders.
    job = [_failure(0, -15), _failure(1, 1, message=own), _failure(2, -9, timestamp=130)]
    assert [failure_kind(f, job) for f in job] == [STOPPED, OWN, STOPPED] and root_rank(job) == 1
    # Chapter 08b's crash: rank 1 SIGKILLs itself, the others report its death: rank 1 is the root cause.
    job = [_failure(0, 1, timestamp=101, message=peer), _failure(1, -9), _failure(2, 1, timestamp=101, message=peer)]
    assert [failure_kind(f, job) for f in job] == [PEER, OWN, PEER] and root_rank(job) == 1
    # The same under load: rank 1 stamped when torchrun noticed its death, a second after the peers had raised.
    job = [_failure(0, 1, timestamp=100, message=peer), _failure(1, -9, 101), _failure(2, 1, 100, message=peer)]
    assert [failure_kind(f, job) for f in job] == [PEER, OWN, PEER] and root_rank(job) == 1


def test_forensics_blames_with_the_same_rule(tmp_path, monkeypatch):
    """A rank that left no dump is a crash when it failed by itself, missing when torchrun stopped it: the same
    SIGKILL reads both ways, by the exit file's timestamps, as it does for the launcher's root cause."""
    def fault(rank_end):
        ranks = {0: [0], 1: [0], 2: [0, 1]}  # rank 2 is in collective #1, ranks 0 and 1 never reached it
        dumps = {r: {"entries": [{"record_id": s, "collective_seq_id": s, "profiling_name": "gloo:all_reduce",
                                  "process_group": ("0", "default_pg"), "input_sizes": [[4]], "is_p2p": False,
                                  "time_created_ns": 0} for s in seqs]} for r, seqs in ranks.items() if r != 1}
        stacks = {0: {"stack": [{"file": "/x/torch/distributed/c10d.py", "line": 1, "code": "wait"}]}, 2: None}
        monkeypatch.setattr(forensics, "_load", lambda run_dir, world: (dumps, stacks))
        failures = [_failure(0, -15, 101), rank_end, _failure(2, -15, 101)]
        contract.exit_file(tmp_path).write_text(json.dumps({"status": "failed", "root_rank": root_rank(failures),
                                                            "failures": failures}))
        found = forensics.diagnose(tmp_path, 3, {f["rank"]: f["exitcode"] for f in failures})
        return found.ranks, found.kind, failure_kind(rank_end, failures)

    assert fault(_failure(1, -9, 100)) == ([1], "crash", OWN)  # killed first: its own end, by both readings
    assert fault(_failure(1, -9, 102)) == ([1], "crash", OWN)  # stamped late (CI's failure): still its own
    assert fault(_failure(1, -9, 131)) == ([1], "missing", STOPPED)  # SIGKILLed by torchrun: not a crash
