"""`gpucourse scripts`: write scripts/ from the chapters' %%writefile cells, the one source of every chapter script.

    gpucourse scripts            # write each chapter script that differs from its cell (says which)
    gpucourse scripts --check    # write nothing; exit 1 naming each script that differs (what CI's test checks)

A chapter writes its script in a `%%writefile ../scripts/NAME.py` cell, so that a learner sees and edits it where it
is taught; scripts/ holds the same text for the launcher, the graders, the dry runs and the tests. Edit the cell,
then run this: it reads the notebooks as JSON (nothing is executed) and writes what `%%writefile` would write (the
cell's body and a final newline).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .exercises import course_root

WRITEFILE = re.compile(r"^%%writefile\s+(\S+)\s*\n")


def written_scripts(notebooks: Path) -> dict[Path, tuple[str, str]]:
    """{script path: (text the cell writes, notebook name)} for every %%writefile cell of notebooks/*.ipynb.
    Raises ValueError for a cell that writes outside scripts/ or a script two cells write differently."""
    out: dict[Path, tuple[str, str]] = {}
    scripts = (notebooks.parent / "scripts").resolve()
    for nb in sorted(notebooks.glob("*.ipynb")):
        for cell in json.loads(nb.read_text(encoding="utf-8"))["cells"]:
            source = "".join(cell.get("source", ""))
            m = WRITEFILE.match(source) if cell.get("cell_type") == "code" else None
            if not m:
                continue
            target = (notebooks / m.group(1)).resolve()
            if target.parent != scripts:
                raise ValueError(f"{nb.name} writes {m.group(1)}, outside scripts/: chapter scripts live there")
            body = source[m.end():]
            text = body if body.endswith("\n") else body + "\n"
            if target in out and out[target][0] != text:
                raise ValueError(f"{target.name} is written differently by {out[target][1]} and {nb.name}")
            out[target] = (text, nb.name)
    return out


def stale(notebooks: Path) -> list[Path]:
    """The scripts whose file differs from (or lacks) what their chapter's cell writes."""
    return [p for p, (text, _) in written_scripts(notebooks).items()
            if not p.exists() or p.read_text(encoding="utf-8") != text]


def write(notebooks: Path) -> list[Path]:
    """Write every stale script; returns the ones written."""
    written = written_scripts(notebooks)
    changed = stale(notebooks)
    for path in changed:
        path.write_text(written[path][0], encoding="utf-8")
    return changed


def add_cli(sub) -> None:
    p = sub.add_parser("scripts", help="write scripts/ from the chapters' %%%%writefile cells (their one source)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a script differs from its cell")
    p.set_defaults(func=_main)


def _main(args) -> int:
    notebooks = course_root() / "notebooks"
    try:
        found = written_scripts(notebooks)
        changed = stale(notebooks) if args.check else write(notebooks)
    except ValueError as err:
        print(f"gpucourse scripts: {err}")
        return 2
    for path in changed:
        print(f"{'differs' if args.check else 'wrote'}: scripts/{path.name} (from {found[path][1]})")
    print(f"{len(found)} chapter scripts, {len(changed)} {'differ' if args.check else 'written'}")
    return 1 if args.check and changed else 0
