"""Exercise 13: find where a 3-D run parts from one process, and which mesh dimension is to blame.

The story
---------
A bug in a parallel training job rarely crashes it. The loss goes down, a little differently, and nobody knows
whether the difference is rounding or a bug. Chapter 13 answers it the way teams that train large models do:
train the same global batch in one process beside the parallel run, in float64, so that rounding is ~1e-14 and
anything larger is a bug; then run each dimension alone (a 1-D control: pp only, dp only, tp only) to find the
one that breaks.

Here you write that comparison. scripts/13_gpt_3d.py (pipeline x FSDP x tensor parallel) records, with
`--record DIR`, each rank's shard of every parameter (before the step's update) and of every gradient, and the
loss, for each step; and the one process's whole tensors. The grader injects silent bugs from real reports
(`--bug`, see the script's BUGS) into a 2 x 2 x 2 run and into the three 1-D controls, and gives you the records.

Task
----
Write `first_divergence(reference, runs, tol) -> None or (step, what, name, dim)`:

- `reference`: the one process's record: {"steps": [{"loss": float, "params": {name: tensor},
  "grads": {name: tensor}}, ...]}, whole tensors, parameters in the model's order.
- `runs`: {"3d": ranks, "pp": ranks, "dp": ranks, "tp": ranks}: the 2 x 2 x 2 run and the three 1-D controls (pp 2,
  dp 2 or tp 2 alone; micro-batches only in the pp control). `ranks` is {rank: {"coords": {"pp", "dp", "tp"},
  "mesh": {"pp", "dp", "tp"}, "steps": [{"loss": float or None, "params": {name: shard}, "grads": {name:
  shard}}, ...]}}, a shard being {"offset": (where it starts in the whole tensor, per dimension), "value": tensor}.
  A rank holds only its pipeline stage's parameters, each cut by FSDP and tensor parallelism (some shards are
  empty); only the last stage's ranks have a loss.
- `tol`: the largest difference that is still rounding (1e-10).

Return None when the 3-D run equals the one process. Otherwise where it first parts from it:

  step   the first step at which anything differs by more than `tol`
  what   within that step, in this order: "param" (a parameter's value before the update), "loss", "grad"
  name   for "param" and "grad", the first parameter in the model's order that differs (on any rank); for
         "loss", None
  dim    the one dimension ("pp", "dp" or "tp") whose 1-D control also parts from the one process; None if
         none of them (or more than one) does

A shard differs when any element differs from the same elements of the whole tensor by more than `tol`; a loss
when any rank's loss differs from the one process's by more than `tol`.

Rules
-----
- Use only the three arguments; return plain values (an int, a word, a name or None, a word or None).
- The grader runs scripts/13_gpt_3d.py with the right code and with each bug, and scores the location (step,
  what, name) and the dimension of each case, and None for the right run. It runs your function in a process of
  its own, with torch and without gpucourse.

Check your work: `gpucourse grade ex13_silent_bugs` (`--seed N` replays a grading's data).
"""


def first_divergence(reference: dict, runs: dict, tol: float = 1e-10):
    """(step, what, name, dim) where runs["3d"] first parts from the one process, or None."""
    ### BEGIN SOLUTION
    ### HINT: for each step, in order: each parameter (model order) compared shard by shard with the whole tensor's same slice (offset), then the loss, then each gradient; the first that differs by more than tol; dim: the only 1-D control that also differs (None unless exactly one)
    where = first_difference(reference, runs["3d"], tol)
    if where is None:
        return None
    broken = [dim for dim in ("pp", "dp", "tp") if first_difference(reference, runs[dim], tol) is not None]
    return (*where, broken[0] if len(broken) == 1 else None)


def first_difference(reference: dict, ranks: dict, tol: float):
    """(step, what, name) of the first difference between one run's ranks and the one process, or None."""
    for step, ref in enumerate(reference["steps"]):
        for what in ("param", "loss", "grad"):
            if what == "loss":
                mine = [r["steps"][step]["loss"] for r in ranks.values()]
                if any(loss is not None and abs(loss - ref["loss"]) > tol for loss in mine):
                    return step, "loss", None
                continue
            whole = ref["params" if what == "param" else "grads"]
            for name, full in whole.items():
                for r in ranks.values():
                    shard = r["steps"][step]["params" if what == "param" else "grads"].get(name)
                    if shard is not None and differs(shard, full, tol):
                        return step, what, name
    return None


def differs(shard: dict, full, tol: float) -> bool:
    """Whether a shard differs from the same elements of the whole tensor by more than tol."""
    value = shard["value"]
    if value.numel() == 0:
        return False
    same = full[tuple(slice(o, o + n) for o, n in zip(shard["offset"], value.shape))]
    return (value - same).abs().max().item() > tol
    ### END SOLUTION
