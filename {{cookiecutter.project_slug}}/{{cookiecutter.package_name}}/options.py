"""TrainOptions: every knob of a run, one typed field each; the command line is built from the fields
(engine/cli.py, which also reads and writes --config files)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from .engine.checkpoint import CheckpointOptions
from .engine.errors import UsageError
from .engine.flags import flag, group, option
from .engine.metrics import LoggingOptions
from .engine.selection import SelectionOptions
from .engine.watchdog import WatchdogOptions




{%- if cookiecutter.use_profiling == "yes" %}


@dataclass
class ProfilingOptions:
    """profiling.py: traces and memory snapshots."""

    profile_steps: str | None = option(
        None, "START:COUNT: a torch.profiler trace of COUNT optimizer steps from step START, one file per rank, "
        "LOG_DIR/profile/trace-rank-<RANK>.json (open it in ui.perfetto.dev); the watchdog allows them "
        "--io-timeout")
    memory_snapshot: bool = option(
        False, "CUDA: record the allocator's history from the start, and dump it to LOG_DIR/profile/"
        "memory-rank-<RANK>-step-<N>.pickle at the end of --profile-steps, and -out-of-memory.pickle on an "
        "out-of-memory error (open them in pytorch.org/memory_viz)")

    def check(self, log_dir: str | None) -> None:
        if self.profile_steps is not None and not (re.fullmatch(r"[1-9]\d*:[1-9]\d*", self.profile_steps) and log_dir):
            raise UsageError(f"--profile-steps must be START:COUNT, both >= 1 (e.g. 10:3), with --log-dir for the "
                             f"traces, got {self.profile_steps!r}" + ("" if log_dir else " and no --log-dir"))
        if self.memory_snapshot and not log_dir:
            raise UsageError("--memory-snapshot writes under --log-dir; give one")
{%- endif %}


@dataclass
class TrainOptions:
    """How to train, whatever is trained. What is trained has its own options (task.py's TaskOptions), in
    `task`; parse_options() makes one command line of both."""

    epochs: int = option(10, "passes over the training set")
    max_steps: int | None = option(
        None, "the run's length in optimizer steps, in place of --epochs: the lr warmup and decay span them and "
        "the run ends there, after as many epochs as they take (counted at the world size the run starts on)")
    stop_at_step: int | None = option(
        None, "stop after this optimizer step and save, the lr schedule unchanged: a run paused, resumed later "
        "with a larger value or without it")
    batch_size: int = option(64, "samples per rank per step (the task's collate makes them one batch); the global "
                             "batch is this times the world size")
    lr: float = option(0.01, "peak learning rate: task.py's build_optimizer starts from it, the schedule scales it")
    lr_schedule: Literal["cosine", "linear", "wsd", "constant"] = option(
        "cosine", "after warmup: a cosine or a line down to 0 at the run's end (--max-steps, else --epochs); wsd: "
        "stable, then a line to 0 over the run's last --decay-fraction; or constant")
    decay_fraction: float = option(0.2, "--lr-schedule wsd: the fraction of the run its lr decays over, at the end")
    warmup_steps: int | None = option(None, "optimizer steps of linear warmup (default: 5%% of the run)")
    grad_accum: int = option(
        1, "micro-batches per optimizer step; gradients are all-reduced once per step, so a step trains on "
        "--batch-size x world size x this samples: the update of one such batch only where samples are "
        "independent (not with BatchNorm or an in-batch contrastive loss: Task.loss_couples)")
    clip_grad: float | None = option(None, "clip the gradient norm to this before each step (default: no clipping)")
    skip_nonfinite: int = option(
        0, "optimizer steps whose loss or gradient norm is not finite (NaN, inf) on any rank to skip, in this run, "
        "before stopping; 0: stop at the first, before its update, with the last checkpoint intact")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto", "autocast dtype; auto: bf16 on CUDA that supports it, else fp32. fp16 uses a gradient scaler")
    strategy: Literal["ddp", "fsdp2"] = option(
        "{{ cookiecutter.strategy }}", "ddp: a full model copy per rank, gradients all-reduced; "
        "fsdp2: parameters, gradients and optimizer state sharded across ranks (checkpoints become step-<N>/ "
        "folders of shards)")
    compile: bool = option(False, "torch.compile the model (the first steps are slow while it compiles)")
    channels_last: bool | None = option(
        None, "NHWC memory format for convolutional models (default: on for CUDA, off for CPU)")
    seed: int = option(0, "seed of model init (every rank alike), data order and fake data; then of each rank's "
                       "own draws (dropout, noise): rank 0 goes on from where model init left torch's generators, "
                       "as a plain script seeded with it would, the other ranks from seeds of their own")
    deterministic: bool = option(False, "bitwise-repeatable CUDA kernels, slower (cuDNN autotuning off); CPU runs "
                                 "are repeatable without it")
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "auto: cuda:LOCAL_RANK when CUDA is available, else cpu")
    num_workers: int = option(2, "DataLoader worker processes per rank")
    eval_every: int = option(1, "evaluate on the held-out split every this many epochs and when training stops "
                                "(0: never)")
    eval_every_steps: int = option(
        0, "evaluate every this many optimizer steps instead of by epochs (and when training stops); 0: by "
        "--eval-every's epochs. Counts steps from the run's start, so a resume keeps the same evaluation steps")
    activation_checkpointing: str = option(
        "none", "none, full, or every-N: keep only the inputs of every (or every Nth) block of the model (the "
        "blocks FSDP2 shards) in the forward pass and recompute the rest in the backward pass: less memory for "
        "about a third more compute; non-reentrant, so dropout draws the same masks again")
    sample_log: str | None = option(
        None, "audit the data order: append each training-sample index this rank loads to "
        "SAMPLE_LOG/rank-<RANK>.txt (with --num-workers 0, exactly the samples trained on)
{%- if cookiecutter.use_streaming == "yes" %}; for a streamed "
        "training set, epoch:piece:index of each sample trained on
{%- endif %}")
{%- if cookiecutter.fault_tolerance == "torchft" %}
    replica_groups: int = option(
        0, "torchft: the job's replica groups (machines, a torchrun each, started by run_node.sh with "
        "REPLICA_GROUPS=N): a group that fails is restarted and heals from the others, which keep training "
        "(docs/replica-groups.md); 0: a failure restarts every rank from the newest checkpoint")
{%- endif %}
    # The options of each concern, read by the module of that concern alone: options.checkpoint.ckpt_every.
    checkpoint: CheckpointOptions = group(CheckpointOptions, "checkpoints")
    watchdog: WatchdogOptions = group(WatchdogOptions, "progress and hangs")
    logging: LoggingOptions = group(LoggingOptions, "logging")
    selection: SelectionOptions = group(SelectionOptions, "the best checkpoint")
{%- if cookiecutter.use_profiling == "yes" %}
    profiling: ProfilingOptions = group(ProfilingOptions, "profiling")
{%- endif %}
    task: Any = field(default=None, metadata={"help": None})  # task.py's TaskOptions, set by parse_options

    def check(self) -> None:
        """Reject values that cannot work, each with what to do instead."""
        checkpoint, watchdog, logging_, selection = self.checkpoint, self.watchdog, self.logging, self.selection
        at_least_one = {"epochs": self.epochs, "batch_size": self.batch_size, "grad_accum": self.grad_accum,
                        "ckpt_every": checkpoint.ckpt_every, "keep_checkpoints": checkpoint.keep_checkpoints,
                        "log_every": logging_.log_every}
        for name, value in at_least_one.items():
            if value < 1:
                raise UsageError(f"--{flag(name)} must be >= 1, got {value}")
        for name in ("max_steps", "stop_at_step"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"--{flag(name)} must be >= 1 (or left out), got {getattr(self, name)}")
        if self.eval_every < 0:
            raise UsageError(f"--eval-every must be >= 0 (0: never), got {self.eval_every}")
        if self.eval_every_steps < 0:
            raise UsageError(f"--eval-every-steps must be >= 0 (0: evaluate by epochs), got {self.eval_every_steps}")
        if self.eval_every_steps and self.eval_every > 1:
            raise UsageError(f"--eval-every {self.eval_every} (epochs) and --eval-every-steps {self.eval_every_steps} "
                             "both set an interval; give one of them")
        if self.num_workers < 0:
            raise UsageError(f"--num-workers must be >= 0, got {self.num_workers}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if not 0 < self.decay_fraction <= 1:
            raise UsageError(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise UsageError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.strategy == "fsdp2" and self.precision == "fp16":
            raise UsageError("--precision fp16 needs a gradient scaler that FSDP2 shards do not support here; "
                             "use --precision bf16 (or fp32) with --strategy fsdp2")
        for name in ("step_timeout", "io_timeout"):
            if not getattr(watchdog, name) > 0:
                raise UsageError(f"--{flag(name)} must be > 0 seconds, got {getattr(watchdog, name)}")
        if self.skip_nonfinite < 0:
            raise UsageError(f"--skip-nonfinite must be >= 0 (0: stop at the first), got {self.skip_nonfinite}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise UsageError(f"--clip-grad must be > 0 (or left out for no clipping), got {self.clip_grad}")
        if selection.keep_best is not None and not re.fullmatch(r"\S+:(min|max)", selection.keep_best):
            raise UsageError(f"--keep-best must be METRIC:min or METRIC:max (e.g. loss:min, accuracy:max), got "
                             f"{selection.keep_best!r}")
        if selection.keep_best is not None and not (self.eval_every or self.eval_every_steps):
            raise UsageError("--keep-best judges evaluations, which --eval-every 0 turns off; evaluate every epoch "
                             "or every few (--eval-every N), or every N steps (--eval-every-steps N)")
        if selection.early_stop_patience is not None and (
                selection.keep_best is None or selection.early_stop_patience < 1):
            raise UsageError("--early-stop-patience needs --keep-best METRIC:min|max (the metric it waits on) and a "
                             f"value >= 1, got {selection.early_stop_patience}")
{%- if cookiecutter.use_profiling == "yes" %}
        self.profiling.check(logging_.log_dir)
{%- endif %}
{%- if cookiecutter.fault_tolerance == "torchft" %}
        if self.replica_groups < 0 or (self.replica_groups and (self.strategy != "ddp" or self.compile)):
            raise UsageError(f"--replica-groups must be >= 0 (0: off) and needs --strategy ddp without --compile, "
                             f"got {self.replica_groups} with --strategy {self.strategy}"
                             f"{' --compile' if self.compile else ''}")
{%- endif %}
        if not re.fullmatch(r"none|full|every-[1-9]\d*", self.activation_checkpointing):
            raise UsageError("--activation-checkpointing must be none, full or every-N (N >= 1), got "
                             f"{self.activation_checkpointing!r}")
