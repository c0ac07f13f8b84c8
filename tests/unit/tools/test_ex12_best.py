"""ex12's grader holds the best modelled MFU of each case as a number (BEST_MFU), because the search that finds it
is the exercise and graders ship with every release. This test, which stays home (tests/ is not in a release),
is that search: it tries every plan the exercise's rules allow, on every case, and checks the stored numbers are
current for the planner of this commit. Plain arithmetic in this process (about 10,000 planner calls, about a
second; the rules take virtual_stages as a power of two to keep it so); no job, no grading.
"""
import math

from gpucourse.models import costs, planner
from gpucourse.tools.grading.graders import ex12_plan_at_scale as grader

GRADER = "gpucourse/tools/grading/graders/ex12_plan_at_scale.py"
REL_TOL = 1e-3


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def every_plan(case: str):
    """Every plan the rules allow for the case, fitting or not: tp inside a node splitting the heads, every pp and
    micro-batch size that fills the pipeline, every schedule (1F1B alone at pp 1; interleaved with every power of two
    chunks the layers allow), recomputation and ZeRO stage; cp 1."""
    model, gpus, system, _, global_batch = grader.CASES[case]
    shape = planner.shape_of(model)
    for tp in divisors(costs.SYSTEMS[system]["node_size"]):
        if shape["heads"] % tp or shape["kv_heads"] % tp and tp % shape["kv_heads"]:
            continue
        for pp in [pp for pp in divisors(gpus // tp) if pp <= shape["layers"]]:
            dp = gpus // (tp * pp)
            schedules = [("1f1b", 1)] + ([("zero-bubble", 1), ("dualpipev", 1)] + [
                ("interleaved", v) for v in (2, 4, 8, 16, 32, 64) if pp * v <= shape["layers"]] if pp > 1 else [])
            micro_batches = [b for b in divisors(global_batch // dp) if global_batch // (dp * b) >= pp
                             ] if global_batch % dp == 0 else []
            for micro_batch in micro_batches:
                for schedule, virtual_stages in schedules:
                    for recompute in planner.RECOMPUTE:
                        for zero in grader.ZERO_STAGES:
                            yield {"dp": dp, "tp": tp, "pp": pp, "cp": 1, "micro_batch": micro_batch,
                                   "recompute": recompute, "zero": zero, "schedule": schedule,
                                   "virtual_stages": virtual_stages}


def best(case: str) -> tuple[dict, dict]:
    """(plan, plan_parallelism's answer) with the highest modelled MFU among the plans that fit."""
    found = None
    for plan in every_plan(case):
        try:
            got = grader.modelled(case, plan)
        except ValueError:  # the planner refuses it (DualPipeV with fewer than 2 x pp micro-batches)
            continue
        if got["fits"] and (found is None or got["mfu"] > found[1]["mfu"]):
            found = plan, got
    assert found, f"ex12's case {case} has no plan that keeps the rules and fits: change its CASES entry"
    return found


def test_the_graders_best_mfu_is_the_best_plans():
    found = {case: best(case) for case in grader.CASES}
    for case, (plan, got) in found.items():  # the best plan keeps the grader's own rules
        problems = [grader.layout_problem(case, plan)] + [
            rule(case, plan, got) for rule in (grader.tp_problem, grader.pipeline_problem, grader.fits_problem)]
        assert not any(problems), f"{case}: the search's best plan breaks a rule of the grader: {problems}"
    current = {case: float(f"{got['mfu']:.5g}") for case, (_, got) in found.items()}
    stale = {case: (grader.BEST_MFU.get(case), mfu) for case, mfu in current.items()
             if not math.isclose(grader.BEST_MFU.get(case, math.nan), mfu, rel_tol=REL_TOL)}
    plans = "\n".join(f"  {case}: {plan}" for case, (plan, _) in found.items())
    assert not stale and set(grader.BEST_MFU) == set(current), (
        f"the best modelled MFU per case moved (stored, found): {stale}. The planner or CASES changed: paste\n"
        f"BEST_MFU = {current}\ninto {GRADER} (rewrap it), check the exercise's mutants still lose exactly their "
        f"points (pytest tests/test_mutants.py -k ex12), and say so in the commit. The best plans:\n{plans}")
