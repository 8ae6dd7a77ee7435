"""Held-out evaluation, exact across ranks."""

from __future__ import annotations

import math

import torch

from .distributed import all_reduce_sum
from .parallel import sync_buffers_from_main


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device) -> tuple[float, float, int]:
    """(mean loss, accuracy, samples) on the held-out split, from sums and counts reduced over ranks
    (not a mean of per-rank means, which is wrong when shards differ in size)."""
    sync_buffers_from_main(model)  # every rank evaluates with the same BatchNorm statistics
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)  # loss sum, correct, count
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        totals[0] += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += labels.numel()
    model.train(was_training)
    loss_sum, correct, count = all_reduce_sum(totals).tolist()
    if count == 0:
        return math.nan, math.nan, 0
    return loss_sum / count, correct / count, int(count)
