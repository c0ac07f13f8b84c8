"""Batch execution of the course's notebooks with papermill: `gpucourse course` and `make course`.

Each chapter notebook has a cell tagged `parameters`; its metadata `gpucourse.smoke` holds the tiny
values CI uses (`--smoke`). Executed copies go to an output folder, never over the sources nor over
any notebook that is not itself an executed copy.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .argtypes import positive_seconds
from ..run.paths import project_root

NOTEBOOK_GLOB = "[0-9][0-9]*_*.ipynb"
# A chapter's file: its key (two digits, and a letter for a chapter that follows another of the same number, as
# 07b follows 07), "_", its name. Sorted by file name, 07_... comes before 07b_... ("_" sorts before letters).
CHAPTER_NAME = re.compile(r"(\d\d[a-z]?)_\w+\.ipynb")


class CourseError(ValueError):
    """The request cannot be run as given (unknown notebook, broken notebook file, bad output folder)."""


def notebooks_dir() -> Path:
    root = project_root()
    if root is None:
        raise CourseError("the course notebooks are not next to this package: run from a clone of the course")
    return root / "notebooks"


def chapter_key(path: Path) -> str:
    """A chapter's key, the part of its file name before the first "_": "07" for 07_zero_and_fsdp.ipynb, "07b"
    for 07b_precision_and_recomputation.ipynb. What per-chapter tables and file names are keyed by."""
    found = CHAPTER_NAME.fullmatch(Path(path).name)
    if not found:
        raise CourseError(f"{Path(path).name} is not a chapter's file name (NN_name.ipynb or NNx_name.ipynb)")
    return found.group(1)


def find_notebooks(only: list[str] | None = None, folder: Path | None = None) -> list[Path]:
    """Chapter notebooks in order (of `folder`, default: the notebooks/ of the checkout this package is in); `only`
    keeps those whose name starts with or contains one of the names ("07" keeps 07 and 07b; "07b" or "07_" one)."""
    books = sorted(p for p in (folder or notebooks_dir()).glob(NOTEBOOK_GLOB) if CHAPTER_NAME.fullmatch(p.name))
    if not only:
        return books
    picked = [nb for nb in books if any(nb.stem.startswith(n) or n in nb.stem for n in only)]
    unknown = [n for n in only if not any(nb.stem.startswith(n) or n in nb.stem for nb in books)]
    if unknown:
        names = ", ".join(nb.stem for nb in books)
        raise CourseError(f"no notebook matches {', '.join(unknown)}; the notebooks are: {names}")
    return picked


def read_notebook(path: Path):
    """The notebook at `path`, or CourseError saying why it is not one (not JSON, not a notebook, unreadable)."""
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception as err:  # NotJSONError, a schema ValidationError, OSError, UnicodeDecodeError...
        why = "not JSON" if isinstance(err, nbformat.reader.NotJSONError) else str(err).strip().splitlines()[0]
        raise CourseError(f"{path} is not a valid notebook ({why}): restore it (git checkout -- {path}) "
                          "or give another notebook") from None


def smoke_parameters(path: Path) -> dict:
    return dict(read_notebook(path).metadata.get("gpucourse", {}).get("smoke", {}))


def with_parameters(path: Path, out: Path, parameters: dict) -> Path:
    """Write to `out` a copy of the notebook with `parameters` injected the way papermill injects them (a cell
    tagged `injected-parameters` right after the cell tagged `parameters`), for running it elsewhere than
    through papermill: in JupyterLab, as the browser pass does with the smoke values CI uses."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    read_notebook(path)  # a clear CourseError for a file that is not a notebook
    nbformat.write(parameterize_notebook(load_notebook_node(str(path)), parameters), out)
    return out


def _check_output(path: Path, out: Path) -> None:
    """`out` may be written: nothing is there, or an executed copy (papermill's mark) of an earlier run."""
    if out.resolve() == path.resolve():
        raise CourseError(f"the output folder {out.parent} holds the source notebooks: executed copies would "
                          "overwrite them; choose another --output folder")
    if out.exists():
        try:
            executed = "papermill" in json.loads(out.read_bytes()).get("metadata", {})
        except (OSError, ValueError, AttributeError):
            executed = False
        if not executed:
            raise CourseError(f"{out} exists and is not an executed copy from an earlier run: it is left "
                              "untouched; choose another --output folder")


def _make_output_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CourseError(f"cannot create the output folder {output_dir}: {err.strerror or err}; "
                          "choose another --output folder") from None


@dataclass
class NotebookRun:
    notebook: str
    status: str  # "ok" | "failed"
    duration: float
    output: Path
    failing_cell: int | None = None
    error: str = ""


def local_kernel_manager():
    """The kernel manager of the course's batch runs: jupyter_client's, talking to the kernel over Unix sockets (ZeroMQ
    `ipc`) instead of TCP on 127.0.0.1. Over TCP, ipykernel 7 warns once per kernel that its traffic is not
    encrypted (right: any local user could connect to the ports), which printed between `gpucourse course`'s
    progress lines once per notebook. The kernel runs on this machine, so sockets in the user's private runtime
    folder (mode 0700) need no encryption, and ipykernel has nothing to warn about."""
    from jupyter_client import AsyncKernelManager
    from traitlets import CaselessStrEnum

    class LocalKernelManager(AsyncKernelManager):
        transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

    return LocalKernelManager


def execute_notebook(path: Path, output_dir: Path, *, smoke: bool = False, parameters: dict | None = None,
                     cell_timeout: float | None = 600, kernel: str = "python3") -> NotebookRun:
    """Run one notebook with papermill in its own folder; never raises for an error inside the notebook.

    Raises CourseError, before running anything, for a file that is not a notebook, a bad cell_timeout or
    an output that must not be overwritten (the source itself, or a notebook that is not an executed copy).
    """
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    path, output_dir = Path(path), Path(output_dir)
    _check_cell_timeout(cell_timeout)
    read_notebook(path)
    params = {**(smoke_parameters(path) if smoke else {}), **(parameters or {})}
    out = output_dir / path.name
    _check_output(path, out)
    _make_output_dir(output_dir)
    os.environ.setdefault("GPUCOURSE_LIVE", "text")  # plain, whole lines in the executed notebook
    start = time.monotonic()
    try:
        pm.execute_notebook(str(path), str(out), parameters=params, cwd=str(path.parent), kernel_name=kernel,
                            execution_timeout=cell_timeout, progress_bar=False, log_output=False,
                            kernel_manager_class=local_kernel_manager())
    except PapermillExecutionError as err:
        return NotebookRun(path.stem, "failed", time.monotonic() - start, out, err.cell_index,
                           f"{err.ename}: {err.evalue}")
    except Exception as err:  # a cell timeout or a dead kernel: papermill raises other types
        return NotebookRun(path.stem, "failed", time.monotonic() - start, out, _failing_cell(out),
                           f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
    return NotebookRun(path.stem, "ok", time.monotonic() - start, out)


def _failing_cell(executed: Path) -> int | None:
    """The cell that was running when execution stopped (papermill marks it, even on a timeout)."""
    try:
        import nbformat

        nb = nbformat.read(executed, as_version=4)
    except Exception:
        return None
    for i, cell in enumerate(nb.cells):
        if cell.get("metadata", {}).get("papermill", {}).get("status") in ("running", "failed"):
            return i
    return None


def _check_cell_timeout(cell_timeout) -> None:
    if cell_timeout is not None and (isinstance(cell_timeout, bool) or not isinstance(cell_timeout, (int, float))
                                     or not cell_timeout > 0):
        raise CourseError(f"cell_timeout must be a positive number of seconds or None, not {cell_timeout!r}")


def run_course(*, smoke: bool = False, only: list[str] | None = None, output: Path | None = None,
               cell_timeout: float | None = 600) -> list[NotebookRun]:
    from tqdm.auto import tqdm

    books = find_notebooks(only)
    output = Path(output or (notebooks_dir().parent / "executed")).expanduser().resolve()
    if output.exists() and not output.is_dir():
        raise CourseError(f"--output {output} is a file, not a folder: choose a folder for the executed notebooks")
    _check_cell_timeout(cell_timeout)
    for path in books:  # every problem is reported before the first notebook runs for minutes
        read_notebook(path)
        _check_output(path, output / path.name)
    results = []
    bar = tqdm(books, desc="course", unit="notebook")
    for path in bar:
        bar.set_postfix_str(path.stem)
        results.append(execute_notebook(path, output, smoke=smoke, cell_timeout=cell_timeout))
    bar.close()
    return results


CHECK_MARK = "NBVAL_CHECK_OUTPUT"


def expected_outputs_file(path: Path) -> Path:
    """Where the outputs nbval compares a notebook's checked cells against are kept (not in the notebook,
    which is stored stripped)."""
    return path.parent / "checked_outputs" / f"{path.stem}.json"


def checked_cell_outputs(executed: Path) -> dict:
    """{cell id: outputs} of the cells marked NBVAL_CHECK_OUTPUT in an executed notebook."""
    import nbformat

    nb = nbformat.read(executed, as_version=4)
    return {c.id: c.outputs for c in nb.cells if c.cell_type == "code" and CHECK_MARK in c.source}


def refresh_checked_outputs(path: Path, executed: Path) -> int:
    """Store the outputs of the checked cells of an executed run (learner defaults) as nbval's reference."""
    import json

    outputs = checked_cell_outputs(executed)
    target = expected_outputs_file(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(outputs, indent=1, sort_keys=True) + "\n")
    return len(outputs)


def with_expected_outputs(path: Path, out: Path) -> Path:
    """A copy of the stripped notebook with the stored reference outputs put back, for nbval --nbval-lax."""
    import json

    import nbformat

    nb = nbformat.read(path, as_version=4)
    expected = json.loads(expected_outputs_file(path).read_text())
    for cell in nb.cells:
        if cell.get("id") in expected:
            cell.outputs = [nbformat.from_dict(o) for o in expected[cell.id]]
            cell.execution_count = 1  # nbval skips cells it thinks were never run
    nbformat.write(nb, out)
    return out


def table(results: list[NotebookRun]) -> str:
    lines = [f"{'notebook':<36} {'status':<7} {'seconds':>8}  failing cell / error"]
    for r in results:
        where = f"cell {r.failing_cell}: {r.error}" if r.status != "ok" else ""
        lines.append(f"{r.notebook:<36} {r.status:<7} {r.duration:>8.1f}  {where}")
    total = sum(r.duration for r in results)
    lines.append(f"{len(results)} notebook(s), {sum(r.status == 'ok' for r in results)} ok, {total:.0f} s in all")
    return "\n".join(lines)


def _cli(args) -> int:
    """Bad input raises CourseError; the CLI (cli.main) prints it as one line and exits 2."""
    if args.refresh_checked and args.smoke:
        raise CourseError("--refresh-checked runs the learner defaults; drop --smoke")
    results = run_course(smoke=args.smoke, only=args.only, output=args.output, cell_timeout=args.cell_timeout)
    print(table(results))
    if args.refresh_checked:
        for path, r in zip(find_notebooks(args.only), results):
            if r.status == "ok":
                print(f"{path.name}: {refresh_checked_outputs(path, r.output)} checked cell(s) refreshed")
    print(f"executed notebooks are in {results[0].output.parent}" if results else "")
    return 0 if all(r.status == "ok" for r in results) else 1


def add_cli(sub) -> None:
    p = sub.add_parser("course", help="execute the chapter notebooks in order (papermill)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, as in CI")
    p.add_argument("--only", nargs="+", metavar="NAME", help="notebooks to run, e.g. 00 01_collectives")
    p.add_argument("--output", type=Path, help="folder for executed notebooks (default: executed/)")
    p.add_argument("--cell-timeout", type=positive_seconds, default=600, help="seconds per cell (default 600)")
    p.add_argument("--refresh-checked", action="store_true",
                   help="maintainers: store the outputs of NBVAL_CHECK_OUTPUT cells back into the sources")
    p.set_defaults(func=_cli)
