"""`Task`: the contract between task.py and the package, one keyword per field, that task.py builds at its end
(`TASK = Task(...)`), in the manner of torchtitan's TrainSpec. Python checks the call: a field missing or
misspelled is a TypeError at import that names it. The fields come in groups: what every task gives, then
what it may give, with the defaults that hold without it. What the package does with them is engine/tasks.py's."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from .options import TrainOptions

DatasetBuilder = Callable[[TrainOptions], tuple[Dataset, Dataset]]  # options -> (train, held-out)
ModelBuilder = Callable[[TrainOptions, Dataset], nn.Module]  # options, the training set -> a model


@dataclass(frozen=True, kw_only=True)
class Task:
    """What the package calls, each by keyword. A batch is whatever `collate` makes of a list of samples."""

    # ---- required ------------------------------------------------------------------------------------------
    options: type  # a dataclass of the task's flags, read as options.task.<name>
    datasets: dict[str, DatasetBuilder]  # --data name -> builder of (train, held-out) datasets
    models: dict[str, ModelBuilder]  # --model name -> builder
    build_optimizer: Callable[[nn.Module, TrainOptions], torch.optim.Optimizer | dict[str, torch.optim.Optimizer]]
    evaluation_sums: Callable[[nn.Module, Any], dict[str, Any]]  # (model, batch) -> sums over the batch
    summarize: Callable[[dict[str, Any], dict[str, torch.Tensor]], dict[str, float]]  # sums -> logged metrics
    smoke_test_args: list[str]  # the tiny run tests/ trains: keep it quick and learnable

    # ---- the step: compute_loss or training_step, one of the two ---------------------------------------------
    # compute_loss(model, batch, step) -> the mean loss, minimised; `model` is wrapped (DDP, FSDP2, compile),
    # `step` is step.py's Step (its number, the options, the plain model, log()).
    compute_loss: Callable[[nn.Module, Any, Any], torch.Tensor] | None = None
    # training_step(step, batches) -> the loss to log: a task that steps its optimizers itself (networks stepped
    # in turn), through step.backward and step.update; the model's top-level modules are then wrapped one by one.
    training_step: Callable[[Any, list], torch.Tensor] | None = None
    # A loss that couples a batch's samples (in-batch contrastive): "micro_batch" or "global_batch" (all ranks'
    # through an all_gather); --grad-accum and resizes then say what they change, keep_coupled_batch refuses them.
    loss_couples: str | None = None
    keep_coupled_batch: bool = False
    # A step may leave trained parameters without a gradient (an expert no sample reached): DDP then looks for them
    # after every forward (find_unused_parameters); without it such a step stops the job, naming them.
    find_unused_parameters: bool = False

    # ---- data ----------------------------------------------------------------------------------------------
    collate: Callable[[list], Any] = default_collate  # samples -> a batch (any nesting of tensors)
    # batches(dataset, options, epoch[, world_size]) -> the epoch's batches of sample indices, alike on every rank
    # (length buckets, a token budget); with world_size, each rank takes its own contiguous part (streams in order).
    batches: Callable[..., list[list[int]]] | None = None
    # --data name -> a download into options.task.data_dir, run on one rank per storage while the others wait.
    prepare_data: dict[str, Callable[[TrainOptions], None]] = field(default_factory=dict)
    throughput_unit: str = "samples"  # logged as <unit>/s, and the held-out count as "on N held-out <unit>"
    # Throughput units in a batch (tokens without padding: a mask's sum). None: the length of its first tensor,
    # said once to be a guess unless the batch is (inputs, targets).
    units_in_batch: Callable[[Any], int | torch.Tensor] | None = None

    # ---- evaluation ----------------------------------------------------------------------------------------
    # Per-sample rows gathered from every rank for summarize(sums, outputs): metrics over the whole held-out set
    # (AUC, retrieval). None: summarize gets {}.
    evaluation_outputs: Callable[[nn.Module, Any], dict[str, torch.Tensor]] | None = None
    # after_evaluation(learned, results, closes, options) -> learned, a dict of plain values saved in checkpoints,
    # on every rank after each evaluation ("interval", "epoch" or "run" it closes); its "lr_scale" multiplies the
    # lr schedule (reduce on plateau), its "data_stage" reaches the training set's set_stage (a curriculum).
    after_evaluation: Callable[[dict, dict, str, TrainOptions], dict] | None = None
    # The state entry whose swapped_into(model) holds the weights every evaluation (and the export) uses: an EMA.
    evaluate_with: str | None = None

    # ---- state kept across steps ---------------------------------------------------------------------------
    # state(model, options) -> {name: anything with state_dict()/load_state_dict()}, built after wrapping, saved
    # with every checkpoint, read as step.state[name]; alike on every rank (each save checks it) or each rank's
    # own, PerRank(value, resplit) (engine/task_state.py).
    state: Callable[[nn.Module, TrainOptions], dict[str, Any]] | None = None
    after_step: Callable[[Any], None] = lambda step: None  # after each optimizer step, on every rank
    # (N, work): work(step, generator) on rank 0 after every N steps (N a number or a TaskOptions field's name),
    # the others waiting; with evaluate_with's weights, in eval mode, its draws changing nothing of the run.
    rank_0_work: tuple[int | str, Callable[[Any, torch.Generator], None]] | None = None

    # ---- declarations --------------------------------------------------------------------------------------
    training_defaults: dict[str, Any] = field(default_factory=dict)  # training options' defaults, e.g. {"lr": 3e-4}
    # Refuse values (raise UsageError) before any process group starts; the world size is os.environ's WORLD_SIZE.
    check_options: Callable[[TrainOptions], None] = lambda options: None
    model_flops_per_unit: Callable[[nn.Module, TrainOptions], float | None] = lambda model, options: None
    # More --model names, built only when a name is not in `models` (a family whose import is slow).
    more_models: Callable[[], dict[str, ModelBuilder]] | None = None
    # What the export writes from the weights it read and the task options (LoRA merged into its base).
    export_weights: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]] | None = None

    # ---- tests ---------------------------------------------------------------------------------------------
    # (steps, ratio): the mean loss of the last five of `steps` is below ratio x the first five's; or (steps,
    # metric, ">" or "<", bound) on the last evaluation. None: no learning check.
    smoke_test_learning: tuple | None = (30, 0.7)
    # smoke_test_files(folder) writes files the tiny run needs (a tiny base model) and returns the flags naming them.
    smoke_test_files: Callable[[Path], list[str]] | None = None

    def __post_init__(self) -> None:
        if (self.compute_loss is None) == (self.training_step is None):
            raise TypeError("Task(...) takes compute_loss (train.py steps every optimizer) or training_step (the "
                            "task steps them itself): one of the two")
        if self.compute_loss is not None and not takes_three_arguments(self.compute_loss):
            raise TypeError(f"Task(compute_loss=...) is called as compute_loss(model, batch, step); give "
                            f"{getattr(self.compute_loss, '__name__', 'it')} a third parameter, step (step.py's Step)")
        if not dataclasses.is_dataclass(self.options):
            raise TypeError(f"Task(options=...) must be a dataclass of the task's flags, got {self.options!r}")
        if self.prepare_data and "data_dir" not in {f.name for f in dataclasses.fields(self.options)}:
            raise TypeError(f"Task(prepare_data=...) downloads into options.task.data_dir: give "
                            f"{self.options.__name__} a data_dir field")
        learning = self.smoke_test_learning
        if learning is not None and not (isinstance(learning, tuple) and (
                len(learning) == 2 or len(learning) == 4 and learning[2] in (">", "<"))):
            raise TypeError(f"Task(smoke_test_learning={learning!r}): (steps, ratio), (steps, metric, '>' or '<', "
                            "bound) or None")
        if self.loss_couples not in (None, "micro_batch", "global_batch"):
            raise TypeError(f"Task(loss_couples={self.loss_couples!r}): None, 'micro_batch' or 'global_batch'")
        if self.evaluate_with is not None and self.state is None:
            raise TypeError(f"Task(evaluate_with={self.evaluate_with!r}) names an entry of Task(state=...), which "
                            "is not given")
        every = self.rank_0_work[0] if isinstance(self.rank_0_work, tuple) and len(self.rank_0_work) == 2 else None
        if self.rank_0_work is not None and not (isinstance(every, str) or isinstance(every, int) and every >= 1):
            raise TypeError(f"Task(rank_0_work=...) is (every N steps, work), N >= 1 or the name of a TaskOptions "
                            f"field; got {self.rank_0_work!r}")
        if not set(self.prepare_data) <= set(self.datasets):
            unknown = sorted(set(self.prepare_data) - set(self.datasets))
            raise TypeError(f"Task(prepare_data=...) names {unknown}, which are not in datasets")


def takes_three_arguments(function: Callable) -> bool:
    """Whether function(model, batch, step) binds: a compute_loss written for two arguments fails here, at
    import, with what to change, not at the first step."""
    try:
        inspect.signature(function).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the call decide
        pass
    return True
