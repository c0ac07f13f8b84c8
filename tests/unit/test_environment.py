"""Set-up files agree with each other: pyproject.toml is the one source of dependencies."""
import re
import tomllib

import yaml

from tests.conftest import ROOT


def test_environment_yml_installs_the_package_from_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert env["channels"] == ["conda-forge"]
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert "python=3.11" in conda and "pip" in conda
    assert conda.index("pip") > conda.index("python=3.11")
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    editable = [line for line in pip if line.startswith("-e")]
    assert len(editable) == 1, "environment.yml must install the package itself with pip"
    extras = re.search(r"\[(.*)\]", editable[0]).group(1).split(",")
    assert set(extras) <= set(project["project"]["optional-dependencies"]), extras
    # Nothing pinned twice: any extra pip line must agree with pyproject exactly.
    declared = set(project["project"]["dependencies"])
    for deps in project["project"]["optional-dependencies"].values():
        declared |= set(deps)
    assert all(line in declared for line in pip if not line.startswith(("-e", "-c constraints.txt"))), pip
    assert "-c constraints.txt" in pip  # the torch CI tests, as make installs it


def test_torch_is_a_tested_range_and_ci_pins_the_highest():
    from gpucourse.run.hardware import TESTED_TORCH, torch_note

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    low, high = TESTED_TORCH
    assert f"torch>={low}" in project["project"]["dependencies"]  # a preinstalled newer torch is kept
    assert f"torch=={high}" in (ROOT / "constraints.txt").read_text().splitlines()
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()  # make lab / make test / CI install that one
    assert project["project"]["requires-python"] == ">=3.11"
    assert torch_note("2.13.0") == torch_note("2.11.0+cu130") == torch_note("2.12.1") == ""
    assert "untested" in torch_note("2.10.0") and "untested" in torch_note("2.14.0")


def test_readme_documents_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme and "make check" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "\ncheck:" in (ROOT / "Makefile").read_text()


def declared_names(project: dict) -> set[str]:
    """Every package pyproject.toml declares, by name (no versions, no extras), the package itself left out."""
    deps = [*project["project"]["dependencies"], *sum(project["project"]["optional-dependencies"].values(), [])]
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in deps} - {project["project"]["name"]}


def explained_names(readme: str) -> set[str]:
    """The packages in the first column of the README's "Dependencies, and why each is here" table."""
    table = readme.split("## Dependencies, and why each is here")[1].split("\n## ")[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    names = [name for row in rows for name in re.findall(r"`([^`]+)`", row) if name not in ("lab", "test", "dev")]
    return {re.match(r"[A-Za-z0-9_.-]+", name).group(0).lower() for name in names}


def test_the_readme_says_why_each_dependency_is_here():
    """The guide asks for it: one row per dependency pyproject.toml declares, and none that it does not."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared, explained = declared_names(project), explained_names((ROOT / "README.md").read_text())
    assert declared == explained, (f"not explained: {sorted(declared - explained)}; "
                                   f"not declared: {sorted(explained - declared)}")
    assert "gpucourse" not in declared and "torch" in declared and "nbstripout" in declared  # the parsing can fail
