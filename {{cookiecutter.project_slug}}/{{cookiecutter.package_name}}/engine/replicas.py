"""What keeps DDP's replicas one model: rank 0's buffers given to every rank before a save or an evaluation, and
the check that every rank holds the same parameters (a silent corruption or a bug otherwise trains several
models under one loss curve)."""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_objects, all_reduce
from .errors import UsageError


def is_sharded(module: nn.Module) -> bool:
    """Whether fully_shard wrapped `module`; where FSDP was never imported, nothing was."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def sync_buffers_from_main(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (e.g. BatchNorm running statistics), a collective.

    DDP syncs parameters through gradients, but buffers only by broadcasting rank 0's at the start of each
    training forward; between steps every replica holds the statistics of its own last batch. Saving or
    evaluating needs the one canonical copy that training continues from.
    """
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


class ReplicaCorrupted(RuntimeError):
    """One rank's parameters differ from those every other rank agrees on: silent data corruption (a flipped bit in
    memory, a faulty GPU or link) on that rank's machine, since code that depends on the rank would seldom pick
    one rank out of many. A fault of the machine, not a bug: the job restarts from its last checkpoint (verified
    when it was saved), and once torchrun's restarts are spent it exits non-zero, for the scheduler to requeue it
    and drain that node."""


def check_replicas_match(model: nn.Module, step: int, without_gradient: list[str] = ()) -> int:
    """Stop the job unless every rank holds the same parameters (a collective: one small all-reduce); returns
    how many parameters were compared (0: nothing to compare).

    DDP keeps replicas equal only while every gradient is all-reduced and nothing else writes to parameters,
    and a loss that falls shows neither. Each rank sums the bits of every parameter (read as integers, so any
    flipped bit counts); one all-reduce of (sums, -sums) with MAX gives every rank each sum's largest and
    smallest value. `model` is the unwrapped model. FSDP2 shards differ by design: nothing to compare.
    Only when they differ are the ranks' fingerprints and hosts gathered, to say which ranks hold which model:
    one rank against all the others (three or more ranks) is ReplicaCorrupted, any other split a bug (UsageError).
    `without_gradient`: this rank's trained parameters that the step left with no gradient, named as the cause."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or any(map(is_sharded, model.modules())):
        return 0
    names, parameters = zip(*model.named_parameters(), strict=True)
    sums = torch.stack([bit_sum(parameter) for parameter in parameters])
    extremes = all_reduce(torch.cat([sums, -sums]), "max")
    differing = (extremes[:len(sums)] != -extremes[len(sums):]).nonzero().flatten().tolist()
    if not differing:
        return len(names)
    ranks_by_model: dict[tuple[int, ...], list[int]] = {}
    places = all_gather_objects((tuple(sums.tolist()), socket.gethostname(), list(without_gradient)))
    unused = sorted({name for _, _, names in places for name in names})
    if unused:  # a bucket with a parameter that got no gradient is never all-reduced (every rank keeps its own)
        raise UsageError(
            f"the ranks hold different models after step {step}: step {step} left {len(unused)} trained "
            f"parameter(s) without a gradient ({', '.join(map(repr, unused[:3]))}"
            f"{f' and {len(unused) - 3} more' if len(unused) > 3 else ''}), so DDP did not all-reduce their "
            "gradient buckets; if a step may leave parameters unused (a mixture of experts, a conditional branch), "
            "give task.py's Task find_unused_parameters=True, else use them in the loss or freeze them")
    for rank, (fingerprint, *_) in enumerate(places):
        ranks_by_model.setdefault(fingerprint, []).append(rank)
    groups = sorted(ranks_by_model.values(), key=len, reverse=True)
    which = (f"parameter {names[differing[0]]!r} differs (and {len(differing) - 1} more of {len(names)}); "
             f"{len(groups)} different models, held by {describe_groups(groups, places)}")
    if len(groups) == 2 and len(groups[1]) == 1 and len(groups[0]) >= 2:
        [odd_rank] = groups[1]
        raise ReplicaCorrupted(
            f"rank {odd_rank} on {places[odd_rank][1]} holds parameters that differ from those of the other "
            f"{len(groups[0])} ranks after step {step}: {which}. One rank out of many is a fault of its machine "
            "(silent data corruption, a faulty GPU, memory or link), not of the code: restarting from the last "
            "checkpoint; if it comes back, drain that node")
    raise UsageError(
        f"the ranks hold different models after step {step}: {which}. DDP did not all-reduce every gradient, "
        "or something changed parameters outside the optimizer: the loss ran the plain model (step.model) or a "
        "method other than forward (DDP syncs gradients only through forward), a forward whose output DDP cannot "
        "look into (a dataclass not registered with torch.utils._pytree), code that depends on the rank, or an "
        "in-place update of a parameter; fix the model or loss in task.py")


def describe_groups(groups: list[list[int]], places: list[tuple]) -> str:
    """"ranks 0, 2 (host-a, host-b) | rank 1 (host-a)": who holds each model, the most common first."""
    def hosts(ranks: list[int]) -> str:
        return ", ".join(dict.fromkeys(places[rank][1] for rank in ranks))
    return " | ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks[:8]))}"
                      f"{f' and {len(ranks) - 8} more' if len(ranks) > 8 else ''} ({hosts(ranks[:8])})"
                      for ranks in groups[:4])


def bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor's elements read as integers of their width: equal tensors give equal sums, and a
    change of any one bit changes it."""
    as_integers = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.detach().contiguous().view(as_integers).sum(dtype=torch.int64)
