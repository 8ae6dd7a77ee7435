"""The held-out evaluation: the task's sums added up exactly over batches and ranks, per-sample outputs
gathered from every rank, the same number of batches on every rank, and a stop that a SIGTERM can ask for."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .collectives import all_gather_objects, all_reduce, all_reduce_int, from_first_rank_with
from .data import to_device
from .errors import UsageError
from .optim import MixedPrecision
from .replicas import sync_buffers_from_main

if TYPE_CHECKING:  # for annotations only: the engine imports nothing around it
    from ..spec import Task

log = logging.getLogger(__name__)

# How often an evaluation asks whether to stop: a blocking all-reduce of one number, cheap beside 16 forwards.
STOP_CHECK_BATCHES = 16


def evaluate(model: torch.nn.Module, loader, device: torch.device, amp: MixedPrecision, task: Task,
             max_batches: int | None = None, stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
    """evaluate_on_every_rank, with torch's generators put back as they were after it: what an evaluation draws
    (noise in a diffusion model's loss, dropout left on) cannot change the training run, whose resume would
    otherwise differ by the start-up check's draws, made once per launch."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return evaluate_on_every_rank(model, loader, device, amp, task, max_batches, stop)


@torch.no_grad()
def evaluate_on_every_rank(model: torch.nn.Module, loader, device: torch.device, amp: MixedPrecision, task: Task,
                           max_batches: int | None = None, stop: Callable[[], bool] | None = None
                           ) -> dict[str, float] | None:
    """task.summarize(sums, outputs): task.evaluation_sums added up over the held-out split and over ranks (not
    a mean of per-rank means, which is wrong when shards differ in size), and task.evaluation_outputs'
    per-sample rows from every rank, if the task has it. A sum may be a tensor of any shape (a confusion
    matrix): summarize gets it as a float if it has one element, else as a tensor. Forwards run under
    training's autocast: as fast as training's, and the numbers are those of the model as trained.
    max_batches=1 is the check before training starts: a bug in the evaluation path shows at step 0.
    `stop()`, a collective that says whether to stop now, is asked every STOP_CHECK_BATCHES batches (every
    rank at the same ones): if it says so, the evaluation ends there and returns None, so that a SIGTERM
    during a long evaluation still leaves time to save.

    Every rank runs the same number of batches: FSDP2 all-gathers inside forward, and a loss may hold
    collectives of its own (negatives from every rank), so a rank that stopped early would leave the others
    waiting forever. Shards differ by up to one sample, so batch counts may too: a rank with fewer batches
    repeats its last one, and counts none of it."""
    sync_buffers_from_main(model)  # every rank evaluates with the same BatchNorm statistics
    was_training = model.training
    model.eval()
    batches = len(loader) if max_batches is None else min(len(loader), max_batches)
    most = all_reduce_int(batches, device, "max")
    if all_reduce_int(batches, device, "min") == 0 < most:
        raise UsageError("the held-out split has fewer samples than there are ranks; use more data")
    def evaluated(batch) -> tuple[dict, dict[str, torch.Tensor] | None]:
        with amp.autocast():
            sums = task.evaluation_sums(model, batch)
            outputs = None if task.evaluation_outputs is None else task.evaluation_outputs(model, batch)
        return sums, outputs

    totals, rows, batch, problem, counts = None, [], None, None, set()
    batches_left = iter(loader)
    for index in range(most):
        if stop is not None and index % STOP_CHECK_BATCHES == STOP_CHECK_BATCHES - 1 and stop():
            model.train(was_training)
            return None
        if index >= batches:  # the same forwards and collectives as a counted batch, counted nowhere
            evaluated(batch)
            continue
        batch = to_device(next(batches_left), device)
        sums, outputs = evaluated(batch)
        if outputs is not None:
            rows.append({name: value.detach().cpu() for name, value in outputs.items()})
        counts = {name for name, value in sums.items() if is_count(value)}  # summed as float64, given back as int
        values = {name: torch.as_tensor(value, device=device).double() for name, value in sums.items()}
        if totals is not None and shapes_of(values) != shapes_of(totals):  # reported below, on every rank
            problem = problem or f"task.evaluation_sums returned {shapes_of(values)} after {shapes_of(totals)}"
            continue
        totals = values if totals is None else {name: totals[name] + value for name, value in values.items()}
    model.train(was_training)
    sums = sum_across_ranks(totals, device, task.throughput_unit, problem)
    sums = {name: int(value) if name in counts and isinstance(value, float) else value for name, value in sums.items()}
    outputs = {}
    if task.evaluation_outputs is not None:
        gathered = [row for rank_rows in all_gather_objects(rows) for row in rank_rows]  # rank by rank
        outputs = {name: torch.cat([row[name] for row in gathered]) for name in (gathered[0] if gathered else {})}
    unit = task.throughput_unit
    if unit not in sums:  # alike on every rank: the names are the lowest rank's
        raise UsageError(f"task.evaluation_sums returned no {unit!r} (it returned {', '.join(sorted(sums))}): the "
                         f"count of held-out {unit} in the batch, which the evaluation divides its sums by and logs; "
                         f"add it to the dict evaluation_sums returns in task.py")
    if sums[unit] == 0:  # no held-out data
        return {"loss": math.nan, unit: 0}
    results = task.summarize(sums, outputs)
    if unit not in results:
        raise UsageError(f"task.summarize returned no {unit!r} (it returned {', '.join(sorted(results))}): the "
                         f"count of held-out {unit}, logged beside the metrics; add {unit!r}: sums[{unit!r}] to "
                         "the dict summarize returns in task.py")
    return results


def evaluation_due(options, progress, epoch_ended: bool, finished: bool) -> str:
    """What an evaluation after this step (or this epoch's end) closes, or "" where none is due: "interval" every
    --eval-every-steps steps; else "epoch" every --eval-every epochs; where the run ends closing neither, "stop"
    at --stop-at-step, else "run": logged, but not judged by --keep-best and early stopping."""
    by_steps, by_epochs = options.eval_every_steps, options.eval_every
    on_interval = by_steps and progress.step % by_steps == 0  # at an epoch's end: evaluated after its last step
    if on_interval and not epoch_ended:
        return "interval"
    if by_epochs and not by_steps and epoch_ended and (progress.epoch % by_epochs == 0 or finished):
        return "epoch"
    if not finished or not (by_steps or by_epochs) or on_interval:
        return ""
    return "stop" if options.stop_at_step is not None and progress.step >= options.stop_at_step else "run"


def is_count(value) -> bool:
    """An int, or an integer tensor of one element (a count of samples, tokens, correct answers)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_floating_point() and not value.is_complex()
    return isinstance(value, int)


def shapes_of(values: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(value.shape) for name, value in values.items()}


def sum_across_ranks(totals: dict[str, torch.Tensor] | None, device: torch.device, unit: str,
                     problem: str | None = None) -> dict:
    """Each named total summed over ranks, in one all-reduce (a collective); a one-element total comes back as
    a float, others as CPU tensors. Every rank joins, also one without held-out batches (totals None), so all
    take the names and shapes of the lowest rank that has them. Sums whose names or shapes differ between
    batches or ranks (a bincount without minlength) stop every rank with one line: added up, they would
    broadcast into wrong numbers, or leave ranks in all-reduces of different lengths."""
    shapes = from_first_rank_with(None if totals is None else shapes_of(totals), device)
    if problem is None and totals is not None and shapes_of(totals) != shapes:
        problem = f"task.evaluation_sums returned {shapes_of(totals)} on one rank and {shapes} on another"
    problem = from_first_rank_with(problem, device)  # a collective: every rank stops, or none
    if problem:
        raise UsageError(f"{problem}; every sum must have the same names and shapes on every batch and rank "
                         "(e.g. torch.bincount(..., minlength=classes))")
    shapes = shapes or {unit: ()}
    if totals is None:
        totals = {name: torch.zeros(shape, device=device, dtype=torch.float64) for name, shape in shapes.items()}
    flat = all_reduce(torch.cat([totals[name].flatten() for name in shapes]), "sum")
    sums, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape)
        value = flat[offset:offset + size].reshape(shape).cpu()
        sums[name], offset = value.item() if size == 1 else value, offset + size
    return sums


class Learned:
    """What the run learns from its evaluations (Task.after_evaluation's dict), the same on every rank and saved
    with every checkpoint. Its "lr_scale" multiplies the lr schedule and its "data_stage" reaches the training set,
    both from the next step; the rest is the rule's own memory (the best loss so far)."""

    def __init__(self, rule: Callable[[dict, dict, str, object], dict], lr_schedule, loader):
        self.rule, self.lr_schedule, self.loader = rule, lr_schedule, loader
        self.values: dict = {}

    def after(self, results: dict, closes: str, options, step: int) -> None:
        values = self.rule(dict(self.values), results, closes, options)
        try:
            json.dumps(values)
        except (TypeError, ValueError):
            raise UsageError(f"Task.after_evaluation returned {values!r}: a dict of plain values (numbers, strings, "
                             "lists and dicts of them), which checkpoints save as they are") from None
        every_rank = all_gather_objects(values)  # one rank's decision would train another run on each
        for name in sorted(set().union(*every_rank)):
            if len(ranks := {repr(each.get(name)): None for each in every_rank}) > 1:
                raise UsageError(f"Task.after_evaluation returned other values of {name!r} on the ranks "
                                 f"({', '.join(list(ranks)[:4])}); decide from the evaluation results it is given, "
                                 "the same on every rank, not from a rank's own loss, data or generator")
        acting = {"lr_scale": 1.0, "data_stage": 0}  # the keys that act, and their values before any is returned
        changed = {name: value for name, value in values.items()
                   if name in acting and value != self.values.get(name, acting[name])}
        if changed:
            log.info("step %d: %s from the next step on (Task.after_evaluation)", step,
                     ", ".join(f"{name} {value!r}" for name, value in changed.items()))
        self.values = values
        self.apply()

    def apply(self) -> None:
        self.lr_schedule.scale = float(self.values.get("lr_scale", 1.0))
        if "data_stage" in self.values or getattr(self.loader, "stage", None) is not None:
            if not hasattr(self.loader, "set_stage"):
                raise UsageError("Task.after_evaluation returned a data_stage, which reaches a training set that "
                                 "train.py samples (not Task.batches' batches, not a stream)")
            self.loader.set_stage(self.values.get("data_stage", 0))  # (0 where the rule returns none)

    def state_dict(self) -> dict:
        # One string: a DCP folder (FSDP2) would save a dict key by key and load only the keys a fresh one has.
        return {"values": json.dumps(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values = json.loads(state["values"])
        self.apply()
