"""Chapter 07b: mixed precision, recipe by recipe: the bytes each holds, loss scaling, and master weights.

    torchrun --nproc-per-node 1 scripts/07b_precision.py [--width 256 --depth 8 --steps 3]

One rank is enough: precision is about what each rank holds and computes, whatever the world size. Parts:
  recipe    AdamW steps in each recipe (fp32; bf16 autocast; bf16 parameters + fp32 master weights; everything
            bf16), then the bytes of parameters, gradients, master weights and optimizer states, counted from
            the tensors (gpucourse.models.memory.model_state_bytes) and checked against costs.recipe_bytes_per_param:
            the run fails if they differ. Also counted: the 16-bit weight copies autocast keeps for backward,
            and how many weights the last step left unchanged. On a GPU, torch.cuda.max_memory_allocated too.
  scaler    fp16 autocast + torch.amp.GradScaler, the scale started too large on purpose: each overflowing step
            is skipped (parameters unchanged) and halves the scale; the others step. Checked step by step.
  underflow the common mistake: fp16 autocast without a GradScaler, on a model that fits its targets to within
            a residual r; gradient elements that underflow to zero, counted, against the same with the scaler.
"""
import argparse
import gc
import math

import torch
from torch import nn

from gpucourse import costs, runtime
from gpucourse.models.memory import model_state_bytes

LR = 1e-4            # AdamW's step moves each weight by about LR: below bf16's resolution for |w| > ~2^-5
HALF = torch.bfloat16


def make_model(width, depth, device):
    torch.manual_seed(0)  # the same initial weights for every recipe
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]).to(device)


def data(width, batch, steps, device):
    """Batches of a fixed 'teacher' network's inputs and outputs (a task whose loss can go down), each moved to
    the device only when it is used, so that on a GPU the allocator's count holds nothing but the run's states."""
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(width, width, generator=gen) / width**0.5
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen)
        yield x.to(device), torch.tanh(x @ teacher.T).to(device)


class WeightCopies:
    """Bytes of the 16-bit copies of the weights that autograd saves for backward under autocast, counted with
    saved-tensor hooks: a saved tensor that equals a parameter cast to 16 bits (or its transpose: a linear
    layer saves weight.t()) is one of them."""

    def __init__(self, params):
        self.params, self.bytes, self.numel = list(params), 0, 0

    def _pack(self, t):
        for p in self.params:
            if t.dtype == p.dtype or t.numel() != p.numel():
                continue
            cast = p.detach().to(t.dtype)
            if any(v.shape == p.shape and torch.equal(v, cast) for v in (t, t.mT if t.dim() == 2 else t)):
                self.bytes += t.numel() * t.element_size()
                self.numel += t.numel()
                break
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def run_recipe(recipe, args, device):
    """Train args.steps AdamW steps in `recipe`; count what the model states hold after the last step."""
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()  # the previous recipe's tensors are gone before the count starts, not freed during it
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    model = make_model(args.width, args.depth, device)
    if recipe in ("mixed", "bf16"):
        model.to(HALF)                                   # the parameters themselves become 16-bit
    params = list(model.parameters())
    # mixed: the optimizer updates fp32 master copies; the 16-bit parameters are copied from them after a step
    master = [nn.Parameter(p.detach().float()) for p in params] if recipe == "mixed" else []
    opt = torch.optim.AdamW(master or params, lr=LR)
    copies = WeightCopies(params)
    for step, (x, y) in enumerate(data(args.width, args.batch, args.steps, device)):
        last = step == args.steps - 1
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=HALF, enabled=recipe == "autocast"):
            if last and recipe == "autocast":
                with copies:
                    out = model(x)
            else:
                out = model(x.to(params[0].dtype))
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        if last:
            before_step = [t.detach().clone() for t in params + master]
        if master:
            for m, p in zip(master, params):
                m.grad = p.grad.float()                  # fp32 gradient for the step; dropped right after it
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, params):
                    p.copy_(m)                           # round the updated master to the 16-bit parameter
                    m.grad = None
        else:
            opt.step()
    after = params + master
    unchanged = {name: sum(int((a == b).sum()) for a, b in zip(after[i:j], before_step[i:j]))
                 for name, i, j in (("params", 0, len(params)), ("master", len(params), len(after)))}
    final_loss = loss.item()
    del before_step, out, loss, x, y                     # what is left: the model states
    counted = model_state_bytes(params, opt, master)
    numel = sum(p.numel() for p in params)
    expected = costs.recipe_bytes_per_param(recipe, "adamw")
    for part in ("parameters", "gradients", "master weights", "optimizer states"):
        assert counted[part] == expected[part] * numel, (recipe, part, counted[part], expected[part] * numel)
    assert counted["step counters"] == 4 * len(params), counted  # AdamW: one fp32 step per parameter tensor
    peak = held = None
    if cuda:  # the allocator's count: at least the tensors' bytes (it rounds each block up); the peak adds
        torch.cuda.synchronize()  # activations, autocast's weight copies and the fp32 gradients of the step
        peak = torch.cuda.max_memory_allocated() - before
        held = torch.cuda.memory_allocated() - before
        assert held >= sum(counted.values()) - counted["step counters"], (held, counted)
    # autocast saves a 16-bit copy of a weight for backward where the layer's input needs a gradient: all but
    # the first layer here (its input is the data)
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    if recipe == "autocast":
        assert copies.numel == sum(w.numel() for w in weights[1:]), (copies.numel, [w.shape for w in weights])
    runtime.log(part="recipe", recipe=recipe, num_params=numel, num_tensors=len(params), loss=final_loss,
                **{k.replace(" ", "_"): v for k, v in counted.items()},
                weight_copies=copies.bytes, unchanged_params=unchanged["params"],
                unchanged_master=unchanged["master"] if master else None,
                dtype=str(params[0].dtype), state_dtype=str(opt.state[(master or params)[0]]["exp_avg"].dtype),
                cuda_peak=peak, cuda_held=held)


def run_scaler(args, device):
    """fp16 autocast with a GradScaler whose initial scale is too large: watch it skip and halve, then step."""
    model = make_model(args.width, args.depth, device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale, growth_interval=args.growth_interval)
    good_in_a_row = 0
    for step, (x, y) in enumerate(data(args.width, args.batch, args.scaler_steps, device)):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()                    # backward of loss x scale: 16-bit gradients scaled up
        scaler.unscale_(opt)                             # divide by the scale in fp32 (where clipping would go)
        overflow = not all(bool(p.grad.isfinite().all()) for p in params)
        before = [p.detach().clone() for p in params]
        scaler.step(opt)                                 # skipped when a gradient is inf or nan
        scaler.update()                                  # halve after an overflow; double after growth_interval
        changed = any(not torch.equal(a, b) for a, b in zip(before, params))
        new_scale = scaler.get_scale()
        if overflow:
            assert not changed and new_scale == scale * 0.5, (step, changed, scale, new_scale)
            good_in_a_row = 0
        else:
            good_in_a_row += 1
            grew = good_in_a_row == args.growth_interval
            assert changed and new_scale == scale * (2.0 if grew else 1.0), (step, changed, scale, new_scale)
            good_in_a_row = 0 if grew else good_in_a_row
        # "scaler_step", not "step": runtime.log's step drives the launcher's progress ("20 steps done")
        runtime.log(part="scaler", scaler_step=step, scale=scale, new_scale=new_scale, overflow=overflow,
                    params_changed=changed, loss=loss.item())


def run_underflow(args, device):
    """fp16 autocast without a scaler: the gradients of a small residual underflow to zero. Counted."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(args.batch, args.width, generator=gen).to(device)
    with torch.no_grad():
        fit = make_model(args.width, args.depth, device)(x)      # what the model predicts now
    noise = torch.randn(fit.shape, generator=gen).to(device)
    for residual in args.residuals:
        y = fit + residual * noise                               # targets the model already fits to ~residual
        grads = {}
        for mode in ("fp32", "fp16", "fp16+scaler"):
            model = make_model(args.width, args.depth, device)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16+scaler")  # default scale 2^16
            with torch.autocast(device.type, dtype=torch.float16, enabled=mode != "fp32"):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)                                  # a no-op when the scaler is disabled
            grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
        alive = grads["fp32"] != 0
        lost = {mode: int(((grads[mode] == 0) & alive).sum()) for mode in ("fp16", "fp16+scaler")}
        runtime.log(part="underflow", residual=residual, numel=int(alive.numel()), nonzero_fp32=int(alive.sum()),
                    zero_fp16=lost["fp16"], zero_fp16_scaler=lost["fp16+scaler"],
                    median_abs_grad=grads["fp32"].abs().median().item())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps per recipe before counting")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--recipes", nargs="+", default=list(costs.MEASURED_RECIPES), choices=costs.MEASURED_RECIPES)
    parser.add_argument("--scaler-steps", type=int, default=20)
    parser.add_argument("--init-scale", type=float, default=2.0**28,
                        help="GradScaler's first scale (its default: 2^16)")
    parser.add_argument("--growth-interval", type=int, default=4, help="GradScaler's (default 2000)")
    parser.add_argument("--residuals", type=float, nargs="+", default=[1e-2, 1e-3, 1e-4])
    args = parser.parse_args()
    for name in ("steps", "scaler_steps", "growth_interval", "width", "depth", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    ctx = runtime.setup(seed=0)
    for recipe in args.recipes:
        print(f"recipe {recipe}: {args.steps} AdamW step(s), then the bytes of the model states counted")
        run_recipe(recipe, args, ctx.device)
    print(f"fp16 + GradScaler: {args.scaler_steps} steps, the scale started at 2^{math.log2(args.init_scale):g}")
    run_scaler(args, ctx.device)
    print(f"fp16 without a scaler: gradients that underflow to zero, at residuals {args.residuals}")
    run_underflow(args, ctx.device)
    runtime.teardown()


if __name__ == "__main__":
    main()
