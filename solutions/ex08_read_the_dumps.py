"""Exercise 08, part 2: read the Flight Recorder dumps of a job that hung or crashed, and name the fault.

The story
---------
Chapter 08b's lab broke collectives on purpose and let `result.diagnosis()` read the dumps. Here you write
the reading yourself. When a job stalls, times out or fails, the launcher asks each rank still alive for its
Flight Recorder buffer: the collectives it called, in order, each with its sequence number in the process
group, its operation and the sizes of its inputs. A rank that had already left (it finished, crashed or was
killed) leaves no dump; its exit code is what is known of it.

Task
----
Write `diagnose(dumps, exits) -> (ranks, seq_id, kind)`:

- `dumps`: {rank: that rank's dump, or None where it left none}, one key per rank of the job. A dump is the
  dict torch writes (unpickled): `dump["entries"]` lists the rank's collectives, oldest first; in each entry,
  `collective_seq_id` (1, 2, ... in its process group), `profiling_name` (e.g. "gloo:all_reduce"),
  `input_sizes` (e.g. [[8]]), `process_group` (a pair: (id, name), the default group's name is
  "default_pg") and `is_p2p` (True for send/recv, which have no collective sequence number). Read the
  default group's collectives only; gloo records every entry as "scheduled", so `state` says nothing here.
- `exits`: {rank: exit code, or None where none was recorded (a rank that ended normally, or that the
  launcher stopped)}; a negative code -N means the signal N ended it (-9: SIGKILL, -15: SIGTERM).

Return the culprit ranks (a sorted list), the sequence number of the first collective that went wrong, and
the kind of fault:

  order      at that sequence number the ranks called different operations: blame the ranks outside the
             largest group that agrees
  shape      the same operation, with different input sizes: the same rule
  missing    a rank never entered the collective the others wait in, and left no dump: it ended without
             being killed (it skipped that collective and finished)
  crash      the same, but a signal other than SIGTERM killed it (SIGTERM is how torchrun stops the ranks
             left after another failed)
  straggler  the same, but the rank is alive and left a dump: it is busy in its own code

Look for a disagreement first (the lowest sequence number at which the ranks that reached it differ: a rank
whose call went through may have gone on to later collectives). Only when they all agree, take the highest
sequence number any rank reached, and blame the ranks that never entered it.

Rules
-----
- Use only the two arguments (no files, no launcher results); return plain values: a list of ints, an int
  and one of the five words.
- The grader injects 10 random faults (kind, culprit rank, step) into real 4-rank jobs of
  scripts/08b_hangs.py and scores one point per right answer (all three parts right).

Check your work: `gpucourse grade ex08_read_the_dumps` (`--seed N` replays a grading's faults).
"""
from collections import Counter

SIGTERM = 15


def diagnose(dumps: dict, exits: dict) -> tuple[list[int], int | None, str]:
    """(culprit ranks, sequence number of the first collective that went wrong, kind of fault)."""
    ### BEGIN SOLUTION
    ### HINT: per rank, {collective_seq_id: entry} of the default group; the lowest seq id where the ranks that reached it differ in op, then in sizes (blame the minority); else the highest seq id reached and who never entered it (a dump: straggler; none: crash if a signal other than SIGTERM killed it, else missing)
    calls = {}
    for rank, dump in dumps.items():
        if dump is not None:
            calls[rank] = {e["collective_seq_id"]: e for e in dump["entries"]
                           if not e["is_p2p"] and e["process_group"][1] == "default_pg"}
    for seq in sorted({s for seen in calls.values() for s in seen}):
        reached = {rank: seen[seq] for rank, seen in calls.items() if seq in seen}
        for kind, field in (("order", "profiling_name"), ("shape", "input_sizes")):
            said = {rank: str(entry[field]) for rank, entry in reached.items()}
            most = Counter(said.values()).most_common(1)[0][0]
            odd = sorted(rank for rank, value in said.items() if value != most)
            if odd:
                return odd, seq, kind
    last = max((max(seen, default=0) for seen in calls.values()), default=0)
    behind = sorted(rank for rank in dumps if last not in calls.get(rank, {}))

    def why(rank):
        code = exits.get(rank)
        if dumps[rank] is not None:
            return "straggler"
        return "crash" if code is not None and code < 0 and code != -SIGTERM else "missing"

    kinds = {why(rank) for rank in behind}
    kind = next((k for k in ("crash", "straggler", "missing") if k in kinds), "missing")
    return behind, last or None, kind
    ### END SOLUTION
