#!/usr/bin/env python3
r"""Train the model of {{ cookiecutter.package_name }}/task.py with DDP or FSDP2, launched by torchrun.

    python train.py --max-steps 50                        # one plain process, for debugging
    ./run_node.sh --epochs 5                              # all GPUs (or CPU ranks) of this machine
    NNODES=2 RDZV_ENDPOINT=node0:{{ cookiecutter.rdzv_port }} ./run_node.sh --epochs 5   # same on each machine
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=node0:{{ cookiecutter.rdzv_port }} --rdzv-id=job1 train.py --epochs 5

Every flag: `python train.py --help`. Restarted by torchrun, a scheduler or you, training resumes from the
newest checkpoint in --ckpt-dir. The loop below is yours to edit; torchrun details live in
{{ cookiecutter.package_name }}/engine/distributed.py.
"""

import gc

if __name__ == "__main__":  # run by torchrun or python, not imported by a test
    gc.disable()  # while importing; see the end of this file. So the imports come after code:
# ruff: noqa: E402

import contextlib
import logging
import math
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from {{ cookiecutter.package_name }}.engine import tasks
from {{ cookiecutter.package_name }}.engine.checkpoint import build_checkpointer, check_checkpoint_dir
from {{ cookiecutter.package_name }}.engine.cli import parse_options, recorded
from {{ cookiecutter.package_name }}.engine.data import OnDevice, build_loaders, training_steps
from {{ cookiecutter.package_name }}.engine.distributed import (
    DistEnv,
    StoreAddress,
    describe_job,
    distributed_session,
    select_device,
    setup_logging,
    side_group,
)
from {{ cookiecutter.package_name }}.engine.errors import UsageError
from {{ cookiecutter.package_name }}.engine.evaluation import Learned, evaluate, evaluation_due
from {{ cookiecutter.package_name }}.engine.failure import (
    CrashRecord,
    end_attempt_after,
    end_job_for_usage_error,
    usage_error_reported_under_this_torchrun,
)
from {{ cookiecutter.package_name }}.engine.metrics import build_meter
from {{ cookiecutter.package_name }}.engine.optim import (
    LearningRateSchedule,
    MixedPrecision,
    NonFiniteGuard,
    check_coupled_batch,
    planned_steps,
    resolve_precision,
)
from {{ cookiecutter.package_name }}.engine.parallel import uses_channels_last, wrap_networks
from {{ cookiecutter.package_name }}.engine.replicas import check_replicas_match
from {{ cookiecutter.package_name }}.engine.reproducibility import seed_and_choose_kernels, seed_per_rank
from {{ cookiecutter.package_name }}.engine.selection import ModelSelection
from {{ cookiecutter.package_name }}.engine.task_state import saved_entries
from {{ cookiecutter.package_name }}.engine.watchdog import EXIT_CODE_AFTER_SIGTERM, StopAgreement, Watchdog
from {{ cookiecutter.package_name }}.options import TrainOptions
{% if cookiecutter.use_profiling == "yes" -%}
from {{ cookiecutter.package_name }}.profiling import StepProfiler, record_memory_history
{% endif -%}
{% if cookiecutter.fault_tolerance == "torchft" -%}
from {{ cookiecutter.package_name }}.replica_groups import ReplicaGroups
{% endif -%}
from {{ cookiecutter.package_name }}.spec import Task
from {{ cookiecutter.package_name }}.step import Step
from {{ cookiecutter.package_name }}.task import TASK

log = logging.getLogger(__name__)


@dataclass
class TrainingProgress:
    """Where the loop stands. Every field is saved in each checkpoint and restored on resume: a value the loop
    keeps is one more field here (a job whose checkpoints lack it resumes once with --resume-changed-state)."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0
    samples_in_epoch: int = 0  # global samples (all ranks) of this epoch already trained on
    samples_seen: int = 0  # global samples trained on in all, what the lr schedule follows
    evaluation_due: str = ""  # what the evaluation still to run closes: "interval", "epoch", "run" or "stop"

    def __post_init__(self) -> None:  # a checkpoint from before evaluations said what they close: a bool
        if isinstance(self.evaluation_due, bool):
            self.evaluation_due = "epoch" if self.evaluation_due else ""

    def advance(self, samples: int) -> None:
        self.step += 1
        self.samples_in_epoch += samples
        self.samples_seen += samples

    def finished(self, options: TrainOptions, run_samples: int | None) -> bool:
        """Once `run_samples` samples are trained (--max-steps' at the world size the run started on: a resize
        ends it where its lr schedule ends), else after --epochs; or after --stop-at-step."""
        if options.stop_at_step is not None and self.step >= options.stop_at_step:
            return True
        return self.samples_seen >= run_samples if run_samples is not None else self.epoch >= options.epochs

    def next_epoch(self) -> None:
        self.epoch += 1
        self.samples_in_epoch = 0


def train(options: TrainOptions, task: Task, env: DistEnv, device: torch.device, store: StoreAddress | None{% if cookiecutter.fault_tolerance == "torchft" %},
          groups: ReplicaGroups | None{% endif %}) -> None:
    log.info("%s", describe_job(env, device))
{%- if cookiecutter.fault_tolerance == "torchft" %}
    data_env = env  # the data's view of the ranks
    if groups is not None:  # --replica-groups: this torchrun is one group of several (replica_groups.py)
        groups.join(device, store, options.watchdog.step_timeout, options.watchdog.io_timeout)
        data_env = groups.data_env()  # the training set split as if every group were present
        log.info("%s", groups.describe())
{%- endif %}
    # From here on SIGTERM means "save and stop at the next step", and a rank that stops making progress is
    # ended (with its stack logged) so that torchrun restarts the group.
    watchdog = Watchdog(env, store, options.watchdog.step_timeout, options.watchdog.io_timeout)
    stop = StopAgreement(side_group())
    seed_and_choose_kernels(options.seed, options.deterministic, env, device)  # cuDNN autotuning, or not
    train_set, eval_set = tasks.build_datasets(task, options, env, device)
    train_loader, eval_loader = build_loaders(train_set, eval_set, options, env, device, task.collate, task.batches{% if cookiecutter.fault_tolerance == "torchft" %},
                                              train_env=data_env{% endif %})
    model = tasks.build_model(task, options, train_set).to(device)
    # The model is the same everywhere; now each rank draws its own numbers.
    seed_per_rank(options.seed, {% if cookiecutter.fault_tolerance == "torchft" %}data_env{% else %}env{% endif %}, device)
    channels_last = uses_channels_last(model, device, options.channels_last)
    model = model.to(memory_format=torch.channels_last) if channels_last else model
    amp = MixedPrecision(resolve_precision(options.precision, device), device)
    # Forward and backward through `networks.model` (DDP or FSDP2, maybe compiled); save and evaluate `model`.
    # A task with its own training_step gets the model's top-level networks wrapped one by one instead.
    networks = wrap_networks(model, device, options.strategy, options.compile, amp.param_dtype,
                             options.activation_checkpointing, one_by_one=task.training_step is not None,
                             find_unused_parameters=task.find_unused_parameters{% if cookiecutter.fault_tolerance == "torchft" %} or groups is not None{% endif %})
{%- if cookiecutter.fault_tolerance == "torchft" %}
    if groups is not None:
        groups.average_gradients(networks)  # within the group, then across the groups present
{%- endif %}
    optimizers = task.build_optimizer(model, options)  # after wrapping: FSDP2 swaps in sharded parameters
    nonfinite = NonFiniteGuard(options.skip_nonfinite, amp, device)  # a NaN loss stops the job (or is skipped)

    def optimizer_step(optimizer: torch.optim.Optimizer, number: int) -> torch.Tensor:
        """The optimizer step, which step.update() takes (below, or in a task's training_step). Returns the gradient
        norm before clipping. Every optimizer's gradients are zeroed when the training step ends (Step.run)."""
        amp.scaler.unscale_(optimizer)  # true gradients for the norm and clipping (a no-op unless fp16)
        parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, options.clip_grad or math.inf)
{%- if cookiecutter.fault_tolerance == "torchft" %}
        allowed = nonfinite.allows_update(number, grad_norm)  # else skipped on every rank, or a stop
        if (groups is None or groups.should_commit(number, allowed)) and allowed:  # a group lost in it: dropped
{%- else %}
        if nonfinite.allows_update(number, grad_norm):  # else skipped on every rank, or a stop
{%- endif %}
            amp.scaler.step(optimizer)  # fp16: skips a step whose gradients overflowed
        return grad_norm

    def default_training_step(step: Step, batches: list) -> torch.Tensor:
        """The training step, unless the task gives its own: compute_loss's backward on each micro-batch (with
        --grad-accum, gradients add up and are all-reduced on the last), then every optimizer's update."""
        def loss_of(networks: SimpleNamespace, batch) -> torch.Tensor:
            return task.compute_loss(networks.model, batch, step)  # the task runs the model

        loss = step.backward(loss_of, batches)
        step.update()
        return loss

    training_step = task.training_step or default_training_step
    # The task's own state beside the model (an EMA, say): updated by task.after_step, saved with the rest.
    task_state = tasks.build_state(task, model, options, taken={
        "model", "optimizer", "lr_schedule", "grad_scaler", "selection", "batches_position",
        "learned"{% if cookiecutter.use_streaming == "yes" %}, "stream_position"{% endif %}{% if cookiecutter.fault_tolerance == "torchft" %}, "replica_groups"{% endif %}})
    step = Step(networks, model, optimizers, amp, options, nonfinite, optimizer_step, task_state)  # what a task sees
    optimizer = step.optimizer  # every optimizer as one: scaled by the lr schedule, saved by checkpoints
    # Over samples seen, not steps: a job resumed on another number of ranks continues the same curve.
    # It spans the run (--max-steps, else --epochs) and says where it ends: `run_samples`.
    lr_schedule = LearningRateSchedule(optimizer, options, train_loader)
    # Saved besides: where the training set stands beyond a count of samples ({% if cookiecutter.use_streaming == "yes" %}a stream's position, {% endif %}the task's
    # batches), what the task learns from its evaluations (Task.after_evaluation: an lr scale, a data stage), and
    # the task's state (each entry the same on every rank, checked at each save, or PerRank: each rank's own).
    learned = Learned(task.after_evaluation, lr_schedule, train_loader)
    saved_too = {**({train_loader.position_entry: train_loader} if train_loader.position_entry else {}),
                 **({"learned": learned} if task.after_evaluation is not None else {}),
                 **saved_entries(task_state, device)}
    # --keep-best, --early-stop-patience: the best evaluation so far, and how many came after it.
    selection = ModelSelection(options.selection, options.checkpoint.ckpt_dir, env)
    checkpointer = build_checkpointer(options.checkpoint, recorded(options), env, device,
                                      sharded=options.strategy == "fsdp2", model=model, optimizer=optimizer,
                                      lr_schedule=lr_schedule, grad_scaler=amp, selection=selection, **saved_too{% if cookiecutter.fault_tolerance == "torchft" %},
                                      **(groups.checkpoint_entries() if groups else {}){% endif %})
    progress = checkpointer.resume(TrainingProgress)  # the newest checkpoint's, or a fresh one
{%- if cookiecutter.fault_tolerance == "torchft" %}
    if groups is not None:  # what a group that joins late copies from a running one: all of the above
        groups.share(checkpointer, progress, options.seed)
        with watchdog.slow_phase("waiting for every replica group"):
            groups.wait_for_the_others()
{%- endif %}
    # What --grad-accum and a resize do to a loss that couples a batch's samples (contrastive, BatchNorm).
    check_coupled_batch(task.loss_couples, task.keep_coupled_batch, model, options, env.world_size,
                        checkpointer.resumed_from, own_batches=task.batches is not None)
    # --max-steps' run is a number of samples (its steps at the first world size), which a resize keeps.
    run_samples = lr_schedule.run_samples  # None: the run is --epochs
    planned = planned_steps(options, train_loader, progress, lr_schedule)  # the step it ends at, at this size
{%- if cookiecutter.use_profiling == "yes" %}
    profiler = StepProfiler(options.profiling, options.logging.log_dir, env, device, watchdog)  # --profile-steps
    profiler.before_step(progress.step + 1)
{%- endif %}
    first_step = progress.step + 1  # of this run
    if options.eval_every or options.eval_every_steps:  # one held-out batch now: a bug in the evaluation path
        # shows before training
        with watchdog.slow_phase("checking evaluation on one batch"):
            selection.check_metric(evaluate(model, eval_loader, device, amp, task, max_batches=1))
    meter = build_meter(options, env, device, planned, done_steps=progress.step, unit=task.throughput_unit,
                        flops_per_unit=task.model_flops_per_unit(model, options),
                        changed_options=checkpointer.changed_options)
    rank_0_every = tasks.work_every(task, options)  # 0: the task has no work for rank 0 alone
    stop_requested = False

    # Each step's micro-batches, epoch after epoch from where progress stands; None where an epoch has ended.
    steps = meter.timed(training_steps(train_loader, progress, options.grad_accum))
    while True:
        # Before the next step: the evaluation due (of an interval, an epoch, the run, or one a SIGTERM cut short).
        if progress.evaluation_due and not stop_requested:
            with watchdog.slow_phase("evaluating"), tasks.evaluation_weights(task, model, task_state):
                results = evaluate(model, eval_loader, device, amp, task,
                                   stop=lambda: stop.agreed_now(watchdog.sigterm_received))
            if results is None:  # SIGTERM reached some rank: saved as still due, evaluated on resume
                stop_requested = True
            else:
                closes, progress.evaluation_due = progress.evaluation_due, ""
                meter.log_evaluation(progress.step, progress.epoch, results, closes)
                if task.after_evaluation is not None and closes != "stop":  # (a pause is no part of the run)
                    learned.after(results, closes, options, progress.step)  # the task's lr scale, data stage
                # --keep-best judges the evaluations --eval-every(-steps) asks for: not one at an end in mid-interval.
                if closes in ("interval", "epoch") and selection.judge(results, progress.step, stop.decided_by_rank_0):
                    with watchdog.slow_phase("saving the best checkpoint"):
                        checkpointer.save(progress, wait=True)  # the best so far: saved now, and kept
                    selection.write_record()
        if stop_requested or progress.finished(options, run_samples) \
                or selection.out_of_patience():
            break  # the loop's one exit
        batches = next(steps)  # whatever task.collate made, moved to the device as the step reads it
        if batches is None:  # the epoch ran to its end
            progress.next_epoch()
            stop_requested = stop.agreed_now(watchdog.sigterm_received)  # not after a long evaluation
        else:
            samples = train_loader.samples_in_step(progress.samples_in_epoch)  # every rank's, this step
            lr = lr_schedule.set_lr(progress.samples_seen + samples / 2)  # at the step's middle
{%- if cookiecutter.fault_tolerance == "torchft" %}
            if groups is not None and groups.start_step(progress, options.checkpoint.ckpt_every):
                steps = meter.timed(training_steps(train_loader, progress, options.grad_accum))  # healed: another
                continue  # group's progress, and the data position it names
{%- endif %}
            loss, grad_norm = step.run(training_step, OnDevice(batches, device, channels_last),
                                       number=progress.step + 1)
            amp.scaler.update()  # once a step, after every optimizer stepped: the fp16 scale for the next
            task.after_step(step)  # the task's state after the update: an EMA, a momentum encoder
            meter.update(loss, sum(tasks.units_in(task, micro_batch) for micro_batch in batches),
                         step.logged_means())  # with what the task gave step.log(...), after_step's included
            progress.advance(samples)
            meter.end_step(progress, lr, grad_norm)
{%- if cookiecutter.use_profiling == "yes" %}
            profiler.before_step(progress.step + 1)  # before the beat: a profiled step is a slow one
{%- endif %}
            watchdog.beat(progress.step)
            if rank_0_every and progress.step % rank_0_every == 0:  # samples, a figure: Task.rank_0_work's
                with watchdog.slow_phase("the task's work on rank 0"), meter.excluded():
                    tasks.work_alone(task, step, env, device)
            if progress.step == first_step:  # the replica check: one model on every rank (again at each save)
                if check_replicas_match(model, progress.step, step.without_gradient):  # else the job has stopped
                    log.info("step %d: every rank holds the same parameters", progress.step)
            stop_requested = stop.agreed(watchdog.sigterm_received)  # SIGTERM reached some rank: same step on all
        # After each step and each epoch's end, what is due: an evaluation, a checkpoint (before that evaluation:
        # one that fails loses no training).
        finished = progress.finished(options, run_samples)
        progress.evaluation_due = progress.evaluation_due or evaluation_due(
            options, progress, epoch_ended=batches is None, finished=finished)
        if stop_requested or finished:
            meter.log_the_rest(progress)  # the steps since the last line
        if stop_requested or finished or (batches is not None and progress.step % options.checkpoint.ckpt_every == 0):
            with watchdog.slow_phase("saving a checkpoint"):
                checkpointer.save(progress)
    steps.close()  # the loader's workers end now, not at the process's exit

    # meter.close() inside the phase, also on the SIGTERM exit: the tracker's last rows are written within its limit.
{%- if cookiecutter.use_profiling == "yes" %}
    profiler.close()  # a run that ended inside the profiled steps still writes their trace
{%- endif %}
    with watchdog.slow_phase("final checkpoint"), contextlib.closing(meter):
        checkpointer.save(progress, wait=True)
{%- if cookiecutter.fault_tolerance == "torchft" %}
    if groups is not None:
        groups.shutdown()
{%- endif %}
    if stop_requested:  # preemption, or torchrun stopping the group
        log.info("stopped by SIGTERM after step %d; run the same command again to resume", progress.step)
        sys.exit(EXIT_CODE_AFTER_SIGTERM)


@record  # an uncaught exception's traceback reaches torchrun's failure summary
def main(argv: list[str] | None = None) -> None:
    env = crashes = None
    try:
        # What torchrun sets for each process it starts: RANK (0..WORLD_SIZE-1, across machines), LOCAL_RANK (on
        # this machine), WORLD_SIZE, and its restart count and run id; none set: one plain process, rank 0 of 1.
        env = DistEnv.from_environ()
        if usage_error_reported_under_this_torchrun(env):  # the same command again: the same error, already shown
            sys.exit(1)
        setup_logging(env)
        task = TASK  # everything task.py gives the package: its datasets, models, loss, evaluation
        options = parse_options(argv, TrainOptions, task.options, task.training_defaults)
        device = select_device(options.device, env)  # cuda:LOCAL_RANK (never the global rank), or the CPU
{%- if cookiecutter.use_profiling == "yes" %}
        record_memory_history(options.profiling, options.logging.log_dir, device, env)  # from before the model is built
{%- endif %}
        # Bad input fails here, on every rank, before any process group or download starts.
        tasks.check_task_options(task, options)
{%- if cookiecutter.fault_tolerance == "torchft" %}
        groups = ReplicaGroups(options.replica_groups, env) if options.replica_groups else None
        if groups is not None:
            if task.training_step is not None:  # its several updates would each try to commit the step
                raise UsageError("--replica-groups commits one optimizer update per step: a Task with its own "
                                 "training_step trains in the default mode only (leave out --replica-groups)")
            options.checkpoint.ckpt_dir = groups.checkpoint_dir(options.checkpoint.ckpt_dir)  # one folder each
{%- endif %}
        check_checkpoint_dir(options.checkpoint.ckpt_dir)
        crashes = CrashRecord(options.checkpoint.ckpt_dir, env)
        # The process group over all WORLD_SIZE ranks: NCCL on GPUs, gloo on CPUs, on a store made fresh for each
        # torchrun attempt (pytorch/pytorch#135712); for one plain process, none.
        with distributed_session(env, device, timeout=options.watchdog.collective_timeout()) as store:
            if crashes.known_bug_on_any_machine(device):  # found by an earlier attempt, nothing changed since
                sys.exit(1)
            train(options, task, env, device, store{% if cookiecutter.fault_tolerance == "torchft" %}, groups{% endif %})
    except UsageError as error:
        end_job_for_usage_error(error, env)  # one line per job; torchrun's retries end at once, silently
    except Exception as error:
        end_attempt_after(error, crashes, env or DistEnv())  # a lost peer or a repeated bug: one line at most
        raise


if __name__ == "__main__":
    # Importing torch made half a million objects that live as long as the process. Python's cycle collector
    # would walk them all, again and again while they were made, at each full collection during training and once
    # more at exit: about a second of CPU at every start and restart of a rank, and in DataLoader workers started
    # by fork it would write to their memory, which each worker then copies. So, adapting the recipe of Python's
    # gc.freeze() docs: no collection while importing, then what the imports made is moved where the collector
    # never looks (with the few MB of garbage they left, which one more full collection would cost to free).
    gc.freeze()
    gc.enable()
    main()
