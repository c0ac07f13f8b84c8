"""Chapter 04: the same training on N ranks, per-rank batch fixed, under three learning-rate rules.

    --rules keep linear warmup     trained one after the other, each from the same initial weights
      keep     base_lr, whatever the global batch
      linear   the linear scaling rule: base_lr * k, k = global batch / base batch, from the first step
      warmup   the same scaled rate, reached by a linear warmup from base_lr over --warmup-epochs
               (warmup_scheduler from --schedule-impl: by default your exercise ex04)

The base batch is one rank's batch (--batch), the batch base_lr is meant for; on N ranks the global batch is
N * --batch, so k = N. Every run makes --epochs passes over the same training set: N ranks take N times
fewer, N times larger steps. The data (make_data) are generated from a fixed seed, identically on every
rank; each rank trains on its own shard (DistributedSampler). The records, --evals-per-epoch per epoch:
epoch, opt_step, lr, the loss of every step since the last record (averaged over the global batch),
test loss and accuracy (the whole test set, split over the ranks and summed). Rank 0 saves the weights
at the end of every epoch (run_dir/model-<rule>-epoch<e>.pt).

    gpucourse dryrun scripts/04_large_batch.py --world 1024 -- --rules linear --n-train 65536 --n-test 1024
runs it as ranks 0 and 1023 of 1,024 with a fake process group (each rank needs --n-train / N >= --batch: a
full batch a step): collectives, memory and FLOPs counted, values read as None.
"""
import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpucourse import exercises, runtime

CLASSES, DIM, CLUSTERS = 10, 16, 12
EXERCISE = Path(__file__).resolve().parents[1] / "exercises" / "ex04_lr_schedule.py"


def make_data(n_train: int, n_test: int, seed: int = 0):
    """10 classes in 16 dimensions, each class a union of 12 Gaussian clusters at random centres.

    Not linearly separable (a class's clusters lie scattered among the others'), yet learnable: a classifier
    that knew the centres would get about 96 %. The features are left unstandardised (standard deviation
    about 5), as raw features often are: with He initialisation the loss surface is steep at the start.
    """
    gen = torch.Generator().manual_seed(seed)
    centres = 4.2 * torch.randn(CLASSES * CLUSTERS, DIM, generator=gen)
    cluster = torch.randint(0, CLASSES * CLUSTERS, (n_train + n_test,), generator=gen)
    x = centres[cluster] + 3.0 * torch.randn(n_train + n_test, DIM, generator=gen)
    y = cluster % CLASSES
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def make_model(width: int = 128, depth: int = 4) -> nn.Sequential:
    """An MLP with He (Kaiming) initialisation, the usual choice for ReLU networks; no normalisation layers."""
    layers, fan_in = [], DIM
    for _ in range(depth):
        linear = nn.Linear(fan_in, width)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.ReLU()]
        fan_in = width
    return nn.Sequential(*layers, nn.Linear(fan_in, CLASSES))


def evaluate(model, loader, device) -> tuple[float, float]:
    """Test loss and accuracy over the whole test set: each rank scores its shard, the sums are all-reduced."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            sums[0] += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            sums[1] += (logits.argmax(1) == y).sum().item()
            sums[2] += len(y)
    dist.all_reduce(sums)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def train(rule: str, args, data, schedule, ctx, done_before: int, total: int) -> int:
    """One run under `rule`; returns the number of optimizer steps it took."""
    train_set, test_set = data
    base_batch, global_batch = args.batch, args.batch * ctx.world_size
    target_lr = args.base_lr * global_batch / base_batch  # the linear scaling rule
    torch.manual_seed(args.seed)  # the same initial weights for every rule and world size
    model = DDP(make_model().to(ctx.device))
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=1024, sampler=DistributedSampler(test_set, shuffle=False))
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise SystemExit(f"--n-train {len(train_set)} on {ctx.world_size} ranks leaves each fewer than one batch of "
                         f"{args.batch}: use --n-train >= {ctx.world_size * args.batch}")
    warmup_steps = round(args.warmup_epochs * steps_per_epoch) if rule == "warmup" else 0
    opt = torch.optim.SGD(model.parameters(), lr=target_lr if rule == "linear" else args.base_lr,
                          momentum=args.momentum)
    sched = None
    if rule == "warmup":  # from BASE_LR at step 0 to target_lr at warmup_steps, then constant
        sched = schedule.warmup_scheduler(opt, base_lr=args.base_lr, base_batch=base_batch,
                                          global_batch=global_batch, warmup_steps=warmup_steps)
    every = max(1, steps_per_epoch // args.evals_per_epoch)
    runtime.log(rule=rule, header=True, base_lr=args.base_lr, target_lr=target_lr, base_batch=base_batch,
                global_batch=global_batch, steps_per_epoch=steps_per_epoch, warmup_steps=warmup_steps,
                epochs=args.epochs, params=sum(p.numel() for p in model.parameters()))
    if ctx.rank == 0:
        print(f"{rule}: global batch {global_batch}, lr {opt.param_groups[0]['lr']:g}"
              + (f" rising to {target_lr:g} over {warmup_steps} steps" if sched else "")
              + f", {steps_per_epoch * args.epochs} steps", flush=True)

    def record(step: int, losses: list[float], lrs: list[float]) -> None:
        mean = torch.tensor(losses, dtype=torch.float64, device=ctx.device)
        dist.all_reduce(mean)  # every step's loss over the global batch: the mean of the ranks' means
        test_loss, test_acc = evaluate(model, test_loader, ctx.device)
        step_losses = (mean / ctx.world_size).tolist()
        progress = {"step": done_before + step - 1, "total": total} if step else {}
        runtime.log(**progress, rule=rule, epoch=step / steps_per_epoch, opt_step=step,
                    lr=lrs[-1] if lrs else opt.param_groups[0]["lr"], lrs=lrs, step_losses=step_losses,
                    train_loss=sum(step_losses) / len(step_losses) if step_losses else None,
                    test_loss=test_loss, test_acc=test_acc, seconds=time.perf_counter() - start)

    start = time.perf_counter()
    record(0, [], [])  # before the first step
    step, losses, lrs = 0, [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        for x, y in loader:
            lrs.append(opt.param_groups[0]["lr"])
            loss = nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks here
            opt.step()
            if sched is not None:
                sched.step()
            step += 1
            losses.append(loss.item())
            if step % every == 0 or step == steps_per_epoch * args.epochs:
                record(step, losses, lrs)
                losses, lrs = [], []
        if ctx.rank == 0:
            torch.save(model.module.state_dict(), ctx.run_dir / f"model-{rule}-epoch{epoch + 1}.pt")
    if ctx.rank == 0:
        print(f"{rule}: done in {time.perf_counter() - start:.1f} s", flush=True)
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rules", nargs="+", default=["keep", "linear", "warmup"],
                        choices=["keep", "linear", "warmup"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--base-lr", type=float, default=0.0125, help="the learning rate for one rank's batch")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--warmup-epochs", type=float, default=0.5)
    parser.add_argument("--n-train", type=int, default=16384)
    parser.add_argument("--n-test", type=int, default=4096)
    parser.add_argument("--evals-per-epoch", type=int, default=16)
    parser.add_argument("--schedule-impl", default=str(EXERCISE), help="the file defining warmup_scheduler (ex04)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ctx = runtime.setup(seed=args.seed, seed_per_rank=False)
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)  # one thread per rank, on 1 rank too: the ranks share the cores
    data = make_data(args.n_train, args.n_test, seed=args.seed)  # identical on every rank: same seed
    schedule = exercises.load_file(args.schedule_impl, "lr_schedule") if "warmup" in args.rules else None
    total = len(args.rules) * args.epochs * (args.n_train // ctx.world_size // args.batch)
    done = 0
    for rule in args.rules:
        done += train(rule, args, data, schedule, ctx, done, total)
    runtime.teardown()


if __name__ == "__main__":
    main()
