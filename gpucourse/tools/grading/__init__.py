"""Grading: the exercises' graders, the machinery that runs them, and the reports they give.

    runner.py         `gpucourse grade`: runs an exercise's graders in a pytest subprocess, reads back the points
    plugin.py         that subprocess's pytest plugin: `points`, `submission`, `timing`, the outcomes file
    records.py        the grader process's side of a grading job: its records and raw results, `check`
    jobkit.py         the rank's side: every grading job's order of events, guard, watchdog and record writer
    (what a submission communicates is recorded by gpucourse/run/comm_recorder.py, shared with `gpucourse dryrun`)
    graders/          one grader per exercise, exNN_<name>.py: what runs in the ranks, and the checks of the grader
                      process (pytest tests with `points`); _-prefixed files are what two graders share

    report = gpucourse.grading.grade("ex01")    # in a notebook: shows as an HTML table
"""
from .runner import GradeReport, TestOutcome, add_cli, grade, grade_class, run_graders, run_pytest  # noqa: F401
