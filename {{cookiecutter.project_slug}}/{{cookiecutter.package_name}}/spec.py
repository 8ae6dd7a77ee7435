"""`Task`: everything the package calls from task.py, as one spec that task.py builds at its end
(`TASK = Task(...)`), in the manner of torchtitan's TrainSpec. Python checks the call: a hook missing or
misspelled is a TypeError at import that names it. The fields after `summarize` are optional, with the
defaults below. Also here: the check of the --data and --model names against the spec's tables."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from .collectives import run_once_per_storage
from .data import tensors_in
from .distributed import DistEnv
from .errors import UsageError
from .options import TrainOptions

DatasetBuilder = Callable[[TrainOptions], tuple[Dataset, Dataset]]  # options -> (train, held-out)
ModelBuilder = Callable[[TrainOptions, Dataset], nn.Module]  # options, the training set -> a model


def samples_in(batch: Any) -> int:
    """The default unit count of a batch: the length of its first tensor, in any nesting (tuple, dict,
    dataclass)."""
    first = next(tensors_in(batch), None)
    return first.shape[0] if first is not None and first.dim() else 1


@dataclass(frozen=True, kw_only=True)
class Task:
    """What the package calls, each by keyword. A batch is whatever `collate` makes of a list of samples."""

    options: type  # a dataclass of the task's flags, read as options.task.<name>
    datasets: dict[str, DatasetBuilder]  # --data name -> builder of (train, held-out) datasets
    models: dict[str, ModelBuilder]  # --model name -> builder
    build_optimizer: Callable[[nn.Module, TrainOptions], torch.optim.Optimizer | dict[str, torch.optim.Optimizer]]
    compute_loss: Callable[[nn.Module, Any], torch.Tensor]  # (model, batch) -> the mean loss, minimised
    evaluation_sums: Callable[[nn.Module, Any], dict[str, Any]]  # (model, batch) -> sums over the batch
    summarize: Callable[[dict[str, Any], dict[str, torch.Tensor]], dict[str, float]]  # sums -> logged metrics
    smoke_test_args: list[str]  # the tiny run tests/ trains: keep it quick and learnable
    # Optional:
    throughput_unit: str = "samples"  # logged as <unit>/s, and the held-out count as "on N held-out <unit>"
    units_in_batch: Callable[[Any], int | torch.Tensor] = samples_in  # throughput units in a batch, e.g. tokens
    collate: Callable[[list], Any] = default_collate  # samples -> a batch (any nesting of tensors)
    # Per-sample rows (each tensor's first dimension) gathered from every rank for summarize(sums, outputs):
    # metrics over the whole held-out set (AUC, retrieval). None: summarize gets {}.
    evaluation_outputs: Callable[[nn.Module, Any], dict[str, torch.Tensor]] | None = None
    model_flops_per_unit: Callable[[nn.Module, TrainOptions], float | None] = lambda model, options: None
    check_options: Callable[[TrainOptions], None] = lambda options: None  # refuse values before any process group
    # --data name -> a download into options.task.data_dir, run before that dataset is built on one rank per
    # storage while the others wait: nodes sharing a network folder download once, nodes with local disks each
    # their own, and a failure stops every rank with its line.
    prepare_data: dict[str, Callable[[TrainOptions], None]] = field(default_factory=dict)
    # More --model names, built only when a name is not in `models`: a family whose import is slow
    # (torchvision's, about as long as torch's) costs nothing to a run that does not use it.
    more_models: Callable[[], dict[str, ModelBuilder]] | None = None
    training_defaults: dict[str, Any] = field(default_factory=dict)  # training options' defaults, e.g. {"lr": 3e-4}

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.options):
            raise TypeError(f"Task(options=...) must be a dataclass of the task's flags, got {self.options!r}")
        if self.prepare_data and "data_dir" not in {f.name for f in dataclasses.fields(self.options)}:
            raise TypeError(f"Task(prepare_data=...) downloads into options.task.data_dir: give "
                            f"{self.options.__name__} a data_dir field")
        if not set(self.prepare_data) <= set(self.datasets):
            unknown = sorted(set(self.prepare_data) - set(self.datasets))
            raise TypeError(f"Task(prepare_data=...) names {unknown}, which are not in datasets")

    def check(self, options: TrainOptions) -> None:
        """Refuse a --data or --model name the spec has no builder for, then what the task refuses."""
        if options.task.data not in self.datasets:
            raise UsageError(self.unknown_name("data", options.task.data, self.datasets))
        if self.model_builder(options.task.model) is None:
            every_model = {**(self.more_models() if self.more_models else {}), **self.models}
            raise UsageError(self.unknown_name("model", options.task.model, every_model))
        self.check_options(options)

    def build_datasets(self, options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
        prepare = self.prepare_data.get(options.task.data)
        if prepare is not None:
            run_once_per_storage(options.task.data_dir, env, device, lambda: prepare(options),
                                 what=f"preparing --data {options.task.data} in {options.task.data_dir}")
        return self.datasets[options.task.data](options)

    def build_model(self, options: TrainOptions, train_set: Dataset | None) -> nn.Module:
        return self.model_builder(options.task.model)(options, train_set)

    def model_builder(self, name: str) -> ModelBuilder | None:
        if name not in self.models and self.more_models is not None:
            return self.more_models().get(name)
        return self.models.get(name)

    def unknown_name(self, kind: str, name: str, builders: dict) -> str:
        close = difflib.get_close_matches(name, list(builders), n=3)
        known = sorted(builders, key=lambda known_name: (known_name not in self.models, known_name))  # ours first
        hint = (f"did you mean {', '.join(close)}?" if close
                else f"known: {', '.join(known[:8])}{', ...' if len(known) > 8 else ''}.")
        table = "datasets" if kind == "data" else "models"
        return (f"--{kind} {name!r} is not in the task's {table}; {hint} To add it, write a builder and add "
                f"{name!r}: <builder> to TASK's {table} in {self.options.__module__.replace('.', '/')}.py")
