"""Grader of ex12: plan a training job at scale (run it with `gpucourse grade ex12`).

One real 1-rank job (this file, through gpucourse.launch) calls the submission's plan_training on each case of
CASES and records the plan it returned, made plain (whole numbers and names; anything else as its repr), e.g.

    {"case": "llama3-70b", "group": "plan", "got": {"dp": 128, "tp": 8, "pp": 1, ...}, "error": None}

The rank judges nothing. The grader process takes each case's inputs from CASES (never from the record) and
judges the plan with the course's planner (gpucourse.models.planner.plan_parallelism): every rule of the
exercise is checked here, per case, so nothing the submission does can reach the verdict. The best modelled MFU
a plan can reach under those rules is NOT computed here: finding it is the exercise, and graders ship with every
release. It is stored per case (BEST_MFU); tests/test_ex12_best.py, which stays home, finds it by trying every
plan the rules allow and fails, with the numbers to paste, when the planner has moved it.

Memory is the planner's model for the big models: a real-tensor dry run of a 70 B model does not fit on this
machine, and a fake-tensor one takes minutes (benchmarks/dryrun_scale.py), too long for a grading. The one case
small enough to run, chapter 09's capstone at world 1,024, is also dry-run for real
(gpucourse.dryrun, its first and its last rank, about 5 s): the counted peak must fit and every tensor-parallel
group the run formed must sit inside one node.
"""
import functools
import numbers
from pathlib import Path

import pytest

from gpucourse.models import costs, planner
from gpucourse.run import dryrun as dry
from gpucourse.tools.exercises import course_root
from gpucourse.tools.grading import jobkit
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs

# --- the cases -------------------------------------------------------------------------------------------------
CAPSTONE_SCRIPT = course_root() / "scripts" / "09_gpt_2d.py"
CAPSTONE_DATA = course_root() / "data" / "macbeth.txt"
# The capstone with one layer (so pp is 1: the script splits dp x tp only) and its defaults: d_model 64, 4 heads,
# a 4 x d_model GELU MLP, context 64, one token per character of its corpus.
CAPSTONE = {"layers": 1, "d_model": 64, "ffn": 256, "heads": 4, "kv_heads": 4, "mlp_matrices": 2,
            "vocab": len(set(CAPSTONE_DATA.read_text(encoding="utf-8")))}
# name: (model, gpus, system, seq, global_batch). 70 B is chapter 12's example; 405 B is fastest with an
# interleaved pipeline (the mutants that drop, starve or mis-schedule the pipeline show there); 8 B and 1.3 B fit
# with few or no model-parallel GPUs.
CASES = {
    "llama3-70b": ("llama3-70b", 1024, "h100-sxm", 8192, 512),
    "llama3-8b": ("llama3-8b", 64, "h100-sxm", 8192, 256),
    "llama3-405b": ("llama3-405b", 16384, "h100-sxm", 8192, 2048),
    "gpt-1.3b": ("gpt-1.3b", 8, "h100-sxm", 2048, 64),
    "capstone": (CAPSTONE, 1024, "h100-sxm", 64, 512),
}
KEYS = ("dp", "tp", "pp", "cp", "micro_batch", "recompute", "zero", "schedule", "virtual_stages")  # a plan may set
NEEDED = ("dp", "tp", "pp")
ZERO_STAGES = (0, 1, 2, 3)
# The best modelled MFU over every plan that keeps the rules and fits, per case, for the planner of this commit:
# numbers, never a search (see the module's docstring). Refresh: `pytest tests/test_ex12_best.py` prints them.
BEST_MFU = {"llama3-70b": 0.46619, "llama3-8b": 0.5091, "llama3-405b": 0.33411, "gpt-1.3b": 0.51227,
            "capstone": 3.8634e-06}
SHARE_OF_BEST = 0.9


def plain(value):
    """A returned value as the record keeps it: a whole number, a name or a float; its repr otherwise."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, numbers.Real, str)):
        return repr(value)[:80]
    if isinstance(value, numbers.Integral):
        return int(value)
    return value[:80] if isinstance(value, str) else float(value)


def run(module, guard, case: str) -> dict:
    model, gpus, system, seq, global_batch = CASES[case]
    with guard.watching():
        got = module.plan_training(dict(model) if isinstance(model, dict) else model, gpus, system, seq,
                                   global_batch)
    if not isinstance(got, dict):
        raise TypeError(f"plan_training returned a {type(got).__name__}, not a dict of plan_parallelism's arguments")
    return {"got": {str(k)[:40]: plain(v) for k, v in list(got.items())[:20]}}


class Ex12Job(jobkit.GradingJob):
    """ex12's grading job: the submission's plan for every case, on 1 rank."""

    name, wanted = "ex12", ("plan_training",)
    preload = jobkit.PRELOAD_BASE
    case_limit = 30.0
    reason = "an endless loop, or a search far too slow (the solution takes a few seconds a case at most)"

    def make_guard(self, comm) -> jobkit.Guard:
        guard = jobkit.Guard(comm)
        guard.submission = self.submission
        return guard

    def plan(self) -> list[tuple]:
        return [(case, "plan", functools.partial(run, case=case)) for case in CASES]


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)
CASE_LIMIT_S = 30
JOB_TIMEOUT_S = 120
DRYRUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def job(submission) -> JobRecords:
    return launch_jobs(JOB, submission, [1], name="grade-ex12", case_limit=CASE_LIMIT_S, timeout=JOB_TIMEOUT_S,
                       stall_timeout=2 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})[1]


def node_size(case: str) -> int:
    return costs.SYSTEMS[CASES[case][2]]["node_size"]


def modelled(case: str, plan: dict) -> dict:
    """plan_parallelism on the case's inputs and the plan's degrees (ValueError when it cannot be laid out)."""
    model, gpus, system, seq, global_batch = CASES[case]
    return planner.plan_parallelism(model, gpus=gpus, system=system, seq=seq, global_batch=global_batch, **plan)


def layout_problem(case: str, plan: dict) -> str | None:
    """Why the plan is not a layout of the case's GPUs (None when it is)."""
    gpus = CASES[case][1]
    unknown = sorted(set(plan) - set(KEYS))
    if unknown:
        return f"unknown key(s) {unknown}: a plan sets {', '.join(KEYS)} (the case gives model, gpus, seq, ...)"
    missing = [k for k in NEEDED if k not in plan]
    if missing:
        return f"the plan has no {', '.join(missing)}"
    degrees = {k: plan.get(k, 1) for k in ("dp", "tp", "pp", "cp", "micro_batch")}
    bad = [k for k, v in degrees.items() if not (isinstance(v, int) and v >= 1)]
    if bad:
        return f"{', '.join(f'{k}={degrees[k]!r}' for k in bad)}: degrees are whole numbers >= 1"
    product = degrees["dp"] * degrees["tp"] * degrees["pp"] * degrees["cp"]
    if product != gpus:
        return f"dp x tp x pp x cp = {product:,}, not the case's {gpus:,} GPUs"
    if degrees["cp"] != 1:
        return f"cp={degrees['cp']}: this exercise keeps cp = 1 (sequences of 8K tokens or fewer)"
    zero = plan.get("zero", 1)
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        return f"zero={plan.get('zero')!r}: one of {ZERO_STAGES}"
    chunks = plan.get("virtual_stages", 1)
    if isinstance(chunks, int) and chunks >= 1 and chunks & (chunks - 1):
        return f"virtual_stages={chunks}: a power of two (the exercise's rule: it keeps the search small)"
    # One stage has nothing to schedule (and the planner would count its activations a chunk at a time).
    if degrees["pp"] == 1 and (plan.get("schedule", "1f1b"), plan.get("virtual_stages", 1)) != ("1f1b", 1):
        return (f"schedule={plan.get('schedule')!r}, virtual_stages={plan.get('virtual_stages')!r} with pp=1: "
                "one stage has no pipeline to schedule, its schedule is '1f1b'")
    try:
        modelled(case, plan)
    except ValueError as err:
        return f"plan_parallelism refuses it: {err}"
    return None


def judged(rule):
    """rule(case, plan, model) -> problem, as check's problem(rec): the plan must be a layout first."""

    def problem(rec) -> str | None:
        case, plan = rec["case"], rec["got"]
        why = layout_problem(case, plan)
        if why:
            return f"not a valid layout ({why})"
        return rule(case, plan, modelled(case, plan))

    return problem


def described(plan: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in plan.items())


def tp_problem(case, plan, got):
    tp, node = plan["tp"], node_size(case)
    if node % tp:
        return f"tp={tp} does not divide the node's {node} GPUs: its all-reduces, every layer, cross nodes"
    return None  # the heads: plan_parallelism refuses a tp that splits one (layout_problem)


def pipeline_problem(case, plan, got):
    if got["micro_batches"] < plan["pp"]:
        return (f"{got['micro_batches']} micro-batch(es) a step for pp={plan['pp']} stages "
                f"(global_batch / (dp x micro_batch)): the pipeline never fills")
    return None


def fits_problem(case, plan, got):
    if not got["fits"]:
        return (f"modelled {got['reserved_bytes'] / planner.GiB:.1f} GiB reserved per GPU (a peak of "
                f"{got['peak_bytes'] / planner.GiB:.1f} GiB of tensors, plus headroom), over the device's "
                f"{got['device_bytes'] / planner.GiB:.0f} GiB ({described(plan)})")
    return None


def mfu_problem(case, plan, got):
    best = BEST_MFU[case]
    if not got["mfu"] >= SHARE_OF_BEST * best:
        return (f"modelled MFU {got['mfu']:.3g} is {got['mfu'] / best:.0%} of the best {best:.3g} a plan that keeps "
                f"the rules reaches ({described(plan)}); at least {SHARE_OF_BEST:.0%} is needed")
    return None


@functools.lru_cache(maxsize=None)
def capstone_dry_run(dp: int, tp: int) -> dict:
    """The capstone as its first and last rank of a world of dp x tp (one step, one layer): gpucourse.dryrun."""
    _, gpus, _, _, global_batch = CASES["capstone"]
    args = ["--dp", dp, "--tp", tp, "--batch", global_batch, "--layers", CAPSTONE["layers"], "--steps", 1,
            "--eval-batches", 0, "--sample", 0]
    return dry.dryrun(CAPSTONE_SCRIPT, world=gpus, args=args, timeout=DRYRUN_TIMEOUT_S)


def dry_run_problem(rec) -> str | None:
    plan = rec["got"]
    why = layout_problem("capstone", plan)
    if why:
        return f"not a valid layout ({why})"
    dp, tp, node = plan["dp"], plan["tp"], node_size("capstone")
    if plan["pp"] != 1:
        return f"pp={plan['pp']}: the capstone has one layer and splits dp x tp only"
    device_bytes = modelled("capstone", plan)["device_bytes"]
    try:
        report = capstone_dry_run(dp, tp)
    except (dry.DryRunError, dry.DryRunFailed) as err:
        return f"the dry run of the capstone at --dp {dp} --tp {tp} failed: {str(err).splitlines()[0][:200]}"
    for rank in report["ranks"]:
        if rank["peak_bytes"] > device_bytes:
            return f"rank {rank['rank']}'s counted peak {rank['peak_bytes']:,} B exceeds {device_bytes:,.0f} B"
        groups = [c["group"] for c in rank["comms"] if c["op"] == "all_reduce" and c["group_size"] == tp > 1]
        if tp > 1 and not groups:
            return f"rank {rank['rank']} made no all-reduce in a group of {tp}: no tensor-parallel group was seen"
        spread = [g for g in groups if len({r // node for r in g}) > 1]
        if spread:
            return f"rank {rank['rank']}'s tensor-parallel group {spread[0]} spans nodes of {node}"
    return None


# --- the tests ------------------------------------------------------------------------------------------------------
@pytest.mark.points(1)
@pytest.mark.parametrize("case", CASES)
def test_layout(job, case):
    """dp x tp x pp x cp = the GPUs, whole numbers, known keys, cp 1, ZeRO 0-3, virtual stages a power of two,
    1F1B at pp 1, accepted by plan_parallelism."""
    check(job, [case], lambda rec: layout_problem(case, rec["got"]))


@pytest.mark.points(1)
@pytest.mark.parametrize("case", CASES)
def test_tp_inside_a_node(job, case):
    """tp divides the node size: tensor parallelism's all-reduces, every layer, stay on NVLink."""
    check(job, [case], judged(tp_problem))


@pytest.mark.points(1)
@pytest.mark.parametrize("case", CASES)
def test_pipeline_fills(job, case):
    """At least pp micro-batches a step: global_batch / (dp x micro_batch) >= pp."""
    check(job, [case], judged(pipeline_problem))


@pytest.mark.points(2)
@pytest.mark.parametrize("case", CASES)
def test_fits_in_memory(job, case):
    """The planner's modelled memory per GPU (first and last stage, with headroom) is within the device's 80 GiB:
    plan_parallelism(...)["fits"]."""
    check(job, [case], judged(fits_problem))


@pytest.mark.points(2)
@pytest.mark.parametrize("case", CASES)
def test_near_the_best_mfu(job, case):
    """Modelled MFU at least 90 % of the best over every plan that keeps the rules and fits (BEST_MFU: stored)."""
    check(job, [case], judged(mfu_problem))


@pytest.mark.points(2)
def test_capstone_plan_runs_in_a_dry_run(job):
    """The capstone's plan dry-run for real at world 1,024 (first and last rank): it runs, its counted peak fits,
    and each tensor-parallel group the run formed sits inside one node."""
    check(job, ["capstone"], dry_run_problem)


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex12Job)
