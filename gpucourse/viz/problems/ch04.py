"""Chapter 04's problems: the steps an epoch and a warmup take as the global batch grows (training.steps_per_epoch),
steps against examples around the critical batch (training.batch_tradeoff, McCandlish et al. 2018), with your run's
noise scale, and an audit of Goyal et al.'s warmup counted in optimizer steps."""
from __future__ import annotations

from ...models import training
from .base import Problem

MCCANDLISH = ("McCandlish et al., An Empirical Model of Large-Batch Training, arXiv 1812.06162: (S/S_min - 1)"
              "(E/E_min - 1) = 1 (eq. 2.11), B_crit = E_min / S_min about the noise scale B_noise")
GOYAL = ("Goyal et al., Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour, arXiv 1706.02677: ResNet-50, "
         "minibatch 8,192 on 256 GPUs (32 a GPU), warmup over the first 5 epochs; ImageNet-1k's training set: "
         "1,281,167 images")


def _warmup_steps(items, batch_per_rank, world_size, warmup_epochs):
    per_epoch = training.steps_per_epoch(items, batch_per_rank, world_size)
    one_rank = training.steps_per_epoch(items, batch_per_rank, 1)
    return {"answer": warmup_epochs * per_epoch, "per_epoch": per_epoch, "global_batch": batch_per_rank * world_size,
            "one_rank": warmup_epochs * one_rank}


def _steps_over_min(batch, noise_scale):
    t = training.batch_tradeoff(batch, noise_scale)
    return {"answer": t["steps"], "examples": t["examples"]}


def _fewer_steps(small, large, noise_scale):
    a, b = training.batch_tradeoff(small, noise_scale), training.batch_tradeoff(large, noise_scale)
    return {"answer": a["steps"] / b["steps"], "s_small": a["steps"], "s_large": b["steps"], "linear": large / small,
            "e_small": a["examples"], "e_large": b["examples"], "more_examples": b["examples"] / a["examples"]}


def _your_noise_scale(noise_scale, batch_per_rank, ranks):
    small, large = batch_per_rank, batch_per_rank * ranks
    return {**_fewer_steps(small, large, noise_scale), "small": small, "large": large}


def _goyal(items, batch_per_gpu, gpus, warmup_epochs):
    return _warmup_steps(items, batch_per_gpu, gpus, warmup_epochs)


PROBLEMS = [
    Problem(
        "04.warmup-steps",
        "Chapter 04's recipe: {items:,} training samples, {batch_per_rank} a rank, {world_size} ranks, and warmup over "
        "the first {warmup_epochs} epochs. How many optimizer steps does the warmup last?",
        inputs={"items": 16384, "batch_per_rank": 32, "world_size": 4, "warmup_epochs": 0.5}, work=_warmup_steps,
        unit="steps", digits=0, tolerance=0,
        hint="the warmup is set in epochs, but the schedule counts optimizer steps: an epoch on N ranks is N times "
             "fewer steps, items / (batch per rank x N).",
        traps={"one_rank": "That is one rank's count: with the global batch 4 times larger an epoch has 4 times "
                           "fewer steps."},
        solution="global batch {global_batch}: {per_epoch} steps an epoch; x {warmup_epochs} = {answer}."),
    Problem(
        "04.steps-over-minimum",
        "A task whose critical batch (about its gradient noise scale) is {noise_scale:,} samples trains at batch "
        "{batch}. By McCandlish et al.'s model, how many times the minimum number of steps S_min does it take?",
        inputs={"batch": 512, "noise_scale": 2000}, work=_steps_over_min, unit="x", digits=2,
        source=MCCANDLISH,
        hint="S = S_min (1 + B_crit / B): far below the critical batch, the steps grow as B_crit / B; at B_crit they "
             "are twice the minimum.",
        traps={"examples": "That is E / E_min = 1 + B / B_crit, the examples over their minimum, not the steps."},
        solution="1 + {noise_scale} / {batch} = {answer} (and E / E_min = 1 + {batch} / {noise_scale} = "
                 "{examples:.2f})."),
    Problem(
        "04.fewer-steps",
        "The same task (critical batch {noise_scale:,}): going from batch {small:,} to batch {large:,}, how many times "
        "fewer steps does it need?",
        inputs={"small": 1024, "large": 8192, "noise_scale": 2000}, work=_fewer_steps, unit="x", digits=2,
        level="combine", source=MCCANDLISH,
        hint="the linear scaling rule's k times fewer steps holds only far below B_crit: take the ratio of "
             "1 + B_crit / B at the two batches.",
        traps={"linear": "That is the linear rule's k: near and above the critical batch the steps fall less."},
        solution="S/S_min: {s_small:.3f} at {small}, {s_large:.3f} at {large}; ratio {answer} fewer steps, for "
                 "{more_examples:.2f} x the examples."),
    Problem(
        "04.your-noise-scale",
        "Your chapter 04 run, section 6: the noise scale at the last epoch's weights is {noise_scale:g} samples. "
        "Taking it as the critical batch, how many times fewer steps does the {ranks}-rank batch ({batch_per_rank} a "
        "rank) need than one rank's?",
        inputs={"noise_scale": 400.0, "batch_per_rank": 32, "ranks": 4}, own=("noise_scale", "batch_per_rank", "ranks"),
        work=_your_noise_scale, unit="x", digits=2, level="your run", source=MCCANDLISH,
        hint="the global batch is batch per rank x ranks; the steps at each batch are S_min (1 + B_noise / B): "
             "divide one by the other.",
        traps={"linear": "That is the linear rule's promise (k times fewer): it holds only for batches far below "
                         "the noise scale."},
        solution="S/S_min at {small}: {s_small:.3f}; at {large}: {s_large:.3f}; {answer} fewer steps (the linear "
                 "rule: {linear:g})."),
    Problem(
        "04.audit-goyal-warmup",
        "Audit: Goyal et al. train ResNet-50 with a minibatch of 8,192 on {gpus} GPUs ({batch_per_gpu} images a GPU) "
        "and warm up over the first {warmup_epochs} epochs of ImageNet's {items:,} training images. A framework that "
        "takes warmup in steps: how many optimizer steps is that (DistributedSampler, last batch kept)?",
        inputs={"items": 1_281_167, "batch_per_gpu": 32, "gpus": 256, "warmup_epochs": 5}, work=_goyal,
        unit="steps", digits=0, tolerance=0, level="audit", source=GOYAL,
        hint="each GPU reads ceil(images / GPUs) images an epoch, in batches of 32 (the last one smaller): that many "
             "steps an epoch, times 5.",
        traps={"one_rank": "That counted steps of 32 images on one GPU: the 8,192-image minibatch takes 256 times "
                           "fewer."},
        solution="{per_epoch} steps an epoch (global batch {global_batch:,}); x {warmup_epochs} epochs = {answer}."),
]
