"""Measuring a run: loss (averaged over ranks), lr, throughput, step time, time spent waiting for data,
memory; shown as log lines or a progress bar, and written by rank 0 to metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .distributed import DistEnv, mean_across_ranks
from .options import TrainOptions

log = logging.getLogger("train")


def build_meter(options: TrainOptions, env: DistEnv, device: torch.device, total_steps: int,
                done_steps: int) -> TrainingMeter:
    """The run's meter: metrics files with --log-dir and a progress bar on a terminal, both on rank 0 only."""
    metrics_log = None
    if options.log_dir and env.is_main_process:
        metrics_log = MetricsLog(options.log_dir, resumed_step=done_steps, restart=env.restart_count)
    # A bar for people watching a terminal; plain log lines for files, CI and schedulers.
    show_bar = options.progress_bar if options.progress_bar is not None else sys.stderr.isatty()
    progress_bar = ProgressBar(env.is_main_process and show_bar, total_steps, done_steps)
    return TrainingMeter(device, options.log_every, metrics_log, progress_bar)


class MetricsLog:
    """Rank 0's record of a run in --log-dir: metrics.jsonl (one JSON object per row) and TensorBoard events.

    Rows are appended, so a restarted run continues the same file; rows for steps after the checkpoint it
    resumed from appear twice (each with its restart number), and TensorBoard drops its own stale ones.
    """

    def __init__(self, log_dir: str, resumed_step: int, restart: int):
        self.restart = restart
        folder = Path(log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(folder / "metrics.jsonl", "a", buffering=1)  # line-buffered: readable while running
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning("tensorboard is not installed, so only %s/metrics.jsonl is written; "
                        "pip install tensorboard for event files", log_dir)
        else:
            # purge_step: events a previous attempt wrote after the checkpoint we resumed from are hidden.
            self.tensorboard = SummaryWriter(log_dir, purge_step=resumed_step or None)

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"kind": kind, "step": step, **values, "restart": self.restart}) + "\n")
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


class ProgressBar:
    """A tqdm bar over optimizer steps, on rank 0 only; log lines are printed above it, not through it."""

    def __init__(self, enabled: bool, total_steps: int, done_steps: int):
        self.bar = None
        if not enabled:
            return
        from tqdm import tqdm

        width = shutil.get_terminal_size().columns  # 80 where the terminal reports no size
        self.bar = tqdm(total=total_steps, initial=done_steps, unit="step", ncols=width, file=sys.stderr)
        for handler in logging.getLogger().handlers:
            handler.setStream(_WriteAboveBar())

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def show(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _WriteAboveBar:
    def write(self, text: str) -> None:
        from tqdm import tqdm

        if text.strip():
            tqdm.write(text.rstrip("\n"), file=sys.stderr)

    def flush(self) -> None:
        sys.stderr.flush()


class TrainingMeter:
    """Accumulates loss on the device between log lines, so logging costs one all-reduce per interval, not a
    host sync per step. Call `update` for every micro-batch and `end_step` after every optimizer step."""

    def __init__(self, device: torch.device, log_every: int, metrics_log: MetricsLog | None,
                 progress_bar: ProgressBar):
        self.device = device
        self.log_every = log_every
        self.metrics_log = metrics_log
        self.progress_bar = progress_bar
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.micro_batches = 0
        self.steps = 0
        self.samples = 0
        self.data_wait = 0.0
        self.paused = 0.0  # evaluation inside the interval: not training time
        self.started = self.last_step_end = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def timed(self, batches: Iterable) -> Iterator:
        """Yields from `batches`, adding the time spent waiting for each to the data-wait total."""
        iterator = iter(batches)
        while True:
            waiting_since = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.data_wait += time.perf_counter() - waiting_since
            yield batch

    def update(self, loss: torch.Tensor, global_micro_batch_size: int) -> None:
        self.loss_sum += loss.detach()
        self.micro_batches += 1
        self.samples += global_micro_batch_size

    def end_step(self, step: int, epoch: int, lr: float) -> None:
        self.steps += 1
        self.last_step_end = time.perf_counter()
        self.progress_bar.update()
        if step % self.log_every == 0:
            self.log_and_reset(step, epoch, lr)

    def log_and_reset(self, step: int, epoch: int, lr: float) -> None:
        """Log the mean loss over ranks and micro-batches since the last line (a collective)."""
        loss = mean_across_ranks(self.loss_sum / max(self.micro_batches, 1))
        elapsed = time.perf_counter() - self.started - self.paused
        row = {"loss": loss, "lr": lr, "samples_per_sec": self.samples / elapsed,
               "step_time_s": elapsed / max(self.steps, 1), "data_wait_frac": self.data_wait / elapsed}
        if self.device.type == "cuda":
            row["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.progress_bar.bar is not None:
            self.progress_bar.show(f"loss {loss:.4f}, {row['samples_per_sec']:.1f} samples/s")
        else:
            log.info("step %d | epoch %d | loss %.4f | lr %.2e | %.1f samples/s | %.3f s/step | data wait %.0f%%",
                     step, epoch, loss, lr, row["samples_per_sec"], row["step_time_s"], 100 * row["data_wait_frac"])
        if self.metrics_log is not None:
            self.metrics_log.write("train", step, row)
        self.reset()

    def log_evaluation(self, step: int, epoch: int, result: tuple[float, float, int]) -> None:
        loss, accuracy, samples = result
        log.info("step %d | epoch %d | eval loss %.4f | accuracy %.3f on %d held-out samples",
                 step, epoch, loss, accuracy, samples)
        if self.metrics_log is not None:
            self.metrics_log.write("eval", step, {"loss": loss, "accuracy": accuracy, "samples": samples})
        self.paused += time.perf_counter() - max(self.last_step_end, self.started)

    def close(self) -> None:
        self.progress_bar.close()
        if self.metrics_log is not None:
            self.metrics_log.close()
