"""A submission's function called on the grader's cases in a Python process of its own (ex08_read_the_dumps, ex13).

For exercises whose submission reads data the grader produced (dumps, recorded shards) rather than running in the
ranks: the process is `python -I` (no PYTHON* variables, no user site), started in an empty folder with an almost
empty environment, given the cases on its standard input and nothing else; `gpucourse` cannot be imported there
(the course's own reading would answer for the submission). Each call has a time limit; what the submission prints
goes to stderr, never where the answers go.
"""
import json
import os
import pickle
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, pickle, signal, sys, importlib.util
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what the submission prints goes nowhere the answers go
sys.modules["gpucourse"] = None  # the course's own code is not the submission's
given = pickle.load(sys.stdin.buffer)

def stop(signum, frame):
    raise TimeoutError(f"{given['function']} did not return within {given['limit']:g} s")

def one_line(err):
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]

signal.signal(signal.SIGALRM, stop)
answers = []
try:
    signal.alarm(int(given["limit"]) + 1)
    spec = importlib.util.spec_from_file_location("submission", given["path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signal.alarm(0)
except BaseException as err:
    answers = [{"error": f"the submission could not be loaded: {one_line(err)}"}] * len(given["cases"])
else:
    for args in given["cases"]:
        try:
            signal.alarm(int(given["limit"]))
            got = getattr(module, given["function"])(*args)
            signal.alarm(0)
            answers.append({"answer": json.loads(json.dumps(got, default=repr))})
        except BaseException as err:
            signal.alarm(0)
            answers.append({"error": one_line(err)})
out.write(json.dumps(answers))
out.flush()
"""


def answers_in_child(submission, function: str, cases: list[tuple], limit: float, slack_s: float = 10) -> list[dict]:
    """[{"answer": the return value, made plain} or {"error": one line}] for `function(*args)` of the submission
    on each case's args, in a fresh `python -I` process; the same error for every case if the process ended
    without answering."""
    given = pickle.dumps({"path": str(submission), "function": function, "cases": cases, "limit": limit})
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="grade-child-") as empty:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", CHILD], input=given, capture_output=True, cwd=empty,
                                  env=env, timeout=limit * (len(cases) + 2) + slack_s)
            got = json.loads(done.stdout)
        except subprocess.TimeoutExpired:
            got = None
        except ValueError:  # the process died before it answered (os._exit, a signal)
            got = None
    if not isinstance(got, list) or len(got) != len(cases):
        return [{"error": "the submission's process ended without answering (os._exit? a crash? an endless loop "
                          f"outside {function}?)"}] * len(cases)
    return got
