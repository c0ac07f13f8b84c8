"""Where each rank's time went: read the chrome traces `runtime.profile` wrote and split every step into
compute, communication (exposed or hidden behind compute) and other/idle time.

    from gpucourse.models.traces import analyze_run
    analysis = analyze_run(result)           # a RunResult, or a run directory
    print(analysis.summary())                # per rank: step time, compute, comm, exposed comm, overlap
    analysis.ranks[0].steps[0]               # StepBreakdown(rank=0, step=2, duration_us=..., ...)

Two kinds of traces, told apart by whether they hold GPU kernels (`analysis.kind`):

"cpu-gloo"  gloo does its work on its own threads: each collective is a `gloo:all_reduce` (etc.)
            `user_annotation` there, with its real duration. The caller's `c10d::allreduce_` cpu_op only
            enqueues the work (and waiting on it is not recorded), so communication is measured from gloo's
            threads. Compute is the `cpu_op` and `user_annotation` events of the other threads, except:
              - the profiler's own `ProfilerStep#N` markers,
              - collective calls (`c10d::*`, `record_param_comms`, `gloo:*`, `nccl:*`) and what is nested in them,
              - an event that encloses a collective call (a "step" region around everything): it is a container,
                only what is nested inside it counts;
              - FSDP2's own regions (`FSDP::pre_forward`, `FSDP::all_gather_copy_out`, ...) and what encloses
                them: they hold FSDP's waits on its all-gathers (`Work.wait()` is not recorded), so they are
                containers too, and only the operators nested in them (its copies) count.
            So `with record_function("compute"): time.sleep(0.05)` counts as 50 ms of compute.
            Point-to-point is the exception: gloo records `gloo:send` / `gloo:recv` on the CALLER's thread,
            from the isend/irecv to the transfer's end (it runs meanwhile, asynchronously): they are
            communication, and the caller's work beside them is still compute (ring attention, pipelines).
"gpu"       kernels (`cat: kernel`) whose name contains "nccl" are communication, all other kernels compute;
            memory copies and CPU-side work are "other". Steps are the GPU work launched inside each
            `ProfilerStep#N` (matched through the launch's correlation id). (HolisticTraceAnalysis also reads
            such traces, with more analyses; this parser needs nothing beyond the standard library.)

Within a step, all times are lengths of unions of intervals (nested or concurrent events never count twice):
    compute  = |compute|            comm = |comm|            exposed comm = |comm - compute|
    other    = step - |compute ∪ comm| = step - compute - exposed comm
    overlap fraction = (comm - exposed comm) / comm
"""
from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..run.contract import manifest_file, trace_file, traces_dir
from .units import human_percent

Interval = tuple[float, float]  # (start_us, end_us)

STEP_PREFIX = "ProfilerStep#"
# A caller's collective calls. DTensor (tensor parallel, FSDP2) issues "functional" collectives and later
# blocks in `_c10d_functional::wait_tensor`: that wait is communication, not compute.
CALLER_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "record_param_comms", "gloo:", "nccl:")
COMPUTE_CATS = ("cpu_op", "user_annotation")
GPU_WORK_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
POINT_TO_POINT = ("gloo:send", "gloo:recv")  # recorded on the caller's thread, spanning the async transfer
# Regions a library records around its own waits on collectives, which the trace does not show: FSDP2 (fully_shard)
# waits for a prefetched all-gather inside `FSDP::all_gather_copy_out`. Such a region, and an event enclosing one,
# is a container: only the operators nested in it are compute.
WAIT_REGION_PREFIXES = ("FSDP::",)
EPS_US = 1e-3  # kineto rounds to ns: a child may end 1 ns after its parent


class TraceError(ValueError):
    """A trace, or a whole run's traces, that cannot be analysed; the message names the file and what to do."""


# --- interval arithmetic on sorted, disjoint lists -------------------------------------------------
def union(intervals) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time; empty ones dropped, touching ones merged."""
    out: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def total(intervals: list[Interval]) -> float:
    """Length of a disjoint interval list (use union() first if it may overlap)."""
    return sum(e - s for s, e in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Time covered by both disjoint lists a and b."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Time covered by disjoint list a and not by disjoint list b."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def clip(intervals: list[Interval], start: float, end: float) -> list[Interval]:
    return intersect(intervals, [(start, end)])


# --- the data model ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepBreakdown:
    """One profiled step of one rank, in microseconds. compute + exposed_comm + other = duration."""

    rank: int
    step: int
    start_us: float
    duration_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float
    other_us: float

    @property
    def overlapped_comm_us(self) -> float:
        return self.comm_us - self.exposed_comm_us

    @property
    def overlap(self) -> float:
        """Fraction of communication hidden behind compute (nan when the step communicated nothing)."""
        return self.overlapped_comm_us / self.comm_us if self.comm_us > 0 else math.nan


@dataclass
class RankAnalysis:
    """One rank's trace: its steps and the merged compute/comm intervals (absolute trace time, us)."""

    rank: int
    path: Path
    kind: str  # "cpu-gloo" or "gpu"
    steps: list[StepBreakdown]
    intervals: dict[str, list[Interval]]
    backend: str | None = None
    world_size: int | None = None
    device: str | None = None
    comm_by_name: dict[str, list[Interval]] = field(default_factory=dict)  # "gloo:all_gather" -> its intervals

    def mean(self, attr: str) -> float:
        values = [getattr(s, attr) for s in self.steps]
        return sum(values) / len(values) if values else math.nan

    def collective(self, name: str) -> list[tuple[float, float]]:
        """Per step, (time, exposed time) in us of one collective, by its name in the trace ("gloo:all_gather",
        "gloo:all_reduce"; on GPUs the kernel's name): the union of its intervals in the step, and the part of
        that no compute covers. 0.0 for a step (or a trace) without it; `comm_by_name` lists the names found."""
        intervals = self.comm_by_name.get(name, [])
        out = []
        for s in self.steps:
            end = s.start_us + s.duration_us
            mine = clip(intervals, s.start_us, end)
            out.append((total(mine), total(subtract(mine, clip(self.intervals["compute"], s.start_us, end)))))
        return out

    @property
    def overlap(self) -> float:
        """Overlapped comm / comm over all steps (a ratio of sums: long steps weigh more)."""
        comm = sum(s.comm_us for s in self.steps)
        return sum(s.overlapped_comm_us for s in self.steps) / comm if comm > 0 else math.nan


@dataclass
class RunAnalysis:
    """Every rank of one run. `problems` lists ranks that could not be analysed (the others still are)."""

    kind: str
    backend: str | None
    world_size: int
    ranks: dict[int, RankAnalysis]
    problems: list[str] = field(default_factory=list)
    name: str = ""
    device: str = "?"

    @property
    def steps(self) -> list[StepBreakdown]:
        return [s for r in self.ranks.values() for s in r.steps]

    def label(self) -> str:
        """One line naming the run for plot titles: run, device, backend, world size."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        return f"{self.name} — {self.device}, {self.backend or '?'}, {ranks} ({self.kind} trace)"

    def table(self) -> list[dict]:
        """Per rank, means over its steps in ms: step, compute, comm, exposed comm, other; overlap fraction."""
        rows = []
        for rank, ra in sorted(self.ranks.items()):
            rows.append({"rank": rank, "steps": len(ra.steps),
                         "step_ms": ra.mean("duration_us") / 1e3, "compute_ms": ra.mean("compute_us") / 1e3,
                         "comm_ms": ra.mean("comm_us") / 1e3, "exposed_comm_ms": ra.mean("exposed_comm_us") / 1e3,
                         "other_ms": ra.mean("other_us") / 1e3, "overlap": ra.overlap})
        return rows

    def fractions(self) -> dict:
        """The mean step over the ranks: its time (ms), and compute, exposed comm, other and all comm as
        fractions of it; overlap: the share of comm hidden behind compute (nan without comm)."""
        table = self.table()
        if not table:
            raise ValueError(f"{self.label()}: no rank analysed, so no step to split")

        def mean(key):
            return sum(r[key] for r in table) / len(table)

        step, comm = mean("step_ms"), mean("comm_ms")
        return {"step_ms": step, "compute": mean("compute_ms") / step, "exposed": mean("exposed_comm_ms") / step,
                "other": mean("other_ms") / step, "comm": comm / step,
                "overlap": 1 - mean("exposed_comm_ms") / comm if comm else math.nan}

    def summary(self) -> str:
        lines = [f"{self.label()}: {len(self.ranks)} of {self.world_size} rank(s) analysed",
                 "rank  steps   step ms  compute ms  comm ms  exposed ms  other ms  overlap"]
        for row in self.table():
            overlap = "—" if math.isnan(row["overlap"]) else human_percent(row["overlap"])
            lines.append(f"{row['rank']:>4}  {row['steps']:>5}  {row['step_ms']:>8.2f}  {row['compute_ms']:>10.2f}"
                         f"  {row['comm_ms']:>7.2f}  {row['exposed_comm_ms']:>10.2f}  {row['other_ms']:>8.2f}"
                         f"  {overlap:>7}")
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# --- reading one trace file -------------------------------------------------------------------------
def load_trace(path: str | Path) -> dict:
    """The trace as a dict with a 'traceEvents' list, or a TraceError saying what is wrong with the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise TraceError(f"cannot read trace {path}: {err.strerror or err}") from None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise TraceError(f"{path} is not valid JSON ({err}); it is probably truncated (the rank was killed "
                         "while writing it): run the job again") from None
    if isinstance(data, list):  # the chrome trace format also allows a bare list of events
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{path} is JSON but not a chrome trace (no 'traceEvents' list): pass a file written "
                         "by runtime.profile or torch.profiler's export_chrome_trace")
    return data


def _spans(events) -> list[dict]:
    """Complete ('X') events with a duration, each with its end time precomputed."""
    out = []
    for ev in events:
        if isinstance(ev, dict) and ev.get("ph") == "X" and isinstance(ev.get("ts"), (int, float)):
            dur = ev.get("dur", 0)
            if isinstance(dur, (int, float)) and dur >= 0:
                args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
                out.append({**ev, "end": ev["ts"] + dur, "cat": str(ev.get("cat", "")).lower(),
                            "name": str(ev.get("name", "")), "args": args})
    return out


def _step_windows(spans) -> list[tuple[int, float, float]]:
    """(step number, start, end) of each ProfilerStep#N marker on the CPU, in time order."""
    steps = {}
    for ev in spans:
        if ev["name"].startswith(STEP_PREFIX) and ev["cat"] in COMPUTE_CATS:
            m = re.match(r"ProfilerStep#(\d+)", ev["name"])
            if m:
                steps.setdefault(int(m.group(1)), (ev["ts"], ev["end"]))
    return sorted(((n, s, e) for n, (s, e) in steps.items()), key=lambda w: w[1])


def _encloses(outer: dict, starts: list[float], ends: list[float]) -> bool:
    """Whether any of the (sorted by start) intervals lies inside `outer`."""
    i = bisect.bisect_left(starts, outer["ts"] - EPS_US)
    while i < len(starts) and starts[i] <= outer["end"] + EPS_US:
        if ends[i] <= outer["end"] + EPS_US:
            return True
        i += 1
    return False


def _cpu_intervals(spans) -> dict[str, list[Interval]]:
    """Compute and communication intervals of a CPU (gloo) trace; see the module docstring for the rules."""
    comm = [ev for ev in spans if ev["name"].startswith("gloo:")]
    comm_threads = {(ev.get("pid"), ev.get("tid")) for ev in comm if ev["name"] not in POINT_TO_POINT}
    caller = [ev for ev in spans if (ev.get("pid"), ev.get("tid")) not in comm_threads]
    calls_by_thread: dict = {}
    for ev in caller:
        if ev["name"].startswith(CALLER_COMM_PREFIXES) and ev["name"] not in POINT_TO_POINT:
            calls_by_thread.setdefault((ev.get("pid"), ev.get("tid")), []).append((ev["ts"], ev["end"]))
    waits_by_thread: dict = {}
    for ev in caller:
        if ev["name"].startswith(WAIT_REGION_PREFIXES):
            waits_by_thread.setdefault((ev.get("pid"), ev.get("tid")), []).append((ev["ts"], ev["end"]))
    index = {t: tuple(zip(*sorted(v))) for t, v in calls_by_thread.items()}  # thread -> (starts, ends)
    wait_index = {t: tuple(zip(*sorted(v))) for t, v in waits_by_thread.items()}
    compute = []
    for ev in caller:
        if ev["cat"] not in COMPUTE_CATS or ev["name"].startswith((STEP_PREFIX, *CALLER_COMM_PREFIXES,
                                                                   *WAIT_REGION_PREFIXES)):
            continue
        thread = (ev.get("pid"), ev.get("tid"))
        if any(found and _encloses(ev, *found) for found in (index.get(thread), wait_index.get(thread))):
            continue  # a container around a collective call or a library's wait: its children speak for it
        compute.append((ev["ts"], ev["end"]))
    calls = union(iv for v in calls_by_thread.values() for iv in v)
    return {"compute": subtract(union(compute), calls), "comm": union((ev["ts"], ev["end"]) for ev in comm)}


def _comm_by_name(spans, gpu: bool) -> dict[str, list[Interval]]:
    """The communication intervals of each collective name: gloo's events, and on GPUs the NCCL kernels."""
    by_name: dict[str, list] = {}
    for ev in spans:
        if ev["name"].startswith("gloo:") or (gpu and ev["cat"] == "kernel" and "nccl" in ev["name"].lower()):
            by_name.setdefault(ev["name"], []).append((ev["ts"], ev["end"]))
    return {name: union(v) for name, v in sorted(by_name.items())}


def _gpu_intervals(spans) -> dict[str, list[Interval]]:
    kernels = [ev for ev in spans if ev["cat"] == "kernel"]
    comm = [(ev["ts"], ev["end"]) for ev in kernels if "nccl" in ev["name"].lower()]
    comm += [(ev["ts"], ev["end"]) for ev in spans if ev["name"].startswith("gloo:")]  # gloo ranks on GPUs
    compute = [(ev["ts"], ev["end"]) for ev in kernels if "nccl" not in ev["name"].lower()]
    return {"compute": union(compute), "comm": union(comm)}


def _gpu_step_windows(spans, cpu_windows):
    """GPU step windows: from the first GPU work launched in step N to the first launched in step N+1.

    The ProfilerStep markers are CPU time; the GPU runs the step's kernels later. A kernel belongs to the step
    whose CPU window holds its launch (same `correlation` id). Steps without matched GPU work keep their CPU window.
    """
    launch_ts = {ev["args"]["correlation"]: ev["ts"] for ev in spans
                 if ev["cat"] in ("cuda_runtime", "cuda_driver") and "correlation" in ev["args"]}
    starts = [s for _, s, _ in cpu_windows]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for ev in spans:
        if ev["cat"] not in GPU_WORK_CATS or ev["args"].get("correlation") not in launch_ts:
            continue
        t = launch_ts[ev["args"]["correlation"]]
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= cpu_windows[i][2]:
            first[i] = min(first.get(i, math.inf), ev["ts"])
            last[i] = max(last.get(i, -math.inf), ev["end"])
    out = []
    for i, (n, s, e) in enumerate(cpu_windows):
        if i not in first:
            out.append((n, s, e))
            continue
        end = first.get(i + 1, last[i]) if i + 1 < len(cpu_windows) else last[i]
        out.append((n, first[i], max(end, first[i])))
    return out


def _breakdown(rank, windows, intervals) -> list[StepBreakdown]:
    steps = []
    for n, start, end in windows:
        compute, comm = clip(intervals["compute"], start, end), clip(intervals["comm"], start, end)
        compute_us, comm_us = total(compute), total(comm)
        exposed_us = total(subtract(comm, compute))
        other_us = max((end - start) - compute_us - exposed_us, 0.0)
        steps.append(StepBreakdown(rank, n, start, end - start, compute_us, comm_us, exposed_us, other_us))
    return steps


def _rank_from_name(path: Path) -> int | None:
    m = re.search(r"(\d+)$", path.stem)
    return int(m.group(1)) if m else None


def analyze_trace(path: str | Path, rank: int | None = None) -> RankAnalysis:
    """Analyse one rank's chrome trace (CPU/gloo or GPU). Raises TraceError naming the file if it cannot.

    rank: the rank to report (default: the trace's distributedInfo, else the number ending the file name).
    """
    path = Path(path)
    data = load_trace(path)
    info = data.get("distributedInfo") if isinstance(data.get("distributedInfo"), dict) else {}
    spans = _spans(data["traceEvents"])
    windows = _step_windows(spans)
    if not windows:
        raise TraceError(f"{path} has no ProfilerStep#N markers, so it cannot be cut into steps: profile with "
                         "`with runtime.profile(...) as prof:` and call prof.step() once per step")
    gpu = any(ev["cat"] == "kernel" for ev in spans)
    intervals = _gpu_intervals(spans) if gpu else _cpu_intervals(spans)
    if gpu:
        windows = _gpu_step_windows(spans, windows)
    if rank is None:
        rank = info.get("rank", _rank_from_name(path) or 0)
    props = data.get("deviceProperties") or []
    device = props[0].get("name") if gpu and props and isinstance(props[0], dict) else None
    return RankAnalysis(rank=rank, path=path, kind="gpu" if gpu else "cpu-gloo",
                        steps=_breakdown(rank, windows, intervals), intervals=intervals,
                        backend=info.get("backend"), world_size=info.get("world_size"), device=device,
                        comm_by_name=_comm_by_name(spans, gpu))


# --- a whole run ------------------------------------------------------------------------------------
def _run_dir_and_manifest(result_or_run_dir) -> tuple[Path, dict]:
    if hasattr(result_or_run_dir, "run_dir"):  # a RunResult
        return Path(result_or_run_dir.run_dir), dict(getattr(result_or_run_dir, "manifest", {}) or {})
    run_dir = Path(result_or_run_dir).expanduser()
    if not run_dir.is_dir():
        raise TraceError(f"{run_dir} is not a run directory: pass the RunResult of gpucourse.launch "
                         "or the folder it wrote (runs/<name>-<time>/)")
    try:
        manifest = json.loads(manifest_file(run_dir).read_text())
    except (OSError, ValueError):
        manifest = {}
    return run_dir, manifest if isinstance(manifest, dict) else {}


def _trace_files(run_dir: Path, name: str) -> dict[int, Path]:
    pattern = re.compile(rf"{re.escape(name)}(\d+)\.json")
    found = {}
    for path in traces_dir(run_dir).glob("*.json"):
        m = pattern.fullmatch(path.name)
        if m:
            found[int(m.group(1))] = path
    if not found:
        others = sorted(p.name for p in traces_dir(run_dir).glob("*.json"))
        hint = (f" (it holds {', '.join(others)}: pass name= the part before the rank number)" if others else
                ": profile the steps in the script with `with runtime.profile(...) as prof:` and prof.step(), "
                "and check that every rank reached the end of the profiled steps")
        raise TraceError(f"no traces named {name}<rank>.json in {traces_dir(run_dir)}{hint}")
    return dict(sorted(found.items()))


def analyze_run(result_or_run_dir, *, name: str = "rank") -> RunAnalysis:
    """Analyse every rank's trace of a run (a RunResult or its run directory).

    name: the traces' file prefix, as given to runtime.profile(name=...) ("rank" by default).
    Ranks whose trace is missing or unreadable are listed in `.problems`; the others are still analysed.
    Raises TraceError when no rank can be analysed.
    """
    run_dir, manifest = _run_dir_and_manifest(result_or_run_dir)
    files = _trace_files(run_dir, name)
    ranks, problems = {}, []
    for file_rank, path in files.items():
        try:
            ra = analyze_trace(path, rank=file_rank)
        except TraceError as err:
            problems.append(f"rank {file_rank}: {err}")
            continue
        ranks[file_rank] = ra
    first = next(iter(ranks.values()), None)
    world = int(manifest.get("world_size") or (first.world_size if first and first.world_size else 0)
                or max(files) + 1)
    for rank in range(world):
        if rank not in files:
            problems.append(f"rank {rank}: no trace (expected {trace_file(run_dir, name, rank)}); the "
                            f"rank may have stopped before its profiled steps ended: see its log "
                            f"(result.log({rank}, 'stderr'))")
    if not ranks:
        raise TraceError(f"no rank of {run_dir} could be analysed:\n  " + "\n  ".join(problems))
    kinds = sorted({ra.kind for ra in ranks.values()})
    if len(kinds) > 1:
        problems.append(f"ranks disagree on the trace kind ({', '.join(kinds)}); showing them together")
    backend = first.backend or manifest.get("backend")
    if backend == "nccl" and kinds == ["cpu-gloo"]:
        problems.append("backend is nccl but the traces hold no GPU kernels: profile with CUDA activity "
                        "(runtime.profile does so when the rank's device is a GPU)")
    device = first.device or manifest.get("device") or ("cuda" if first.kind == "gpu" else "cpu")
    return RunAnalysis(kind=kinds[0] if len(kinds) == 1 else "mixed", backend=backend, world_size=world,
                       ranks=dict(sorted(ranks.items())), problems=problems, name=run_dir.name, device=device)


# --- named spans: what a script marked with record_function, e.g. a pipeline's F3 and B3 -----------------------
def step_spans(paths: dict, pattern: str, start: str = "sync-start") -> dict[int, list[tuple[str, float, float]]]:
    """{rank: [(label, start ms, end ms)]}, sorted by start: the spans of each rank's trace (paths: {rank: file})
    whose name fully matches `pattern` (the label: its first group, or the whole name), counted from the end of
    the rank's last `start` span (a barrier all ranks leave together); spans before it are left out."""
    regex, out = re.compile(pattern), {}
    for rank, path in sorted(paths.items()):
        events = [e for e in load_trace(path)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
        marks = [e["ts"] + e["dur"] for e in events if e.get("name") == start]
        if not marks:
            raise TraceError(f"{path}: no {start!r} span to count from (the script marks the step's start with it)")
        t0 = max(marks)
        spans = [((m.group(1) if regex.groups else m.group(0)), (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3)
                 for e in events if (m := regex.fullmatch(str(e.get("name")))) and e["ts"] >= t0]
        out[rank] = sorted(spans, key=lambda span: span[1])
    return out


def idle(timeline: dict) -> tuple[float, float, float]:
    """(step ms, idle share of the step, idle over busy time), the last two averaged over the ranks, of a
    {rank: [(label, start ms, end ms)]} timeline. The step runs from the common start to the last span's end."""
    step = max(end for spans in timeline.values() for _, _, end in spans)
    busy = [sum(end - start for _, start, end in spans) for spans in timeline.values()]
    return step, sum(1 - b / step for b in busy) / len(busy), sum((step - b) / b for b in busy) / len(busy)



# --- all-reduces counted per profiled step (chapter 02) ------------------------------------------------
ELEMENT_BYTES = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "Float": 4, "Half": 2, "BFloat16": 2}


def _all_reduce_bytes(event: dict) -> int | None:
    """Bytes of one all-reduce event: NCCL's element count, or gloo's recorded input shape; None if neither."""
    a = event.get("args", {})
    if "In msg nelems" in a:
        return a["In msg nelems"] * ELEMENT_BYTES.get(str(a.get("dtype")), 4)
    if "Input Dims" in a:
        return math.prod(a["Input Dims"][0]) * ELEMENT_BYTES[a["Input type"][0]]
    return None


def last_sized_step(steps: list[tuple[int, int | None]]) -> tuple[int, int | None]:
    """The last (calls, bytes) of all_reduces_per_step whose bytes the trace recorded, else the last: torch 2.11
    leaves the args off the last gloo all_reduce of a profiled run (its work ends after the profiler stops)."""
    return next((step for step in reversed(steps) if step[1] is not None), steps[-1])


def all_reduces_per_step(path: str | Path) -> list[tuple[int, int | None]]:
    """[(all_reduce calls, bytes)] for each profiled step (`ProfilerStep#N` window) of one rank's chrome trace.

    CPU/gloo traces: the `gloo:all_reduce` events that start inside the step's window, their recorded shapes and
    dtypes giving the bytes. GPU/NCCL traces: the `record_param_comms` events of all_reduces, with their element
    count and dtype. gloo on CUDA tensors records no shapes: calls are counted, bytes are None.
    """
    events = [e for e in load_trace(path)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events  # CPU markers: a GPU trace repeats them on the GPU
                   if e["name"].startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation")
    comm = [e for e in events if e["name"] == "gloo:all_reduce"] or [
        e for e in events if e["name"] == "record_param_comms"
        and str(e.get("args", {}).get("Collective name", "")).startswith("allreduce")]
    if not comm:
        raise TraceError(f"{path} holds no all_reduce events (neither gloo:all_reduce nor NCCL's "
                         "record_param_comms): was the run profiled with record_shapes=True?")
    out = []
    for start, end in steps:
        sizes = [_all_reduce_bytes(e) for e in comm if start <= e["ts"] < end]
        out.append((len(sizes), None if None in sizes else sum(sizes)))
    return out
