"""The grading job of ex09 (fix a 2D-mesh training step): every case on one (dp, tp) mesh, in one launch.

    ex09_job.py SUBMISSION.py --dp D --tp T [--case-limit SECONDS]

test_ex09_fix_2d.py launches it on a 2x2, a 2x1 and a 1x2 mesh. The grader makes the mesh before the submission
is imported; each rank logs one record per case (jobkit.record_writer), e.g.

    {"case": "train", "group": "train", "error": None, "coords": [1, 0], "rows": [[4, 5, 6, 7], ...],
     "losses": [3.61, 3.52, 3.41], "expected_losses": [...], "max_diff": 2e-08, "worst": "blocks.0.fc.weight"}

Cases:
  init   build_model(mesh, vocab, seed), called with a different random state on every rank: every parameter
         (DTensors gathered with full_tensor()) against `torch.manual_seed(seed); TinyLM(vocab)` in one process.
  train  a fresh build_model, then STEPS train_step calls on global batches that are the same on every rank; SGD
         with momentum (which, unlike Adam, notices gradients that are summed instead of averaged). Recorded: the
         rows of the global batch each forward of the model was fed, each step's returned loss, and the largest
         difference of the final parameters from one process training the same model on the whole batch.

The one-process reference runs in this rank, with the submission's own TinyLM (the model is not what is graded;
its parallel training is) in the grader's own loop, outside the submission's calls: a plain module, no
process group, the whole batch. What the submission does is watched (comm_recorder, capped output); a case that
runs past --case-limit (a collective some ranks never call) is reported and ends the rank.
"""
import argparse
import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

import comm_recorder  # beside this script: what a submission communicates
import jobkit  # beside this script: what every grading job shares
from gpucourse import runtime

VOCAB, SEED, BATCH, CONTEXT, STEPS, LR = 32, 5, 8, 8, 3, 0.2
FUNCTIONS = ("build_model", "train_step", "TinyLM")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch `step`: random token ids and next-token targets, the same on every rank. Row 0's first token
    is 0, row 1's 1, ...: every row is distinct, so a row fed to the model names its index."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(VOCAB, (BATCH, CONTEXT + 1), generator=gen)
    ids[:, 0] = torch.arange(BATCH)
    return ids[:, :-1], ids[:, 1:]


def optimizer(model) -> torch.optim.Optimizer:
    # foreach=False: the per-tensor path, which takes any mix of plain tensors and DTensors
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole: DTensors gathered over their mesh (a collective of the grader's, on every rank)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def compare(model, reference: dict) -> dict:
    """The largest difference of the model's parameters from the reference's, and where it is."""
    got = full_params(model)
    if set(got) != set(reference):
        raise ValueError(f"build_model's model has parameters {sorted(set(got) ^ set(reference))[:3]} that "
                         "TinyLM(vocab) has not, or lacks them: return the TinyLM it built, parallelized in place")
    diffs = {name: (got[name].double() - ref.double()).abs().max().item() for name, ref in reference.items()}
    worst = max(diffs, key=lambda n: diffs[n] if diffs[n] == diffs[n] else float("inf"))  # NaN is the worst
    return {"max_diff": diffs[worst], "worst": worst}


def reference(module) -> dict:
    """One process, the whole batch, the submission's TinyLM: initial parameters, losses, final parameters."""
    torch.manual_seed(SEED)
    model = module.TinyLM(VOCAB)
    init = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt, losses = optimizer(model), []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"init": init, "losses": losses, "final": {n: p.detach().clone() for n, p in model.named_parameters()}}


def rows_of(fed: torch.Tensor, x: torch.Tensor) -> list[int]:
    """The global batch's row index of every row fed to the model (-1 for a row that is none of them)."""
    fed = fed.detach().reshape(-1, fed.shape[-1]) if fed.dim() > 1 else fed.detach().view(1, -1)
    return [next((j for j in range(x.shape[0]) if fed.shape[-1] == x.shape[1] and torch.equal(row, x[j])), -1)
            for row in fed]


def case_init(module, mesh, guard, ref) -> dict:
    torch.manual_seed(100 + dist.get_rank())  # a different random state on every rank, as after other work
    with guard.watching():
        model = module.build_model(mesh, vocab=VOCAB, seed=SEED)
    return compare(model, ref["init"])


def case_train(module, mesh, guard, ref) -> dict:
    torch.manual_seed(200 + dist.get_rank())
    with guard.watching():
        model = module.build_model(mesh, vocab=VOCAB, seed=SEED)
    opt, fed, rows, losses = optimizer(model), [], [], []
    model.register_forward_pre_hook(lambda _, args: fed.append(args[0] if args else torch.empty(0)))
    for step in range(STEPS):
        x, y = batch(step)
        fed.clear()
        with guard.watching():
            loss = module.train_step(model, opt, x.clone(), y.clone(), mesh)
        rows.append([r for inputs in fed for r in rows_of(inputs, x)])
        losses.append(float(loss) if isinstance(loss, (float, int, torch.Tensor)) and not isinstance(loss, bool)
                      and (not isinstance(loss, torch.Tensor) or loss.numel() == 1) else repr(loss)[:80])
    return {"rows": rows, "losses": losses, "expected_losses": ref["losses"], **compare(model, ref["final"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("submission")
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--case-limit", type=float, default=20.0)
    args = parser.parse_args()
    ctx = runtime.setup(timeout_s=3 * args.case_limit)  # a collective that never completes raises after this
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    coords = [mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()]
    log = jobkit.record_writer()  # before the submission is imported: see record_writer
    guard = jobkit.Guard(comm_recorder.install())
    watchdog = jobkit.Watchdog("a collective some ranks call and others do not (a different group, a different "
                               "number of steps), an endless loop, or far too slow", log)
    cases = [("init", "init", case_init), ("train", "train", case_train)]
    log(case="plan", cases={case: group for case, group, _ in cases}, world_size=ctx.world_size, dp=args.dp,
        tp=args.tp, batch=BATCH)
    module = jobkit.import_or_exit(args.submission, "ex09", FUNCTIONS, guard.watching, watchdog, args.case_limit,
                                   log)
    with watchdog.case_limit("import", "import", args.case_limit):
        try:
            ref = reference(module)  # the grader's loop around the submission's TinyLM, no process group
        except Exception as err:  # noqa: BLE001 - a broken TinyLM is graded, not a grader crash
            log(case="import", group="import", error=f"TinyLM(vocab) does not train in one process: "
                                                      f"{jobkit.one_line(err, args.submission)}")
            runtime.teardown()
            raise SystemExit(1) from None
    jobkit.run_cases([(case, group, functools.partial(run, module, mesh, guard)) for case, group, run in cases],
                     (ref,), watchdog, args.case_limit, args.submission, log,
                     fields=lambda: {"coords": coords, "dp": args.dp, "tp": args.tp})
    runtime.teardown()


if __name__ == "__main__":
    main()
