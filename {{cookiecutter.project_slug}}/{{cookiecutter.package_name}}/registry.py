"""The machinery task.py plugs into: the --data and --model registries and the checks on their names, and
`Task`, everything the package calls, bound from task.py with defaults for the hooks it leaves out."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from .data import tensors_in
from .distributed import DistEnv
from .options import TrainOptions, UsageError

DatasetBuilder = Callable[[TrainOptions, DistEnv, torch.device], tuple[Dataset, Dataset]]
ModelBuilder = Callable[[TrainOptions, Dataset], nn.Module]
DATASETS: dict[str, DatasetBuilder] = {}  # --data name -> builder of (train, held-out)
MODELS: dict[str, ModelBuilder] = {}  # --model name -> builder
# Builders of more MODELS entries, called only for a --model name not registered: a family whose import is
# slow (torchvision's, about as long as torch's) costs nothing to a run that does not use it.
MODEL_FAMILIES: list[Callable[[], dict[str, ModelBuilder]]] = []


def register_dataset(name: str) -> Callable[[DatasetBuilder], DatasetBuilder]:
    """Register a builder of (train, held-out) datasets under a --data name."""
    def register(builder: DatasetBuilder) -> DatasetBuilder:
        DATASETS[name] = builder
        return builder
    return register


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Register a model builder under a --model name; it sees the options and the training set."""
    def register(builder: ModelBuilder) -> ModelBuilder:
        MODELS[name] = builder
        return builder
    return register


def register_model_family(family: Callable[[], dict[str, ModelBuilder]]) -> Callable[[], dict[str, ModelBuilder]]:
    """Register a function that returns more --model names and builders, called when a name is not found."""
    MODEL_FAMILIES.append(family)
    return family


def find_model(name: str) -> ModelBuilder | None:
    while name not in MODELS and MODEL_FAMILIES:
        for family_name, builder in MODEL_FAMILIES.pop(0)().items():
            MODELS.setdefault(family_name, builder)  # a model registered by name comes first
    return MODELS.get(name)


def samples_in(batch: Any) -> int:
    """The default unit count of a batch: the length of its first tensor, in any nesting (tuple, dict,
    dataclass)."""
    first = next(tensors_in(batch), None)
    return first.shape[0] if first is not None and first.dim() else 1


# task.py must define these; the rest of Task's fields are optional hooks with the defaults below.
REQUIRED = ("TaskOptions", "THROUGHPUT_UNIT", "build_optimizer", "compute_loss", "evaluation_sums", "summarize")


@dataclass(frozen=True)
class Task:
    """What the package calls. Required, from task.py: TaskOptions (a dataclass of the task's flags),
    THROUGHPUT_UNIT, build_optimizer(model, options), compute_loss(model, batch) -> the mean loss,
    evaluation_sums(model, batch) -> sums over the batch, summarize(sums, outputs) -> the logged metrics."""

    module: str  # for messages: where to register a name
    options_class: type
    throughput_unit: str
    build_optimizer: Callable[[nn.Module, TrainOptions], torch.optim.Optimizer]
    compute_loss: Callable[[nn.Module, Any], torch.Tensor]
    evaluation_sums: Callable[[nn.Module, Any], dict[str, Any]]
    summarize: Callable[[dict[str, Any], dict[str, torch.Tensor]], dict[str, float]]
    # Optional hooks, each replaceable by a function of that name in task.py:
    collate: Callable[[list], Any] = default_collate  # samples -> a batch (any nesting of tensors)
    # Per-sample rows (each tensor's first dimension) gathered from every rank for summarize(sums, outputs):
    # metrics over the whole held-out set (AUC, retrieval). None: summarize gets {}.
    evaluation_outputs: Callable[[nn.Module, Any], dict[str, torch.Tensor]] | None = None
    units_in_batch: Callable[[Any], int | torch.Tensor] = samples_in  # THROUGHPUT_UNITs in a batch, e.g. tokens
    model_flops_per_unit: Callable[[nn.Module, TrainOptions], float | None] = lambda model, options: None
    check_options: Callable[[TrainOptions], None] = lambda options: None  # refuse values before any process group
    training_defaults: dict[str, Any] = field(default_factory=dict)  # TRAINING_DEFAULTS: e.g. {"lr": 3e-4}

    @classmethod
    def from_module(cls, module: ModuleType) -> Task:
        missing = [name for name in REQUIRED if not hasattr(module, name)]
        if missing:
            raise UsageError(f"{module.__file__}: define {', '.join(missing)} (see the README's Make it yours)")
        optional = {name: getattr(module, name) for name in
                    ("collate", "evaluation_outputs", "units_in_batch", "model_flops_per_unit", "check_options")
                    if hasattr(module, name)}
        return cls(module=module.__name__, options_class=module.TaskOptions, throughput_unit=module.THROUGHPUT_UNIT,
                   build_optimizer=module.build_optimizer, compute_loss=module.compute_loss,
                   evaluation_sums=module.evaluation_sums, summarize=module.summarize,
                   training_defaults=getattr(module, "TRAINING_DEFAULTS", {}), **optional)

    def check(self, options: TrainOptions) -> None:
        """Refuse a --data or --model name nothing is registered under, then what task.py refuses."""
        if options.task.data not in DATASETS:
            raise UsageError(self.unknown_name("data", options.task.data, DATASETS, "register_dataset"))
        if find_model(options.task.model) is None:
            raise UsageError(self.unknown_name("model", options.task.model, MODELS, "register_model"))
        self.check_options(options)

    def build_datasets(self, options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
        return DATASETS[options.task.data](options, env, device)

    def build_model(self, options: TrainOptions, train_set: Dataset) -> nn.Module:
        return find_model(options.task.model)(options, train_set)

    def unknown_name(self, kind: str, name: str, registry: dict, decorator: str) -> str:
        close = difflib.get_close_matches(name, list(registry), n=3)
        known = sorted(registry)
        hint = (f"did you mean {', '.join(close)}?" if close
                else f"known: {', '.join(known[:8])}{', ...' if len(known) > 8 else ''}.")
        return (f"--{kind} {name!r} is not registered; {hint} To add it, register a builder with "
                f"@{decorator}({name!r}) in {self.module.replace('.', '/')}.py")
