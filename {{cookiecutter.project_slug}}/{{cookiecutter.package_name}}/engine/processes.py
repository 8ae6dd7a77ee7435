"""Processes and their sockets: the job's connections, which DataLoader workers close; workers that take
SIGTERM from their training process alone; whether another process has ended, is stopped, or is the one a
pid once named."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

# The job's own connections (its store, gloo's full mesh), for DataLoader workers to close: a forked
# copy would keep a dead rank's connections open, so its peers would wait in a collective instead of failing.
JOB_SOCKETS: set[tuple[int, int]] = set()  # (file descriptor, socket inode)


def network_sockets() -> dict[int, int]:
    """This process's open TCP/IP sockets: file descriptor -> socket inode (Linux; empty elsewhere)."""
    found = {}
    if os.path.isdir("/proc/self/fd"):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                probe = socket.socket(fileno=int(name))  # raises for anything that is not a socket
                family = probe.family
                probe.detach()  # looking must not close it
                if family in (socket.AF_INET, socket.AF_INET6):
                    found[int(name)] = os.fstat(int(name)).st_ino
    return found


@contextlib.contextmanager
def recording_job_sockets() -> Iterator[None]:
    """Around the creation of a store or process group: remember the sockets it opened."""
    before = network_sockets()
    yield
    JOB_SOCKETS.update(network_sockets().items() - before.items())


def close_job_sockets() -> None:
    """In a forked child (a DataLoader worker): close its copies of the job's connections and listening
    ports, checking each is still the same socket."""
    for fd, inode in JOB_SOCKETS:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == inode:
                os.close(fd)


def detach_from_job_signals(worker_id: int, training_process: int) -> None:
    """DataLoader workers leave the training process's process group, so the SIGTERM or Ctrl-C that torchrun
    (which signals its workers' groups) or a terminal sends the group does not reach them: the training
    process decides when to stop, saves, and then shuts its workers down itself.

    Slurm signals every process of a job step, workers included. So a worker obeys SIGTERM only from its
    training process: that is how the DataLoader ends a worker that does not stop when asked, and Python's
    exit ends daemonic children before joining them. A worker that ignored SIGTERM made every exit after an
    error wait for torchrun's SIGKILL, 30 s later; one that obeyed every SIGTERM died under Slurm's
    preemption signal, failing the step that was to be saved. `training_process` is passed in, not read with
    os.getppid(): under the forkserver start method (Python 3.14's default on Linux) a worker's parent is the
    forkserver.

    A worker ends with the training process: torch's own check of its parent runs only between samples, so a
    worker stuck in a dataset's __getitem__ outlived a training process that the watchdog had ended, in a
    process group that torchrun no longer signals. Under fork, Linux's parent-death signal kills it even while
    it holds the GIL; under forkserver the parent is the forkserver, which lives as long as its children do,
    so a thread also watches the training process itself."""
    os.setpgid(0, 0)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    training_process_ended = watch_process(training_process)
    signal.set_wakeup_fd(-1)  # the parent's watchdog pipe is not this process's
    close_job_sockets()  # so a dead training process's ports refuse, and its peers' collectives fail, at once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # held for the thread below, in every thread

    def follow_the_training_process() -> None:
        while True:
            received = signal.sigtimedwait({signal.SIGTERM}, 1.0)
            if (received and received.si_pid == training_process) or training_process_ended():
                os._exit(0)  # as torch's own worker handler does: a requested exit, not a failure

    threading.Thread(target=follow_the_training_process, daemon=True).start()


def start_forkserver_deaf_to_sigterm() -> None:
    """Under the forkserver start method (Python 3.14's default on Linux, or set by the user) DataLoader workers
    are forked by a server process that multiprocessing starts, once, in the training process's process group.
    The SIGTERM that torchrun, a terminal or Slurm sends that group would end it, and with it (their parent
    gone) every loader worker: the rank fails in its next step instead of saving at the agreed one. So the
    server is started here, before any loader, ignoring SIGTERM (an ignored signal stays ignored through exec;
    a blocked one would not); the workers it forks take SIGTERM from their training process alone (above)."""
    import multiprocessing
    from multiprocessing import forkserver

    if multiprocessing.get_start_method() != "forkserver":
        return
    # Blocked meanwhile in this process too, so that a SIGTERM arriving in between waits for the handler.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def watch_process(pid: int) -> Callable[[], bool]:
    """A check of whether process `pid` has ended: a pidfd on Linux (never fooled by a reused pid)."""
    try:
        handle = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux; or the process has already ended
        return lambda: not os.path.exists(f"/proc/{pid}") if sys.platform == "linux" else False
    return lambda: bool(select.select([handle], [], [], 0)[0])


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal or a debugger (Linux: T or t in /proc/<pid>/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def process_identity(pid: int) -> str:
    """"host pid start-time boot-id pid-namespace": names one process on one machine, even after its pid is
    reused, and even where containers share a hostname (host networking) but not a pid namespace, so that the
    same pid means different processes (Linux; elsewhere the start time is unknown and the identity never
    matches another process's)."""
    try:
        started = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except (OSError, IndexError):
        return f"{socket.gethostname()} {pid} unknown"
    return f"{socket.gethostname()} {pid} {started} {boot} {namespace}"
