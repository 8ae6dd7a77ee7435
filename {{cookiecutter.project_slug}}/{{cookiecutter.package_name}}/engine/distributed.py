"""Joining the job torchrun started: read the launch environment once, set up logging for this rank, pick
device and backend, and start and tear down the process group on a store of this attempt's own.

Nothing else in the project reads torchrun's environment; collectives.py reduces numbers across ranks,
parallel.py wraps the model (DDP, FSDP2), watchdog.py opens a store connection of its own, and
checkpoint/sharded.py hands FSDP2's shards to torch.distributed.checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import UsageError
from .processes import recording_job_sockets

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
    max_restarts: int = 0  # TORCHELASTIC_MAX_RESTARTS: torchrun's --max-restarts (0 unless given)
    run_id: str = "local"  # TORCHELASTIC_RUN_ID: the rendezvous id, identical on every node
    launched_by_torchrun: bool = False
    # TORCHELASTIC_USE_AGENT_STORE: torchrun's store outlives restarts (see run_node.sh, pytorch#135712).
    store_shared_across_restarts: bool = False
    # STOP_REQUEUE_FILE: where a bug found by a retry is written, for a requeue script (train.sbatch) to read.
    stop_requeue_file: str | None = None
    # TORCHELASTIC_ERROR_FILE: where torchrun reads a failed rank's error, for its "Root Cause" summary.
    error_file: str | None = None

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
            max_restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        except ValueError as error:
            raise UsageError(f"torchrun environment is not numeric where it must be ({error})") from None
        env = cls(
            rank=numbers["RANK"], world_size=numbers["WORLD_SIZE"],
            local_rank=numbers["LOCAL_RANK"], local_world_size=numbers["LOCAL_WORLD_SIZE"],
            node_rank=numbers["GROUP_RANK"], restart_count=restart_count, max_restarts=max_restarts,
            run_id=environ.get("TORCHELASTIC_RUN_ID", "none"), launched_by_torchrun=True,
            store_shared_across_restarts=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            stop_requeue_file=environ.get("STOP_REQUEUE_FILE") or None,
            error_file=environ.get("TORCHELASTIC_ERROR_FILE") or None,
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
    def run_name(self) -> str:
        """The run id as a file name: the same on every node, and another for another job."""
        return as_file_name(self.run_id)

    @property
    def num_nodes(self) -> int:
        # torchrun starts the same number of workers on every node.
        return self.world_size // self.local_world_size


def as_file_name(text: str) -> str:
    """`text` with every character that is not safe in a file name on any system replaced by "_"."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def hang_reports_folder(env: DistEnv) -> Path:
    """Where this run's hang reports go (NCCL's flight records), relative to where the job was started: a
    folder per run id, so two jobs started from one folder keep each other's."""
    return Path("hang-reports") / env.run_name


def nccl_flight_recorder_settings(env: DistEnv) -> dict[str, str]:
    """NCCL's flight recorder: each rank keeps its last 2000 collectives, and when one rank's collective times
    out, every rank writes them to hang-reports/<run id>/nccl_trace_rank_<N>, for `python -m
    torch.distributed.flight_recorder.fr_trace hang-reports/<run id>` to show which collective each rank
    reached. That, not a Python stack, tells where NCCL ranks wait: their collectives return as soon as they
    are queued. (TORCH_NCCL_TRACE_BUFFER_SIZE is the older name of TORCH_FR_BUFFER_SIZE.)"""
    folder = hang_reports_folder(env).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(folder / "nccl_trace_rank_")}


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
            "start at most that many processes per node (--nproc-per-node / NPROC_PER_NODE)",
            same_on_every_rank=False)
    return torch.device("cuda", env.local_rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def setup_logging(env: DistEnv) -> None:
    """INFO on rank 0 only; other ranks report warnings and errors, prefixed with their rank."""
    prefix = "" if env.is_main_process else f"[rank {env.rank}] "
    logging.basicConfig(
        level=logging.INFO if env.is_main_process else logging.WARNING,
        format=f"%(asctime)s.%(msecs)03d {prefix}%(message)s", datefmt="%H:%M:%S", force=True,
    )


def describe_job(env: DistEnv, device: torch.device) -> str:
    return (f"world_size={env.world_size} nodes={env.num_nodes} ranks_per_node={env.local_world_size} "
            f"backend={backend_for(device)} device={device} run_id={env.run_id} restart={env.restart_count}")


@dataclass(frozen=True)
class StoreAddress:
    """Where this job's key-value store listens (the watchdog opens a connection of its own to it)."""

    host: str
    port: int

    @classmethod
    def of_torchrun(cls) -> StoreAddress:
        """The store torchrun names for this attempt: its own, shared across restarts, or rank 0's to host."""
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def connect(self, timeout: timedelta) -> dist.TCPStore:
        """A client connection of its own to this store."""
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)


@contextlib.contextmanager
def distributed_session(env: DistEnv, device: torch.device,
                        timeout: timedelta = timedelta(minutes=10)) -> Iterator[StoreAddress | None]:
    """Join the process group for the duration of the block (nothing to join for one plain process).

    `timeout` bounds every collective; a stalled rank is usually caught sooner by the watchdog.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL never puts every rank's context on cuda:0
        for name, value in nccl_flight_recorder_settings(env).items():  # read when the process group starts
            os.environ.setdefault(name, value)
    address = None
    if env.launched_by_torchrun:
        with recording_job_sockets():
            store, address = store_of_this_attempt(env, timeout)
            dist.init_process_group(
                backend=backend_for(device), store=store, rank=env.rank, world_size=env.world_size,
                timeout=timeout, device_id=device if device.type == "cuda" else None,
            )
            SIDE_GROUP.append(new_lazy_gloo_group(timeout))
            SESSION_TIMEOUT.append(timeout)
    try:
        yield address
    finally:
        SIDE_GROUP.clear()
        SESSION_TIMEOUT.clear()
        if dist.is_initialized():
            # A DDP model caught in a reference cycle is freed by the cycle collector, possibly only at
            # interpreter exit, after the group it holds was destroyed: gloo's threads then abort the process
            # ("terminate called without an active exception", SIGABRT after a job that succeeded).
            gc.collect()
            dist.destroy_process_group()


# The process group's gloo companion (side_group()), made with it and dropped with it, and its timeout.
SIDE_GROUP: list[dist.ProcessGroup] = []
SESSION_TIMEOUT: list[timedelta] = []


def session_timeout() -> timedelta:
    """The bound on any one collective that distributed_session was given (for groups made later)."""
    return SESSION_TIMEOUT[0] if SESSION_TIMEOUT else dist.default_pg_timeout


def side_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank beside the main one, for the loop's small agreements on CPU (stop after the
    same step{% if cookiecutter.use_streaming == "yes" %}, a streamed epoch's end{% endif %}), each issued asynchronously one step ahead so that it never waits on
    the GPU, nor the GPU on it; None without a process group. One for the whole job: another group would be
    another set of connections."""
    return SIDE_GROUP[0] if SIDE_GROUP else None


def new_lazy_gloo_group(timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group of every rank (a collective), connected lazily (TORCH_GLOO_LAZY_INIT, read when a gloo group
    is made; torch 2.8 and later, pytorch/pytorch#150801): a rank connects to a peer when it first exchanges
    with it. The side group's all-reduce and all-gather run over a ring: each rank talks to its two neighbours.
    Eagerly (older torch), gloo connects a full mesh at creation: every rank opens N-1 sockets, more than a
    common `ulimit -n` of 1024 allows at a thousand ranks, and reads every rank's address through rank 0's
    store, 8 N^3 bytes in all, gigabytes at that size. The main group keeps torch's default: its collectives
    may talk to any peer. One all-reduce here makes the ring's connections while the job's sockets are being
    recorded, so DataLoader workers forked later close them (processes.close_job_sockets). `timeout`: the main
    group's (a new group's own default is 30 minutes)."""
    previous = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        with recording_job_sockets():
            group = dist.new_group(backend="gloo", timeout=timeout)
            dist.all_reduce(torch.zeros(1), group=group)
    finally:
        if previous is None:
            del os.environ["TORCH_GLOO_LAZY_INIT"]
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = previous
    return group


class PortTaken(RuntimeError):
    """Without a shared store, torchrun picks a free port for rank 0's store when an attempt starts, and rank 0
    listens on it seconds later; another process on that machine can take it in between
    (pytorch/pytorch#126510). A fault of this attempt: the next one gets another port."""

    def __init__(self, port: int):
        super().__init__(f"port {port}, which torchrun chose for this attempt's store, was taken by another "
                         "process before rank 0 could listen on it (pytorch/pytorch#126510)")


def store_of_this_attempt(env: DistEnv, timeout: timedelta) -> tuple[dist.Store, StoreAddress]:
    """A TCPStore that no earlier attempt of this job has written to, and where it listens.

    torchrun >= 2.5 hands every worker its own rendezvous store, which outlives restarts. The process group
    keeps its keys (gloo's listening addresses among them) under fixed names, so a restarted worker can read
    a dead predecessor's entry and connect to a port nobody listens on, then fail or hang
    (pytorch/pytorch#135712); torch's per-restart key prefix breaks once nodes have different restart counts
    (a node that joined later). So rank 0 of every attempt starts a fresh store and publishes its address
    with a random token; the others skip entries whose store is gone or holds another token. Without a
    shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) torchrun already gives each attempt a fresh one,
    hosted by rank 0 at MASTER_ADDR:MASTER_PORT, as env:// would. This can go, and init_process_group use
    env:// again, once torchrun gives every attempt's process group keys of its own across nodes that
    restarted different numbers of times.
    """
    master = StoreAddress.of_torchrun()
    if not env.store_shared_across_restarts:
        try:
            store = dist.TCPStore(master.host, master.port, env.world_size, is_master=env.is_main_process,
                                  timeout=timeout, multi_tenant=True, wait_for_workers=False)
        except dist.DistNetworkError as error:
            # The libuv store says "EADDRINUSE ... address already in use", the older one "errno: 98 - Address
            # already in use"; torch's own elastic utilities match the same words.
            if env.is_main_process and "address already in use" in str(error).lower():
                raise PortTaken(master.port) from error
            raise
        return wait_for_every_rank(store, store, env, time.monotonic() + timeout.total_seconds()), master
    shared = master.connect(timeout)
    key = f"ddp-template/{env.run_id}/store-of-this-attempt"
    deadline = time.monotonic() + timeout.total_seconds()
    if env.is_main_process:
        host = address_others_reach(master.host)
        fresh = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        token = uuid.uuid4().hex
        fresh.set("token", token)
        shared.set(key, f"{host} {fresh.port} {token}")
        return wait_for_every_rank(fresh, shared, env, deadline), StoreAddress(host, fresh.port)
    pause = 0.05
    while time.monotonic() < deadline:
        stop_if_another_machine_found_a_usage_error(shared, env)
        if shared.check([key]):  # rank 0's entry, maybe a stale one of an earlier attempt
            host, port, token = shared.get(key).decode().split()
            address = StoreAddress(host, int(port))
            if listening(address.host, address.port):  # a stale entry's store died with its rank 0: refused at once
                # A short timeout: the stale port may since have been taken by something that is not our store.
                with contextlib.suppress(RuntimeError):
                    candidate = address.connect(timedelta(seconds=5))
                    if candidate.get("token").decode() == token:
                        candidate.set_timeout(timeout)
                        return wait_for_every_rank(candidate, shared, env, deadline), address
        time.sleep(pause)
        pause = min(2 * pause, 1.0)  # at a thousand ranks, rank 0's store answers a thousand polls a second
    raise TimeoutError(f"rank 0 published no store for this attempt within {timeout}")


# In this attempt's store: how many ranks have joined it, or stopped on a usage error they published first.
JOINED = "joined"


def usage_error_key(env: DistEnv) -> str:
    return f"ddp-template/{env.run_id}/usage-error"


def publish_usage_error(line: str, env: DistEnv, ranks_it_stops: int) -> None:
    """Tell the job's other machines that this one stopped on a usage error they may not see (a --data-dir
    missing here, other flags on this machine): they stop too, instead of waiting for it in the process group's
    start-up until the timeout. `ranks_it_stops`: this rank alone, or all of this machine's. Through torchrun's
    store where it is shared; else through this attempt's, which is rank 0's to host: a rank 0 that stopped
    hosts it until every rank has joined it or stopped (a minute at most)."""
    master = StoreAddress.of_torchrun()
    if env.store_shared_across_restarts:
        master.connect(timedelta(seconds=5)).compare_set(usage_error_key(env), "", line)  # the first one stays
        return
    if not env.is_main_process:  # rank 0's store, if its machine is fine: it waits in it for this rank
        store = master.connect(timedelta(seconds=60))
    else:
        store = dist.TCPStore(master.host, master.port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=5), multi_tenant=True)
    store.compare_set(usage_error_key(env), "", line)
    store.add(JOINED, ranks_it_stops)  # after the line, so a rank that counts all joined reads it then
    deadline = time.monotonic() + 60
    while env.is_main_process and store.add(JOINED, 0) < env.world_size and time.monotonic() < deadline:
        time.sleep(0.2)


def stop_if_another_machine_found_a_usage_error(shared: dist.Store, env: DistEnv) -> None:
    if shared.check([usage_error_key(env)]):
        line = shared.get(usage_error_key(env)).decode().removeprefix("error: ")
        raise UsageError(f"{line} (found on another machine of this job)")


def wait_for_every_rank(store: dist.Store, shared: dist.Store, env: DistEnv, deadline: float) -> dist.Store:
    """Wait in `store` (this attempt's) until every rank has joined, watching torchrun's store for a usage error
    another machine found: torch's own wait, inside init_process_group, would wait out the whole timeout."""
    store.add(JOINED, 1)
    pause = 0.05
    while True:
        joined = store.add(JOINED, 0)
        stop_if_another_machine_found_a_usage_error(shared, env)  # after the count: a stopped rank counts itself
        if joined >= env.world_size:
            return store
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {joined} of {env.world_size} ranks joined this attempt within the timeout")
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


def address_toward(host: str) -> str:
    """This machine's address on the route to `host`: what the other machines can reach us at (a UDP
    connect sends nothing; it only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def address_others_reach(store_host: str) -> str:
    """Where the job's other machines can reach this one, which shares the store at `store_host` with them.

    The source address of the route toward the store, except where that route is loopback: then this machine
    hosts the store under a name that resolves to itself here only (Debian and Ubuntu map a machine's own
    hostname to 127.0.1.1), and the other machines, which reached the store under that name, reach us so too.
    """
    address = address_toward(store_host)
    all_on_this_machine = store_host == "localhost" or is_ip_address(store_host)  # torchrun --standalone, 127.0.0.1
    return store_host if ipaddress.ip_address(address).is_loopback and not all_on_this_machine else address


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False
