"""Held-out evaluation, exact across ranks."""

from __future__ import annotations

import math

import torch

from .distributed import all_reduce_int, all_reduce_sum
from .errors import UsageError
from .parallel import forward_is_collective, sync_buffers_from_main
from .precision import MixedPrecision


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device,
             amp: MixedPrecision) -> tuple[float, float, int]:
    """(mean loss, accuracy, samples) on the held-out split, from sums and counts reduced over ranks
    (not a mean of per-rank means, which is wrong when shards differ in size). Forwards run under training's
    autocast: as fast as training's, and the numbers are those of the model as trained."""
    sync_buffers_from_main(model)  # every rank evaluates with the same BatchNorm statistics
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)  # loss sum, correct, count
    lockstep = forward_is_collective(model)
    if lockstep:
        # FSDP2 all-gathers inside forward, so every rank must run as many forwards. Shards differ by up to one
        # sample, so batch counts may too: agree on the most first (a collective, so before any forward), and
        # a rank with fewer batches repeats its last one, uncounted.
        most = all_reduce_int(len(loader), device, "max")
        if all_reduce_int(len(loader), device, "min") == 0 < most:
            raise UsageError("the held-out split has fewer samples than there are ranks; use more data")
    images = None
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with amp.autocast():
            logits = model(images).float()
        totals[0] += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += labels.numel()
    if lockstep:
        for _ in range(most - len(loader)):
            with amp.autocast():
                model(images)
    model.train(was_training)
    loss_sum, correct, count = all_reduce_sum(totals).tolist()
    if count == 0:
        return math.nan, math.nan, 0
    return loss_sum / count, correct / count, int(count)
