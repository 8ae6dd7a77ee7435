"""Where a slow step's time and a GPU's memory go: --profile-steps START:COUNT records a torch.profiler trace of
those optimizer steps, one file per rank; on CUDA, --memory-snapshot records the allocator's history for
pytorch.org/memory_viz."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .engine.distributed import DistEnv
from .engine.errors import UsageError
from .options import ProfilingOptions

log = logging.getLogger(__name__)


class StepProfiler:
    """Call before_step(N) before optimizer step N (before the watchdog's beat that starts it): the trace covers
    steps START to START + COUNT - 1 of the job, and the watchdog allows them --io-timeout, as a slow phase.
    close() at the end writes what a run that stopped inside those steps recorded."""

    def __init__(self, options: ProfilingOptions, log_dir: str | None, env: DistEnv, device: torch.device, watchdog):
        first, _, count = (options.profile_steps or "0:0").partition(":")  # checked by TrainOptions.check
        self.first, self.last = int(first), int(first) + int(count) - 1
        self.folder = Path(log_dir or ".") / "profile"
        self.memory = options.memory_snapshot
        self.env, self.device, self.watchdog = env, device, watchdog
        self.profiler: torch.profiler.profile | None = None
        self.told = False

    def before_step(self, step: int) -> None:
        if self.profiler is None and step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
            self.watchdog.profiling = f"profiled training step ({self.first}-{self.last})"
        elif self.profiler is not None and step == self.last + 1:
            self.close()
        elif self.first and not self.told and self.first < step <= self.last + 1:
            log.info("--profile-steps %d-%d: this run resumed at step %d, past their start; no trace", self.first,
                     self.last, step)
        self.told = True

    def close(self) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.folder / f"trace-rank-{self.env.rank}.json"))
        self.profiler = None
        self.watchdog.profiling = None
        log.info("profiled steps %d-%d: %s/trace-rank-<RANK>.json, one per rank (open in ui.perfetto.dev)",
                 self.first, self.last, self.folder)
        if self.memory:
            dump_memory(self.folder, self.env, f"step-{self.last}")


def record_memory_history(options: ProfilingOptions, log_dir: str | None, device: torch.device, env: DistEnv) -> None:
    """--memory-snapshot: record CUDA's allocations from here on (Python stacks: C++ ones cost every allocation
    more), so that an out-of-memory error at any point, the resume's included, dumps their history (torch's
    recipe, "Understanding CUDA Memory Usage")."""
    if not options.memory_snapshot:
        return
    if device.type != "cuda":
        raise UsageError("--memory-snapshot records CUDA's allocator; this run has no CUDA device (--device)")
    folder = Path(log_dir) / "profile"
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    torch._C._cuda_attach_out_of_memory_observer(lambda *_: dump_memory(folder, env, "out-of-memory"))


def dump_memory(folder: Path, env: DistEnv, when: str) -> None:
    path = folder / f"memory-rank-{env.rank}-{when}.pickle"
    folder.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    log.warning("rank %d: CUDA memory snapshot %s (drag it onto pytorch.org/memory_viz)", env.rank, path)
