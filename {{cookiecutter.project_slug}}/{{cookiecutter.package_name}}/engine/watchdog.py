"""Keeps one stuck rank from stalling a job: a thread beside the
training loop that ends this rank when it stops making progress, says where every rank was (and where NCCL's
flight records go), and makes SIGTERM prompt. SIGTERM is handled here alone: the handler, the watching
thread, and the agreement of all ranks to stop after the same step (StopAgreement). (DataLoader workers,
which leave the job's signals and its sockets to the training process: processes.py.)

torchrun restarts a worker group only after a worker exits. A rank waiting in a collective for a peer that
is stopped, stuck, or gone without closing its connections waits out the process-group timeout; and while
the main thread is inside a collective (C++), Python runs no signal handler, so torchrun's SIGTERM goes
unanswered until its SIGKILL 30 s later. This thread runs regardless: it sees SIGTERM through a wakeup
pipe, and the main thread's progress through `beat()`. It stays as long as collectives cannot be
interrupted by a signal and the process-group timeout is the only bound on a wait (with NCCL,
TORCH_NCCL_ASYNC_ERROR_HANDLING and a shorter timeout after warm-up, as torchtitan sets, do part of it).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from .distributed import DistEnv, StoreAddress, hang_reports_folder
from .flags import option
from .processes import is_stopped, process_identity, recording_job_sockets

log = logging.getLogger(__name__)

# Exit status after a clean stop on SIGTERM: the shell's "terminated by SIGTERM", so a scheduler or torchrun
# sees an interrupted job (to requeue or restart), never a finished one.
EXIT_CODE_AFTER_SIGTERM = 128 + signal.SIGTERM


# Exit status of a rank that stopped making progress: non-zero, so torchrun restarts the group.
EXIT_CODE_AFTER_HANG = 124
# After SIGTERM, how long a rank may stay in a training step before any step has been timed, before it counts
# as waiting for a peer that has gone: torchrun sends SIGKILL 30 s after SIGTERM (unless
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise), which leaves some seconds to save.
PATIENCE_BEFORE_A_TIMED_STEP = 20.0
# On NCCL, how long after a collective's own timeout this thread reports a hang (Watchdog._bound_collectives).
NCCL_FIRST = 30.0
# Set while this rank's watchdog reports a hang, which ends with os._exit: a main thread whose collective
# fails meanwhile (the stopped rank has left) waits for the report instead of exiting first (failure.py).
REPORTING_A_HANG = threading.Event()
# Set at this attempt's first finished optimizer step: an error before it is one of start-up (see failure.py).
STEPPED = threading.Event()
# The main thread's innermost frame in one of these means it waits for other ranks: in a collective, or in a
# backward pass whose gradient all-reduce waits for them.
WAITING_IN = ("torch/distributed/", "torch/autograd/", "torch/_tensor.py")
# The log keeps this many innermost frames of a stopped rank's stack; the whole stack goes to a file.
FRAMES_LOGGED = 3
# Set by failure.py's CrashRecord: given a hang's summary, whether the previous attempt ended in the same hang
# (then recorded as a bug, which later attempts under this torchrun do not retry).
hang_recorder: Callable[[str], bool] | None = None


class Phase(NamedTuple):
    """What the main thread is doing: replaced whole (one assignment, atomic under the GIL), never changed."""

    what: str  # "training step", "saving a checkpoint", ...
    step: int  # the optimizer step it belongs to: a training step's own; for a slow phase, the last one done
    slow: bool  # a slow phase (I/O, evaluation): allowed io_timeout, not step_timeout
    since: float  # time.monotonic() at its start


@dataclass
class WatchdogOptions:
    """The watchdog's flags: how long a rank may go without progress before it counts as stopped."""

    step_timeout: float = option(
        120, "seconds a training step may take before its rank counts as stopped: it logs where every rank "
        "was and exits, so torchrun restarts the group from the last checkpoint")
    io_timeout: float = option(
        1800, "the same for start-up (downloads, compilation, the first step), checkpoint I/O, evaluation and the "
        "task's work on rank 0 alone (Task.rank_0_work: samples, a beam search)")

    def collective_timeout(self) -> timedelta:
        """The process group's bound on any one collective: a backstop behind the watchdog's timeouts."""
        return timedelta(seconds=max(self.step_timeout, self.io_timeout) + 60)


class Watchdog:
    """`beat(step)` after every optimizer step; wrap slow phases (start-up, checkpoint I/O, evaluation) in
    `slow_phase(...)`. A training step that takes longer than `step_timeout`, or a slow phase longer than
    `io_timeout`, ends this rank after it has logged its stack and, on the lowest live rank, a summary naming
    the rank that stopped. After SIGTERM, a rank that makes no progress for a few step times is blocked on a
    peer that is gone: it exits at once instead of waiting for torchrun's SIGKILL."""

    def __init__(self, env: DistEnv, store_address: StoreAddress | None, step_timeout: float, io_timeout: float):
        self.env = env
        self.step_timeout = step_timeout
        self.io_timeout = io_timeout
        self.sigterm_received = False
        self._sigterm_seen_at: float | None = None
        self._phase = Phase("starting", 0, True, time.monotonic())
        self._longest_step = 0.0  # of the steps after the first
        self._first_step = 0.0  # the first's, compilation and autotuning included
        self.profiling: str | None = None  # what the steps are while profiled (profiling's): slow on purpose
        self._main_thread = threading.main_thread().ident
        self._nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        self._store_address = store_address
        # The main thread's own connection, for its slow phases; the watching thread opens others when it must.
        self._store: dist.TCPStore | None = None
        self._slow_depth = 0  # slow phases the main thread is in (one may hold another)
        self._steps_done: int | None = None  # the last beat's step
        # (the training step, when this thread last saw another rank in a slow phase while that step waited)
        self._slow_phase_seen: tuple[Phase, float] | None = None
        self._next_slow_phase_check = 0.0
        if store_address is not None:
            with recording_job_sockets():  # DataLoader workers, forked later, close their copy
                self._store = store_address.connect(timedelta(seconds=30))
            # Where this process is and where torchrun reads its error, so a live rank can end it (and say
            # why) should it be stopped; and that it is in no slow phase.
            self._store.append(processes_key(socket.gethostname()),
                               f"{env.rank} {process_identity(os.getpid())}\t{env.error_file or ''}\n")
            self._store.set(phase_key(env.rank), "")
        # The C-level handler writes the signal number here even while the main thread is blocked in C++.
        self._wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
        self._arm_backstop(self._phase)
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def _arm_backstop(self, phase: Phase) -> None:
        """This thread needs the GIL, which a main thread stuck in C code that holds it (a regular expression
        that backtracks for hours, a C extension's loop) never gives up: then faulthandler's own thread, which
        needs no GIL, prints every thread's stack and exits 1, well after this watchdog would have reported.
        Training steps are armed from this thread, off the loop's path (an arming starts a thread, about
        40 us); a slow phase's start and end by the main thread itself, so that neither a long save that holds
        the GIL meets a step's deadline, nor a step right after one keeps the slow phase's."""
        allowed = self.io_timeout if phase.slow else self.step_timeout
        deadline = phase.since + 2 * allowed + 2 * self._longest_step + 10
        # To the process's own stderr, not sys.stderr: torch's excepthook swaps sys.stderr for a StringIO while
        # it prints a traceback, and an arming then fails (io.UnsupportedOperation: fileno) and ends this thread.
        faulthandler.dump_traceback_later(max(deadline - time.monotonic(), 1.0), exit=True,
                                          file=sys.__stderr__ or sys.stderr)

    def _on_sigterm(self, signum, frame) -> None:
        self.sigterm_received = True

    def beat(self, step: int) -> None:
        """An optimizer step finished: the next one is a training step again (a slow one while profiled)."""
        now = time.monotonic()
        slow = self.profiling is not None
        if not self._phase.slow:
            self._longest_step = max(self._longest_step, now - self._phase.since)
        else:  # the first step (start-up's end): collectives get a step's time from here
            self._first_step = self._first_step or now - self._phase.since  # compilation and all
        if self._phase.slow != slow:
            self._bound_collectives(slow=slow)
        self._phase = Phase(self.profiling or "training step", step + 1, slow, now)
        self._steps_done = step
        STEPPED.set()

    @contextlib.contextmanager
    def slow_phase(self, what: str) -> Iterator[None]:
        """Checkpoint I/O, evaluation: allowed `io_timeout`, not `step_timeout`. Afterwards the phase it
        interrupted continues with its allowance: a training step, or start-up (whose first step, with its
        compilation and autotuning, is still a slow phase after the evaluation check before it).

        Work one rank does alone (sample images, an upload) goes in one too, on that rank: the others wait for it
        in their next collective, see its phase in the store and wait with it. On NCCL, whose collectives time
        out by themselves (_bound_collectives), every rank enters the phase and waits in a barrier inside it."""
        interrupted = self._phase
        self._bound_collectives(slow=True)
        done = interrupted.step if interrupted.slow or self._steps_done is None else self._steps_done
        self._phase = Phase(what, done, True, time.monotonic())
        self._arm_backstop(self._phase)
        self._publish_slow_phase(1, self._phase)
        try:
            yield
        finally:
            self._publish_slow_phase(-1, interrupted)
            self._bound_collectives(slow=interrupted.slow)
            self._phase = interrupted._replace(since=time.monotonic())
            self._arm_backstop(self._phase)

    def _publish_slow_phase(self, change: int, phase: Phase) -> None:
        """Tell the other ranks that this one entered a slow phase (change 1) or left one (-1), for the phase it
        is in afterwards: a rank whose training step waits for this one meanwhile is not stuck
        (_others_in_a_slow_phase), and a hang report names what this rank was doing though it sent no report.
        Two store requests on entering and two on leaving, about a millisecond; none while training steps run."""
        self._slow_depth += change
        if self._store is None:
            return
        try:
            if change > 0 and self._slow_depth == 1:
                self._store.add(SLOW_PHASES, 1)
            described = {"phase": phase.what, "step": phase.step}
            self._store.set(phase_key(self.env.rank), json.dumps(described) if self._slow_depth else "")
            if change < 0 and self._slow_depth == 0:
                self._store.add(SLOW_PHASES, -1)
        except dist.DistError:  # the store's host has gone: this job ends anyway, by its own error
            pass

    def _bound_collectives(self, slow: bool) -> None:
        """On NCCL, each collective's own timeout is its phase's allowance, so that NCCL's watchdog, in C++,
        times a stuck collective out first, dumps every rank's flight record (TORCH_NCCL_DUMP_ON_TIMEOUT, even
        where Python is wedged) and aborts; this thread reports NCCL_FIRST seconds later, where it did not.
        Under one bound for everything (the process group's, set for start-up) NCCL would wait half an hour
        behind this thread, and never dump. torchtitan shortens it after the first step the same way. On gloo
        this thread's report, which names the rank by its stack, comes first: its timeout stays the bound."""
        if self._nccl:
            set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # older torch
            set_timeout(timedelta(seconds=self.io_timeout if slow else self.step_timeout))

    def _watch(self) -> None:
        armed_for = self._phase  # armed by __init__
        while True:
            if self._phase is not armed_for:  # a new phase: the backstop's deadline moves with it
                armed_for = self._phase
                self._arm_backstop(armed_for)
            if select.select([self._wakeup_read], [], [], 0.25)[0]:
                if signal.SIGTERM in os.read(self._wakeup_read, 256):
                    self.sigterm_received = True
                    self._sigterm_seen_at = self._sigterm_seen_at or time.monotonic()
            phase, now = self._phase, time.monotonic()
            allowed = (self.io_timeout if phase.slow else self.step_timeout) + (NCCL_FIRST if self._nccl else 0)
            if now - phase.since > allowed and not self._others_in_a_slow_phase(phase, now):
                self._end_after_hang(phase.what, phase.step, now - phase.since)
            # In a preemption every rank soon reaches the next step and stops there together; a rank still
            # inside the same training step a few step times after SIGTERM waits for a peer that has gone.
            # Before a step has been timed (the first, with compilation, autotuning and the loaders' start),
            # nothing says how long one takes: then it gets the time that is left to save in torchrun's grace.
            patience = 1.0 + 2 * self._longest_step if self._longest_step else PATIENCE_BEFORE_A_TIMED_STEP
            if (self._sigterm_seen_at and not phase.slow and now - phase.since > patience
                    and now - self._sigterm_seen_at > patience):
                log.error("[rank %d] SIGTERM while step %d has waited %.1f s for other ranks: one of them has "
                          "gone; exiting now so torchrun can restart the group\n%s", self.env.rank, phase.step,
                          now - phase.since, self._main_thread_stack())
                os._exit(EXIT_CODE_AFTER_SIGTERM)

    def _others_in_a_slow_phase(self, phase: Phase, now: float) -> bool:
        """Whether this training step, past its time, waits for a rank in a slow phase (saving, evaluating, work
        it does alone): then it is not stuck, and waits with that phase's allowance (--io-timeout), asking the
        store again every --step-timeout, and for at least a --step-timeout after the last slow phase ended
        (the step it waits for still has to arrive). A rank whose own stack is in its own code is never excused: it
        is the one the others wait for. Once a hang report has begun, nobody waits any longer."""
        if phase.slow or self._store_address is None or self._waiting_for_others() is False:
            return False
        seen = self._slow_phase_seen[1] if self._slow_phase_seen and self._slow_phase_seen[0] is phase else None
        if now < self._next_slow_phase_check:
            return seen is not None and now - seen <= 2 * self.step_timeout
        self._next_slow_phase_check = now + max(self.step_timeout, 1.0)
        try:
            store = self._store_address.connect(timedelta(seconds=5))
            slow, reporting = int(store.add(SLOW_PHASES, 0)), store.check([f"{HANG_REPORTS}count"])
        except dist.DistError:
            return False
        if reporting or now - phase.since > self.io_timeout + self.step_timeout:
            return False
        if slow > 0:
            if seen is None:  # its backstop gets the slow phase's allowance
                self._arm_backstop(phase._replace(slow=True, since=now))
            self._slow_phase_seen = (phase, now)
            return True
        return seen is not None and now - seen <= 2 * self.step_timeout

    def _main_thread_stack(self) -> str:
        return "".join(self._main_thread_frames())

    def _main_thread_frames(self) -> list[str]:
        """The main thread's stack, a formatted frame an entry, innermost last."""
        frame = sys._current_frames().get(self._main_thread)
        return traceback.format_stack(frame) if frame else ["(main thread not found)\n"]

    def _waiting_for_others(self) -> bool | None:
        """Whether the main thread waits for other ranks; None on NCCL, whose collectives return as soon as
        they are queued, so that a healthy rank waits later, at a host sync: its flight record tells."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return None
        frame = sys._current_frames().get(self._main_thread)
        innermost = traceback.extract_stack(frame)[-2:] if frame else []
        return any(part in entry.filename for entry in innermost for part in WAITING_IN)

    def _end_after_hang(self, what: str, step: int, stalled: float) -> None:
        REPORTING_A_HANG.set()
        waiting = self._waiting_for_others()
        stopped_since = time.time() - stalled
        limit = f"--io-timeout {self.io_timeout:g} s" if self._phase.slow else f"--step-timeout {self.step_timeout:g} s"
        report = {"rank": self.env.rank, "step": step, "phase": what, "stalled_s": round(stalled),
                  "waiting_for_others": waiting, "stopped_since": stopped_since, "limit": limit}
        line = (f"[rank {self.env.rank}] no progress for {stalled:.0f} s in {what} (step {step}, past {limit}); "
                f"{WAITING_WORDS[waiting]}")
        frames = self._main_thread_frames()
        stack = "".join(frames)
        sys.stderr.write(f"{line}; innermost frames:\n{self._log_stack(frames)}{self._write_nccl_flight_record()}")
        sys.stderr.flush()
        summary = None
        try:
            summary = self._share_and_summarize(report)
        except Exception as error:  # noqa: BLE001 - the store lives on rank 0, which may be the one that stopped
            sys.stderr.write(f"[rank {self.env.rank}] could not share this report ({type(error).__name__}); "
                             "rank 0, which holds the job's store, may be the rank that stopped\n")
        # A rank named by its own stack, past its limit, at the same step and phase as in the previous attempt:
        # work that needs longer than the limit, not retried by this torchrun (a requeue, maybe on other machines,
        # still tries). Not on NCCL's summaries, which name no rank by its stack.
        if summary is not None and hang_recorder is not None and stopped_limits(summary) and hang_recorder(summary):
            raise_limits = " or ".join(f"{name} (now {value} s)" for name, value in stopped_limits(summary))
            summary = (f"error: {summary.removesuffix(RESTART_WORDS)}; the same hang as the previous attempt, at the "
                       "same step and phase from the same checkpoint: it recurs, so torchrun does not retry it; if "
                       f"that work needs longer, raise {raise_limits}")
        if summary is not None:
            sys.stderr.write(summary + "\n")
            sys.stderr.flush()
        # torchrun names as root cause the failure with the earliest time: a rank whose own code stopped failed
        # when it stopped; one waiting for it, when it gave up.
        write_error_file(self.env.error_file, summary or line, stack,
                         stopped_since if waiting is False else time.time())
        os._exit(EXIT_CODE_AFTER_HANG)

    def _log_stack(self, frames: list[str]) -> str:
        """The innermost FRAMES_LOGGED of `frames`, and where the whole stack went (a waiting rank's runs to dozens
        of frames, and every rank logs its own)."""
        stack = "".join(frames)
        path = hang_reports_folder(self.env) / f"stack-rank-{self.env.rank}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(stack)
            where = f"  (whole stack: {path})\n"
        except OSError as error:
            return stack + f"  (could not write {path}: {error.strerror})\n"
        return "".join(frames[-FRAMES_LOGGED:]) + where

    def _write_nccl_flight_record(self) -> str:
        """On NCCL: this rank's last collectives, as torch's flight recorder saw them, beside the ones NCCL
        writes itself when a collective times out (which may come later than this report, or not at all);
        a line saying where, or nothing."""
        if not (dist.is_initialized() and dist.get_backend() == "nccl"):
            return ""
        try:
            c10d = torch._C._distributed_c10d
            trace = getattr(c10d, "_dump_fr_trace", None) or c10d._dump_nccl_trace  # the older name
            path = hang_reports_folder(self.env) / f"nccl_trace_rank_{self.env.rank}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(trace())  # pickled, as fr_trace reads it
            return f"NCCL flight recorder: {path.resolve()}\n"
        except Exception as error:  # noqa: BLE001 - the stack above is the report; this is extra
            return f"(no NCCL flight record: {type(error).__name__}: {error})\n"

    def _share_and_summarize(self, report: dict) -> str | None:
        """The summary, if this rank is the one to print it."""
        if self._store_address is None:
            return None
        # The other live ranks time out within one step of this one: a rank that finished one more step than
        # the stopped rank (which hung after its last collective) beat a step later. A fixed window shorter
        # than a step would count that healthy rank silent, name it, and SIGKILL it.
        summary = share_hang_report(self._store_address.connect(timedelta(seconds=5)), self.env.rank,
                                    self.env.world_size, report,
                                    window=3 + (self._longest_step or self._first_step),
                                    flight_records=hang_reports_folder(self.env), host=socket.gethostname())
        return summary


def write_error_file(path: str | None, message: str, stack: str, failed_at: float) -> None:
    """The error file torchrun reads for its failure summary (TORCHELASTIC_ERROR_FILE), in the format of
    torch.distributed.elastic's own @record, with the time this rank failed: the earliest is the root cause."""
    if not path:
        return
    with contextlib.suppress(OSError):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": f"{message}\n{stack}", "timestamp": str(int(failed_at))}}}))


HANG_REPORTS = "ddp-template/hang-report/"
# How many ranks are in a slow phase now, and what each is doing there ("" when it is in none).
SLOW_PHASES = f"{HANG_REPORTS}slow-phases"


def phase_key(rank: int) -> str:
    return f"{HANG_REPORTS}phase/{rank}"


def processes_key(host: str) -> str:
    """The store key listing "rank identity" of every rank on the machine named `host`."""
    return f"ddp-template/processes/{host}"


def share_hang_report(store: dist.Store, rank: int, world_size: int, report: dict, window: float,
                      flight_records: Path, host: str) -> str | None:
    """Share this rank's hang report through the job's store, end the ranks on this machine that sent none, and
    return the summary if this rank is the one to print it (the first to report), else None.

    A constant number of store requests per rank, whatever the size of the job: its report, its rank appended
    to the job's list and to its machine's, and after the window the machine's lists (the ranks that run here
    and those of them that reported). One rank, the first to report, reads every report, in one multi_get:
    rank 0's store answers each request in turn, and N ranks each checking N keys was 2N^2 requests, two
    million at a thousand ranks, while every rank waited; once it has read them it says so, and rank 0, whose
    process holds the store, and every other reporter wait for that before they end a stopped rank or
    themselves: a rank is ended only once the summary is read, and never for being silent alone (a rank in a
    slow phase waits silently, and says so through its phase key). `host`: this machine's name."""
    store.set(f"{HANG_REPORTS}{rank}", json.dumps(report))
    store.append(f"{HANG_REPORTS}reporters", f"{rank},")
    store.append(f"{HANG_REPORTS}reporters/{host}", f"{rank},")
    first = store.add(f"{HANG_REPORTS}count", 1) == 1
    time.sleep(window)
    summary = None
    if first:
        reporters = sorted(ranks_in(store.get(f"{HANG_REPORTS}reporters")))
        reports = dict(zip(reporters, (json.loads(value) for value in
                                       store.multi_get([f"{HANG_REPORTS}{reporter}" for reporter in reporters])),
                           strict=True))
        silent = sorted(set(range(world_size)) - set(reports))
        summary = hang_summary(reports, silent, flight_records, slow_phases_of(store, silent))
        store.set(f"{HANG_REPORTS}read", "1")
    else:  # the first reporter's window (3 s + its own longest step) may end after this one's
        with contextlib.suppress(Exception):
            store.wait([f"{HANG_REPORTS}read"], timedelta(seconds=window + 5))
    end_stopped_ranks_on_this_machine(store, rank, host, ranks_in(store.get(f"{HANG_REPORTS}reporters/{host}")),
                                      stopped_since=report.get("stopped_since", time.time()))
    if rank == 0:  # its process holds the store: it ends a second after the others were told the summary was
        time.sleep(STORE_HOST_LINGERS)  # read, whose last requests would otherwise meet a closed store (which
    return summary  # c10d logs with dozens of C++ frames per request)


STORE_HOST_LINGERS = 1.0  # seconds: the others' last requests (their machine's lists) take milliseconds


def slow_phases_of(store: dist.Store, ranks: list[int]) -> dict[int, dict]:
    """What each of these ranks (that sent no report) is doing in a slow phase, for those that are in one: one
    request for all of them (a rank that stopped before its watchdog started has no key: asked one by one)."""
    keys = [phase_key(rank) for rank in ranks]
    if not keys:
        return {}
    values = store.multi_get(keys) if store.check(keys) else [
        store.get(key) if store.check([key]) else b"" for key in keys]
    return {rank: json.loads(value) for rank, value in zip(ranks, values, strict=True) if value}


def ranks_in(listed: bytes) -> set[int]:
    return {int(rank) for rank in listed.decode().split(",") if rank}


def end_stopped_ranks_on_this_machine(store: dist.Store, rank: int, host: str, reported: set[int],
                                     stopped_since: float) -> None:
    """A rank that sent no report and whose process is stopped (SIGSTOP, a debugger: state T) cannot answer
    SIGTERM, so torchrun would SIGKILL it only after its shutdown timeout (30 s on the restart path): end it
    now if it runs here, writing torchrun's error file for it first, so that torchrun names it, not a rank that
    waited for it. A silent rank that runs is left alone: it may be saving, or working alone in a slow phase
    (a frozen one, holding the GIL, is ended by its own faulthandler backstop)."""
    if not store.check([processes_key(host)]):
        return
    for line in store.get(processes_key(host)).decode().splitlines():
        other, rest = line.split(" ", 1)
        identity, _, error_file = rest.partition("\t")
        if int(other) in reported:
            continue
        pid = int(identity.split()[1])
        # here, not a reused pid, and stopped
        if "unknown" not in identity and process_identity(pid) == identity and is_stopped(pid):
            message = (f"rank {other} (process {pid} on this machine) sent no report and is stopped (state T): "
                       f"ended with SIGKILL by rank {rank}, which is all a stopped process answers")
            write_error_file(error_file, f"HANG: {message}", "", stopped_since)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                sys.stderr.write(f"[rank {rank}] {message}\n")


class StopAgreement:
    """Turns "SIGTERM reached some rank" into a stop after the same step on every rank.

    Each step, every rank all-reduces its flag (max) on the job's gloo side group, asynchronously, and reads
    the result one step later: the collective never waits on the GPU and the GPU never waits on it (a
    blocking read would cost a host sync per step). Every rank reads the same result at the same step. On a
    ring of N ranks the all-reduce takes 2(N-1) hops, a tenth of a second at a thousand ranks: hidden behind
    a step that takes longer.
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group  # distributed.side_group(); None: one plain process
        self.pending: tuple[torch.Tensor, dist.Work | None] | None = None

    def agreed(self, received: bool) -> bool:
        stop = False
        if self.pending is not None:
            flag, work = self.pending
            if work is not None:
                work.wait()
            stop = bool(flag.item())  # a CPU tensor: no device sync
        flag = torch.tensor([int(received)], dtype=torch.int32)
        work = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
                if self.group is not None else None)
        self.pending = (flag, work)
        return stop

    def decided_by_rank_0(self, values: list[float]) -> list[float]:
        """Rank 0's values (a verdict on an evaluation), on every rank: one blocking broadcast on the side group,
        after the all-reduces before it (one group runs its collectives in order)."""
        if self.group is None:
            return values
        sent = torch.tensor(values, dtype=torch.float64)
        dist.broadcast(sent, src=0, group=self.group)  # the side group holds every rank: global rank 0 is its 0
        return sent.tolist()

    def agreed_now(self, received: bool) -> bool:
        """The same, up to this moment (a blocking all-reduce): before a long phase, such as an epoch's
        evaluation, which a stop agreed one step later would only come after, maybe past the grace period."""
        stop = self.agreed(received)
        flag, work = self.pending
        if work is not None:
            work.wait()
        self.pending = None
        return stop or bool(flag.item())


WAITING_WORDS = {True: "waiting for other ranks", False: "NOT waiting for other ranks",
                 None: "NCCL: its flight record says which collective it reached"}


def hang_summary(reports: dict[int, dict], silent: list[int], flight_records: Path,
                 slow_phases: dict[int, dict] | None = None) -> str:
    """One line naming the rank(s) that stopped: those that sent no report outside a slow phase, and those
    whose main thread was not waiting for others. On NCCL the second cannot be read from a stack, and the
    flight records name them. A silent rank in a slow phase (`slow_phases`: a save, an evaluation, work it
    does alone, allowed --io-timeout) is where it may be, and is not named. Runs of ranks that were at the
    same place are one entry ("ranks 0-1022: ..."), so the line stays short at any size."""
    slow_phases = slow_phases or {}
    not_waiting = [rank for rank, seen in reports.items() if seen["waiting_for_others"] is False]
    unknown = any(seen["waiting_for_others"] is None for seen in reports.values())
    silent, in_slow_phase = [r for r in silent if r not in slow_phases], [r for r in silent if r in slow_phases]
    stopped = sorted(silent + not_waiting)
    waiting = {True: "waiting for others", False: "not waiting", None: "unknown on NCCL"}
    places: list[tuple[str, list[int]]] = []  # (where, the ranks there), runs of consecutive ranks
    seen_at = {**reports, **{rank: {**slow_phases[rank], "waiting_for_others": "slow"} for rank in in_slow_phase}}
    waiting["slow"] = "a slow phase (--io-timeout), sent no report"
    for rank, seen in sorted(seen_at.items()):
        place = f"step {seen['step']}, {seen['phase']}, {waiting[seen['waiting_for_others']]}"
        if places and places[-1][0] == place and places[-1][1][-1] == rank - 1:
            places[-1][1].append(rank)
        else:
            places.append((place, [rank]))
    where = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}: {place}" for place, ranks in places)
    if stopped:
        limits = sorted({reports[rank]["limit"] for rank in not_waiting if "limit" in reports[rank]})
        culprit = (f"rank(s) {rank_ranges(stopped)} stopped making progress"
                   + (f" (past {' and '.join(limits)})" if limits else "")
                   + (f" ({rank_ranges(silent)} sent no report: stopped, or frozen)" if silent else ""))
    elif unknown:
        culprit = (f"no rank named by its stack on NCCL; `python -m torch.distributed.flight_recorder.fr_trace "
                   f"{flight_records}` shows which collective each rank reached")
    else:
        culprit = "every rank waits for the others: ranks called different collectives"
    return f"HANG: {culprit}. Where each rank was: {where}. Stacks: {flight_records}/stack-rank-<N>.txt{RESTART_WORDS}"


# How a hang's summary ends; a hang that recurs says instead why it ends the job.
RESTART_WORDS = "; exiting so torchrun restarts the group from the last checkpoint."


def stopped_limits(summary: str) -> list[tuple[str, str]]:
    """(flag, value) of the limits the stopped ranks ran past, as hang_summary names them."""
    return sorted(set(re.findall(r"(--(?:io|step)-timeout) ([\d.e+]+) s", summary.split(". Where")[0])))


def rank_ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] as "1-3, 7"."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and runs[-1][-1] == rank - 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
