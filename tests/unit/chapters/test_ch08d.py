"""What chapter 08d (training through failures) shows, `gpucourse/chapters/ch08d.py`, built from hand-made records."""
import socket

import pytest
from matplotlib.figure import Figure

from gpucourse.chapters import ch08d


class Run:  # what ch08d reads of a RunResult
    def __init__(self, records, *more_ranks):
        self.metrics = dict(enumerate([records, *more_ranks]))


def step(s, replicas, attempt=0, committed=True, digest="d", healed=False, t=None):
    return {"step": s, "replicas": replicas, "attempt": attempt, "committed": committed, "digest": f"{digest}{s}",
            "healed": healed, "same": True, "batches": 0, "t": float(s if t is None else t), "loss": 1.0}


def survive_runs():
    """Replica 1 dies in step 3 (its all-reduce fails everywhere: step 3 dropped), is back at step 6."""
    r0 = [step(s, 2) for s in range(3)] + [step(3, 2, committed=False)] + [step(s, 1) for s in range(3, 6)]
    r0 += [step(s, 2) for s in range(6, 9)]
    r1 = [step(s, 2) for s in range(3)] + [step(s, 2, attempt=1, healed=s == 6) for s in range(6, 9)]
    for i, r in enumerate(r0):
        r["batches"] = i
    r1[-1]["batches"] = r0[-1]["batches"]
    return {0: Run(r0), 1: Run(r1)}


def test_absence_counts_the_steps_between_the_last_commit_and_the_return():
    assert ch08d.absence(survive_runs()[1].metrics[0]) == {"last step before": 2, "back at step": 6,
                                                           "steps missed": 3}
    with pytest.raises(ValueError, match="did not die"):
        ch08d.absence(survive_runs()[0].metrics[0])


def test_membership_shows_who_restarted_and_who_stepped_alone():
    df = ch08d.membership(survive_runs())
    assert df.loc[0, "attempts"] == 1 and df.loc[1, "attempts"] == 2
    assert df.loc[0, "steps dropped"] == 1 and df.loc[0, "steps committed"] == 9
    assert df.loc[0, "first step short of a replica"] == 3 and df.loc[0, "last step short of a replica"] == 5
    assert df.loc[1, "steps it missed"] == 3 and df.loc[0, "steps it missed"] == 0
    assert df.loc[0, "final step"] == df.loc[1, "final step"] == 8


def test_compared_finds_a_step_whose_digests_differ():
    runs = survive_runs()
    same = ch08d.compared(runs)
    assert same["steps all logged"] == same["steps bit-identical"] == 6
    assert same["first common step after a return"] == 6
    runs[1].metrics[0][-1]["digest"] = "other"
    assert ch08d.compared(runs)["steps bit-identical"] == 5


def test_compared_checks_each_rank_against_the_same_rank_of_the_other_groups():
    def sharded():  # two ranks a group: rank 1's digests are its own shards'
        runs = survive_runs()
        for run in runs.values():
            run.metrics[1] = [{**r, "digest": "rank1-" + r["digest"]} for r in run.metrics[0]]
        return runs

    same = ch08d.compared(sharded())
    assert same["ranks compared"] == 2 and same["steps all logged"] == same["steps bit-identical"] == 6
    assert same["in-run checks passed"] == 2 * ch08d.compared(survive_runs())["in-run checks passed"]
    runs = sharded()
    runs[1].metrics[1][-1]["digest"] = "other"  # rank 1 of replica 1 differs at its last step; rank 0 agrees
    assert ch08d.compared(runs)["steps bit-identical"] == 5
    runs = sharded()
    del runs[0].metrics[1][-1]  # a step rank 1 of replica 0 never logged is no common step
    assert ch08d.compared(runs)["steps all logged"] == 5


def test_against_uninterrupted_counts_the_samples_the_dead_replica_never_trained_on():
    df = ch08d.against_uninterrupted(survive_runs(), 16)
    assert df.loc["committed steps", "difference"] == 0 and df.loc["committed steps", "this run"] == 9
    # 6 steps with 2 replicas, 3 alone, 1 dropped: 15 batches of 16 against 9 x 2
    assert df.loc["samples trained on", "this run"] == 15 * 16
    assert df.loc["samples trained on", "difference"] == (15 - 18) * 16


def test_the_samples_lost_are_read_from_a_replica_that_never_died_whichever_was_killed():
    from gpucourse.models import training

    runs = survive_runs()
    assert ch08d.short_steps(runs) == {"replicas": 2, "steps": 9, "short": 3}
    swapped = {0: runs[1], 1: runs[0]}  # the killed replica is replica 0: its records lack the steps it missed
    assert ch08d.short_steps(swapped) == ch08d.short_steps(runs)
    for which in (runs, swapped):
        df = ch08d.against_uninterrupted(which, 16)
        assert df.loc["samples trained on", "this run"] == 15 * 16
        lost = -df.loc["samples trained on", "difference"] / df.loc["samples trained on", "uninterrupted"]
        assert lost == pytest.approx(training.replica_loss(2, 3, 9)["samples"])  # the problem's formula
    with pytest.raises(ValueError, match="every replica restarted"):
        ch08d.short_steps({1: runs[1]})


def test_membership_plot_draws_each_attempt():
    fig = ch08d.membership_plot(survive_runs(), "cpu · gloo · 1 rank")
    assert isinstance(fig, Figure) and len(fig.axes[0].lines) == 3
    with pytest.raises(ValueError):
        ch08d.membership_plot({})


def diloco_runs(steps=20, sync=5, params=100):
    runs = {}
    for mode in ("ddp", "diloco"):
        calls = steps if mode == "ddp" else steps // sync * 3
        sent = params * 4 * (steps if mode == "ddp" else steps // sync)
        for r in range(2):
            recs = [{"step": s, "loss": 1.0 / (s + 1), "mode": mode} for s in range(steps)]
            recs.append({"final": True, "mode": mode, "held_out": 0.1 if mode == "ddp" else 0.15, "digest": mode,
                         "params": params, "param_bytes": params * 4, "calls": calls, "bytes": sent})
            runs[f"{mode}{r}"] = Run(recs)
    return runs


def test_communication_and_trade_are_computed_from_the_runs():
    df = ch08d.communication(diloco_runs())
    assert df.loc["ddp", "bytes per step / parameter bytes"] == 1.0
    assert df.loc["diloco", "bytes per step / parameter bytes"] == 0.2
    assert bool(df.loc["diloco", "replicas identical"]) and df.loc["diloco", "steps"] == 20
    cost = ch08d.trade(diloco_runs())
    assert cost["bytes ratio"] == 5 and cost["loss ratio"] == pytest.approx(1.5)
    broken = diloco_runs()
    broken["ddp1"].metrics[0].pop()
    with pytest.raises(ValueError, match="ddp1"):
        ch08d.finals(broken)


def test_loss_plot_marks_the_syncs():
    fig = ch08d.loss_plot(diloco_runs(), 5, "cpu · gloo · 1 rank")
    assert isinstance(fig, Figure) and len(fig.axes[0].lines) == 4 + 4  # 2 modes x 2 lines, 4 syncs


def test_lighthouse_listens_on_loopback_and_is_gone_after_the_block():
    pytest.importorskip("torchft")
    with ch08d.lighthouse() as lh:
        host, port = lh.address.removeprefix("http://").rsplit(":", 1)
        assert host == "127.0.0.1" and lh.meeting.is_dir()
        socket.create_connection((host, int(port)), timeout=5).close()
    assert not lh.meeting.exists()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5).close()


def test_torchft_hook_on_a_dead_peer_reproduces_the_missing_future():
    pytest.importorskip("torchft")
    seen = ch08d.torchft_hook_on_a_dead_peer()
    assert seen == {"wait returned": False, "future set up": False, "error recorded": "Connection closed by peer"}


def test_fsdp_hook_on_a_dead_peer_returns_with_the_error_recorded():
    pytest.importorskip("torchft")
    assert ch08d.fsdp_hook_on_a_dead_peer() == {"all_reduce returned": True,
                                                "error recorded": "Connection closed by peer"}
