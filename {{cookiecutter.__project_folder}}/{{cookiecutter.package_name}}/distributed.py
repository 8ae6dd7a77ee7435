"""Everything torchrun and torch.distributed: read the launch environment once, pick device and backend,
start and tear down the process group, and reduce numbers across ranks.

Nothing else in the project reads os.environ or calls torch.distributed directly, except parallel.py, which
wraps the model for data parallelism.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import UsageError

# What torchrun sets for every worker. Either all of these are present or none (plain `python train.py`).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as torchrun described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0  # GROUP_RANK: which machine this is, 0..nodes-1
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: how often torchrun has restarted the group
    run_id: str = "local"  # TORCHELASTIC_RUN_ID: the rendezvous id, identical on every node
    launched_by_torchrun: bool = False
    # TORCHELASTIC_USE_AGENT_STORE: torchrun's store outlives restarts (see run_node.sh, pytorch#135712).
    store_shared_across_restarts: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> DistEnv:
        present = [name for name in TORCHRUN_VARIABLES if name in environ]
        if not present:
            return cls()
        missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
        if missing:
            raise UsageError(
                f"partial torchrun environment: {', '.join(present)} set but {', '.join(missing)} missing; "
                "launch with torchrun (or run_node.sh), or unset them to run as one plain process")
        try:
            numbers = {name: int(environ[name]) for name in TORCHRUN_VARIABLES if name != "MASTER_ADDR"}
            restart_count = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError as error:
            raise UsageError(f"torchrun environment is not numeric where it must be ({error})") from None
        env = cls(
            rank=numbers["RANK"], world_size=numbers["WORLD_SIZE"],
            local_rank=numbers["LOCAL_RANK"], local_world_size=numbers["LOCAL_WORLD_SIZE"],
            node_rank=numbers["GROUP_RANK"], restart_count=restart_count,
            run_id=environ.get("TORCHELASTIC_RUN_ID", "none"), launched_by_torchrun=True,
            store_shared_across_restarts=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
        env.check_consistent()
        return env

    def check_consistent(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"inconsistent torchrun environment: RANK={self.rank} with WORLD_SIZE={self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size <= self.world_size:
            raise UsageError(
                f"inconsistent torchrun environment: LOCAL_RANK={self.local_rank}, "
                f"LOCAL_WORLD_SIZE={self.local_world_size}, WORLD_SIZE={self.world_size}")

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @property
    def num_nodes(self) -> int:
        # torchrun starts the same number of workers on every node.
        return self.world_size // self.local_world_size


def select_device(requested: str, env: DistEnv) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is wanted and present, else cpu. The global rank is never a device index."""
    cuda_available = torch.cuda.is_available()
    if requested == "cuda" and not cuda_available:
        raise UsageError("--device cuda but no CUDA device is visible; use --device cpu or auto")
    if requested == "cpu" or not cuda_available:
        return torch.device("cpu")
    if env.local_rank >= torch.cuda.device_count():
        raise UsageError(
            f"LOCAL_RANK={env.local_rank} but only {torch.cuda.device_count()} CUDA devices are visible; "
            "start at most that many processes per node (--nproc-per-node / NPROC_PER_NODE)")
    return torch.device("cuda", env.local_rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def distributed_session(env: DistEnv, device: torch.device) -> Iterator[None]:
    """Join the process group for the duration of the block (nothing to join for one plain process)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL never puts every rank's context on cuda:0
    if env.launched_by_torchrun:
        # MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE come from torchrun through env://.
        dist.init_process_group(
            backend=backend_for(device), timeout=timedelta(minutes=10),
            device_id=device if device.type == "cuda" else None,
        )
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum across ranks, in place; returns the tensor for chaining."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_int(value: int, device: torch.device, op: str) -> int:
    """An integer reduced over ranks with op "sum", "max" or "min" (every rank gets the result)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return int(tensor.item())


def barrier(device: torch.device) -> None:
    """Wait for every rank. An all-reduce rather than dist.barrier(), which guesses the device under NCCL."""
    all_reduce_int(0, device, "max")


def mean_across_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (gloo has no AVG, so sum and divide)."""
    total = all_reduce_sum(value.detach().float().clone())
    return total.item() / (dist.get_world_size() if dist.is_initialized() else 1)


def broadcast_object(value, source_rank: int = 0):
    """`source_rank`'s value of a picklable object (tensors included), on every rank."""
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=source_rank)
    return holder[0]


# Exit status after a clean stop on SIGTERM: the shell's "terminated by SIGTERM", so a scheduler or torchrun
# sees an interrupted job (to requeue or restart), never a finished one.
EXIT_CODE_AFTER_SIGTERM = 128 + signal.SIGTERM


class StopRequest:
    """Turns SIGTERM into a stop that every rank agrees on.

    Slurm and Kubernetes send SIGTERM before they kill a job, and torchrun forwards it to its workers (then
    waits about 30 s before SIGKILL). The handler only sets a flag; the loop asks `agreed()` once per step,
    an all-reduce, so all ranks stop after the same step and can save one consistent checkpoint.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.received = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.received = True

    def agreed(self) -> bool:
        return all_reduce_int(int(self.received), self.device, "max") > 0


def run_once_per_node(env: DistEnv, device: torch.device, action: Callable[[], None], what: str) -> None:
    """Run `action` on local rank 0 of every node while the node's other ranks wait (e.g. a download).

    A failure is shared with every rank, so all of them stop with the same error instead of the others
    hanging in a barrier until the timeout.
    """
    failure = ""
    if env.is_local_main_process:
        try:
            action()
        except Exception as error:  # noqa: BLE001 - reported on every rank below
            failure = f"{what} failed on node {env.node_rank}: {error}"
    if all_reduce_int(1 if failure else 0, device, "max"):
        raise UsageError(failure or f"{what} failed; see the error from local rank 0 of the node that failed")
