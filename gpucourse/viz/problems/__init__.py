"""Numeric problems, a module a chapter, each answer computed by the course's models (base.py says how).

    from gpucourse import problems
    problems.show("12")                        # chapter 12's problems, one widget each
    problems.show("01", mine={"your-busbw-predict": {"time_ms": t_ms}})   # its your-run problems with your numbers
    problems.show("01.your-busbw-predict", time_ms=41.0)   # one problem, any of its inputs changed

`gpucourse progress` prints, per chapter, how many problems you have answered right (base.progress_file).
Add a problem: docs/problems.md.
"""
from __future__ import annotations

from . import (ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch07b, ch08, ch08b, ch08c, ch08d, ch09, ch10, ch11, ch12,
               ch13)
from .base import Problem, ProblemSet, progress_by_chapter, progress_file, read_progress

CHAPTERS: dict[str, list[Problem]] = {
    "01": ch01.PROBLEMS, "02": ch02.PROBLEMS, "03": ch03.PROBLEMS, "04": ch04.PROBLEMS, "05": ch05.PROBLEMS,
    "06": ch06.PROBLEMS, "07": ch07.PROBLEMS, "07b": ch07b.PROBLEMS, "08": ch08.PROBLEMS, "08b": ch08b.PROBLEMS,
    "08c": ch08c.PROBLEMS, "08d": ch08d.PROBLEMS, "09": ch09.PROBLEMS, "10": ch10.PROBLEMS, "11": ch11.PROBLEMS,
    "12": ch12.PROBLEMS, "13": ch13.PROBLEMS}
TITLES = {"01": "Chapter 01 · collectives: bus bandwidth and the alpha-beta model",
          "02": "Chapter 02 · data parallelism: shards, steps and the bytes accumulation and hooks send",
          "03": "Chapter 03 · profiling and scaling: the DDP step, its buckets and scaling efficiency",
          "04": "Chapter 04 · large batches: steps, warmup and the critical batch",
          "05": "Chapter 05 · pipelines: the bubble and the activations in flight",
          "06": "Chapter 06 · tensor parallelism: all-reduces per block, against compute and across links",
          "07": "Chapter 07 · ZeRO: model states per GPU",
          "07b": "Chapter 07b · precision and recomputation: bytes per parameter, activations, FLOPs",
          "08": "Chapter 08 · nodes and failures: placement, checkpoints and the checkpoint interval",
          "08b": "Chapter 08b · hangs and desyncs: what a hang idles, the Flight Recorder's reach, uneven shards",
          "08c": "Chapter 08c · checkpoints and slow ranks: the interval, goodput, one slow rank and hiccups at scale",
          "08d": "Chapter 08d · training through failures: the samples a lost replica costs, healing, DiLoCo's bytes",
          "09": "Chapter 09 · the 2-D capstone: FLOPs per token, MFU, memory and traffic per rank",
          "10": "Chapter 10 · context parallelism: bytes per rank, GQA and when a ring hop hides",
          "11": "Chapter 11 · expert parallelism: capacity, all-to-alls and active parameters",
          "12": "Chapter 12 · at scale: the planner, MFU and published runs",
          "13": "Chapter 13 · 3-D parallelism: what each group carries, and who holds less"}


def all_problems() -> list[Problem]:
    return [p for ps in CHAPTERS.values() for p in ps]


def get(problem_id: str) -> Problem:
    """One problem by its id ('12.interleaved-bubble'), fresh (no tries counted)."""
    for p in all_problems():
        if p.id == problem_id:
            return p.given()
    raise ValueError(f"no problem {problem_id!r}; chapters with problems: {', '.join(CHAPTERS)} "
                     f"(problems.show('12') lists chapter 12's)")


def show(key: str, mine: dict | None = None, **inputs):
    """A chapter's problems ("12"), or one problem ("12.mfu") with some of its inputs replaced.

    mine: the chapter's own run's numbers for its 'your run' problems, {problem: {input: value}}, a problem named by
    its id ("01.your-alpha") or its short name ("your-alpha"), each input one of the problem's `own`; the widget
    then says which inputs are the learner's (Problem.from_run checks each value)."""
    key = str(key)
    if "." in key:
        if mine is not None:
            raise ValueError(f"mine= goes with a chapter: problems.show({key.partition('.')[0]!r}, "
                             f"mine={{{key.partition('.')[2]!r}: {{...}}}})")
        return get(key).given(**inputs)
    chapter = key.zfill(3 if key[-1:].isalpha() else 2)  # "7" is "07", "7b" is "07b"
    if chapter not in CHAPTERS:
        raise ValueError(f"no problems for chapter {key!r} yet; chapters with problems: {', '.join(CHAPTERS)}")
    if inputs:
        raise ValueError(f"inputs go to one problem (problems.show('01.your-busbw-predict', time_ms=...)), or to a "
                         f"chapter's your-run problems as problems.show({chapter!r}, mine={{problem: {{input: "
                         f"value}}}}); got {', '.join(inputs)}")
    shown = [p.given() for p in CHAPTERS[chapter]]
    for name, values in _by_problem(chapter, mine).items():
        at = [p.id for p in shown].index(name)
        shown[at] = shown[at].from_run(values)
    return ProblemSet(TITLES[chapter], shown)


def _by_problem(chapter: str, mine) -> dict:
    """mine's keys as the chapter's problem ids; a key that is not one of the chapter's problems is refused."""
    if mine is None:
        return {}
    yours = [p.id.partition(".")[2] for p in CHAPTERS[chapter] if p.own]
    if not isinstance(mine, dict):
        raise TypeError(f"mine must be a dict {{problem: {{input: value}}}}, got {type(mine).__name__}; chapter "
                        f"{chapter}'s your-run problems: {', '.join(yours) or 'none'}")
    ids, out = {p.id for p in CHAPTERS[chapter]}, {}
    for name, values in mine.items():
        pid = str(name) if "." in str(name) else f"{chapter}.{name}"
        if pid not in ids:
            elsewhere = [p.id for p in all_problems() if p.id == str(name) or p.id.partition(".")[2] == str(name)]
            where = (f"{elsewhere[0]} is chapter {elsewhere[0].partition('.')[0]}'s, not chapter {chapter}'s"
                     if elsewhere else f"no problem {name!r}")
            raise ValueError(f"{where}; chapter {chapter}'s your-run problems: {', '.join(yours) or 'none'}")
        if pid in out:
            raise ValueError(f"{pid} is given twice in mine (by its id and by its short name)")
        out[pid] = values
    return out


def progress(path=None) -> dict[str, dict]:
    """{chapter: {"problems", "tried", "right"}} from the learner's progress file (default: progress_file())."""
    return progress_by_chapter(read_progress(path), CHAPTERS)
