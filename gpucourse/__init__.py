"""gpucourse: the helper package of a hands-on course on multi-GPU and distributed training.

Four layers, each a folder; a module imports from its own layer and the ones listed before it only:

    run/     running jobs: the launcher, its agent, the ranks' runtime, what a run leaves on disk
    models/  numbers: units, the cost models, memory counts, what a profiler trace says
    viz/     what a learner sees: charts, timelines, widgets, quick checks
    tools/   what people run: the CLI, grading, releases, the course in batch, the GPU check

Importing the package is cheap (no torch): names are loaded on first use, so `import gpucourse`
in a shell or a notebook costs milliseconds and `gpucourse.runtime` pulls torch only inside a rank.
The names below are the course's public surface: `gpucourse.launch(...)`, `gpucourse.launch_all([...])`,
`from gpucourse import runtime, costs`.
"""
from importlib import import_module

__version__ = "0.1.0"

# name -> the module that defines it
_NAMES = {
    "launch": "gpucourse.run.launcher",
    "launch_all": "gpucourse.run.launcher",
    "LaunchError": "gpucourse.run.launcher",
    "RunResult": "gpucourse.run.result",
    "load_run": "gpucourse.run.result",
    "list_runs": "gpucourse.run.result",
    "hardware_report": "gpucourse.run.hardware",
    "analyze_run": "gpucourse.models.traces",
    "dryrun": "gpucourse.run.dryrun",
}
# the modules a chapter or a script imports by short name: `from gpucourse import runtime`
_MODULES = {
    "runtime": "gpucourse.run.runtime", "hardware": "gpucourse.run.hardware", "live": "gpucourse.run.live",
    "costs": "gpucourse.models.costs", "memory": "gpucourse.models.memory", "traces": "gpucourse.models.traces",
    "units": "gpucourse.models.units",
    "plots": "gpucourse.viz.plots", "timeline": "gpucourse.viz.timeline", "widgets": "gpucourse.viz.widgets",
    "quiz": "gpucourse.viz.quiz", "slurm": "gpucourse.run.slurm",
    "exercises": "gpucourse.tools.exercises", "grading": "gpucourse.tools.grading",
    "labconfig": "gpucourse.tools.labconfig",
}


def __getattr__(name):
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    if name in _MODULES:
        return import_module(_MODULES[name])
    raise AttributeError(f"module 'gpucourse' has no attribute {name!r}")


__all__ = sorted([*_NAMES, *_MODULES])

if "IPython" in __import__("sys").modules:  # in a notebook: words in printed output wrap whole (run/live.py)
    import_module("gpucourse.run.live").style_notebook_outputs()
