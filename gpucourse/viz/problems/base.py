"""Numeric problems: the learner types a number, the course's own code says whether it is right.

    Problem("01.busbw-all-reduce",
            "An all_reduce of {size_mib} MiB on {n} GPUs takes {time_ms} ms. What is its bus bandwidth?",
            inputs={"size_mib": 256, "n": 8, "time_ms": 1.5},
            work=lambda size_mib, n, time_ms: {"answer": costs.busbw("all_reduce", size_mib * 2**20,
                                                                     time_ms / 1e3, n)},
            unit="GB/s", scale=1e9, hint="busbw is algbw times 2(n-1)/n for an all_reduce.",
            solution="algbw x 2(n-1)/n = {answer}.")

A problem states its inputs; its answer is never a number typed into the problem but what `work(**inputs)`
returns under "answer", computed by the course's models (costs, planner, memory, published): Problem refuses a
`work` that is not a function, or one that calls nothing from gpucourse.models (a typed number in a lambda).
The worked solution is a template filled from the same call's values, so the text cannot drift from the formulas.

Like QuickCheck (viz/quiz.py): a widget in a notebook (a text box, a Check button, feedback), text elsewhere with
`.check(value)` and `.reveal()`. A wrong answer gets the hint naming the step most people miss (and, where the
number typed is a known slip, what that slip was); the second wrong answer shows the worked solution. Every answer
checked is appended to the learner's progress file (progress_file: in mywork/, never in the course's notebooks/),
which `gpucourse progress` reads.
"""
from __future__ import annotations

import datetime
import html
import inspect
import json
import math
import numbers
import os
import re
import string
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..quiz import REVEAL_AFTER, Feedback, in_kernel

LEVELS = ("apply", "combine", "your run", "audit")  # one formula; two together; a number off your run; a public tool
PROGRESS_ENV = "GPUCOURSE_PROGRESS"  # a file to record answers in, instead of the workspace's
PROGRESS_FILE = "problems-progress.jsonl"
WORKSPACE = "mywork"  # the learner's copy of the chapters (tools/workspace.py), beside notebooks/
_ID = re.compile(r"^(\d\d[a-z]?)\.[a-z0-9][a-z0-9-]*$")
_MODELS = "gpucourse.models"


@dataclass(frozen=True)
class ProblemFeedback(Feedback):
    kind: str = "right"  # "right", "hint" (first wrong answers), "solution" (the worked solution shown), "unread"

    def html(self) -> str:
        colour = {"right": "#2e7d32", "unread": "#6d4c41"}.get(self.kind, "#c62828")
        return f"<div style='color:{colour}; white-space:pre-line'>{html.escape(self.text)}</div>"


def course_calls(work: Callable) -> list[str]:
    """The functions of gpucourse.models that `work` calls ('costs.busbw', 'planner.shape_params'), read from its
    code (helpers of this package it calls are followed): what the answer is computed by."""
    found, seen = [], set()

    def add(obj):  # named by the module that defines it: published.shape_of is planner.shape_of
        if inspect.isfunction(obj) or inspect.isclass(obj):
            label = f"{obj.__module__.rpartition('.')[2]}.{obj.__name__}"
            if obj.__module__.startswith(_MODELS) and label not in found:
                found.append(label)

    def visit(fn):
        code = getattr(fn, "__code__", None)
        if code is None or code in seen:
            return
        seen.add(code)
        names, stack = set(), [code]
        while stack:  # nested code: comprehensions, inner lambdas
            c = stack.pop()
            names.update(c.co_names)
            stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        for name in sorted(names):
            obj = fn.__globals__.get(name)
            if isinstance(obj, types.ModuleType) and obj.__name__.startswith(_MODELS):
                for attr in sorted(names):
                    add(getattr(obj, attr, None))
            elif callable(obj) and getattr(obj, "__module__", "").startswith(_MODELS):
                add(obj)
            elif inspect.isfunction(obj) and obj.__module__.startswith(__name__.rpartition(".")[0]):
                visit(obj)

    visit(work)
    return found


def parse_number(text, unit: str = "") -> float:
    """'1,234.5', '1.2e3', '16.6 GB' (its own unit after it), '19 %': a float, or ValueError."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    t = str(text).strip().replace(",", "").replace("_", "").replace("\u2009", "").replace(" ", "")
    if unit and t.lower().endswith(unit.replace(" ", "").lower()):
        t = t[:-len(unit.replace(" ", ""))]
    value = float(t)  # ValueError on anything else
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def fields(template: str) -> set[str]:
    return {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name}


@dataclass(frozen=True)
class Problem:
    """One numeric problem. id: "NN.slug", NN its chapter. question and solution: str.format templates, the question
    over `inputs`, the solution over inputs, work's values and {answer} (the answer in its unit, as text)."""
    id: str
    question: str
    inputs: dict
    work: Callable[..., dict]  # work(**inputs) -> {"answer": value in base units, other named steps...}
    unit: str
    hint: str                  # the step most people miss
    solution: str
    scale: float = 1.0         # the answer in `unit` is work(...)["answer"] / scale
    digits: int = 2            # decimals shown
    tolerance: float = 0.02    # relative; an answer within half the last shown digit is right too
    level: str = "apply"
    traps: dict = field(default_factory=dict)  # {work key: what that slip was}, for a number typed near its value
    own: tuple = ()            # inputs a learner reads off their own run: show("NN", mine={slug: {...}}) gives them
    source: str = ""           # where hardware figures come from (a datasheet, a paper)
    measured: tuple = ()       # the inputs (of `own`) that hold the learner's own run's numbers now (from_run)

    def __post_init__(self):
        match = _ID.match(self.id) if isinstance(self.id, str) else None
        if not match:
            raise ValueError(f"problem id must be 'NN.slug' (its chapter, a dot, lowercase words), got {self.id!r}")
        if not callable(self.work):
            raise ValueError(f"{self.id}: work must be a function of the inputs that computes the answer with the "
                             f"course's code (costs, planner, memory, ...), not a typed value: got {self.work!r}")
        if not course_calls(self.work):
            raise ValueError(f"{self.id}: work calls nothing from gpucourse.models: an answer must come from the "
                             "course's formulas, never a number typed into the problem")
        if self.level not in LEVELS:
            raise ValueError(f"{self.id}: level must be one of {LEVELS}, got {self.level!r}")
        if not self.tolerance >= 0 or not self.scale > 0:
            raise ValueError(f"{self.id}: tolerance must be >= 0 and scale > 0")
        if "answer" not in fields(self.solution):
            raise ValueError(f"{self.id}: the worked solution must state {{answer}}")
        unknown = fields(self.question) - set(self.inputs)
        if unknown:
            raise ValueError(f"{self.id}: the question names {sorted(unknown)}, which are not inputs")
        if set(self.own) - set(self.inputs):
            extra = sorted(set(self.own) - set(self.inputs))
            raise ValueError(f"{self.id}: own names inputs it does not have: {extra}")
        if set(self.measured) - set(self.own):
            raise ValueError(f"{self.id}: measured names inputs not read off a run (not in own): "
                             f"{sorted(set(self.measured) - set(self.own))}")
        object.__setattr__(self, "wrong_tries", 0)

    @property
    def chapter(self) -> str:
        return self.id.partition(".")[0]

    def given(self, **inputs) -> Problem:
        """The same problem with some inputs replaced (a learner's own measurements): a fresh one, no tries."""
        unknown = set(inputs) - set(self.inputs)
        if unknown:
            raise ValueError(f"{self.id} has no input {', '.join(sorted(unknown))}; its inputs: "
                             f"{', '.join(self.inputs)}")
        return Problem(**{**{f: getattr(self, f) for f in self.__dataclass_fields__},
                          "inputs": {**self.inputs, **inputs},
                          "measured": tuple(k for k in self.measured if k not in inputs)})

    def from_run(self, values: dict) -> Problem:
        """The same problem with the learner's own run's numbers for some of its `own` inputs (a chapter passes what
        its run measured): a fresh one whose text and widget say which inputs are the run's. Refuses, naming what to
        do, an input the problem does not take or does not read off a run, and a value that is not a plain number
        (a whole number where the input counts things). Floats are kept to 4 significant figures, so the question
        shows the very numbers the answer is computed from."""
        if not self.own:
            raise ValueError(f"{self.id} takes no numbers from your run: it is an {self.level!r} problem, not a "
                             f"'your run' one")
        if not isinstance(values, dict):
            raise TypeError(f"{self.id}: give your run's numbers as a dict of input: value "
                            f"({', '.join(f'{k!r}: ...' for k in self.own)}), got {type(values).__name__}")
        unknown = sorted(set(values) - set(self.inputs))
        if unknown:
            raise ValueError(f"{self.id} has no input {', '.join(map(str, unknown))}; the ones from your run: "
                             f"{', '.join(self.own)}")
        not_own = sorted(set(values) - set(self.own))
        if not_own:
            raise ValueError(f"{self.id}: {', '.join(not_own)} is part of the question, not read off your run; "
                             f"the inputs from your run: {', '.join(self.own)}")
        read = {name: _run_number(self.id, name, value, self.inputs[name]) for name, value in values.items()}
        return Problem(**{**{f: getattr(self, f) for f in self.__dataclass_fields__},
                          "inputs": {**self.inputs, **read},
                          "measured": tuple(k for k in self.own if k in read or k in self.measured)})

    # --- the numbers, all from one call -------------------------------------------------------------------
    def values(self) -> dict:
        out = self.work(**self.inputs)
        if not isinstance(out, dict) or "answer" not in out:
            raise ValueError(f"{self.id}: work must return a dict with 'answer', got {out!r}")
        return out

    @property
    def answer(self) -> float:
        """The answer in `unit`: work(**inputs)["answer"] / scale."""
        return float(self.values()["answer"]) / self.scale

    def format(self, value: float) -> str:
        number = f"{value:,.{self.digits}f}"
        return f"{number} %" if self.unit == "%" else f"{number} {self.unit}".rstrip()

    def answer_text(self) -> str:
        return self.format(self.answer)

    def question_text(self) -> str:
        return self.question.format(**self.inputs)

    def solution_text(self) -> str:
        values = self.values()
        text = self.solution.format(**{**self.inputs, **values, "answer": self.answer_text()})
        calls = ", ".join(course_calls(self.work))
        return f"{text}\n(Computed by gpucourse.models: {calls}.)"

    def is_right(self, value: float) -> bool:
        expected = self.answer
        return abs(value - expected) <= max(self.tolerance * abs(expected), 0.5 * 10 ** -self.digits)

    # --- answering ----------------------------------------------------------------------------------------
    def check(self, typed, *, record: bool = True) -> ProblemFeedback:
        """Feedback for a typed answer (text or number, in `unit`); recorded in the progress file when read."""
        try:
            value = parse_number(typed, self.unit)
        except ValueError:
            return ProblemFeedback(False, f"Type a number, in {self.unit or 'plain units'} (e.g. 12.5).", "unread")
        right = self.is_right(value)
        if not right:
            object.__setattr__(self, "wrong_tries", self.wrong_tries + 1)
        if record:
            record_answer(self, typed, right)
        if right:
            return ProblemFeedback(True, f"Correct: {self.answer_text()}.\n{self.solution_text()}", "right")
        said = f"Not quite: {self.format(value)} is not it. " + (f"{self.slip(value)} " if self.slip(value) else "")
        if self.wrong_tries >= REVEAL_AFTER:
            return ProblemFeedback(False, f"{said}Worked solution:\n{self.solution_text()}", "solution")
        return ProblemFeedback(False, f"{said}Hint: {self.hint} Try again.", "hint")

    def slip(self, value: float) -> str:
        """What a known slip gives, if `value` is near it ('' otherwise)."""
        values = self.values()
        for key, message in self.traps.items():
            near = float(values[key]) / self.scale
            if abs(value - near) <= max(self.tolerance * abs(near), 0.5 * 10 ** -self.digits):
                return message
        return ""

    def reveal(self) -> str:
        return f"Answer: {self.answer_text()}.\n{self.solution_text()}"

    # --- display ------------------------------------------------------------------------------------------
    def run_notes(self) -> list[str]:
        """What the text and the widget say about the inputs of a 'your run' problem: which are the learner's own
        run's numbers, and which are still the problem's illustrative ones (and how to pass them)."""
        if not self.own:
            return []
        out = []
        if self.measured:
            out.append("Your own run's numbers, measured in this chapter: "
                       + ", ".join(f"{k} = {self.inputs[k]!r}" for k in self.measured) + ".")
        rest = [k for k in self.own if k not in self.measured]
        if rest:
            slug = self.id.partition(".")[2]
            out.append(f"Illustrative, not from your run: {', '.join(rest)}; pass your own with "
                       f"problems.show({self.chapter!r}, mine={{{slug!r}: {{"
                       + ", ".join(f"{k!r}: ..." for k in rest) + "}}).")
        return out

    def heading(self) -> str:
        return f"Problem {self.id} ({self.level})"

    def text(self) -> str:
        lines = [f"{self.heading()}: {self.question_text()}", f"  Answer in {self.unit or 'plain units'}."]
        if self.source:
            lines.append(f"  Figures from: {self.source}")
        lines += [f"  {line}" for line in self.run_notes()]
        lines.append("(In JupyterLab: type a number and press Check. Elsewhere: .check(x) answers, .reveal() shows "
                     "the worked solution.)")
        return "\n".join(lines)

    __str__ = text

    def __repr__(self) -> str:
        return f"Problem({self.id!r}, {self.level}, in {self.unit!r})"

    def widget(self):
        """The question, a text box for the number with its unit, a Check button and feedback: one VBox."""
        import ipywidgets as w

        note = "" if not self.source else f"<br><small>Figures from: {html.escape(self.source)}</small>"
        note += "".join(f"<br><small>{html.escape(line)}</small>" for line in self.run_notes())
        title = w.HTML(f"<b>{html.escape(self.heading())}:</b> {html.escape(self.question_text())}{note}")
        answer = w.Text(placeholder=f"a number, in {self.unit or 'plain units'}", layout=w.Layout(width="14em"))
        unit = w.Label(self.unit)
        button, feedback = w.Button(description="Check", button_style="primary"), w.HTML()

        def on_click(_):
            if not answer.value.strip():
                feedback.value = "<i>Type a number first.</i>"
            else:
                feedback.value = self.check(answer.value).html()

        button.on_click(on_click)
        return w.VBox([title, w.HBox([answer, unit, button]), feedback])

    def _repr_mimebundle_(self, include=None, exclude=None):
        return _bundle(self.text(), self.widget)


def _run_number(problem_id: str, name: str, value, default):
    """A run's measurement as the problem takes it: a finite number >= 0, whole where the default is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = " (a tensor or array: pass float(x) or x.item())" if hasattr(value, "item") else ""
        raise TypeError(f"{problem_id}: {name} must be a number from your run, got {type(value).__name__} "
                        f"{value!r}{hint}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{problem_id}: {name} must be a finite number >= 0 (a size, a count or a time), got {value!r}")
    if isinstance(default, numbers.Integral):
        if value != int(value):
            raise TypeError(f"{problem_id}: {name} counts whole things, got {value!r}: pass a whole number")
        return int(value)
    return float(f"{float(value):.4g}")


class ProblemSet:
    """Several problems shown together (a chapter's): one widget each."""

    def __init__(self, title: str, problems: list[Problem]):
        self.title, self.problems = title, list(problems)

    def __iter__(self):
        return iter(self.problems)

    def __len__(self):
        return len(self.problems)

    def text(self) -> str:
        return "\n\n".join([f"{self.title}: {len(self.problems)} problems"] + [p.text() for p in self.problems])

    __str__ = text

    def __repr__(self) -> str:
        return f"ProblemSet({self.title!r}, {len(self.problems)} problems)"

    def widget(self):
        import ipywidgets as w

        return w.VBox([w.HTML(f"<h4>{html.escape(self.title)}</h4>")] + [p.widget() for p in self.problems])

    def _repr_mimebundle_(self, include=None, exclude=None):
        return _bundle(self.text(), self.widget)


def _bundle(text, make_widget) -> dict:
    bundle = {"text/plain": text}
    if in_kernel():
        view = make_widget()._repr_mimebundle_()
        bundle.update({k: v for k, v in view.items() if k != "text/plain"})
    return bundle


# --- the learner's record -----------------------------------------------------------------------------------

def progress_file(cwd: Path | None = None) -> Path:
    """Where answers are recorded: $GPUCOURSE_PROGRESS; else mywork/problems-progress.jsonl of the workspace the
    working directory is in (or of the checkout it is in: a chapter run from the course's notebooks/ records into
    mywork/ beside it, never into notebooks/); else the working directory."""
    if os.environ.get(PROGRESS_ENV):
        return Path(os.environ[PROGRESS_ENV]).expanduser()
    here = (cwd or Path.cwd()).resolve()
    for folder in [here, *here.parents]:
        if folder.name == WORKSPACE:
            return folder / PROGRESS_FILE
        if (folder / "pyproject.toml").is_file() and (folder / "notebooks").is_dir():
            return folder / WORKSPACE / PROGRESS_FILE
    return (here.parent / WORKSPACE if here.name == "notebooks" else here) / PROGRESS_FILE


def record_answer(problem: Problem, typed, right: bool, path: Path | None = None) -> Path:
    """Append one answer (a JSON line) to the progress file; returns its path."""
    path = path or progress_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"time": datetime.datetime.now().isoformat(timespec="seconds"), "chapter": problem.chapter,
            "problem": problem.id, "typed": str(typed), "right": bool(right)}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    return path


def read_progress(path: Path | None = None) -> list[dict]:
    """The answers recorded (a torn or foreign line is skipped); [] when there is no file."""
    path = path or progress_file()
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and {"chapter", "problem", "right"} <= set(rec):
            out.append(rec)
    return out


def progress_by_chapter(records: list[dict], problems: dict[str, list[Problem]]) -> dict[str, dict]:
    """{chapter: {"problems" (how many it has), "tried", "right" (problems answered right at least once)}}."""
    out = {ch: {"problems": len(ps), "tried": 0, "right": 0} for ch, ps in problems.items()}
    tried, right = {}, {}
    for rec in records:
        tried.setdefault(rec["chapter"], set()).add(rec["problem"])
        if rec["right"]:
            right.setdefault(rec["chapter"], set()).add(rec["problem"])
    for ch in sorted(set(out) | set(tried)):
        row = out.setdefault(ch, {"problems": 0, "tried": 0, "right": 0})
        row["tried"], row["right"] = len(tried.get(ch, ())), len(right.get(ch, ()))
    return dict(sorted(out.items()))
