"""gpucourse: the helper package of a hands-on course on multi-GPU and distributed training.

Importing the package is cheap (no torch): names are loaded on first use, so `import gpucourse`
in a shell or a notebook costs milliseconds and `gpucourse.runtime` pulls torch only inside a rank.
"""
from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "launch": "gpucourse.launcher",
    "LaunchError": "gpucourse.launcher",
    "RunResult": "gpucourse.result",
    "load_run": "gpucourse.result",
    "list_runs": "gpucourse.result",
    "hardware_report": "gpucourse.hardware",
    "analyze_run": "gpucourse.traces",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpucourse' has no attribute {name!r}")


__all__ = sorted(_LAZY)
