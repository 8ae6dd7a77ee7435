"""Collectives on plain numbers and objects, the same calls with or without a process group (one plain
process: the value itself): what metrics, checkpoints and the task's downloads share across ranks."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .distributed import DistEnv
from .errors import UsageError


def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce across ranks in place with op "sum", "max" or "min"; returns the tensor for chaining."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return tensor


def all_gather_objects(value) -> list:
    """Every rank's value of a picklable object, in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def all_reduce_int(value: int, device: torch.device, op: str) -> int:
    """An integer reduced over ranks with op "sum", "max" or "min" (every rank gets the result)."""
    return int(all_reduce(torch.tensor([value], dtype=torch.int64, device=device), op).item())


def barrier(device: torch.device) -> None:
    """Wait for every rank. An all-reduce rather than dist.barrier(), which guesses the device under NCCL."""
    all_reduce_int(0, device, "max")


def same_on_every_rank(value: str, device: torch.device) -> bool:
    """Whether every rank holds the same `value` (a hash of its 48 first bits, compared in one small all-reduce:
    the largest and the smallest agree)."""
    number = int(hashlib.sha256(value.encode()).hexdigest()[:12], 16)
    highest, minus_lowest = all_reduce(torch.tensor([number, -number], dtype=torch.float64, device=device),
                                       "max").tolist()
    return highest == -minus_lowest


def world_size() -> int:
    """Ranks in the job: 1 without a process group."""
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_object(value, source_rank: int = 0):
    """`source_rank`'s value of a picklable object (tensors included), on every rank."""
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=source_rank)
    return holder[0]


def from_first_rank_with(value, device: torch.device):
    """The value of the lowest-numbered rank where it is not None (None if it is None everywhere)."""
    if not dist.is_initialized():
        return value
    world_size = dist.get_world_size()
    source = all_reduce_int(dist.get_rank() if value is not None else world_size, device, "min")
    return None if source == world_size else broadcast_object(value, source_rank=source)


def first_node_on_its_storage(folder: Path, env: DistEnv, device: torch.device) -> tuple[bool, int]:
    """(whether this rank is the first rank of the first node that sees `folder`'s storage, how many storages
    the nodes see): one rank per storage, whether the folder is shared by every node, local to each, or a mix.

    The first rank of every node leaves a probe file; a node is first if no lower-numbered node's probe is
    visible to it. A collective: call on every rank."""
    token = broadcast_object(uuid.uuid4().hex if env.is_main_process else None)
    probe = folder / f".storage-probe-{token}-node{env.node_rank}"
    if env.is_local_main_process:
        probe.touch()
    barrier(device)
    is_first = False
    if env.is_local_main_process:
        visible = [int(path.name.rsplit("node", 1)[1]) for path in folder.glob(f".storage-probe-{token}-*")]
        is_first = min(visible) == env.node_rank
    barrier(device)
    if env.is_local_main_process:
        probe.unlink()
    return is_first, all_reduce_int(int(is_first), device, "sum")


def run_once_per_storage(folder: str | Path, env: DistEnv, device: torch.device, action: Callable[[], None],
                         what: str) -> None:
    """Run `action` (a download into `folder`) on one rank per storage behind `folder` while every other rank
    waits: nodes sharing a network folder download once, instead of all at once into the same files (each
    truncating the others' archive); nodes with local disks each download their own.

    A failure is shared with every rank, so all of them stop with the same error instead of the others
    hanging in a barrier until the timeout.
    """
    def attempt(step: Callable[[], object]) -> None:
        failure = None
        try:
            step()
        except Exception as error:  # noqa: BLE001 - reported on every rank below
            failure = f"{what} failed on node {env.node_rank}: {error}"
        failure = from_first_rank_with(failure, device)  # every rank gets the first failing node's message
        if failure:
            raise UsageError(failure)

    folder = Path(folder)
    attempt(lambda: folder.mkdir(parents=True, exist_ok=True))  # where the storage is probed
    downloads, _ = first_node_on_its_storage(folder, env, device)
    attempt(action if downloads else lambda: None)
