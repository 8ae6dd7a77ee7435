"""Where a slow step's time and a GPU's memory go: --profile-steps START:COUNT records a torch.profiler trace of
those optimizer steps, one file per rank; on CUDA, --memory-snapshot records the allocator's history for
pytorch.org/memory_viz."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .distributed import DistEnv
from .errors import UsageError
from .options import TrainOptions

log = logging.getLogger(__name__)


class StepProfiler:
    """Call after_step(step) once before the first step (with the resumed step) and after each optimizer step:
    the trace covers steps START to START + COUNT - 1 of the job, whichever run of it trains them. Profiled
    steps are slow on purpose, so the watchdog allows them --io-timeout while they run."""

    def __init__(self, options: TrainOptions, env: DistEnv, device: torch.device, watchdog):
        first, _, count = (options.profile_steps or "0:0").partition(":")  # checked by TrainOptions.check
        self.first, self.count = int(first), int(count)
        self.folder = Path(options.log_dir or ".") / "profile"
        self.env, self.device, self.watchdog = env, device, watchdog
        self.profiler: torch.profiler.profile | None = None
        self.memory = options.memory_snapshot
        if self.memory:
            if device.type != "cuda":
                raise UsageError("--memory-snapshot records CUDA's allocator; this run has no CUDA device")
            # From the start, so that an out-of-memory error at any step has its history (torch's recipe,
            # docs/source/torch_cuda_memory.rst).
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            torch._C._cuda_attach_out_of_memory_observer(lambda *_: self.dump_memory("out-of-memory"))

    def after_step(self, step: int) -> None:
        if self.profiler is None and self.count and step == self.first - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
            self.watchdog.profiling = f"profiled training step ({self.count} from step {self.first})"
        elif self.profiler is not None and step == self.first + self.count - 1:
            self.profiler.stop()
            self.folder.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.folder / f"trace-rank-{self.env.rank}.json"))
            self.profiler = None
            self.watchdog.profiling = None
            if self.env.rank == 0:
                log.info("profiled steps %d-%d: %s/trace-rank-<RANK>.json, one per rank (open in "
                         "ui.perfetto.dev)", self.first, step, self.folder)
            if self.memory:
                self.dump_memory(f"step-{step}")

    def dump_memory(self, when: str) -> None:
        path = self.folder / f"memory-rank-{self.env.rank}-{when}.pickle"
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        log.warning("rank %d: CUDA memory snapshot in %s (drag it onto pytorch.org/memory_viz)", self.env.rank, path)
