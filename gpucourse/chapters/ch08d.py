"""Chapter 08d, training through failures: the lighthouse it starts, and the tables and figures it shows from its runs.

`notebooks/08d_training_through_failures.ipynb` imports it by its short name:

    from gpucourse.chapters import ch08d
    with ch08d.lighthouse() as lh:        # torchft's Lighthouse, in this process, shut down on every way out
        ...                               # launch the replica groups with TORCHFT_LIGHTHOUSE=lh.address
    ch08d.membership(runs)                # each replica group: its attempts, the steps it missed, its last step
    ch08d.short_steps(runs)               # the steps committed, and those with a replica missing

A run is a RunResult of one replica group (one launch); `runs` is {replica index: RunResult}. A table is a
`viz.tables.Table` (`@as_table`); a figure a matplotlib Figure that says where its numbers came from.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from ..models.units import human_bytes
from ..viz.plots import finished
from ..viz.tables import as_table


@dataclass(frozen=True)
class Lighthouse:
    """Where the replica groups find the lighthouse (their $TORCHFT_LIGHTHOUSE), and a folder to meet in before
    their first step (so that the first quorum has them all)."""
    address: str
    meeting: Path


@contextmanager
def lighthouse(*, join_timeout_ms: int = 10_000, heartbeat_timeout_ms: int = 2_000):
    """torchft's LighthouseServer, listening on 127.0.0.1 inside this process, for as long as the `with` block runs.

    It forms a quorum before each step of the replica groups: those whose Manager sent a heartbeat within
    heartbeat_timeout_ms (a dead replica is dropped after that long), at least one. Being a thread of this process,
    nothing of it outlives the block, nor the kernel. RUST_LOG defaults to "warn" (torchft logs each quorum at INFO).
    """
    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft's Rust extension loads
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=join_timeout_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    meeting = Path(tempfile.mkdtemp(prefix="gpucourse-08d-"))
    try:
        yield Lighthouse(f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}", meeting)
    finally:
        server.shutdown()
        shutil.rmtree(meeting, ignore_errors=True)


def steps(records: list[dict]) -> list[dict]:
    """A replica's step records (08d_survive.py logs one per step it ran), in order."""
    return [r for r in records if "step" in r and "replicas" in r]


def absence(records: list[dict]) -> dict:
    """What a replica's records say of its absence: the last step it committed before it died, the step it came
    back at (its first step after the restart), and the steps in between it missed. Raises if it never died."""
    before = [r["step"] for r in steps(records) if r["attempt"] == 0 and r["committed"]]
    after = [r["step"] for r in steps(records) if r["attempt"] > 0]
    if not after:
        raise ValueError("this replica has no step after a restart: it did not die, or never came back")
    last = max(before, default=-1)
    return {"last step before": last, "back at step": min(after), "steps missed": min(after) - last - 1}


@as_table
def membership(runs: dict) -> pd.DataFrame:
    """One row per replica group: its attempts (1 + torchrun's restarts), the steps it committed and those it ran
    but dropped (should_commit said no: a replica's all-reduce failed), the step its
    quorum first lacked a replica and the step every replica was back, the steps it missed itself, the batches
    torchft counted as committed over all replicas, and its final step. runs: {replica: RunResult}."""
    rows = []
    for replica, result in runs.items():
        recs = steps(result.metrics[0])
        alone = [r["step"] for r in recs if r["replicas"] < max(x["replicas"] for x in recs)]
        died = any(r["attempt"] > 0 for r in recs)
        rows.append({"replica": replica, "attempts": 1 + max(r["attempt"] for r in recs),
                     "steps committed": sum(r["committed"] for r in recs),
                     "steps dropped": sum(not r["committed"] for r in recs),
                     "first step short of a replica": min(alone, default=None),
                     "last step short of a replica": max(alone, default=None),
                     "steps it missed": absence(result.metrics[0])["steps missed"] if died else 0,
                     "batches committed (all replicas)": recs[-1]["batches"], "final step": recs[-1]["step"]})
    return pd.DataFrame(rows).set_index("replica")


def compared(runs: dict) -> dict:
    """The replica groups' parameters, step by step, from their logged digests, rank by rank (each rank's digest is of
    its shards: rank r of one group is compared with rank r of the others): the steps at which every rank of every
    group logged one, how many of those agree bit for bit on every rank, and how many of the ranks' steps with a peer
    group in the quorum passed the run's own bitwise check against it (`same`). runs: {replica: RunResult}."""
    ranks = sorted(set.intersection(*(set(result.metrics) for result in runs.values())))
    logged = [{(rank, r["step"]): r for rank in ranks for r in steps(result.metrics[rank]) if r["committed"]}
              for result in runs.values()]
    everywhere = set.intersection(*(set(m) for m in logged))  # (rank, step) that every group logged
    common = sorted(s for s in {s for _, s in everywhere} if all((rank, s) in everywhere for rank in ranks))
    agree = [s for s in common if all(len({m[rank, s]["digest"] for m in logged}) == 1 for rank in ranks)]
    back = [s for s in common if any(m[rank, s]["healed"] or m[rank, s]["attempt"] for m in logged for rank in ranks)]
    return {"steps all logged": len(common), "steps bit-identical": len(agree), "ranks compared": len(ranks),
            "first common step after a return": min(back, default=None),
            "in-run checks passed": sum(r["same"] for m in logged for r in m.values() if r["replicas"] > 1)}


def survivor(runs: dict) -> list[dict]:
    """The step records of a replica that never restarted (the first such): it logged every step the job committed,
    each with the size of its quorum. runs: {replica: RunResult}."""
    for result in runs.values():
        recs = steps(result.metrics[0])
        if recs and all(r["attempt"] == 0 for r in recs):
            return recs
    raise ValueError("every replica restarted: no one logged every committed step")


def short_steps(runs: dict) -> dict:
    """The job's committed steps, and how many of them it committed with a replica missing from the quorum (read from
    a replica that never died): the inputs of training.replica_loss for the run. runs: {replica: RunResult}."""
    committed = [r for r in survivor(runs) if r["committed"]]
    return {"replicas": len(runs), "steps": len(committed),
            "short": sum(r["replicas"] < len(runs) for r in committed)}


@as_table
def against_uninterrupted(runs: dict, batch: int) -> pd.DataFrame:
    """What the run kept of an uninterrupted one, counted: the committed steps (the same: the step count never went
    back) and the samples trained on (fewer: the dead replica's batches of the steps it missed were never trained
    on, nor given to anyone else). batch: samples per replica per step. runs: {replica: RunResult}."""
    recs = {replica: steps(result.metrics[0]) for replica, result in runs.items()}
    final = max(r[-1]["step"] for r in recs.values()) + 1
    replicas = len(runs)
    # from a replica that never died: the killed one has no records of the steps it missed
    trained = sum(r["replicas"] for r in survivor(runs) if r["committed"]) * batch
    rows = [{"quantity": "committed steps", "this run": final, "uninterrupted": final},
            {"quantity": "samples trained on", "this run": trained, "uninterrupted": final * replicas * batch}]
    for row in rows:
        row["difference"] = row["this run"] - row["uninterrupted"]
    return pd.DataFrame(rows).set_index("quantity")


def membership_plot(runs: dict, label: str = ""):
    """Each replica's step against wall-clock time, one marker per step: filled when every replica was in its quorum,
    hollow when some were missing. A gap is a replica that was dead; its line resumes at the step it recovered."""
    if not runs:
        raise ValueError("membership_plot needs {replica: RunResult}")
    recs = {replica: steps(result.metrics[0]) for replica, result in runs.items()}
    t0 = min(r[0]["t"] for r in recs.values() if r)
    full = max(x["replicas"] for r in recs.values() for x in r)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, (replica, rs) in enumerate(recs.items()):
        for attempt in sorted({r["attempt"] for r in rs}):
            mine = [r for r in rs if r["attempt"] == attempt]
            ax.plot([r["t"] - t0 for r in mine], [r["step"] for r in mine], "-", color=f"C{i}", lw=1,
                    label=f"replica {replica}" + (f", attempt {attempt}" if attempt else ""))
        for together, face in ((True, f"C{i}"), (False, "none")):
            pts = [r for r in rs if (r["replicas"] == full) == together]
            ax.scatter([r["t"] - t0 for r in pts], [r["step"] for r in pts], s=10, facecolors=face,
                       edgecolors=f"C{i}", linewidths=0.6)
    ax.set(xlabel="seconds since the first step", ylabel="step (torchft's committed count)")
    ax.set_title(f"replica groups through a failure: hollow = a replica missing from the quorum — {label}",
                 fontsize=9)
    ax.legend(fontsize=8)
    return finished(fig)


def finals(results: dict) -> dict:
    """{name: final record} of DiLoCo-vs-DDP runs (08d_diloco.py's last record). results: {name: RunResult}."""
    found = {}
    for name, result in results.items():
        last = [r for r in result.metrics[0] if r.get("final")]
        if not last:
            raise ValueError(f"{name}: no final record (did the run fail?)")
        found[name] = last[-1]
    return found


@as_table
def communication(results: dict) -> pd.DataFrame:
    """One row per mode (ddp, diloco): training steps, all-reduces and bytes each replica sent into them (counted
    from every tensor handed to torchft's all-reduce), bytes per step against the parameters' size, the held-out
    loss of the final model, and whether all its replicas ended bit-identical. results: {"ddp0": RunResult, ...}."""
    fin = finals(results)
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in fin.values()):
        mine = [f for f in fin.values() if f["mode"] == mode]
        steps_run = max(len(steps_logged(res)) for name, res in results.items() if fin[name]["mode"] == mode)
        one = mine[0]
        rows.append({"mode": mode, "replicas": len(mine), "steps": steps_run, "all-reduces": one["calls"],
                     "bytes sent per replica": human_bytes(one["bytes"]),
                     "bytes per step / parameter bytes": round(one["bytes"] / steps_run / one["param_bytes"], 3),
                     "held-out loss": round(one["held_out"], 4),
                     "replicas identical": len({f["digest"] for f in mine}) == 1})
    return pd.DataFrame(rows).set_index("mode")


def steps_logged(result) -> list[dict]:
    """08d_diloco.py's per-step records of one replica."""
    return [r for r in result.metrics[0] if "step" in r and "loss" in r and not r.get("final")]


def trade(results: dict) -> dict:
    """DiLoCo against DDP, computed from the runs: how many times fewer bytes DiLoCo sent, and its held-out loss
    relative to DDP's (ratio > 1: worse). results: {"ddp0": RunResult, ..., "diloco0": ...}."""
    fin = finals(results)
    by_mode = {f["mode"]: f for f in fin.values()}
    ddp, diloco = by_mode["ddp"], by_mode["diloco"]
    return {"bytes ratio": ddp["bytes"] / diloco["bytes"], "loss ratio": diloco["held_out"] / ddp["held_out"],
            "ddp loss": ddp["held_out"], "diloco loss": diloco["held_out"]}


def loss_plot(results: dict, sync_every: int, label: str = ""):
    """The training loss per step, averaged over each mode's replicas (a light line: every 10 steps' mean), DDP
    against DiLoCo, with DiLoCo's syncs marked. results: {"ddp0": RunResult, ...}."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    modes = {}
    for name, result in results.items():
        for r in steps_logged(result):
            modes.setdefault(r["mode"], {}).setdefault(r["step"], []).append(r["loss"])
    for i, (mode, by_step) in enumerate(modes.items()):
        xs = sorted(by_step)
        ys = [sum(by_step[s]) / len(by_step[s]) for s in xs]
        ax.plot(xs, ys, color=f"C{i}", lw=0.6, alpha=0.5)
        ax.plot(xs[9::10], [sum(ys[j - 9:j + 1]) / 10 for j in range(9, len(ys), 10)], "o-", color=f"C{i}",
                ms=3, label=f"{mode} (mean of 10 steps)")
    last = max(max(m) for m in modes.values())
    for s in range(sync_every - 1, last + 1, sync_every):
        ax.axvline(s, color="grey", lw=0.4, ls=":")
    ax.set_yscale("log")
    ax.set(xlabel="step (dotted: a DiLoCo sync)", ylabel="training loss (replicas' mean)")
    ax.set_title(f"synchronous data parallelism against DiLoCo, same data — {label}", fontsize=9)
    ax.legend(fontsize=8)
    return finished(fig)


def _dead_peer():
    """A stand-in for what torchft's _ManagedWork uses of a Manager (it records the error), and a work that fails as
    gloo's does when the peer's process died mid-all-reduce."""
    import torch.distributed as dist

    class Log:
        def exception(self, msg):  # torchft logs the error here
            pass

    class Manager:
        _logger, _pg, error = Log(), None, None

        def report_error(self, e):
            self.error = e

    class PeerGone(dist._Work):
        def wait(self, timeout=None):
            raise RuntimeError("Connection closed by peer")

    return Manager(), PeerGone


def torchft_hook_on_a_dead_peer() -> dict:
    """The smallest reproduction of why 08d_survive.py does not replicate through torchft's DistributedDataParallel
    (torchft 0.2.0 on gloo).

    torchft.ddp.DistributedDataParallel's hook calls `work.wait()` on the Manager's all-reduce, then asserts that the
    work's future chain was set up (`assert fut._fut`). Given a work whose wait() raises as gloo's does when the peer's
    process is gone, torchft's `_ManagedWork.wait` records the error for should_commit and returns False before it
    sets up the chain: the assert then fails in the survivor, which dies with the replica it should outlive. Returns
    what that hook sees: {"wait returned", "future set up", "error recorded"}. Runs in this process, starts nothing.
    """
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust extension loads (it reads it once)
    import torch
    from torchft.manager import _ManagedWork

    manager, PeerGone = _dead_peer()
    work = _ManagedWork(manager, PeerGone(), torch.zeros(4))
    waited = work.wait()
    return {"wait returned": waited, "future set up": work.get_future()._fut is not None,
            "error recorded": str(manager.error)}


def fsdp_hook_on_a_dead_peer() -> dict:
    """The same dead peer on the path 08d_survive.py takes (torchft's HSDP): FSDP2's all-reduce hook calls
    `dist.all_reduce(shard, group=ManagedProcessGroup(manager))`; torchft's ManagedProcessGroup hands the shard to the
    Manager's all-reduce, whose work is the same `_ManagedWork`, and torch's all_reduce only waits on it: the error is
    recorded for should_commit, False is returned, and nothing after it asserts. Returns {"all_reduce returned",
    "error recorded"}. Runs in this process, starts nothing."""
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust extension loads (it reads it once)
    import torch
    import torch.distributed as dist
    from torchft.manager import _ManagedWork
    from torchft.process_group import ManagedProcessGroup

    manager, PeerGone = _dead_peer()
    manager.allreduce = lambda tensor, reduce_op: _ManagedWork(manager, PeerGone(), tensor)
    dist.all_reduce(torch.zeros(4), group=ManagedProcessGroup(manager), op=dist.ReduceOp.AVG)
    return {"all_reduce returned": True, "error recorded": str(manager.error)}
