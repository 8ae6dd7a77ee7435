"""What the package does with a task's spec (spec.py's Task): the --data and --model names checked against its
tables, its datasets, model and state built and checked, the weights evaluation uses, and the work rank 0 does
alone; also how the units of a batch are counted when the task does not say."""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .checkpoint.weights import checkpoint_at, load_checkpoint
from .cli import recorded_options
from .collectives import barrier, run_once_per_storage
from .data import tensors_in
from .distributed import DistEnv
from .errors import UsageError
from .flags import flag
from .parallel import whole_model
from .task_state import LeftOutWeights, PerRank

if TYPE_CHECKING:  # for annotations only: the engine imports nothing around it
    from ..options import TrainOptions
    from ..spec import ModelBuilder, Task

log = logging.getLogger(__name__)


def samples_in(batch: Any) -> int:
    """The default unit count of a batch: the length of its first tensor, in any nesting (tuple, dict,
    dataclass). A guess unless the batch is a tuple of tensors (inputs, targets): said once."""
    first = next(tensors_in(batch), None)
    count = first.shape[0] if first is not None and first.dim() else 1
    if not (isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor)):
        say_samples_are_guessed(type(batch).__name__, count)
    return count


def units_in(task: Task, batch: Any) -> int | torch.Tensor:
    """Throughput units in a batch: the task's units_in_batch, else samples_in."""
    return (task.units_in_batch or samples_in)(batch)


@functools.cache
def say_samples_are_guessed(kind: str, count: int) -> None:
    log.warning("throughput counts %d samples in a batch (a %s): the length of its first tensor. If that is not how "
                "many samples it holds (a flat tensor of packed tokens, a per-token first entry), give TASK "
                "units_in_batch(batch), and throughput_unit to count tokens", count, kind)


def check_task_options(task: Task, options: TrainOptions) -> None:
    """Refuse a --data or --model name the spec has no builder for, then what the task refuses."""
    if options.task.data not in task.datasets:
        raise UsageError(unknown_name(task, "data", options.task.data, task.datasets))
    if model_builder(task, options.task.model) is None:
        every_model = {**(task.more_models() if task.more_models else {}), **task.models}
        raise UsageError(unknown_name(task, "model", options.task.model, every_model))
    every = work_every(task, options)  # a number Task() checked, or what the TaskOptions field it names holds
    if isinstance(every, int) and every < 0:  # the user's flag
        raise UsageError(f"--{flag(task.rank_0_work[0])} must be >= 0 (0: never), got {every}")
    if not isinstance(every, int):
        raise UsageError(f"Task(rank_0_work=({task.rank_0_work[0]!r}, ...)) names a TaskOptions field for its "
                         f"steps; it holds {every!r}: give it an int option, >= 1 (0: never)")
    task.check_options(options)


def work_every(task: Task, options: TrainOptions) -> int:
    """After how many optimizer steps rank_0_work's work runs again; 0: never."""
    if task.rank_0_work is None:
        return 0
    every = task.rank_0_work[0]
    return getattr(options.task, every, None) if isinstance(every, str) else every


def build_datasets(task: Task, options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    prepare = task.prepare_data.get(options.task.data)
    if prepare is not None:
        run_once_per_storage(options.task.data_dir, env, device, lambda: prepare(options),
                             what=f"preparing --data {options.task.data} in {options.task.data_dir}")
    return task.datasets[options.task.data](options)


def build_state(task: Task, model: nn.Module, options: TrainOptions, taken: set[str]) -> dict[str, Any]:
    """The task's state (Task.state), checked: every entry saveable, none named like one of `taken` (the
    checkpoint entries train.py saves), and the one evaluate_with names among them."""
    state = task.state(model, options) if task.state is not None else {}
    for name, value in state.items():
        if name in taken:
            raise UsageError(f"task.py: Task(state=...) names an entry {name!r}, which train.py saves already; "
                             "rename it")
        if not (hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
            raise UsageError(f"task.py: Task(state=...)[{name!r}] is a {type(value).__name__}, which a "
                             "checkpoint cannot hold; give it state_dict() and load_state_dict()")
        if isinstance(value, PerRank):
            value.name = name
    if getattr(model, "left_out_of_checkpoints", ()):  # saved in their place: a fingerprint of them
        state[LeftOutWeights.NAME] = LeftOutWeights(model, options.checkpoint.resume_changed_state)
    if task.evaluate_with is not None and not hasattr(state.get(task.evaluate_with), "swapped_into"):
        raise UsageError(f"task.py: Task(evaluate_with={task.evaluate_with!r}) needs an entry of that name in "
                         "Task(state=...) with swapped_into(model)")
    return state


def evaluation_weights(task: Task, model: nn.Module, state: dict[str, Any]) -> contextlib.AbstractContextManager:
    """The weights evaluation runs with: the state entry evaluate_with names, swapped into the model."""
    if task.evaluate_with is None:
        return contextlib.nullcontext(model)
    return state[task.evaluate_with].swapped_into(model)


def work_alone(task: Task, step: Any, env: DistEnv, device: torch.device) -> None:
    """Task.rank_0_work's work after step.number: on rank 0, with a generator of its own, the model with the
    evaluation's weights in eval mode, without gradients, under the run's autocast, then torch's generators and
    the modules' modes restored, while the other ranks wait for it in a barrier. Every rank swaps the weights in
    (an EMA's shards, under FSDP2), then gathers an FSDP2 model whole for rank 0."""
    modes = [(module, module.training) for module in step.model.modules()]
    with evaluation_weights(task, step.model, step.state), whole_model(step.model, keep=env.rank == 0):
        if env.rank == 0:
            try:
                step.model.eval()  # no dropout, and no BatchNorm statistics that rank 0 alone would update
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                        torch.no_grad(), step.amp.autocast():
                    task.rank_0_work[1](step, torch.Generator().manual_seed(step.options.seed + step.number))
            finally:
                for module, training in modes:
                    module.train(training)
        barrier(device)


def build_model(task: Task, options: TrainOptions, train_set: Dataset | None) -> nn.Module:
    model = model_builder(task, options.task.model)(options, train_set)
    check_every_module_is_registered(model)
    log.info("%s", describe_parameters(model))
    return model


def trained_model(task: Task, options_class: type, checkpoint: str | Path, trained: bool = False) -> nn.Module:
    """The model a checkpoint holds, rebuilt in one plain process (no torchrun; CPU) for inference: `checkpoint` is
    a --ckpt-dir (its newest whole checkpoint), a step-<N>.pt file or a step-<N>/ folder. The options are the ones
    its run recorded (options_class: TrainOptions), the training set is built as that run built it (a model sized
    from its data: a vocabulary, the columns of a table), and the weights are those evaluation used (the state
    entry evaluate_with names: an EMA), or with `trained` the weights as trained. In eval mode."""
    weights, record, _ = load_checkpoint(checkpoint_at(Path(checkpoint)), None if trained else task.evaluate_with)
    options = recorded_options(record, options_class, task.options, task.training_defaults)
    model = build_model(task, options, task.datasets[options.task.data](options)[0])
    model.load_state_dict(weights)
    return model.eval()


def model_builder(task: Task, name: str) -> ModelBuilder | None:
    if name not in task.models and task.more_models is not None:
        return task.more_models().get(name)
    return task.models.get(name)


def unknown_name(task: Task, kind: str, name: str, builders: dict) -> str:
    close = difflib.get_close_matches(name, list(builders), n=3)
    known = sorted(builders, key=lambda known_name: (known_name not in task.models, known_name))  # ours first
    hint = (f"did you mean {', '.join(close)}?" if close
            else f"known: {', '.join(known[:8])}{', ...' if len(known) > 8 else ''}.")
    table = "datasets" if kind == "data" else "models"
    return (f"--{kind} {name!r} is not in the task's {table}; {hint} To add it, write a builder and add "
            f"{name!r}: <builder> to TASK's {table} in {task.options.__module__.replace('.', '/')}.py")


def describe_parameters(model: nn.Module) -> str:
    """The start-up line on what is trained, what is frozen and what checkpoints leave out."""
    def millions(parameters) -> str:
        return f"{sum(parameter.numel() for parameter in parameters) / 1e6:.2f} M"
    parameters = list(model.parameters())
    frozen = [name for name, module in model.named_modules() if name and any(True for _ in module.parameters())
              and not any(parameter.requires_grad for parameter in module.parameters())]
    frozen = [name for name in frozen if not any(name.startswith(f"{outer}.") for outer in frozen)]  # outermost
    line = f"model: {millions(parameters)} parameters, {millions(p for p in parameters if p.requires_grad)} trained"
    if frozen:
        line += f"; frozen: {', '.join(frozen[:8])}{', ...' if len(frozen) > 8 else ''}"
    not_saved = getattr(model, "left_out_of_checkpoints", ())
    if not_saved:
        line += f"; not saved (the model builder makes them each run): {', '.join(not_saved)}"
    return line


def check_every_module_is_registered(model: nn.Module) -> None:
    """Refuse modules kept in a plain list, tuple or dict attribute: torch does not register them, so their
    parameters would be neither trained (the optimizer never sees them), all-reduced, sharded nor saved, and
    the run would go on without an error."""
    registered = set(model.modules())  # a list that only refers to registered modules is the model's own business
    for owner_name, owner in model.named_modules():
        for attribute, value in vars(owner).items():
            if attribute.startswith("_"):  # torch's own: _modules, _parameters, hooks
                continue
            members = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
            if any(isinstance(member, nn.Module) and member not in registered for member in members):
                where = f"{owner_name}.{attribute}" if owner_name else attribute
                kind = "nn.ModuleDict" if isinstance(value, dict) else "nn.ModuleList"
                raise UsageError(f"the model keeps modules in a plain {type(value).__name__}, {where}, which torch "
                                 f"does not register: their parameters would not be trained, synced or saved; "
                                 f"make it an {kind} in task.py")
