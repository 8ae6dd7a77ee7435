"""The optimizer and its learning-rate schedule (linear warmup, then cosine decay or constant)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

from .options import TrainOptions


def build_optimizer(model: torch.nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """Replace this with your own optimizer; the schedule below scales whatever lr it starts with."""
    return torch.optim.SGD(model.parameters(), lr=options.lr, momentum=0.9, weight_decay=5e-4)


@dataclass
class WarmupThenDecay:
    """lr multiplier for an optimizer step: linear warmup from ~0 to 1, then cosine to 0 (or constant 1).

    A callable object rather than a lambda so LambdaLR saves its fields in the checkpoint: a resumed run
    keeps the plan it started with, even when a different world size would make the run's length differ.
    """

    warmup_steps: int
    total_steps: int
    decay: str = "cosine"

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "constant":
            return 1.0
        progress = min((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 1.0)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def planned_steps(options: TrainOptions, steps_per_epoch: int) -> int:
    """Optimizer steps in the whole run: --epochs worth, or --max-steps if that comes first."""
    total_steps = options.epochs * steps_per_epoch
    return total_steps if options.max_steps is None else min(total_steps, options.max_steps)


def build_lr_schedule(optimizer: torch.optim.Optimizer, options: TrainOptions, total_steps: int) -> LambdaLR:
    """Stepped once per optimizer step; its state goes into every checkpoint."""
    warmup_steps = options.warmup_steps if options.warmup_steps is not None else total_steps // 20
    return LambdaLR(optimizer, WarmupThenDecay(warmup_steps, total_steps, options.lr_schedule))
