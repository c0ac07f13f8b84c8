"""The learner's own copy of the chapters: `make lab` opens it, so JupyterLab's autosave never touches the course.

    gpucourse workspace                 copy every chapter not yet in mywork/, list chapters updated since copied
    gpucourse workspace --refresh 05    take the course's current chapter 05; your copy is kept beside it

mywork/ sits beside notebooks/, so a chapter's relative paths (../scripts, ../exercises, ../solutions) mean the
same from either. The checkout is the one the command is run in (the working directory or a folder above it): with
two clones and one environment, each clone gets its own mywork/. Run outside any clone, it is the checkout the
package was installed from; the output names the folder either way.
What was copied is recorded in mywork/.copied.json (chapter file -> sha256 of the course's
version at copy time): a chapter whose course version has changed since is reported, never overwritten.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import shutil
from pathlib import Path

from .course import find_notebooks, notebooks_dir

WORKSPACE = "mywork"
RECORD = ".copied.json"


class WorkspaceError(ValueError):
    """A refresh names no chapter, or the record is unreadable: what was wrong and what to do."""


def checkout_of(folder: Path) -> Path | None:
    """The course checkout that `folder` is in (it, or the nearest folder above it, holding pyproject.toml of the
    gpucourse project and a notebooks/ folder), or None."""
    for root in [folder.resolve(), *folder.resolve().parents]:
        project = root / "pyproject.toml"
        if (root / "notebooks").is_dir() and project.is_file() and 'name = "gpucourse"' in project.read_text():
            return root
    return None


def course_notebooks(cwd: Path | None = None) -> Path:
    """The notebooks/ folder `gpucourse workspace` copies from: that of the checkout it is run in, else the
    package's own (CourseError when there is neither)."""
    root = checkout_of(Path.cwd() if cwd is None else cwd)
    return root / "notebooks" if root else notebooks_dir()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_record(folder: Path) -> dict[str, str]:
    path = folder / RECORD
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise WorkspaceError(f"{path} is not valid JSON ({err}): delete it and run `gpucourse workspace` again "
                             "(your notebooks are not touched)") from None


def sync(folder: Path, chapters: list[Path] | None = None) -> dict[str, list[str]]:
    """Copy the chapters missing from `folder`; {"copied": [...], "updated": [...], "kept": [...]} by file name.
    "updated": the course's version changed since it was copied (the copy is left as it is)."""
    chapters = find_notebooks() if chapters is None else chapters
    folder.mkdir(parents=True, exist_ok=True)
    record = _read_record(folder)
    out = {"copied": [], "updated": [], "kept": []}
    for source in chapters:
        mine = folder / source.name
        if not mine.exists():
            shutil.copy2(source, mine)
            record[source.name] = digest(source)
            out["copied"].append(source.name)
        elif record.get(source.name) not in (None, digest(source)):
            out["updated"].append(source.name)
        else:
            out["kept"].append(source.name)
    (folder / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return out


def refresh(folder: Path, chapter: str, chapters: list[Path] | None = None) -> tuple[Path, Path | None]:
    """The course's current version of `chapter` ("05" or a file name) into `folder`; the learner's copy, if any,
    renamed to <name>-mine-<date>.ipynb first. (new copy, kept copy or None)."""
    chapters = find_notebooks() if chapters is None else chapters
    found = [p for p in chapters if p.name == chapter or p.name.startswith(f"{chapter}_")]
    if len(found) != 1:
        names = ", ".join(p.name.split("_")[0] for p in chapters)
        raise WorkspaceError(f"no single chapter {chapter!r}: name one of {names}")
    source = found[0]
    mine, kept = folder / source.name, None
    if mine.exists():
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        kept = mine.with_name(f"{mine.stem}-mine-{stamp}.ipynb")
        mine.rename(kept)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, mine)
    record = _read_record(folder)
    record[source.name] = digest(source)
    (folder / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return mine, kept


def add_cli(sub) -> None:
    p = sub.add_parser("workspace", help="your own copy of the chapters (mywork/): what `make lab` opens")
    p.add_argument("--dir", default=None, help=f"the folder (default: {WORKSPACE}/ beside notebooks/)")
    p.add_argument("--refresh", metavar="CHAPTER", help="take the course's current version of this chapter "
                   "(e.g. 05); your copy is kept beside it")
    p.set_defaults(func=_main)


def _main(args) -> int:
    source = course_notebooks()
    chapters = find_notebooks(folder=source)
    folder = Path(args.dir) if args.dir else source.parent / WORKSPACE
    print(f"the course's chapters: {source}/")
    if args.refresh:
        new, kept = refresh(folder, args.refresh, chapters)
        print(f"{new}: the course's current version" + (f"; yours is now {kept.name}" if kept else ""))
        return 0
    done = sync(folder, chapters)
    if done["copied"]:
        print(f"copied into {folder}/: {', '.join(done['copied'])}")
    for name in done["updated"]:
        print(f"{name}: the course has a newer version than your copy (kept). "
              f"To take it: gpucourse workspace --refresh {name.split('_')[0]} (yours is kept beside it)")
    print(f"your chapters: {folder}/ (the course's own stay untouched in notebooks/)")
    return 0
