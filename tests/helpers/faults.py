"""Faults done to a running job: stopping, pausing and killing its processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from .jobs import assert_no_scheduler_warning, wait_for


@contextlib.contextmanager
def paused(*launchers: subprocess.Popen) -> Iterator[list[int]]:
    """Hold every worker of these torchruns still (SIGSTOP) while the test picks one to kill or signals the
    job, then let them go on: a small model's run would otherwise end before the fault lands."""
    with stopped([pid for launcher in launchers for pid in worker_pids(launcher)]) as pids:
        yield pids


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[list[int]]:
    """SIGSTOP these processes, and SIGCONT the ones still alive afterwards."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def kill_a_worker_and_finish(launcher: subprocess.Popen, after: Path, which: int = -1) -> str:
    """Once `after` (a checkpoint) exists, kill -9 one training process of this torchrun (the last it started,
    or `which`; its workers held still meanwhile, so a small run cannot end first), and return the job's
    output once it has restarted, resumed and finished."""
    wait_for(after, launcher)
    with paused(launcher) as workers:
        os.kill(workers[which], signal.SIGKILL)
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, output[-4000:]
    assert "restart=1" in output and "resuming from" in output, output[-4000:]
    assert_no_scheduler_warning(output)
    return output


def worker_pids(launcher: subprocess.Popen) -> list[int]:
    """The training processes torchrun started (its children running train.py)."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    return [int(pid) for pid in children if b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]
