"""The grading job of ex09 (fix a 2D-mesh training step): every case on one (dp, tp) mesh, in one launch.

    ex09_job.py SUBMISSION.py --dp D --tp T [--case-limit SECONDS]

test_ex09_fix_2d.py launches it on a 2x2, a 2x1 and a 1x2 mesh. The grader makes the mesh before the submission
is imported; each rank logs one record per case (jobkit.record_writer) and saves what the submission produced,
raw: every parameter whole (DTensors gathered with full_tensor(), a collective of the grader's, on every rank)
and, in train, the inputs each forward of the model was fed. E.g.

    {"case": "train", "group": "train", "error": None, "raw": ["fed", "params"], "losses": [3.61, 3.52, 3.41]}

Cases:
  init   build_model(mesh, vocab, seed), called with a different random state on every rank: its parameters.
  train  a fresh build_model, then STEPS train_step calls on global batches that are the same on every rank; SGD
         with momentum (which, unlike Adam, notices gradients that are summed instead of averaged). Saved: what
         each forward of the model was fed, each step's returned loss, and the final parameters.

The rank judges nothing. The grader process trains one process on the whole batch (`reference`: the course's
TinyLM, which the exercise gives and does not grade, from the graders' own copy ex09_model.py, never from the
learner's file: `course_model`; no process group) and compares the parameters (`compare`) and losses; it finds
which rows of the global batch each forward was fed (`rows_of`).
What the submission does is watched (comm_recorder, capped output); a case that runs past --case-limit (a
collective some ranks never call) is reported and ends the rank.
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from gpucourse.grading.graders import ex09_model  # the model the exercise gives, the grader's own copy
from gpucourse.grading import jobkit  # what every grading job shares
from gpucourse import runtime

VOCAB, SEED, BATCH, CONTEXT, STEPS, LR = 32, 5, 8, 8, 3, 0.2
FUNCTIONS = ("build_model", "train_step", "TinyLM")


# --- the inputs: the same in every rank and in the grader process ------------------------------------
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


# --- the reference and the comparisons: the grader process's, never a rank's --------------------------
def course_model() -> type:
    """The TinyLM class the course gives (the exercise's model: it is not what is graded), for the one-process
    reference: the graders' own copy (ex09_model.py), so that nothing of the learner's file (its class bodies, its
    module-level code) ever runs in the grader process, in the checkout or in a release (which has no solutions/).
    tests/test_ex09_model.py keeps the copy and the solution's classes the same model."""
    return ex09_model.TinyLM


def reference(model_class) -> dict:
    """One process, the whole batch: initial parameters, losses, final parameters."""
    torch.manual_seed(SEED)
    model = model_class(VOCAB)
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


def compare(got: dict, reference: dict) -> dict:
    """The largest difference of the submission's parameters (whole) from the reference's, and where it is;
    {"names": ...} when the names or shapes differ from TinyLM(vocab)'s."""
    odd = sorted(set(got) ^ set(reference)) or sorted(n for n in reference if got[n].shape != reference[n].shape)
    if odd:
        return {"names": odd[:3]}
    diffs = {name: (got[name].double() - ref.double()).abs().max().item() for name, ref in reference.items()}
    worst = max(diffs, key=lambda n: diffs[n] if diffs[n] == diffs[n] else float("inf"))  # NaN is the worst
    return {"max_diff": diffs[worst], "worst": worst}


def rows_of(fed: torch.Tensor, x: torch.Tensor) -> list[int]:
    """The global batch's row index of every row fed to the model (-1 for a row that is none of them)."""
    fed = fed.reshape(-1, fed.shape[-1]) if fed.dim() > 1 else fed.view(1, -1)
    return [next((j for j in range(x.shape[0]) if fed.shape[-1] == x.shape[1] and torch.equal(row, x[j])), -1)
            for row in fed]


# --- the cases, as each rank runs them: what the submission produced, saved raw ----------------------
def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole: DTensors gathered over their mesh (a collective of the grader's, on every rank)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def plain(fed) -> torch.Tensor:
    """What a forward was fed, as a plain tensor (a DTensor: this rank's part; not a tensor: empty)."""
    if isinstance(fed, DTensor):
        fed = fed.to_local()
    return fed.detach().clone() if isinstance(fed, torch.Tensor) else torch.empty(0)


def case_init(module, mesh, guard) -> dict:
    torch.manual_seed(100 + dist.get_rank())  # a different random state on every rank, as after other work
    with guard.watching():
        model = module.build_model(mesh, vocab=VOCAB, seed=SEED)
    return {"raw": {"params": full_params(model)}}


def case_train(module, mesh, guard) -> dict:
    torch.manual_seed(200 + dist.get_rank())
    with guard.watching():
        model = module.build_model(mesh, vocab=VOCAB, seed=SEED)
    opt, fed, losses, calls = optimizer(model), [], [], []
    model.register_forward_pre_hook(lambda _, args: calls.append(plain(args[0]) if args else torch.empty(0)))
    for step in range(STEPS):
        x, y = batch(step)
        calls.clear()
        with guard.watching():
            loss = module.train_step(model, opt, x.clone(), y.clone(), mesh)
        fed.append(list(calls))
        losses.append(float(loss) if isinstance(loss, (float, int, torch.Tensor)) and not isinstance(loss, bool)
                      and (not isinstance(loss, torch.Tensor) or loss.numel() == 1) else repr(loss)[:80])
    return {"raw": {"fed": fed, "params": full_params(model)}, "losses": losses}


class Ex09Job(jobkit.GradingJob):
    """ex09's grading job: the init and train cases on one (dp, tp) mesh, made before the submission is imported."""

    name, wanted = "ex09", FUNCTIONS
    case_limit = 20.0
    reason = ("a collective some ranks call and others do not (a different group, a different number of steps), "
              "an endless loop, or far too slow")

    def options(self, parser) -> None:
        parser.add_argument("--dp", type=int, required=True)
        parser.add_argument("--tp", type=int, required=True)

    def setup(self):
        return runtime.setup(timeout_s=3 * self.args.case_limit)  # a collective that never completes raises then

    def prepare(self) -> None:
        torch.set_num_threads(1)
        self.mesh = init_device_mesh("cpu", (self.args.dp, self.args.tp), mesh_dim_names=("dp", "tp"))

    def plan(self) -> list[tuple]:
        return [("init", "init", case_init), ("train", "train", case_train)]

    def plan_fields(self) -> dict:
        return {"dp": self.args.dp, "tp": self.args.tp, "batch": BATCH}

    def case_args(self, module) -> tuple:
        return module, self.mesh, self.guard


if __name__ == "__main__":
    jobkit.main(Ex09Job)
