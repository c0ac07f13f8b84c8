"""gpucourse: the helper package of a hands-on course on multi-GPU and distributed training.

Five layers, each a folder; a module imports from its own layer and the ones listed before it only:

    run/       running jobs: the launcher, its agent, the ranks' runtime, what a run leaves on disk
    models/    numbers: units, the cost models, memory counts, what a profiler trace says
    viz/       what a learner sees, shared by the chapters: charts, tables, timelines, widgets, quick checks
    chapters/  one module a chapter (ch05 for notebooks/05_*): the tables and figures only it shows
    tools/     what people run: the CLI, grading, releases, the course in batch, the GPU check

Importing the package is cheap (no torch): names are loaded on first use, so `import gpucourse`
in a shell or a notebook costs milliseconds and `gpucourse.runtime` pulls torch only inside a rank.
The names below are the course's public surface: `gpucourse.launch(...)`, `gpucourse.launch_all([...])`,
`from gpucourse import runtime, costs`; `import gpucourse.costs` and `from gpucourse.costs import busbw` give the
same module objects (gpucourse.models.costs: its layer path stays its name). A notebook imports only these, and
its chapter's module (`from gpucourse.chapters import ch05`), never a layer path (tests/unit/test_notebook_files.py);
inside the package every import names the layer (tests/unit/test_architecture.py).
"""
import sys
from importlib import import_module
from importlib.machinery import ModuleSpec

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
# the modules a notebook or a script imports by short name: `from gpucourse import runtime`, `from gpucourse.quiz import
# QuickCheck`
_MODULES = {
    "runtime": "gpucourse.run.runtime", "hardware": "gpucourse.run.hardware", "live": "gpucourse.run.live",
    "slurm": "gpucourse.run.slurm", "launcher": "gpucourse.run.launcher", "contract": "gpucourse.run.contract",
    "procs": "gpucourse.run.procs", "forensics": "gpucourse.run.forensics",
    "costs": "gpucourse.models.costs", "memory": "gpucourse.models.memory", "traces": "gpucourse.models.traces",
    "units": "gpucourse.models.units", "training": "gpucourse.models.training", "ddpsteps": "gpucourse.models.ddpsteps",
    "scaling": "gpucourse.models.scaling", "pipeline": "gpucourse.models.pipeline",
    "sharding": "gpucourse.models.sharding", "recompute": "gpucourse.models.recompute",
    "planner": "gpucourse.models.planner", "published": "gpucourse.models.published",
    "plots": "gpucourse.viz.plots", "tables": "gpucourse.viz.tables", "timeline": "gpucourse.viz.timeline",
    "widgets": "gpucourse.viz.widgets", "reports": "gpucourse.viz.reports",
    "quiz": "gpucourse.viz.quiz", "problems": "gpucourse.viz.problems",
    "exercises": "gpucourse.tools.exercises", "grading": "gpucourse.tools.grading",
    "labconfig": "gpucourse.tools.labconfig",
}


class _ShortPaths:
    """A finder for `import gpucourse.<short>[.sub]`: the module at its layer path (_MODULES), not a second copy.

    The import system sets the alias's spec on the module it is given; exec_module puts the module's own back."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        parts = fullname.split(".")
        if parts[0] == __name__ and len(parts) > 1 and parts[1] in _MODULES:
            return ModuleSpec(fullname, _ShortPaths, loader_state=".".join([_MODULES[parts[1]], *parts[2:]]))
        return None

    @staticmethod
    def create_module(spec):
        module = import_module(spec.loader_state)
        spec.own_spec = module.__spec__
        return module

    @staticmethod
    def exec_module(module):
        module.__spec__ = module.__spec__.own_spec


def __getattr__(name):
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    if name in _MODULES:
        return import_module(_MODULES[name])
    raise AttributeError(f"module 'gpucourse' has no attribute {name!r}")


__all__ = sorted([*_NAMES, *_MODULES])
if not any(getattr(finder, "__name__", None) == "_ShortPaths" for finder in sys.meta_path):
    sys.meta_path.insert(0, _ShortPaths)  # before the path finder, which would load gpucourse.grading.x twice

if "IPython" in sys.modules:  # in a notebook: words in printed output wrap whole (run/live.py)
    import_module("gpucourse.run.live").style_notebook_outputs()
