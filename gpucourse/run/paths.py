"""Both sides: where runs are written, `runs/` at the project root, or $GPUCOURSE_RUNS_DIR."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from .contract import RUN_DIR_ENV, RUNS_ENV  # noqa: F401  (RUN_DIR_ENV: still importable from here)


def project_root() -> Path | None:
    """The checkout this package lives in (editable install), or None for a plain install."""
    root = Path(__file__).resolve().parents[2]  # gpucourse/run/paths.py -> the checkout
    return root if (root / "pyproject.toml").exists() and (root / "notebooks").is_dir() else None


def runs_root() -> Path:
    """Absolute runs directory: $GPUCOURSE_RUNS_DIR, else <project>/runs, else ./runs."""
    if os.environ.get(RUNS_ENV):
        return Path(os.environ[RUNS_ENV]).expanduser().resolve()
    root = project_root()
    return (root / "runs") if root else Path.cwd().resolve() / "runs"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


def new_run_dir(name: str, root: Path | None = None) -> Path:
    """`<root>/<name>-<YYYYmmdd-HHMMSS>[-k]`, created atomically so parallel launches never share one."""
    root = root or runs_root()
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        path = root / (f"{slug(name)}-{stamp}" + (f"-{k}" if k else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a fresh run directory under {root}")
