"""In the launcher's process (a notebook, the CLI): hang forensics, asking the ranks for their Flight Recorder dumps and
reading them back: what every rank saw when a job stalled, timed out or failed, and whom it blames.

torch's Flight Recorder keeps each rank's recent collectives (op, process group, sequence id, sizes) in a ring
buffer when TORCH_FR_BUFFER_SIZE is set; the launcher sets it for every job (gloo records too, torch 2.13).
Collected into the run directory (rank side: run/capture.py's `start`, run by runtime.setup; launcher side:
`request_dumps`):

    forensics/fr/rank_<r>          the Flight Recorder dump, as torch writes it (pickle): read by `diagnose` and by
                                   torch's own analyser, `python -m torch.distributed.flight_recorder.fr_trace DIR`
    forensics/stacks/rank<r>.json  the rank's main-thread Python stack at that moment, and why it dumped

A rank dumps when the launcher asks (a request file it polls for, so a rank blocked inside a collective answers:
the collective's wait releases the GIL) and when an exception ends it (runtime's excepthook).

`diagnose(run_dir)` reads the dumps of every process group (the default one, and subgroups: a DeviceMesh
dimension's TP or DP groups, whose global ranks each rank files in its dump) and names the fault and its group:
    missing     a rank never entered the collective the others wait in (it waits in another one, or it left)
    straggler   the same, but the rank is busy in its own code, not in any collective
    crash       a rank died (a signal, an exit) without entering it, or in the middle of it
    order       at the same sequence number the ranks called different collectives
    shape       the same collective with different sizes (in the dumps, or in gloo's abort of the rank that
                received a message of another size: that rank leaves no dump). A smaller call in a rank's LAST
                collective can complete on gloo; the rank then ends and takes its dump with it, and the fault
                reads as missing (the evidence says both readings)
    rendezvous  no rank got as far as a process group (a wrong address, port or world size)
and "unknown" when the dumps show none of these (every rank in the same collective, or no dump at all). In a
subgroup the hang spreads: a rank stuck in its TP group's collective leaves its DP peers waiting in theirs. Each
rank waits in the last collective it called until every rank of that group has called it; the culprits are the
ranks that hold others up and wait on no one, named with the first collective (in program order) held up by them.

`arrivals(run_dir)` reads the same dumps of a run that did not hang: when each rank called each collective, from
which chapter 08c finds a rank that is slow, not stuck (models.training.straggler).
"""
from __future__ import annotations

import contextlib
import json
import pickle
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The in-rank capture, named here too (gpucourse.run.forensics.dump, .enabled, ... as before the split).
from .capture import FR_BUFFER_ENV, FR_ENTRIES, POLL_S, dump, enabled, start  # noqa: F401
from .contract import (EVENT_SETUP, EVENT_TEARDOWN, exit_failures, failed_by_itself, forensics_dir,  # noqa: F401
                       fr_file, manifest_file, metrics_file, request_file, stack_file)

WAIT_S = 5.0  # how long the launcher waits for the ranks' dumps before it stops them
RECENT_S = 15.0  # a request this recent is not repeated
GLOO_SIZE_MISMATCH = "Received data size doesn't match expected size"
KINDS = ("missing", "straggler", "crash", "order", "shape", "rendezvous")


# --- in the launcher ----------------------------------------------------------------------------------------------
def request_dumps(run_dir: Path, ranks: list[int], why: str, running=None, wait_s: float = WAIT_S) -> list[int]:
    """Ask `ranks` for their dumps and wait (at most wait_s) until each has answered, or has ended (`running()`:
    the ranks still alive, when the caller can tell). Only ranks past runtime.setup() can answer; a request made
    less than RECENT_S ago is not repeated. Returns the ranks that did not answer."""
    request = request_file(run_dir)
    with contextlib.suppress(OSError):
        if time.time() - request.stat().st_mtime < RECENT_S:
            return []  # asked a moment ago (the launcher, before it stopped the job): the dumps are there
    request.parent.mkdir(parents=True, exist_ok=True)
    asked_at = time.time()
    request.write_text(f"{why} at {asked_at:.3f}\n")  # also the mark that the run was asked (diagnose reads it)
    # Only a rank past runtime.setup() listens; the others (a rendezvous that never formed) cannot answer.
    ranks = sorted(set(ranks) & _ranks_with_event(run_dir, max(ranks, default=-1) + 1, EVENT_SETUP))
    deadline = time.monotonic() + wait_s
    missing = list(ranks)
    while missing and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = set(running()) if running else set(missing)
        missing = [r for r in missing if r in alive and not _dumped_since(run_dir, r, asked_at)]
    return missing


def _dumped_since(run_dir: Path, rank: int, when: float) -> bool:
    path = stack_file(run_dir, rank)
    try:
        return json.loads(path.read_text())["time"] >= when and fr_file(run_dir, rank).exists()
    except (OSError, ValueError, KeyError):
        return False


# --- reading the dumps --------------------------------------------------------------------------------------------
@dataclass
class Diagnosis:
    """Whom the dumps blame: `ranks` (global), the collective's `op` and sequence number `seq_id` in its process
    group, the fault's `kind` (KINDS), and the `evidence`, one line per rank. The group: `group`, its description
    ("default_pg", or "mesh_tp" for a DeviceMesh dimension's group), `group_ranks`, its members' global ranks, and
    `mesh_dim`, the mesh dimension's name where the group is one ("tp"), else None."""

    ranks: list[int]
    op: str | None
    seq_id: int | None
    kind: str
    evidence: list[str] = field(default_factory=list)
    group: str | None = None
    group_ranks: list[int] = field(default_factory=list)
    mesh_dim: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def where(self) -> str:
        """'mesh_tp [0, 1] (mesh dimension tp)': the process group, '' when none is known."""
        if self.group is None:
            return ""
        return f"{self.group} {self.group_ranks}" + (f" (mesh dimension {self.mesh_dim})" if self.mesh_dim else "")

    def __str__(self) -> str:
        who = ", ".join(map(str, self.ranks)) or "none"
        what = f"{self.op} #{self.seq_id}" if self.op else "no collective"
        what += f" in {self.where()}" if self.group is not None and self.op else ""
        return f"{self.kind}: rank(s) {who} ({what})\n" + "\n".join(f"  {line}" for line in self.evidence)


def _load(run_dir: Path, world: int) -> tuple[dict, dict]:
    """({rank: Flight Recorder dump}, {rank: stack record}) of the ranks that dumped."""
    dumps, stacks = {}, {}
    for rank in range(world):
        try:
            dumps[rank] = pickle.loads(fr_file(run_dir, rank).read_bytes())  # written by torch, in this run dir
            stacks[rank] = json.loads(stack_file(run_dir, rank).read_text())
        except (OSError, ValueError, EOFError, pickle.UnpicklingError):
            dumps.pop(rank, None)
    return dumps, stacks


def read_dumps(run_dir: Path, world: int) -> dict[int, dict | None]:
    """{rank: its Flight Recorder dump as torch wrote it (unpickled), or None where it left none}: what exercise
    ex08_read_the_dumps's `diagnose` reads."""
    dumps, _ = _load(Path(run_dir), world)
    return {rank: dumps.get(rank) for rank in range(world)}



def arrivals(run_dir: str | Path, world: int | None = None, group: str = "default_pg") -> dict[int, dict[int, float]]:
    """{sequence id: {rank: when it called that collective (seconds, time.time()'s clock)}} of one process group's
    collectives (`group`: its description), from the dumps every rank left: the Flight Recorder's time_created_ns.
    A slow rank calls each collective late; the others wait for it there (chapter 08c). Ranks on other hosts
    need synchronised clocks for this to mean anything."""
    run_dir = Path(run_dir)
    if world is None:
        world = int(json.loads(manifest_file(run_dir).read_text()).get("world_size", 0))
    dumps, _ = _load(run_dir, world)
    seqs, _ = _collectives(dumps, world)
    out: dict[int, dict[int, float]] = {}
    for rank, by_group in seqs.items():
        for g, entries in by_group.items():
            if g.desc == group:
                for seq, entry in entries.items():
                    out.setdefault(seq, {})[rank] = entry["time_created_ns"] / 1e9
    return dict(sorted(out.items()))

DEFAULT_PG = "default_pg"


@dataclass(frozen=True)
class _Group:
    """A process group as the dumps name it: torch's name for it, its description and its members (global)."""

    name: str
    desc: str
    ranks: tuple[int, ...]

    @property
    def mesh_dim(self) -> str | None:
        return self.desc[len("mesh_"):] if self.desc.startswith("mesh_") else None  # DeviceMesh's group_desc

    def __str__(self) -> str:
        return f"{self.desc} {list(self.ranks)}"


def _groups_of(dump: dict, rank: int, world: int, seen: dict[str, set]) -> dict[str, _Group]:
    """{name: _Group} of the groups a rank's dump names: members from its pg_config (the in-rank capture,
    capture._named_groups, files every group's global ranks), else every rank for the default group and, for another,
    the ranks whose dumps name it (`seen`: all a reader can tell from a dump torch wrote alone)."""
    import ast

    config, out = dump.get("pg_config", {}), {}
    for entry in dump.get("entries", []):
        name, desc = entry.get("process_group", ("", ""))
        if name in out:
            continue
        try:
            ranks = tuple(sorted(int(r) for r in ast.literal_eval(config.get(name, {}).get("ranks") or "[]")))
        except (ValueError, SyntaxError, TypeError):
            ranks = ()
        if rank not in ranks:
            ranks = tuple(range(world)) if desc == DEFAULT_PG else tuple(sorted(seen.get(name, {rank})))
        out[name] = _Group(name, desc, ranks)
    return out


def _collectives(dumps: dict[int, dict], world: int) -> tuple[dict, list]:
    """({rank: {_Group: {sequence id: entry}}}, {rank: [(_Group, sequence id)] in the order the rank called them})
    of every process group's collectives (point-to-point left out)."""
    seen: dict[str, set] = {}
    for rank, dump in dumps.items():
        for entry in dump.get("entries", []):
            seen.setdefault(entry.get("process_group", ("", ""))[0], set()).add(rank)
    seqs, order = {}, {}
    for rank, dump in dumps.items():
        groups = _groups_of(dump, rank, world, seen)
        seqs[rank], order[rank] = {}, []
        for entry in sorted(dump.get("entries", []), key=lambda e: e.get("record_id", 0)):
            if entry.get("is_p2p"):
                continue
            group = groups[entry.get("process_group", ("", ""))[0]]
            seqs[rank].setdefault(group, {})[entry["collective_seq_id"]] = entry
            order[rank].append((group, entry["collective_seq_id"]))
    return seqs, order


def _op(entry: dict) -> str:
    return entry["profiling_name"].split(":", 1)[-1]  # "gloo:all_reduce" -> "all_reduce"


def _sizes(entry: dict) -> str:
    return str(entry.get("input_sizes"))


def _where(stack: dict | None) -> tuple[bool, str]:
    """(waiting inside torch.distributed, the innermost frame of the rank's own code) from a stack record."""
    frames = (stack or {}).get("stack", [])
    in_dist = any("torch/distributed" in f["file"] for f in frames[-6:])
    own = [f for f in frames if "site-packages" not in f["file"] and "/torch/" not in f["file"]
           and "gpucourse/run" not in f["file"]]
    top = own[-1] if own else (frames[-1] if frames else None)
    return in_dist, (f"{Path(top['file']).name}:{top['line']} {top['code']}".strip() if top else "no stack")


def _majority(signatures: dict[int, str]) -> list[int]:
    """The ranks outside the largest group of equal signatures (all of them when no group is largest)."""
    counts = Counter(signatures.values()).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return sorted(signatures)
    return sorted(r for r, s in signatures.items() if s != counts[0][0])


def diagnose(run_dir: str | Path, world: int | None = None, exits: dict[int, int | None] | None = None) -> Diagnosis:
    """Read a run's dumps (and, where given, each rank's exit code: non-zero means it died, unless torchrun stopped
    it: contract.failed_by_itself, with the run's exit files for context) and name
    the fault and its process group (the default group, or a subgroup: a DeviceMesh dimension's TP or DP group).
    The world size is read from the run's manifest unless given."""
    run_dir = Path(run_dir)
    if world is None:
        world = int(json.loads(manifest_file(run_dir).read_text()).get("world_size", 0))
    exits = exits or {}
    dumps, stacks = _load(run_dir, world)
    if not dumps:
        started = _ranks_with_event(run_dir, world, EVENT_SETUP)
        if not started:
            return Diagnosis(sorted(range(world)), None, None, "rendezvous",
                             ["no rank formed a process group (none reached runtime.setup's record): check the "
                              "master address and port, and that every node starts the same world size"])
        return Diagnosis([], None, None, "unknown", ["no rank left a Flight Recorder dump"])
    seqs, order = _collectives(dumps, world)
    before = _program_order(order, seqs)
    found = _mismatch(seqs, before)
    if found:
        return found
    return _blocked(run_dir, world, exits, dumps, stacks, seqs, order, before)


def _in(group: _Group) -> dict:
    return {"group": group.desc, "group_ranks": list(group.ranks), "mesh_dim": group.mesh_dim}


def _program_order(order: dict, seqs: dict):
    """A sort key for (group, sequence id): the order the ranks' program calls them in (every rank runs the same
    program: a group's collective #k comes before another group's #j on any rank that called both), and where no
    rank called both, the time the first rank called it."""
    import functools

    position = {r: {(g.desc, seq): i for i, (g, seq) in enumerate(calls)} for r, calls in order.items()}
    created = {}
    for r, by_group in seqs.items():
        for g, entries in by_group.items():
            for seq, e in entries.items():
                t = e.get("time_created_ns") or 0
                created[(g.desc, seq)] = min(created.get((g.desc, seq), t), t)

    def compare(a, b):
        a, b = (a[0].desc, a[1]), (b[0].desc, b[1])
        if a[0] == b[0]:
            return (a[1] > b[1]) - (a[1] < b[1])
        for pos in position.values():
            if a in pos and b in pos:
                return (pos[a] > pos[b]) - (pos[a] < pos[b])
        return (created.get(a, 0) > created.get(b, 0)) - (created.get(a, 0) < created.get(b, 0))

    return functools.cmp_to_key(compare)


def _mismatch(seqs: dict, before) -> Diagnosis | None:
    """The first collective (in program order) at which a group's ranks called different operations (order) or
    sizes (shape): the ranks outside the majority, counted over every group of its kind (a mesh dimension's
    groups run the same collectives: in a 2-rank TP group, the TP groups of the other ranks break the tie)."""
    groups = {g for by_group in seqs.values() for g in by_group}
    family = {g: [h for h in groups if h.desc == g.desc and g.desc != "undefined"] or [g] for g in groups}
    found = []
    for group in groups:
        for seq in sorted({seq for r in group.ranks for seq in seqs.get(r, {}).get(group, {})}):
            at = {r: seqs[r][group][seq] for r in group.ranks if seq in seqs.get(r, {}).get(group, {})}
            hit = next(((kind, sig) for kind, sig in (("order", _op), ("shape", _sizes))
                        if len({sig(e) for e in at.values()}) > 1), None)
            if hit:
                found.append((group, seq, at, *hit))
                break
    if not found:
        return None
    group, seq, at, kind, sig = min(found, key=lambda f: before((f[0], f[1])))
    peers = {r: sig(seqs[r][h][seq]) for h in family[group] for r in h.ranks if seq in seqs.get(r, {}).get(h, {})}
    ranks = [r for r in _majority(peers) if r in at] or _majority({r: sig(e) for r, e in at.items()})
    evidence = [f"rank {r}: {_op(e)} #{seq} in {group}, sizes {_sizes(e)}" for r, e in sorted(at.items())]
    if len(peers) > len(at):
        evidence.append(f"the other {group.desc} groups' ranks at #{seq}: " + ", ".join(
            f"rank {r} {v}" for r, v in sorted(peers.items()) if r not in at))
    op = _op(at[min(set(at) - set(ranks), default=min(at))]) if kind == "order" else _op(next(iter(at.values())))
    return Diagnosis(ranks, op, seq, kind, evidence, **_in(group))


def _blocked(run_dir, world, exits, dumps, stacks, seqs, order, before) -> Diagnosis:
    """Who waits on whom: each rank that dumped waits in the last collective it called until every rank of its
    group has called it; a rank that never did (it left, it waits in another group's collective, it is busy in
    its own code) blocks it. The culprits are the ranks that block others and wait on no one; the collective
    named is the first (in program order) that waits on them."""
    def reached(rank, group, seq):
        return rank in seqs and max(seqs[rank].get(group, {0: None}), default=0) >= seq

    waits = {}  # rank -> (group, seq, the ranks it waits on)
    for rank, calls in order.items():
        if calls:
            group, seq = calls[-1]
            blockers = [p for p in group.ranks if not reached(p, group, seq)]
            if blockers:
                waits[rank] = (group, seq, blockers)
    if not waits:
        default = next((g for by_group in seqs.values() for g in by_group if g.desc == DEFAULT_PG), None)
        top = max((max(seqs[r][default]) for r in seqs if default in seqs[r]), default=None) if default else None
        op = _op(seqs[min(r for r in seqs if default in seqs[r])][default][top]) if top else None
        return Diagnosis([], op, top, "unknown", ["every rank entered the last collective recorded"],
                         **(_in(default) if default else {}))
    blocking = {p for _, _, blockers in waits.values() for p in blockers}
    roots = {p for p in blocking if p not in waits} or blocking  # a cycle: blame all of it
    group, seq = min(((g, s) for g, s, b in waits.values() if roots & set(b)), key=before)
    entered = seqs[min(r for r in group.ranks if reached(r, group, seq))][group][seq]
    op = _op(entered)
    culprits = sorted(p for p in roots if not reached(p, group, seq) and p in group.ranks)
    evidence = [f"rank {r}: in {op} #{seq} of {group}" for r in group.ranks if reached(r, group, seq)]
    finished = _ranks_with_event(run_dir, world, EVENT_TEARDOWN)
    ended = exit_failures(run_dir)  # when each failed rank ended: a SIGKILL after another's failure was torchrun's
    kinds = set()
    for rank in culprits:
        code = exits.get(rank)
        if rank not in dumps:
            # Died by itself (contract.failed_by_itself, the launcher's rule too): a non-zero exit before its work
            # was done, other than torchrun stopping the ranks left after a failure (a rank stuck in its exit then,
            # or its teardown, is not to blame).
            died = failed_by_itself(code, rank, ended) and rank not in finished
            words = _last_words(run_dir, rank)
            # gloo aborts the process (no Python exception, so no dump) when a peer's message has another size
            kinds.add("shape" if died and GLOO_SIZE_MISMATCH in words else "crash" if died else "missing")
            # A rank that ended normally either skipped the collective or made a smaller call that gloo let
            # complete (a shape fault in its last collective): its dump went with it, so both read as missing.
            evidence.append(f"rank {rank}: left no dump" + (
                f"; it died (exit code {code}): {words}" if died else
                "; it finished while the others waited: it skipped the collective, or its own call was smaller "
                "and completed" if rank in finished else "; it had ended, or never answered"))
            continue
        in_dist, where = _where(stacks.get(rank))
        mine = order[rank][-1] if order[rank] else None
        doing = (f"its last collective {_op(seqs[rank][mine[0]][mine[1]])} #{mine[1]}"
                 + (f" of {mine[0]}" if mine[0] != group else "") if mine else "no collective yet")
        if in_dist:
            kinds.add("missing")
            evidence.append(f"rank {rank}: never entered #{seq}; {doing}; waiting at {where}")
        else:
            kinds.add("straggler")
            evidence.append(f"rank {rank}: never entered #{seq}; {doing}; busy in its own code at {where}")
    for rank, (g, s, blockers) in sorted(waits.items()):
        if g != group:  # the ranks held up in other groups, and by whom: the chain back to the culprit
            evidence.append(f"rank {rank}: waits in {_op(seqs[rank][g][s])} #{s} of {g} for rank(s) "
                            + ", ".join(map(str, blockers)))
    kind = next(k for k in ("shape", "crash", "straggler", "missing") if k in kinds)
    return Diagnosis(culprits, op, seq, kind, evidence, **_in(group))


def _last_words(run_dir: Path, rank: int) -> str:
    from .contract import rank_log
    from .procs import last_words

    try:
        return last_words(rank_log(run_dir, None, rank, "stderr").read_text(errors="replace"))
    except OSError:
        return "(no log)"


def _ranks_with_event(run_dir: Path, world: int, event: str) -> set[int]:
    """The ranks whose metrics hold runtime's `event` record (setup: it joined the group; teardown: it finished)."""
    out = set()
    for rank in range(world):
        try:
            lines = metrics_file(run_dir, rank).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            with contextlib.suppress(ValueError):  # a line cut short by a kill
                if json.loads(line).get("event") == event:
                    out.add(rank)
    return out
