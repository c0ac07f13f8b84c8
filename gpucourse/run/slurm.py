"""In the launcher's process (the CLI, a notebook): for Slurm, write the sbatch script that runs a course script on N
nodes, one torchrun agent per node.

    gpucourse slurm scripts/02_ddp.py --nodes 2 --gpus-per-node 4 -- --steps 100
    sbatch runs/slurm/02_ddp.sbatch

Why this shape (the same one `gpucourse.launch(nnodes=...)` simulates on one machine):
- Slurm starts ONE task per node (`--ntasks-per-node=1`); that task is torchrun, which starts the node's
  ranks, watches them and tears them all down when one fails. Slurm never has to know about ranks.
- The nodes meet through torchrun's c10d rendezvous on the first allocated host, found at run time
  (`scontrol show hostnames`), keyed by the job id, so `--nnodes` comes from `$SLURM_NNODES`.
- Every rank of every node writes its `gpucourse.run.runtime` metrics into one run directory under the runs
  dir (`$GPUCOURSE_RUNS_DIR`, resolved now), which must be on a filesystem all nodes share.
- Slurm's own logs go to `--output-dir`: `<job>-<jobid>.out/.err` for the batch script on the first
  node, `<job>-<jobid>-<node>.out/.err` for each node's torchrun and its ranks.
"""
from __future__ import annotations

import os
import re
import shlex
import time as _time
from collections.abc import Sequence
from pathlib import Path

from .paths import runs_root, slug

# sbatch --time accepts: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
TIME_RE = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")
TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
# Names that go into '#SBATCH' lines, which sbatch splits on whitespace.
NAME_RE = re.compile(r"[A-Za-z0-9_.,+-]+")


class SlurmConfigError(ValueError):
    """The request cannot make a valid sbatch script; the message says what to change."""


def _check_int(name: str, value, minimum: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SlurmConfigError(f"{name}={value!r} is out of range: {hint}")
    return value


def _check_name(what: str, value: str | None) -> str | None:
    if value is not None and not NAME_RE.fullmatch(value):
        raise SlurmConfigError(f"{what} {value!r} may only contain letters, digits and . _ , + -")
    return value


def _check_dir(what: str, path: Path) -> Path:
    # #SBATCH --output=PATH cannot be quoted, and '%' starts one of Slurm's filename patterns.
    if re.search(r"[\s%]", str(path)):
        raise SlurmConfigError(f"{what} {str(path)!r} contains a space or '%', which Slurm's log paths "
                               "cannot take: choose another directory")
    return path


def log_dir(output_dir=None) -> Path:
    """Where Slurm writes the job's logs: output_dir, or <runs dir>/slurm."""
    return Path(output_dir or runs_root() / "slurm").expanduser().resolve()


def _ranks_per_node(gpus_per_node: int, procs_per_node: int | None) -> int:
    if gpus_per_node > 0:
        if procs_per_node not in (None, gpus_per_node):
            raise SlurmConfigError(f"procs_per_node={procs_per_node} with gpus_per_node={gpus_per_node}: "
                                   "GPU nodes run one rank per GPU; leave --procs-per-node out")
        return gpus_per_node
    if procs_per_node is None:
        raise SlurmConfigError("gpus_per_node=0 (CPU nodes) needs procs_per_node (--procs-per-node): "
                               "how many ranks per node")
    return _check_int("procs_per_node", procs_per_node, 1, "ranks per node must be at least 1")


def sbatch_script(script, *, nodes: int, gpus_per_node: int, procs_per_node: int | None = None,
                  args: Sequence[str] = (), job_name: str | None = None, time: str = "00:30:00",
                  partition: str | None = None, account: str | None = None, port: int = 29500,
                  python: str | None = None, output_dir=None, cpus_per_task: int | None = None,
                  max_restarts: int = 0) -> str:
    """The text of an sbatch script running `script` on `nodes` nodes, one torchrun agent per node.

    gpus_per_node: GPUs (= ranks, NCCL) per node; 0 means CPU nodes running `procs_per_node` gloo ranks.
    python: run torchrun as `PYTHON -m torch.distributed.run` (default: `torchrun` from the job's PATH).
    output_dir: where Slurm writes its logs (default: <runs dir>/slurm); it must exist before `sbatch`
    (write_sbatch creates it). cpus_per_task: CPUs per node's task (default: one per rank).
    max_restarts: how many times torchrun restarts the job's ranks after a failure (chapter 08: the
    script must resume from its last checkpoint).
    Raises SlurmConfigError (a ValueError) naming what is wrong.
    """
    _check_int("nodes", nodes, 1, "a job needs at least 1 node")
    _check_int("gpus_per_node", gpus_per_node, 0, "use 0 for CPU nodes, or the number of GPUs per node")
    nproc = _ranks_per_node(gpus_per_node, procs_per_node)
    cpus = _check_int("cpus_per_task", nproc if cpus_per_task is None else cpus_per_task, 1,
                      "each node's task needs at least 1 CPU")
    _check_int("max_restarts", max_restarts, 0, "use 0 (no restart) or the number of restarts allowed")
    _check_int("port", port, 1, "use a free TCP port of the head node (default 29500)")
    if port > 65535:
        raise SlurmConfigError(f"port={port} is out of range: TCP ports go up to 65535")
    if not isinstance(time, str) or not TIME_RE.fullmatch(time):
        raise SlurmConfigError(f"time {time!r} is not a Slurm time limit: use {TIME_FORMATS}")
    if not isinstance(script, (str, os.PathLike)):
        raise SlurmConfigError(f"script must be the path of a Python file, not {script!r}")
    path = Path(script).expanduser().resolve()
    if path.is_dir():
        raise SlurmConfigError(f"script {script} is a directory: give the path of a Python file in it")
    if not path.is_file():
        raise SlurmConfigError(f"script not found: {script}")
    from .launcher import LaunchConfigError, script_args

    try:
        args = script_args(args)  # the launcher's rule: strings, numbers and paths
    except LaunchConfigError as err:
        raise SlurmConfigError(str(err)) from None
    job_name = _check_name("job name", job_name) or slug(path.stem)
    _check_name("partition", partition)
    _check_name("account", account)
    out = _check_dir("output directory", log_dir(output_dir))
    runs = runs_root()
    launcher = f"{shlex.quote(python)} -m torch.distributed.run" if python else "torchrun"
    command = " ".join(shlex.quote(str(a)) for a in [path, *args])
    ranks = f"{gpus_per_node} GPU(s)" if gpus_per_node else f"{nproc} CPU rank(s)"
    stamp = _time.strftime("%Y-%m-%d %H:%M")

    lines = [
        "#!/bin/bash",
        f"# Written by `gpucourse slurm` on {stamp}: {path.name} on {nodes} node(s) x {ranks}.",
        "# Submit with: sbatch THIS_FILE",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={gpus_per_node}"] if gpus_per_node else []),
        f"#SBATCH --cpus-per-task={cpus}",
        f"#SBATCH --time={time}",
        *([f"#SBATCH --partition={partition}"] if partition else []),
        *([f"#SBATCH --account={account}"] if account else []),
        f"#SBATCH --output={out}/%x-%j.out",
        f"#SBATCH --error={out}/%x-%j.err",
        "set -eu",
        "",
        "# The nodes meet at the first allocated host.",
        "# SECURITY: torchrun's c10d rendezvous store has NO authentication and listens on the head node's",
        f"# port {port} on all its interfaces: anyone who can reach that port can join or disrupt the job.",
        "# Run it only on the cluster's internal network, where the compute nodes are not reachable from outside.",
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "",
        "# All ranks of all nodes log their gpucourse.run.runtime metrics into one run directory (shared filesystem).",
        f"export GPUCOURSE_RUNS_DIR={shlex.quote(str(runs))}",
        f'export GPUCOURSE_RUN_DIR="$GPUCOURSE_RUNS_DIR/{job_name}-slurm-$SLURM_JOB_ID"',
        'mkdir -p "$GPUCOURSE_RUN_DIR"',
        f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{max(1, cpus // nproc)}}}",
        *(["# CPU nodes: gloo between CPU processes.", "export GPUCOURSE_BACKEND=gloo GPUCOURSE_DEVICE=cpu"]
          if not gpus_per_node else []),
        *(["# Restarts: each worker group gets its own store; sharing the rendezvous store breaks gloo restarts",
           "# (pytorch issue 135712).", "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"] if max_restarts else []),
        "",
        (f'echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) x {nproc} rank(s), rendezvous $HEAD:{port}, '
         'metrics in $GPUCOURSE_RUN_DIR"'),
        "# One torchrun per node; --kill-on-bad-exit stops every node when one fails. --tee 3 prefixes each",
        "# line with its local rank ([default<r>]:) and keeps lines whole in the node's shared log.",
        f"srun --ntasks-per-node=1 --cpus-per-task={cpus} --kill-on-bad-exit=1 \\",
        f"    --output={out}/%x-%j-%N.out --error={out}/%x-%j-%N.err \\",
        f'  {launcher} --nnodes "$SLURM_NNODES" --nproc-per-node {nproc} --max-restarts {max_restarts} --tee 3 \\',
        f'    --rdzv-backend c10d --rdzv-endpoint "$HEAD:{port}" --rdzv-id "$SLURM_JOB_ID" \\',
        f"    {command}",
    ]
    return "\n".join(lines) + "\n"


def default_path(script, job_name: str | None = None, output_dir=None) -> Path:
    """Where write_sbatch puts the script: <output_dir>/<job name>.sbatch."""
    return log_dir(output_dir) / f"{job_name or slug(Path(script).stem)}.sbatch"


def write_sbatch(script, *, path=None, **kwargs) -> Path:
    """Write sbatch_script(script, **kwargs) to `path` (default: default_path) and create the log directory.

    Never overwrites: a file already at `path` raises SlurmConfigError, as does a path that cannot be written.
    """
    text = sbatch_script(script, **kwargs)
    target = Path(path).expanduser().resolve() if path else default_path(
        script, kwargs.get("job_name"), kwargs.get("output_dir"))
    if target.exists() or target.is_symlink():
        raise SlurmConfigError(f"{target} already exists and is left untouched: write to another file (-o FILE), "
                               "or remove it first")
    try:
        log_dir(kwargs.get("output_dir")).mkdir(parents=True, exist_ok=True)  # Slurm does not create it
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "x") as f:  # "x": never over a file that appeared meanwhile
            f.write(text)
        target.chmod(0o755)
    except OSError as err:
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(target) else ""
        raise SlurmConfigError(f"cannot write {target}: {err.strerror or err}{where}; "
                               "choose another place (-o FILE, --output-dir DIR)") from None
    return target


def _cli(args) -> int:
    """Bad input raises SlurmConfigError; the CLI (cli.main) prints it as one line and exits 2."""
    path = write_sbatch(args.script, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                        procs_per_node=args.procs_per_node, args=args.script_args, job_name=args.job_name,
                        time=args.time, partition=args.partition, account=args.account, port=args.port,
                        python=args.python, output_dir=args.output_dir, cpus_per_task=args.cpus_per_task,
                        max_restarts=args.max_restarts, path=args.path)
    print(f"wrote {path}")
    print(f"submit it with: sbatch {shlex.quote(str(path))}")
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("slurm", help="write an sbatch script: one torchrun per node, c10d rendezvous",
                       usage="gpucourse slurm SCRIPT --nodes N --gpus-per-node G [options] [-- SCRIPT ARGS]")
    p.add_argument("script")
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, metavar="G",
                   help="GPUs (= ranks) per node; 0 for CPU nodes with --procs-per-node ranks over gloo")
    p.add_argument("--procs-per-node", type=int, metavar="M", help="ranks per CPU node (with --gpus-per-node 0)")
    p.add_argument("--cpus-per-task", type=int, metavar="C", help="CPUs per node (default: one per rank)")
    p.add_argument("--time", default="00:30:00", help=f"time limit ({TIME_FORMATS}; default 00:30:00)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--job-name", help="default: the script's name")
    p.add_argument("--port", type=int, default=29500, metavar="PORT",
                   help="rendezvous port on the head node (default 29500)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart the ranks up to K times after a failure (the script must resume; default 0)")
    p.add_argument("--python", help="run torchrun with this Python (default: torchrun from the job's PATH)")
    p.add_argument("--output-dir", metavar="DIR", help="Slurm's log directory (default: <runs dir>/slurm)")
    p.add_argument("-o", "--path", help="where to write the script (default: <output dir>/<job name>.sbatch)")
    p.set_defaults(func=_cli)
