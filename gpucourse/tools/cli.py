"""The `gpucourse` command: launch, doctor, runs, hardware, progress (and the course's other tools).

Exit codes: 0 success; 1 the job (or check) failed; 2 bad input; 124 timed out or stalled; 130 interrupted.
Bad input never shows a Python traceback: one line saying what was wrong and what to do.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from .argtypes import positive_int, positive_seconds

EXIT_CODES = {"ok": 0, "failed": 1, "timeout": 124, "stalled": 124, "interrupted": 130}
# Modules that add their own subcommands with add_cli(subparsers), kept out of this file.
PLUGINS = ("gpucourse.tools.grading.runner", "gpucourse.tools.course", "gpucourse.run.slurm", "gpucourse.tools.release",
           "gpucourse.tools.gpu_check", "gpucourse.tools.workspace", "gpucourse.tools.scripts")


def _launch(args) -> int:
    from ..run.launcher import launch

    result = launch(args.script, nproc=args.nproc, args=args.script_args, backend=args.backend,
                    timeout=args.timeout, stall_timeout=args.stall_timeout, name=args.name, check=False,
                    live="off" if args.quiet else "text", nnodes=args.nnodes, node_rank=args.node_rank,
                    rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts)
    if not result.ok and result.error:
        print(f"gpucourse: {result.error}", file=sys.stderr)
    return EXIT_CODES.get(result.status, 1)


DOCTOR_SCRIPT = Path(__file__).with_name("doctor_job.py")


def _doctor(args) -> int:
    from ..run.hardware import hardware_report
    from ..run.launcher import launch

    report = hardware_report()
    print(report, "\n", flush=True)
    print(f"Smoke job: {args.nproc}-rank all-reduce with backend {args.backend} ...", flush=True)
    started = time.monotonic()
    result = launch(DOCTOR_SCRIPT, nproc=args.nproc, backend=args.backend, timeout=args.timeout,
                    name="doctor", check=False, live="off")
    if not result.ok:
        print(f"doctor: FAILED — {result.error or result.status}\n(logs: {result.run_dir})", file=sys.stderr)
        return 1
    rec = result.metrics[0][-1]
    print(f"doctor: OK — all-reduce over {rec['world_size']} rank(s) ({rec['backend']}, {rec['device']}) "
          f"gave {rec['sum']:g} as expected, in {time.monotonic() - started:.1f} s")
    return 0


def _runs(args) -> int:
    from ..run.paths import runs_root
    from ..run.result import list_runs

    if args.dir and not Path(args.dir).expanduser().is_dir():
        raise UsageError(f"--dir {args.dir} is not a folder: give the runs directory (default: {runs_root()})")
    runs = list_runs(args.dir)
    if not runs:
        print(f"no runs under {args.dir or runs_root()}")
        return 0
    print(f"{'run':<44} {'status':<12} {'ranks':>5} {'duration':>9}  root cause")
    for r in runs[-args.last:]:
        dur = f"{r.duration:.1f} s" if r.duration is not None else "—"
        cause = r.error.summary[:60] if r.error else ""
        print(f"{r.name:<44} {r.status:<12} {r.world_size:>5} {dur:>9}  {cause}")
    return 0


def _diagnose(args) -> int:
    from ..run.result import load_run

    run_dir = Path(args.run_dir).expanduser()
    try:
        result = load_run(run_dir)
    except FileNotFoundError as err:
        raise UsageError(f"{err}: give a run directory (see `gpucourse runs`)") from None
    diagnosis = result.diagnosis()
    if diagnosis is None:
        print(f"{result.name}: {result.status}; no diagnosis (the run finished, or left no Flight Recorder dump)")
        return 1 if not result.ok else 0
    print(json.dumps(diagnosis.to_dict()) if args.json else f"{result.name}: {result.status}\n{diagnosis}")
    return 0


def _dryrun(args) -> int:
    from ..models.costs import SYSTEMS, dryrun_step_time
    from ..run.dryrun import DryRunFailed, dryrun
    from ..viz.reports import dryrun_text

    if args.system not in SYSTEMS:
        raise UsageError(f"--system {args.system}: choose one of {', '.join(sorted(SYSTEMS))}")
    if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        raise UsageError(f"--json {args.json}: give a file name in a folder that exists")
    try:
        result = dryrun(args.script, world=args.world, ranks=args.ranks, args=args.script_args,
                        timeout=args.timeout, fake_tensors=args.fake_tensors)
    except DryRunFailed as err:
        print(f"gpucourse dryrun: {err}", file=sys.stderr)
        return 1
    for rank in result["ranks"]:
        rank["predicted"] = dryrun_step_time(rank, system=args.system)
    if args.json:
        out = Path(args.json)
        tmp = out.with_name(out.name + ".tmp")  # whole or not at all, and only once every rank succeeded
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)
    print(dryrun_text(result))
    return 0


def _hardware(args) -> int:
    from ..run.hardware import hardware_report

    print(hardware_report())
    return 0


def _progress(args) -> int:
    from ..viz import problems

    path = Path(args.file) if args.file else problems.progress_file()
    rows = problems.progress(path)
    if not path.is_file():
        print(f"No answers recorded yet ({path}): a chapter's problems.show(\"12\") cell records each one you check.")
    else:
        print(f"Problems answered right, from {path}:")
    for chapter, row in rows.items():
        print(f"  chapter {chapter}: {row['right']} of {row['problems']} right ({row['tried']} tried)")
    total = sum(row["right"] for row in rows.values()), sum(row["problems"] for row in rows.values())
    print(f"  all: {total[0]} of {total[1]} right")
    return 0


class UsageError(ValueError):
    """A command-line request that cannot be carried out as given (checked by the CLI itself)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors, as one line (it would print the whole usage first). Subcommands inherit it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def bad_input_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean "the request was wrong": each says what was wrong and what to do."""
    from ..run.dryrun import DryRunError
    from ..run.launcher import LaunchConfigError
    from ..run.slurm import SlurmConfigError
    from .course import CourseError
    from .exercises import ExerciseError
    from .gpu_check import GpuCheckError
    from .release import ReleaseError
    from .workspace import WorkspaceError

    return (UsageError, DryRunError, LaunchConfigError, ExerciseError, SlurmConfigError, CourseError, ReleaseError,
            GpuCheckError, WorkspaceError)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="gpucourse", description="Tools of the gpucourse course.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="run a script as a torchrun job",
                       usage="gpucourse launch SCRIPT [-n N] [--timeout S] [-- SCRIPT ARGS]")
    p.add_argument("script")
    p.add_argument("-n", "--nproc", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--backend", default="auto", help="auto (default), gloo, nccl or mpi")
    p.add_argument("--timeout", type=positive_seconds, help="stop the job after S seconds")
    p.add_argument("--stall-timeout", type=positive_seconds, help="stop when no rank logs anything for S seconds")
    p.add_argument("--name", help="run name (default: the script's name)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes; >1 without --rdzv-endpoint simulates them here")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", help="host:port of the rendezvous for a real multi-host job")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("-q", "--quiet", action="store_true", help="do not stream the ranks' output")
    p.set_defaults(func=_launch)

    p = sub.add_parser("doctor", help="hardware report and a smoke all-reduce job")
    p.add_argument("-n", "--nproc", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=positive_seconds, default=120.0)
    p.set_defaults(func=_doctor)

    p = sub.add_parser("runs", help="list runs with status and duration")
    p.add_argument("--dir", help="runs directory (default: runs/ or $GPUCOURSE_RUNS_DIR)")
    p.add_argument("--last", type=positive_int, default=30, help="show the last N runs (default 30)")
    p.set_defaults(func=_runs)

    p = sub.add_parser("diagnose", help="which rank and which collective a stalled or failed run points to")
    p.add_argument("run_dir", help="the run directory (gpucourse runs lists them)")
    p.add_argument("--json", action="store_true", help='print {"ranks", "op", "seq_id", "kind", "evidence", "group", "group_ranks", "mesh_dim"}')
    p.set_defaults(func=_diagnose)

    p = sub.add_parser("dryrun", help="run a script as rank r of a world of N, with a fake process group",
                       usage="gpucourse dryrun SCRIPT --world N [--rank R]... [--fake-tensors] [--json F] "
                             "[-- SCRIPT ARGS]")
    p.add_argument("script")
    p.add_argument("--world", type=int, required=True, help="ranks in the simulated job (1 to 1,048,576)")
    p.add_argument("--rank", type=int, action="append", dest="ranks",
                   help="a rank to simulate (repeat for several; default: the first and the last)")
    p.add_argument("--json", help="also write the report to this file")
    p.add_argument("--fake-tensors", action="store_true",
                   help="the rank's tensors have shapes and no storage: a model larger than this machine's memory")
    p.add_argument("--system", default="h100-sxm", help="the system the step time is modelled on (default h100-sxm)")
    p.add_argument("--timeout", type=positive_seconds, default=600.0, help="stop after S seconds (default 600)")
    p.set_defaults(func=_dryrun)

    p = sub.add_parser("hardware", help="what this machine has and what the launcher would choose")
    p.set_defaults(func=_hardware)

    p = sub.add_parser("progress", help="per chapter, how many of its numeric problems you answered right")
    p.add_argument("--file", help="the progress file (default: mywork/problems-progress.jsonl of this checkout, "
                                  "or $GPUCOURSE_PROGRESS)")
    p.set_defaults(func=_progress)

    for name in PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show a character gets '?', not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" belongs to the script, not to us.
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:split])
    args.script_args = argv[split + 1:]
    try:
        return args.func(args)
    except bad_input_errors() as err:  # the one place where bad input becomes one line and exit code 2
        message = " ".join(line.strip() for line in str(err).splitlines())
        print(f"gpucourse {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpucourse: interrupted; the job was stopped and nothing was left running.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
