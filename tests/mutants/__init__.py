"""The mutants: tests/mutants/<exercise>.diff holds every mutant of one exercise (graded by
tests/integration/test_mutants.py).

Each mutant is the exercise's solution with one plausible learner's mistake, written as a patch on the solution:

    == sum_not_average
    DDP sums the gradients over the ranks without dividing by the world size.
    (more lines: why exactly these tests catch it)
    must fail: test_matches_single_process[DDP-frozen-sgd], test_gradients_kept_and_accumulated[DDP]
    @@
                 work.wait()
    -            p.grad /= world
    +            pass  # MUTANT: the sum, not the average

`== name` starts a mutant; the lines up to its first `@@` say what is wrong (the first line in one sentence) and, on
`must fail:` lines, which grader tests must lose their points (exactly those; `must fail: none`: every point kept).
Each `@@` starts a hunk: lines kept (` `), removed (`-`) and added (`+`), as in a unified diff, but without line
numbers: the kept and removed lines must occur exactly once in the solution, where they are replaced by the kept and
added ones. So a change to the solution touches only the mutants whose lines it changes. An empty line inside a hunk is
an empty kept line. Lines starting with `#` before the first mutant are the file's comments.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


class MutantError(ValueError):
    """A mutants file that cannot be read or applied: the message names the file, the mutant and the line."""


@dataclass
class Mutant:
    exercise: str
    name: str
    about: list[str]
    must_fail: tuple[str, ...] | None  # None until a `must fail:` line (`must fail: none`: the empty tuple)
    hunks: list[tuple[list[str], list[str]]] = field(default_factory=list)  # (old lines, new lines)

    @property
    def id(self) -> str:
        return f"{self.exercise}/{self.name}"

    def apply(self, solution: str) -> str:
        """The solution's text with every hunk applied, in order; MutantError when a hunk's lines are not there
        exactly once."""
        lines = solution.splitlines()
        for n, (old, new) in enumerate(self.hunks, 1):
            at = [i for i in range(len(lines) - len(old) + 1) if lines[i:i + len(old)] == old]
            if len(at) != 1:
                where = "not found" if not at else f"found {len(at)} times (add kept lines to make it unique)"
                raise MutantError(f"{self.id}, hunk {n}: its kept and removed lines are {where} in the solution "
                                  f"(did the solution change? then redo this hunk):\n" + "\n".join(old))
            lines[at[0]:at[0] + len(old)] = new
        return "\n".join(lines) + "\n"


def read_mutants(path: Path) -> list[Mutant]:
    exercise, mutants, hunk = path.stem, [], None
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        where = f"{path.name}:{lineno}"
        if line.startswith("== "):
            name = line[3:].strip()
            if not re.fullmatch(r"[a-z0-9_]+", name) or any(m.name == name for m in mutants):
                raise MutantError(f"{where}: a mutant's name is new and in lower_case_with_underscores: {name!r}")
            mutants.append(Mutant(exercise, name, [], None))
            hunk = None
        elif not mutants:
            if line.strip() and not line.startswith("#"):
                raise MutantError(f"{where}: before the first `== name`, only comments (#) and empty lines")
        elif line.startswith("@@"):
            hunk = ([], [])
            mutants[-1].hunks.append(hunk)
        elif hunk is None:
            if line.startswith("must fail:"):
                names = tuple(n.strip() for n in line[len("must fail:"):].split(",") if n.strip())
                mutants[-1].must_fail = (mutants[-1].must_fail or ()) + (() if names == ("none",) else names)
            elif line.strip():
                mutants[-1].about.append(line)
        elif line == "" or line[0] in " -+":
            kind, text = (line[0], line[1:]) if line else (" ", "")
            if kind in " -":
                hunk[0].append(text)
            if kind in " +":
                hunk[1].append(text)
        else:
            raise MutantError(f"{where}: a hunk's line starts with ' ', '-' or '+': {line!r}")
    for m in mutants:
        for old, new in m.hunks:  # empty lines at a hunk's end separate mutants: they are not kept lines
            while old and new and old[-1] == new[-1] == "":
                old.pop()
                new.pop()
        if not m.about or m.must_fail is None or not m.hunks or not all(old for old, _ in m.hunks):
            raise MutantError(f"{path.name}: mutant {m.name} needs a sentence saying what is wrong, a `must fail:` "
                              f"line and at least one hunk with kept or removed lines")
    return mutants


HERE = Path(__file__).resolve().parent


def all_mutants() -> dict[str, list[Mutant]]:
    """{exercise: its mutants}, from every tests/mutants/<exercise>.diff."""
    return {path.stem: read_mutants(path) for path in sorted(HERE.glob("ex*.diff"))}
