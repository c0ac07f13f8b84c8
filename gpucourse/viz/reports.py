"""What a person reads of a dry run (gpucourse dryrun): the report as text, in the course's units."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

from ..models.units import human_bytes, human_si


def dryrun_text(result: dict) -> str:
    """Per simulated rank: the step's memory peak and parts, FLOPs, what the script assumed (ASSUMED), the
    modelled step time where the result has one ("predicted", labelled MODELLED), and every collective with its
    group, calls and bytes."""
    tensors = "; fake tensors: no storage behind them" if result.get("fake_tensors") else ""
    lines = [f"dry run of {Path(result['script']).name} at world {result['world']:,} (fake process group{tensors}: "
             "memory, FLOPs and bytes counted, not measured; a step time, where shown, is modelled)"]
    for r in result["ranks"]:
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in r["memory"].items())
        lines.append(f"rank {r['rank']}, step {r['step']}: peak {human_bytes(r['peak_bytes'])} ({parts}); "
                     f"{human_si(r['flops'], 'FLOP')}")
        for text in r.get("assumptions", []):
            lines.append(f"  ASSUMED: {text}")
        if r.get("predicted"):
            p = r["predicted"]
            lines.append(f"  MODELLED on {p['system']} ({p['device']}, {p['dtype']}): step {p['step_s'] * 1e3:.3g} ms "
                         f"(compute {p['compute_s'] * 1e3:.3g} ms + communication {p['comm_s'] * 1e3:.3g} ms), MFU "
                         f"{p['mfu']:.1%}; assumes {p['assumes']}")
        for c in r["comms"]:
            group = c["group"] or []
            shown = (f"{group[:4]}"[:-1] + ", ...]" if len(group) > 4 else f"{group}")
            peers = f" peers {c['peers']}" if "peers" in c else ""
            lines.append(f"  {c['op']:<24} group of {c['group_size']:>5} {shown}{peers}: {c['calls']} call(s), "
                         f"{human_bytes(c['bytes'])}")
    return "\n".join(lines)


SOURCE_PLACE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ")


def _ranks(ranks: list[int], start: bool = False) -> str:
    """'rank 2', 'ranks 0, 2 and 3' ('Rank', 'Ranks' to start a sentence)."""
    word = ("Rank" if start else "rank") + ("s" if len(ranks) > 1 else "")
    listed = ", ".join(map(str, ranks[:-1])) + " and " + str(ranks[-1]) if len(ranks) > 1 else str(ranks[0])
    return f"{word} {listed}"


def failure_story(result, width: int = 118) -> str:
    """Chapter 00: how each rank of a failed run ended, and why the launcher names its root cause, every sentence
    taken from the run (RunResult.failures): the exit codes, what each rank raised or was killed by, when (torchrun's
    whole seconds), and whether the exit codes alone could have named the culprit. Lines wrapped at `width`."""
    ends = result.failures
    if not ends:
        return f"{result.name}: no rank failed ({result.status})"
    lines = ["how each rank ended (torchrun records the time of each failure in whole seconds):"]
    for end in ends:
        how = f"killed by {end.signal}" if end.signal else f"exit code {end.exitcode}"
        line = f"  rank {end.rank}: {how}, at +{end.second} s, {end.kind}"
        said = SOURCE_PLACE.sub("", end.message)  # gloo's "[/path/to/pair.cc:553] " says nothing to a reader
        if said:
            room = max(20, width - len(line) - 2)
            line += f": {said[:room - 1]}…" if len(said) > room else f": {said}"
        lines.append(line)
    root = next(end for end in ends if end.root_cause)
    others = [end for end in ends if not end.root_cause]
    same_code = [end.rank for end in others if (end.exitcode, end.signal) == (root.exitcode, root.signal)]
    text = []
    if same_code:
        code = root.signal or f"exit code {root.exitcode}"
        text.append(f"{_ranks(same_code, True)} ended exactly as rank {root.rank} did ({code}): "
                    "the exit codes alone cannot name the culprit here.")
    elif others:
        text.append(f"Here the exit codes differ: rank {root.rank}'s is the odd one out.")
    peers = [end.rank for end in others if end.kind == "reported a peer's failure" and not end.signal]
    if peers:
        text.append(f"{_ranks(peers, True)} did not wait to be stopped: waiting on a rank that had died, "
                    f"{'it' if len(peers) == 1 else 'each'} saw the connection close and raised that error itself, "
                    f"before torchrun's SIGTERM came, so {'it' if len(peers) == 1 else 'they'} too exited with an "
                    "exception's code.")
    stopped = [end.rank for end in others if end.kind == "stopped by torchrun"]
    if stopped:
        were = "was" if len(stopped) == 1 else "were"
        text.append(f"{_ranks(stopped, True)} {were} stopped by torchrun: bystanders.")
    earlier = [end.rank for end in others if end.second < root.second]
    tied = [end.rank for end in others if end.second == root.second]
    when = (f"and it was the first to fail (+{root.second} s)" if not earlier and not tied else
            f"in the same second as {_ranks(tied)}, so the clock alone could not order them: how each ended did"
            if not earlier else f"although {_ranks(earlier)} failed earlier: those only reported or were stopped")
    text.append(f"The launcher names rank {root.rank}: it {root.kind}, {when}.")
    return "\n".join(lines + textwrap.wrap(" ".join(text), width))
