"""Data parallelism for the model: DDP replicas (and torch.compile on top), gradient-sync control for
accumulation, and the buffer sync that DDP leaves to the next forward pass."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def wrap_model(model: torch.nn.Module, device: torch.device, compile_model: bool = False,
               grad_accum: int = 1) -> torch.nn.Module:
    """The module to run forward and backward through: DDP over the already-placed model (the model itself
    for one plain process), compiled when asked. Save, load and evaluate the unwrapped `model`."""
    if dist.is_initialized():
        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            # Gradients are views into the all-reduce buckets: no copy in or out of them, less memory.
            gradient_as_bucket_view=True,
            # Same parameters used every step, so DDP can skip its per-step search for unused ones. Not with
            # no_sync accumulation (pytorch/pytorch#143580) or compile. If you edit the model so that some
            # parameters skip some steps, drop this.
            static_graph=grad_accum == 1 and not compile_model,
        )
    if compile_model:
        # Compiling the DDP module lets dynamo split graphs at bucket boundaries, keeping the all-reduce
        # overlapped with the backward pass.
        model = torch.compile(model)
    return model


def gradient_sync(training_model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap a micro-step's forward and backward: with enabled=False, gradients accumulate locally and the
    all-reduce is skipped; the step that finally syncs all-reduces the accumulated sum once."""
    ddp = getattr(training_model, "_orig_mod", training_model)  # under torch.compile
    if enabled or not isinstance(ddp, DistributedDataParallel):
        return contextlib.nullcontext()
    return ddp.no_sync()


def sync_buffers_from_main(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (e.g. BatchNorm running statistics), a collective.

    DDP syncs parameters through gradients, but buffers only by broadcasting rank 0's at the start of each
    training forward; between steps every replica holds the statistics of its own last batch. Saving or
    evaluating needs the one canonical copy that training continues from.
    """
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def uses_channels_last(model: torch.nn.Module, device: torch.device, requested: bool | None) -> bool:
    """NHWC suits tensor-core convolutions on CUDA; on CPU it rarely helps, so there it is opt-in."""
    if requested is not None:
        return requested
    return device.type == "cuda" and any(isinstance(module, torch.nn.Conv2d) for module in model.modules())
