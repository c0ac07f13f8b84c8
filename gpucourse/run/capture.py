"""In each rank: the Flight Recorder's capture, a rank's dump of its recent collectives and its main-thread stack.

runtime.setup() calls `start` (a thread that answers the launcher's requests) and runtime's excepthook calls `dump`
when an exception ends the rank; a script may call `dump` itself (chapter 08c). What is written where, and how the
launcher asks and reads it back, is told in run/forensics.py, the reader.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path

from .contract import forensics_dir, fr_file, request_file, stack_file  # noqa: F401  (named here too)

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
FR_ENTRIES = 2000  # collectives kept per rank: a few steps of a large model's FSDP traffic
POLL_S = 0.2  # how often a rank looks for the launcher's request


def enabled(env=os.environ) -> bool:
    """Whether the Flight Recorder records in a job with this environment (TORCH_FR_BUFFER_SIZE=0 turns it off)."""
    try:
        return int(env.get(FR_BUFFER_ENV) or 0) > 0
    except ValueError:
        return False


def dump(run_dir: Path, rank: int, why: str) -> bool:
    """Write this rank's Flight Recorder buffer and main-thread stack into the run directory. False if the
    recorder is off (no TORCH_FR_BUFFER_SIZE) or torch has none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        data = _named_groups(_dump_fr_trace(includeStackTraces=False))  # with C++ stacks: 5 s of symbolizing
    except (ImportError, RuntimeError):
        return False
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = [{"file": f.filename, "line": f.lineno, "function": f.name, "code": f.line or ""}
             for f in (traceback.extract_stack(frame) if frame else [])]
    for path, payload in ((fr_file(run_dir, rank), data),
                          (stack_file(run_dir, rank), json.dumps({"rank": rank, "why": why, "time": time.time(),
                                                                  "pid": os.getpid(), "stack": stack}).encode())):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(payload)
        tmp.replace(path)  # whole or not at all: the launcher may stop the rank right after
    return True


def _named_groups(data: bytes) -> bytes:
    """Every process group this rank belongs to, filed in the dump's pg_config under the name its entries use,
    with its description and global ranks. gloo's dump (torch 2.13) files only the default group, under the name
    '' with no ranks, while its entries name it '0' (torch's analyser then fails: KeyError) and name subgroups
    ('2', 'mesh_tp') whose members no dump says. Read from torch's own registry of groups in this process."""
    trace = pickle.loads(data)
    config, names = trace.setdefault("pg_config", {}), {e["process_group"][0]: e["process_group"][1]
                                                        for e in trace.get("entries", [])}
    if "" in config and "0" in names and "0" not in config:
        config["0"] = {**config.pop(""), "name": "0", "desc": names["0"]}
    with contextlib.suppress(Exception):  # a rank that has no process group (any more) keeps torch's config
        from torch.distributed import distributed_c10d as c10d

        for group, name in dict(c10d._world.pg_names).items():
            ranks = sorted(c10d._world.pg_group_ranks.get(group, {}))
            config[name] = {**config.get(name, {}), "name": name, "ranks": str(ranks),
                            "desc": getattr(group, "group_desc", None) or names.get(name, "undefined")}
        if "0" in config and config.get("", {}).get("ranks", "[]") == "[]":
            config.pop("", None)  # torch's nameless stand-in for the default group, filed above as '0'
    return pickle.dumps(trace)


def start(run_dir: Path, rank: int) -> None:
    """Answer the launcher's requests for a dump (a daemon thread, so a rank stuck in a collective still answers)."""
    if not enabled():
        return
    request = request_file(run_dir)

    def watch():
        answered = None
        while True:
            time.sleep(POLL_S)
            try:
                asked = request.read_text()
            except OSError:
                continue
            if asked and asked != answered:
                answered = asked
                dump(run_dir, rank, f"asked by the launcher: {asked.strip()}")

    threading.Thread(target=watch, name="gpucourse-forensics", daemon=True).start()
