"""The optimizer and its learning-rate schedule (linear warmup, then cosine decay or constant)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from .options import TrainOptions


def build_optimizer(model: torch.nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """Replace this with your own optimizer; the schedule below scales whatever lr it starts with."""
    return torch.optim.SGD(model.parameters(), lr=options.lr, momentum=0.9, weight_decay=5e-4)


def warmup_then_decay(step: int, warmup_steps: int, total_steps: int, decay: str) -> float:
    """lr multiplier for an optimizer step: linear warmup from ~0 to 1, then cosine to 0 (or constant 1)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant":
        return 1.0
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def planned_steps(options: TrainOptions, steps_per_epoch: int) -> int:
    """Optimizer steps this run will take: --epochs worth, or --max-steps if that comes first."""
    total_steps = options.epochs * steps_per_epoch
    return total_steps if options.max_steps is None else min(total_steps, options.max_steps)


def build_lr_schedule(optimizer: torch.optim.Optimizer, options: TrainOptions, steps_per_epoch: int) -> LambdaLR:
    """Stepped once per optimizer step; the decay spans --epochs. --max-steps only stops the run early, so a
    run stopped by it and restarted with a larger one continues the same schedule.

    A checkpoint holds the schedule's step count; the plan itself comes from the current options, so
    resuming on another world size (another number of steps per epoch) re-plans the rest of the run.
    """
    total_steps = options.epochs * steps_per_epoch
    warmup_steps = options.warmup_steps if options.warmup_steps is not None else total_steps // 20
    # A lambda, which LambdaLR leaves out of its state_dict: nothing but the step count is restored.
    return LambdaLR(optimizer, lambda step: warmup_then_decay(step, warmup_steps, total_steps, options.lr_schedule))
