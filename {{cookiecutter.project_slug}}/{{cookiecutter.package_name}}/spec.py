"""`Task`: everything the package calls from task.py, as one spec that task.py builds at its end
(`TASK = Task(...)`), in the manner of torchtitan's TrainSpec. Python checks the call: a hook missing or
misspelled is a TypeError at import that names it. The fields after `smoke_test_args` are optional, with the
defaults below; of compute_loss and training_step, one is given. Also here: the check of the --data and
--model names against the spec's tables, and the model's frozen modules that checkpoints leave out."""

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

    options: type  # a dataclass of the task's flags, read as options.task.<name>
    datasets: dict[str, DatasetBuilder]  # --data name -> builder of (train, held-out) datasets
    models: dict[str, ModelBuilder]  # --model name -> builder
    build_optimizer: Callable[[nn.Module, TrainOptions], torch.optim.Optimizer | dict[str, torch.optim.Optimizer]]
    # (model, batch, step) -> the mean loss, minimised; None with a training_step (below). `model` is wrapped
    # (DDP, FSDP2, torch.compile); `step` (step.py's Step): its number, the options, the plain model.
    compute_loss: Callable[[nn.Module, Any, Any], torch.Tensor] | None = None
    evaluation_sums: Callable[[nn.Module, Any], dict[str, Any]]  # (model, batch) -> sums over the batch
    summarize: Callable[[dict[str, Any], dict[str, torch.Tensor]], dict[str, float]]  # sums -> logged metrics
    smoke_test_args: list[str]  # the tiny run tests/ trains: keep it quick and learnable
    # Optional:
    throughput_unit: str = "samples"  # logged as <unit>/s, and the held-out count as "on N held-out <unit>"
    # Throughput units in a batch, e.g. tokens. None: the length of its first tensor (a guess, said once,
    # unless the batch is (inputs, targets)).
    units_in_batch: Callable[[Any], int | torch.Tensor] | None = None
    collate: Callable[[list], Any] = default_collate  # samples -> a batch (any nesting of tensors)
    # Per-sample rows (each tensor's first dimension) gathered from every rank for summarize(sums, outputs):
    # metrics over the whole held-out set (AUC, retrieval). None: summarize gets {}.
    evaluation_outputs: Callable[[nn.Module, Any], dict[str, torch.Tensor]] | None = None
    model_flops_per_unit: Callable[[nn.Module, TrainOptions], float | None] = lambda model, options: None
    # Refuse values (raise UsageError) on every rank before any process group starts; the world size a check may
    # need (a queue of keys that every rank's batch must divide) is int(os.environ.get("WORLD_SIZE", "1")).
    check_options: Callable[[TrainOptions], None] = lambda options: None
    # --data name -> a download into options.task.data_dir, run before that dataset is built on one rank per
    # storage while the others wait: nodes sharing a network folder download once, nodes with local disks each
    # their own, and a failure stops every rank with its line.
    prepare_data: dict[str, Callable[[TrainOptions], None]] = field(default_factory=dict)
    # More --model names, built only when a name is not in `models`: a family whose import is slow
    # (torchvision's, about as long as torch's) costs nothing to a run that does not use it.
    more_models: Callable[[], dict[str, ModelBuilder]] | None = None
    training_defaults: dict[str, Any] = field(default_factory=dict)  # training options' defaults, e.g. {"lr": 3e-4}
    # A task that steps its optimizers itself (two networks stepped in turn, each on its own loss):
    # training_step(step, batches) takes the place of compute_loss and of train.py's backward and optimizer step,
    # once per optimizer step with its --grad-accum micro-batches; `step` (step.py's Step) gives the networks
    # and optimizers and keeps what train.py's own step does (accumulation, mixed precision, clipping). It
    # returns the loss to log. The model's top-level modules are then wrapped (DDP, FSDP2) one by one.
    training_step: Callable[[Any, list], torch.Tensor] | None = None
    # State the task keeps beside the model, updated after each optimizer step (an EMA of the weights, a queue of
    # keys): state(model, options) -> {name: anything with state_dict()/load_state_dict()}, built after wrapping
    # (under FSDP2 from the sharded parameters) and saved and restored with every checkpoint, under its name;
    # read as step.state[name]. An entry is the same on every rank (each save checks it), or each rank's own:
    # PerRank(value, resplit) (engine/task_state.py). after_step(step) runs on every rank after each step.
    state: Callable[[nn.Module, TrainOptions], dict[str, Any]] | None = None
    after_step: Callable[[Any], None] = lambda step: None
    # The state entry whose swapped_into(model) context holds the weights every evaluation uses, the run's last
    # included, and whose state_dict the export (export.py) writes over the model's (an EMA's averages; step.py's
    # ExponentialMovingAverage has both). None: the trained weights.
    evaluate_with: str | None = None
    # What the export (export.py) writes, made from the weights it read (the model's, or evaluate_with's over
    # them) and the run's task options: LoRA adapters merged into their base, say. None: those weights as they are.
    export_weights: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]] | None = None
    # Work one rank does alone every N optimizer steps (sample images, a figure, an upload): (N, work), N a number
    # or the name of a TaskOptions field (a flag). After steps N, 2N, ... work(step, generator) runs on rank 0 while
    # every other rank waits for it, in a phase the watchdog allows --io-timeout, left out of the logged throughput.
    # Its random draws come from `generator` (seeded from --seed and the step), and torch's own generators are put
    # back as they were after it: nothing it draws changes the training run. step.model holds the weights evaluation
    # uses (evaluate_with's: the EMA), in eval mode, without gradients, under the run's autocast; run it, not
    # step.networks (which may be compiled). Under FSDP2 rank 0 gathers the whole model first (its memory, for the
    # work's length), so that it can run it alone; its state_dict() would reshard it there, on rank 0 alone.
    rank_0_work: tuple[int | str, Callable[[Any, torch.Generator], None]] | None = None
    # The task's own batches (length buckets, a token budget: any number of samples each). batches(dataset,
    # options, epoch) -> the epoch's batches, each a list of sample indices, the same list on every rank (draw
    # from options.seed and epoch; --batch-size is then unused). Ranks take them in turn, --grad-accum each a
    # step; samples seen and the lr schedule count what they hold; the held-out set's (epoch 0's) too. Batches
    # in order, each rank its own contiguous part (streams carried across steps): a 4th parameter, world_size,
    # is given it; global batch j goes to rank j % world_size. A resize in mid-epoch is then refused, naming the
    # world size to resume on (the epoch's batches differ); at an epoch's start it goes on with the new batches.
    batches: Callable[..., list[list[int]]] | None = None
    # What the run learns from its evaluations: after_evaluation(learned, results, closes, options) -> learned, a
    # dict of plain values ({} at the start), called on every rank after each evaluation with summarize's results
    # (the same on every rank: decide from them and `learned` alone) and what it closes: "interval", "epoch", or
    # "run" (its end in mid-interval; a --stop-at-step pause's is not given). Saved with checkpoints (plain values
    # only). Two keys act from the next step: "lr_scale" multiplies the lr schedule (reduce on plateau),
    # "data_stage" reaches the training set's set_stage(stage) with each sample, in the process that loads it (a
    # curriculum; not with Task.batches).
    after_evaluation: Callable[[dict, dict, str, TrainOptions], dict] | None = None
    # A step may leave some trained parameters without a gradient (a mixture of experts whose router sends no
    # token to an expert, a branch taken on some steps): DDP then looks for them after every forward, a little
    # slower (find_unused_parameters). Without it such a step stops the job at the replica check, naming them.
    find_unused_parameters: bool = False
    # Whether the loss couples the samples of a batch (an in-batch contrastive loss, BatchNorm, which is found
    # without it): "micro_batch", each rank's micro-batch alone; "global_batch", every rank's through an
    # all_gather. Then --grad-accum is no larger batch, and a resize that changes the coupled batch says so;
    # with keep_coupled_batch it stops instead, naming the --batch-size that keeps it.
    loss_couples: str | None = None
    keep_coupled_batch: bool = False
    # What tests/ ask of the tiny run: (steps, ratio): after this many steps the mean loss of the last five is
    # below ratio x that of the first five; or (steps, metric, ">" or "<", bound): the run's last evaluation has
    # summarize's `metric` above or below `bound` (for a loss that need not fall). None: no learning check.
    smoke_test_learning: tuple | None = (30, 0.7)
    # Files the tiny run needs, made by tests/ themselves (a tiny base model, for a task that starts from one):
    # smoke_test_files(folder) writes them into `folder` and returns the flags that name them.
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
