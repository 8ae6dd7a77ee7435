"""Measuring a run: loss (averaged over ranks), gradient norm, lr, throughput in the task's unit, step time,
time spent waiting for data, memory, model FLOPs utilisation, and the evaluation results; shown as log lines or
a progress bar, and written by rank 0 to metrics.jsonl and a tracker."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from .collectives import all_gather_objects, all_reduce, same_on_every_rank, world_size
from .distributed import DistEnv
from .errors import UsageError
from .flags import option
from .parallel import whole
{%- if cookiecutter.use_trackers == "yes" %}
from .trackers import TRACKERS, Tracker
{%- endif %}

if TYPE_CHECKING:  # for annotations only: the engine imports nothing around it
    from ..options import TrainOptions

log = logging.getLogger(__name__)


@dataclass
class LoggingOptions:
    """metrics.py{% if cookiecutter.use_trackers == "yes" %} and trackers.py{% endif %}: what rank 0 logs, how often, and where it sends it."""

    log_every: int = option(10, "log loss and throughput every this many steps (rank 0)")
    log_dir: str | None = option(
        None, "rank 0 writes LOG_DIR/metrics.jsonl (one JSON object per logged step and per evaluation), "
        "and with --tracker tensorboard its event files there")
{%- if cookiecutter.use_trackers == "yes" %}
    tracker: Literal["tensorboard", "wandb", "mlflow", "none"] = option(
        "tensorboard", "where rank 0 also sends each row: TensorBoard event files in --log-dir, or one "
        "Weights & Biases or MLflow run per job, continued by every restart (its id: CKPT_DIR/tracker.json)")
{%- else %}
    tracker: Literal["tensorboard", "none"] = option(
        "tensorboard", "whether rank 0 also writes each row as TensorBoard event files in --log-dir")
{%- endif %}
    progress_bar: bool | None = option(None, "tqdm progress bar on rank 0 (default: only when stderr is a terminal)")


# Dense bf16 peak FLOP/s per GPU, for model FLOPs utilisation (MFU); a GPU not listed gets no MFU figure.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def build_meter(options: TrainOptions, env: DistEnv, device: torch.device, total_steps: int, done_steps: int,
                unit: str = "samples", flops_per_unit: float | None = None,
                changed_options: list[str] | None = None) -> TrainingMeter:
    """The run's meter: metrics files with --log-dir{% if cookiecutter.use_trackers == "yes" %}, a tracker run{% endif %} and a progress bar on a terminal, all on
    rank 0 only. `changed_options`: what this resume changed{% if cookiecutter.use_trackers == "yes" %}, for the tracker{% endif %}."""
    metrics_log = None
{%- if cookiecutter.use_trackers == "yes" %}
    if (options.logging.log_dir or options.logging.tracker in TRACKERS) and env.is_main_process:
        metrics_log = MetricsLog(options.logging, resumed_step=done_steps, restart=env.restart_count,
                                 tracker=Tracker(options, env, done_steps, changed_options or []))
{%- else %}
    if options.logging.log_dir and env.is_main_process:
        metrics_log = MetricsLog(options.logging, resumed_step=done_steps, restart=env.restart_count)
{%- endif %}
    # A bar for people watching a terminal; plain log lines for files, CI and schedulers.
    show_bar = options.logging.progress_bar if options.logging.progress_bar is not None else sys.stderr.isatty()
    progress_bar = ProgressBar(env.is_main_process and show_bar, total_steps, done_steps)
    peak = None
    if device.type == "cuda" and flops_per_unit:
        name = torch.cuda.get_device_name(device)
        peak = next((flops for gpu, flops in PEAK_BF16_FLOPS.items() if gpu in name), None)
    return TrainingMeter(device, options.logging.log_every, metrics_log, progress_bar, unit=unit,
                         flops_per_unit=flops_per_unit, peak_flops=peak * env.world_size if peak else None)


class MetricsLog:
    """Rank 0's record of a run: in --log-dir, metrics.jsonl (one JSON object per row) and, with --tracker
    tensorboard, its events{% if cookiecutter.use_trackers == "yes" %}; with --tracker wandb or mlflow, that tracker's run{% endif %}.

    Rows are appended, so a restarted run continues the same file; rows for steps after the checkpoint it
    resumed from appear twice (each with its restart number). TensorBoard drops its own stale ones{% if cookiecutter.use_trackers == "yes" %}, and the
    trackers are not sent them again (trackers.py){% endif %}.
    """
{% if cookiecutter.use_trackers == "yes" %}
    def __init__(self, options: LoggingOptions, resumed_step: int, restart: int, tracker: Tracker):
        self.restart, self.tracker = restart, tracker
{%- else %}
    def __init__(self, options: LoggingOptions, resumed_step: int, restart: int):
        self.restart = restart
{%- endif %}
        self.jsonl = self.tensorboard = None
        if options.log_dir:
            folder = Path(options.log_dir)
            folder.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(folder / "metrics.jsonl", "a", buffering=1)  # line-buffered: readable while running
        if options.log_dir and options.tracker == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning("tensorboard is not installed, so only %s/metrics.jsonl is written; "
                            "pip install tensorboard for event files", options.log_dir)
            else:
                # purge_step: events a previous attempt wrote after the checkpoint we resumed from are hidden.
                self.tensorboard = SummaryWriter(options.log_dir, purge_step=resumed_step or None)

    def write(self, kind: str, step: int, values: dict[str, float], **labels: str) -> None:
        """A row of numbers; `labels` (what an evaluation closes) go to metrics.jsonl alone."""
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"kind": kind, "step": step, **values, **labels, "restart": self.restart})
                             + "\n")
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(f"{kind}/{name}", value, step)
{%- if cookiecutter.use_trackers == "yes" %}
        self.tracker.log(kind, step, values)
{%- endif %}

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
{%- if cookiecutter.use_trackers == "yes" %}
        self.tracker.close()
{%- endif %}


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
    host sync per step. Call `update` and `end_step` after every optimizer step."""

    def __init__(self, device: torch.device, log_every: int, metrics_log: MetricsLog | None,
                 progress_bar: ProgressBar, unit: str = "samples", flops_per_unit: float | None = None,
                 peak_flops: float | None = None):
        self.unit = unit  # what throughput counts: samples, tokens (Task.throughput_unit)
        self.flops_per_unit = flops_per_unit
        self.peak_flops = peak_flops  # of all ranks together
        self.device = device
        self.log_every = log_every
        self.metrics_log = metrics_log
        self.progress_bar = progress_bar
        self.task_names: list[str] = []  # the names of the task's step.log values, checked alike on every rank
        self.last_lr = 0.0  # the last step's, for the run's last line
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.grad_norm_sum = torch.zeros((), device=self.device)
        self.micro_batches = 0
        self.task_sums: dict[str, tuple[torch.Tensor, int]] = {}  # step.log's values: (sum of step means, steps)
        self.steps = 0
        self.units = torch.zeros((), device=self.device, dtype=torch.float64)  # this rank's, since the last line
        self.data_wait = 0.0
        self.paused = 0.0  # evaluation and the task's work inside the interval: not training time
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

    def update(self, loss: torch.Tensor, units: int | torch.Tensor, task_values: dict[str, torch.Tensor]) -> None:
        """After every optimizer step: the loss its training_step returned (the mean over its micro-batches), how
        many units (samples, tokens) this rank trained on, and the step's step.log(...) values; a tensor count is
        added where it is (on the device, or a host count as a number), so counting costs no host sync."""
        self.loss_sum += loss.detach()
        self.micro_batches += 1
        self.units += units
        for name, value in task_values.items():
            total, steps = self.task_sums.get(name, (0.0, 0))
            self.task_sums[name] = (total + value, steps + 1)

    def end_step(self, progress: Any, lr: float, grad_norm: torch.Tensor) -> None:
        """After every optimizer step: where training stands now, the lr the step ran with, and the gradient
        norm before clipping (the same on every rank)."""
        self.grad_norm_sum += whole(grad_norm).detach().float()
        self.steps += 1
        self.last_step_end = time.perf_counter()
        self.last_lr = lr
        self.progress_bar.update()
        if progress.step % self.log_every == 0:
            self.log_and_reset(progress, lr)

    def log_the_rest(self, progress: Any) -> None:
        """At the run's end or a stop: the steps since the last line, if any (a collective)."""
        if self.steps:
            self.log_and_reset(progress, self.last_lr)

    def log_and_reset(self, progress: Any, lr: float) -> None:
        """Log the mean loss over ranks and micro-batches since the last line (a collective)."""
        names = sorted(self.task_sums)
        # Every rank must log the same names, or the all-reduce below would add up different values (or, of
        # another length, hang): one small all-reduce compares them first.
        if not same_on_every_rank("\0".join(names), self.units.device):
            theirs = sorted({tuple(ranks_names) for ranks_names in all_gather_objects(names)})
            raise UsageError(f"step.log(...) was given other names on other ranks in the steps up to {progress.step} "
                             f"({' vs '.join(map(str, map(list, theirs[:3])))}); log the same names on every rank "
                             "(a value of 0 where there is none)")
        if names != self.task_names:
            if names:
                log.info("logged beside the loss, each a mean over ranks and the steps since the previous line: %s",
                         ", ".join(names))
            self.task_names = names
        task_means = [(self.task_sums[name][0] / self.task_sums[name][1]).double() for name in names]
        # Mean loss, total units and the means of the task's values over ranks, in one all-reduce.
        loss_sum, units, *task_values = all_reduce(torch.stack([
            (self.loss_sum / max(self.micro_batches, 1)).double(), self.units,
            *[value.to(self.units.device) for value in task_means]]), "sum").tolist()
        loss = loss_sum / world_size()
        task_row = {name: value / world_size() for name, value in zip(names, task_values, strict=True)}
        elapsed = time.perf_counter() - self.started - self.paused
        rate = units / elapsed
        step, epoch = progress.step, progress.epoch
        row = {"loss": loss, **task_row, "grad_norm": self.grad_norm_sum.item() / max(self.steps, 1), "lr": lr,
               "samples_seen": progress.samples_seen, "steps": self.steps,  # the means' steps: fewer than
               # --log-every in the first line after a resume and the last of a run
               f"{self.unit}_per_sec": rate, "step_time_s": elapsed / max(self.steps, 1),
               "data_wait_frac": self.data_wait / elapsed}
        extra = f" | over {self.steps} steps" if self.steps != self.log_every else ""  # a mean of fewer, or more
        if self.device.type == "cuda":
            row["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.peak_flops:
            row["mfu"] = self.flops_per_unit * rate / self.peak_flops
            extra += f" | mfu {100 * row['mfu']:.1f}%"
        if self.progress_bar.bar is not None:
            self.progress_bar.show(f"loss {loss:.4f}, {rate:.1f} {self.unit}/s")
        else:
            task_text = "".join(f" | {name} {value:.4g}" for name, value in task_row.items())
            log.info("step %d | epoch %d | loss %.4f%s | grad norm %.3f | lr %.2e | %d samples seen | %.1f %s/s | "
                     "%.3f s/step | data wait %.0f%%%s", step, epoch, loss, task_text, row["grad_norm"], lr,
                     progress.samples_seen, rate, self.unit, row["step_time_s"], 100 * row["data_wait_frac"], extra)
        if self.metrics_log is not None:
            self.metrics_log.write("train", step, row)
        self.reset()

    @contextlib.contextmanager
    def excluded(self):
        """Time that is not training (the task's work on rank 0), left out of the throughput."""
        started = time.perf_counter()
        try:
            yield
        finally:
            # An evaluation after it leaves out the time since then only: this much is left out already.
            self.last_step_end = time.perf_counter()
            self.paused += self.last_step_end - started

    def log_evaluation(self, step: int, epoch: int, metrics: dict[str, float], closes: str) -> None:
        """One line and one row of whatever task.summarize returned, e.g. eval loss 0.51 | accuracy 0.83, and what
        the evaluation closes (an interval of --eval-every-steps, an epoch; in mid-interval the run or a stop)."""
        shown = " | ".join(f"{name} {value if isinstance(value, int) else f'{value:.4f}'}"  # a count as itself
                           for name, value in metrics.items() if name != self.unit)
        log.info("step %d | epoch %d | eval %s on %d held-out %s (closing %s)", step, epoch, shown,
                 metrics.get(self.unit, 0), self.unit, {"interval": "an interval", "epoch": "an epoch",
                                                        "run": "the run", "stop": "--stop-at-step's stop"}[closes])
        if self.metrics_log is not None:
            self.metrics_log.write("eval", step, metrics, closes=closes)
        self.paused += time.perf_counter() - max(self.last_step_end, self.started)

    def close(self) -> None:
        self.progress_bar.close()
        if self.metrics_log is not None:
            self.metrics_log.close()
