"""The package's short module paths (gpucourse/__init__.py, _MODULES) work both ways: `from gpucourse import costs`
and `import gpucourse.costs` give the one module at its layer path, never a second copy."""
import importlib
import sys

import pytest

import gpucourse


def test_short_paths_import_both_ways_as_the_layer_module():
    for short, target in gpucourse._MODULES.items():
        sys.modules.pop(f"gpucourse.{short}", None)  # through the finder, even where a test imported it before
        by_path = importlib.import_module(f"gpucourse.{short}")
        by_name = getattr(gpucourse, short)
        layer = importlib.import_module(target)
        assert by_path is by_name is layer, short
        assert layer.__name__ == layer.__spec__.name == target, (short, layer.__spec__)
    import gpucourse.grading.runner as short_sub
    import gpucourse.tools.grading.runner as layer_sub

    assert short_sub is layer_sub and short_sub.__spec__.name == "gpucourse.tools.grading.runner"  # not loaded twice
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("gpucourse.no_such_module")
