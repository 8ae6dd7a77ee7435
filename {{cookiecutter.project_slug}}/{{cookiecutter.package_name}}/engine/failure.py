"""How a failed rank ends its attempt, so that a job's log says what happened once:

- a usage error (a bad flag, a path, the launch environment) is printed once per machine, by its first rank
  where every rank finds it; later attempts under the same torchrun end at once in silence, and a requeue script
  (train.sbatch) is told not to requeue;
- a rank that lost a peer (killed, its machine gone) prints one line, not a traceback: torchrun restarts the
  group from the newest checkpoint, which is the recovery, not a second error;
- a bug (the same exception at the same place, from the same checkpoint, with the same code and command, in two
  attempts in a row; in this project's own files, or anywhere before the attempt's first step, such as torch's
  refusal of a model at start-up) is reported once per job: the first attempt's
  traceback (one rank's; the others name it), one line from the retry that met it again, and silence from
  any later attempt under the same torchrun, which ends at once instead of retraining the same steps into
  the same error. torchrun has no exit status that means "do not restart" (pytorch/pytorch#133877), so the
  later attempts still start, and end within seconds. Only what code can fix is a bug: a fault of the
  machine (a communication error of NCCL or gloo, an accelerator error such as an uncorrectable ECC error,
  I/O, memory, a timeout) fails the same way at every attempt on the same machines, and is retried and
  requeued, which can move the job to other ones.

The record of the last crash lives in <ckpt-dir>/.crashes/, one file per job (its rendezvous id, which the
requeues of a multi-node Slurm job share; `torchrun --standalone`, one node, draws a new id each time): a
requeued job that meets the same error again says so in one line, and writes it to the file STOP_REQUEUE_FILE
names, from which train.sbatch learns not to requeue.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from . import watchdog
from .checkpoint.common import BACKGROUND_WRITE
from .checkpoint.folder import CRASH_RECORDS, every_checkpoint, write_json
from .collectives import all_reduce_int
from .distributed import DistEnv, PortTaken, as_file_name, publish_usage_error
from .errors import UsageError
from .processes import process_identity
from .replicas import ReplicaCorrupted
from .watchdog import REPORTING_A_HANG, STEPPED

# What gloo and NCCL raise on a rank whose peer died: the group is gone, and torchrun restarts it.
LOST_PEER = re.compile(r"Connection (reset|closed) by peer|Broken pipe|NCCL communicator was aborted|"
                       r"remote process exited|Socket Timeout", re.IGNORECASE)
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the package this engine is part of: task.py is in it
PROJECT_ROOT = PACKAGE_ROOT.parent
# Faults of the machine, whatever the code: a communication error (DistError: NCCL's "unhandled system error",
# a store timeout), an accelerator's error (torch >= 2.8: "uncorrectable ECC error"), I/O, host memory, and one
# rank's parameters changed against all the others' (silent data corruption).
MACHINE_FAULTS = (dist.DistError, OSError, MemoryError, ReplicaCorrupted,
                  *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()))
# A DataLoader worker's exception reaches the training process re-raised by torch, with the worker's own
# traceback in its message.
WORKER_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)', re.MULTILINE)


def is_lost_peer(error: BaseException) -> bool:
    """A connection to another rank that broke; not any DistError (NCCL's invalid-usage errors are bugs)."""
    return isinstance(error, dist.DistNetworkError) or bool(LOST_PEER.search(str(error)))


def first_sentence(error: BaseException) -> str:
    """"Connection closed by peer [10.0.0.2]:4211" out of gloo's "[.../pair.cc:561] Connection closed by peer
    [10.0.0.2]:4211. This is typically caused by ...", or the exception's type."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().split("\n", 1)[0])
    return re.split(r"\.\s", text, maxsplit=1)[0][:200] or type(error).__name__


def is_machine_fault(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from, is a fault of the machine, never a bug."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, MACHINE_FAULTS) or "CUDA error" in str(error):  # torch < 2.8: a plain RuntimeError
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def innermost_frame(error: BaseException) -> tuple[Path, int] | None:
    """(file, line) where `error` was raised: in the DataLoader worker, for an exception one of them raised."""
    worker_frames = WORKER_FRAME.findall(str(error)) if "Original Traceback" in str(error) else []
    if worker_frames:
        return Path(worker_frames[-1][0]), int(worker_frames[-1][1])
    frames = traceback.extract_tb(error.__traceback__)
    return (Path(frames[-1].filename), frames[-1].lineno or 0) if frames else None


def could_be_a_bug(error: BaseException) -> bool:
    """Whether a repeat of `error` is a bug that only a change of code fixes: no fault of the machine, and
    raised in this project's own files (train.py, the package), or anywhere before this attempt's first step
    (torch's ValueError for a model FSDP2 cannot shard recurs at every start: retrying only prints it again)."""
    frame = innermost_frame(error)
    if is_machine_fault(error) or frame is None:
        return False
    where = frame[0].resolve()
    return where == PROJECT_ROOT / "train.py" or where.is_relative_to(PACKAGE_ROOT) or not STEPPED.is_set()


@dataclass(frozen=True)
class Crash:
    """An exception, where it was raised, from which checkpoint, with which code."""

    error: str  # type and first line of the message
    where: str  # file:line of the innermost frame
    newest_checkpoint: str  # the newest step-<N> in --ckpt-dir when it happened
    code: str  # a hash of train.py and the package's sources
    command: str  # a hash of the command line

    @classmethod
    def of(cls, error: BaseException, ckpt_dir: Path) -> Crash:
        frame = innermost_frame(error)
        where = f"{frame[0].name}:{frame[1]}" if frame else "?"
        calls = [call for call in traceback.extract_tb(error.__traceback__)
                 if Path(call.filename).resolve() == PACKAGE_ROOT / "task.py"]
        if frame and calls and Path(calls[-1].filename).resolve() != frame[0].resolve():  # raised below task.py
            where += f" (from task.py:{calls[-1].lineno})"
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return cls(f"{type(error).__name__}: {message}", where, **conditions_now(ckpt_dir))


def conditions_now(ckpt_dir: Path) -> dict[str, str]:
    """What a retry would start from: the newest checkpoint, the code, the command line."""
    steps = [step for step, _ in every_checkpoint(ckpt_dir)]
    return {"newest_checkpoint": f"step-{steps[0]}" if steps else "none", "code": code_hash(),
            "command": hashlib.sha256("\0".join(sys.argv).encode()).hexdigest()[:16]}


def code_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted([PROJECT_ROOT / "train.py", *PACKAGE_ROOT.rglob("*.py")]):
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class CrashRecord:
    """The job's last crash, and whether it was found to be a bug, in <ckpt-dir>/.crashes/<run id>.json."""

    def __init__(self, ckpt_dir: str, env: DistEnv):
        self.ckpt_dir = Path(ckpt_dir)
        self.env = env
        folder = self.ckpt_dir / CRASH_RECORDS
        name = env.run_name
        self.path = folder / f"{name}.json"
        self.launcher = process_identity(os.getppid())  # torchrun's agent: unique while the machine is up
        launcher = as_file_name(self.launcher)
        self.claim = folder / f"{name}.{launcher}.attempt-{env.restart_count}.reported"
        watchdog.hang_recorder = self.hang_recurs  # the watchdog's summary of a hang, recorded like a crash

    def hang_recurs(self, summary: str) -> bool:
        """Record the hang this attempt ends in (`summary`: which ranks stopped, each rank's step and phase), and
        whether the previous attempt ended in the same one, from the same checkpoint with the same code and
        command: a hang that recurs there is deterministic (work that needs longer than its limit), so it is
        recorded as a bug, which this torchrun's later attempts do not retry (known_bug)."""
        if not self.env.launched_by_torchrun:
            return False
        crash = Crash(summary.removesuffix(watchdog.RESTART_WORDS), "the watchdog", **conditions_now(self.ckpt_dir))
        previous, _, _ = self.read()
        repeated = crash == previous
        self.write(crash, bug=repeated)
        return repeated

    def read(self) -> tuple[Crash | None, bool, str]:
        """(the last crash, whether it was found to be a bug, the torchrun process it happened under)."""
        try:
            saved = json.loads(self.path.read_text())
            return Crash(**saved["crash"]), bool(saved["bug"]), str(saved["launcher"])
        except (OSError, ValueError, KeyError, TypeError):
            return None, False, ""

    def write(self, crash: Crash, bug: bool) -> None:
        write_json(self.path, {"crash": asdict(crash), "bug": bug, "launcher": self.launcher})

    def first_to_report(self) -> bool:
        """True on the first rank of this attempt to ask; every rank that crashes asks."""
        self.path.parent.mkdir(exist_ok=True)
        try:
            os.close(os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def known_bug(self) -> bool:
        """Whether an earlier attempt under this same torchrun process found a bug that this attempt would
        meet again: nothing has changed since (the same newest checkpoint, code and command). A new launch (a
        Slurm requeue, a restarted pod, the user's next command) always trains, and meets a bug a second time
        in one line."""
        if not self.env.launched_by_torchrun:
            return False
        crash, bug, launcher = self.read()
        return bug and crash is not None and launcher == self.launcher and all(
            getattr(crash, name) == value for name, value in conditions_now(self.ckpt_dir).items())

    def known_bug_on_any_machine(self, device: torch.device) -> bool:
        """known_bug(), decided once for the whole job (a collective): the record names the machine whose rank
        wrote it last, and a machine that stopped alone would leave the others waiting for it in their first
        collective until the timeout."""
        return all_reduce_int(int(self.known_bug()), device, "max") == 1


def end_job_for_usage_error(error: UsageError, env: DistEnv | None) -> None:
    """Print a usage error once per machine and exit 1, and make this torchrun's later attempts silent.

    torchrun restarts the worker group after any failure (up to --max-restarts times) and offers no exit
    status that means "do not restart" (pytorch/pytorch#133877): a bad flag on 2 ranks with 3 restarts printed
    its line 8 times. An error found identically on every rank is printed by each machine's first rank (each
    machine's torchrun has a log of its own); one that only some ranks see (same_on_every_rank=False), by each
    of them. The printing rank then marks its torchrun process as having reported it, so that the retries end
    at start-up without a word, and writes the line to STOP_REQUEUE_FILE, so that train.sbatch does not
    requeue the job either. The machine's other ranks wait for that mark before they exit: torchrun stops the
    whole group when the first rank exits. No rank kills its launcher: under Kubernetes torchrun is PID 1,
    which ignores the signal. The line also goes to torchrun's store, where the ranks of machines that did not
    see it (other flags there, a folder missing here) wait to start: they stop with it instead of waiting out
    the process group's timeout.
    """
    uniform = env is not None and error.same_on_every_rank
    line = f"error: {error}"
    reports = not uniform or env.is_local_main_process
    if reports:
        prefix = "" if uniform or env is None or env.world_size == 1 else f"[rank {env.rank}] "
        sys.stderr.write(f"{prefix}{line}\n")  # one write, so lines from several ranks do not interleave
        sys.stderr.flush()
    if env is None or not env.launched_by_torchrun:
        sys.exit(1)
    if reports:  # before the mark, which lets this machine's other ranks exit and torchrun end this one
        with contextlib.suppress(RuntimeError):  # no store, or nobody waits in it
            publish_usage_error(line, env, ranks_it_stops=env.local_world_size if uniform else 1)
    with contextlib.suppress(OSError):  # without a mark, the retries print the line again: no worse than that
        marker = usage_error_marker()
        if reports:
            mark_usage_error(marker)
        else:
            deadline = time.monotonic() + 70  # the reporting rank may host the store for a minute
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
    if reports and env.stop_requeue_file:
        Path(env.stop_requeue_file).write_text(line + "\n")
    sys.exit(1)


def usage_error_reported_under_this_torchrun(env: DistEnv) -> bool:
    """Whether an earlier attempt under the same torchrun process met a usage error: the same command, so the
    same error; this attempt ends at once."""
    with contextlib.suppress(OSError):
        return env.launched_by_torchrun and usage_error_marker().exists()
    return False


def usage_error_marker() -> Path:
    """A file per torchrun process, named by a hash of its identity (which no other process shares, on any
    machine or in any container), in the temporary folder."""
    launcher = process_identity(os.getppid())
    folder = Path(tempfile.gettempdir()) / f"{__package__}-usage-errors-{os.getuid()}"
    return folder / f"{hashlib.sha256(launcher.encode()).hexdigest()[:16]}.launcher"


def mark_usage_error(marker: Path) -> None:
    """Write this torchrun's marker (whole, or not at all), and remove those of torchrun processes that have
    ended: of this pid namespace, whose process is gone (never this torchrun's own), and any a week old
    (another namespace's, or from before a reboot)."""
    marker.parent.mkdir(exist_ok=True)
    launcher = process_identity(os.getppid())
    partial = marker.with_name(f".{marker.name}.{os.getpid()}")
    partial.write_text(launcher + "\n")
    os.replace(partial, marker)
    for other in marker.parent.glob("*.launcher"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # another process may be removing it
            identity = other.read_text().split()
            seen_here = identity[3:] == launcher.split()[3:]  # the same boot and pid namespace as this torchrun
            gone = seen_here and process_identity(int(identity[1])).split() != identity
            if other != marker and (gone or time.time() - other.stat().st_mtime > 7 * 24 * 3600):
                other.unlink()


def what_torchrun_does_next(env: DistEnv) -> str:
    """After this rank exits non-zero: its machine's torchrun restarts the group while it has restarts left
    (--max-restarts), else it gives up, and with it the job (bare torchrun's default is 0)."""
    if env.restart_count < env.max_restarts:
        return "torchrun restarts the group from the newest checkpoint"
    return (f"torchrun has no restart left (--max-restarts {env.max_restarts}), so the job ends; run the same "
            "command to resume from the newest checkpoint")


def exit_at_once(status: int) -> None:
    """End this process now, for torchrun, which waits for every rank of the attempt to exit before it starts
    the next: Python's own shutdown (tearing down modules, collecting torch's objects, joining threads) took
    half a second, a sixth of a restart. What must not be lost still happens: a checkpoint being written in the
    background is finished, and the atexit handlers run (a tracker's last rows, logging's flush). Loader
    workers end with this process (their parent-death signal)."""
    for thread in threading.enumerate():
        if thread.name == BACKGROUND_WRITE:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def end_attempt_after(error: Exception, record: CrashRecord | None, env: DistEnv) -> None:
    """Called with the exception that ended train(); returns if Python should print its traceback, else
    exits with status 1 after at most one line."""
    prefix = f"[rank {env.rank}] " if env.world_size > 1 else ""
    if isinstance(error, PortTaken):  # before is_lost_peer: the cause, a DistNetworkError, is no lost peer
        sys.stderr.write(f"{prefix}{error}; {what_torchrun_does_next(env)}\n")
        sys.exit(1)
    if is_lost_peer(error):
        if REPORTING_A_HANG.is_set():  # this rank's watchdog names the rank that stopped, then ends the process
            time.sleep(60)
        sys.stderr.write(f"{prefix}lost another rank ({first_sentence(error)}); {what_torchrun_does_next(env)}\n")
        exit_at_once(1)
    if record is None or not env.launched_by_torchrun:
        return
    crash = Crash.of(error, record.ckpt_dir)
    previous, _, _ = record.read()
    repeated = crash == previous and could_be_a_bug(error)  # a fault repeats too, on the same machines
    first = record.first_to_report()
    record.write(crash, bug=repeated)
    if not repeated:
        if first:
            return  # the traceback, once: a retry may still succeed (a transient fault)
        sys.stderr.write(f"{prefix}{crash.error} at {crash.where} (the traceback above is another rank's)\n")
        sys.exit(1)
    if first:
        line = (f"error: {crash.error} at {crash.where} again, from the same checkpoint ({crash.newest_checkpoint}) "
                "with the same code: a bug, not a fault, so the job is not retried (its traceback is above, "
                "from the previous attempt); fix it and run the same command again")
        sys.stderr.write(line + "\n")
        if env.stop_requeue_file:
            Path(env.stop_requeue_file).write_text(line + "\n")
    sys.exit(1)
