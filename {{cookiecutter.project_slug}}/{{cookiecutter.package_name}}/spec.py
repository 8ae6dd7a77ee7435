"""`Task`: everything the package calls from task.py, as one spec that task.py builds at its end
(`TASK = Task(...)`), in the manner of torchtitan's TrainSpec. Python checks the call: a hook missing or
misspelled is a TypeError at import that names it. The fields after `smoke_test_args` are optional, with the
defaults below; of compute_loss and training_step, one is given. Also here: the check of the --data and
--model names against the spec's tables, and the model's frozen modules that checkpoints leave out."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from .data import tensors_in
from .engine.collectives import all_reduce, barrier, run_once_per_storage, same_on_every_rank
from .engine.distributed import DistEnv
from .engine.errors import UsageError
from .engine.flags import flag
from .engine.replicas import bit_sum
from .engine.task_state import PerRank
from .options import TrainOptions
from .parallel import whole_model

log = logging.getLogger(__name__)

DatasetBuilder = Callable[[TrainOptions], tuple[Dataset, Dataset]]  # options -> (train, held-out)
ModelBuilder = Callable[[TrainOptions, Dataset], nn.Module]  # options, the training set -> a model


def samples_in(batch: Any) -> int:
    """The default unit count of a batch: the length of its first tensor, in any nesting (tuple, dict,
    dataclass). A guess unless the batch is a tuple of tensors (inputs, targets): said once."""
    first = next(tensors_in(batch), None)
    count = first.shape[0] if first is not None and first.dim() else 1
    if not (isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor)):
        say_samples_are_guessed(type(batch).__name__, count)
    return count


@functools.cache
def say_samples_are_guessed(kind: str, count: int) -> None:
    log.warning("throughput counts %d samples in a batch (a %s): the length of its first tensor. If that is not how "
                "many samples it holds (a flat tensor of packed tokens, a per-token first entry), give TASK "
                "units_in_batch(batch), and throughput_unit to count tokens", count, kind)


@dataclass(frozen=True, kw_only=True)
class Task:
    """What the package calls, each by keyword. A batch is whatever `collate` makes of a list of samples."""

    options: type  # a dataclass of the task's flags, read as options.task.<name>
    datasets: dict[str, DatasetBuilder]  # --data name -> builder of (train, held-out) datasets
    models: dict[str, ModelBuilder]  # --model name -> builder
    build_optimizer: Callable[[nn.Module, TrainOptions], torch.optim.Optimizer | dict[str, torch.optim.Optimizer]]
    # (model, batch, step) -> the mean loss, minimised; None with a training_step (below). `model` is wrapped
    # (DDP, FSDP2, torch.compile); `step` (optim.py's Step): its number, the options, the plain model.
    compute_loss: Callable[[nn.Module, Any, Any], torch.Tensor] | None = None
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
    # once per optimizer step with its --grad-accum micro-batches; `step` (optim.py's Step) gives the networks
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
    # included, and whose state_dict the export (export.py) writes over the model's (an EMA's averages; optim.py's
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
                            f"{getattr(self.compute_loss, '__name__', 'it')} a third parameter, step (optim.py's Step)")
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

    def check(self, options: TrainOptions) -> None:
        """Refuse a --data or --model name the spec has no builder for, then what the task refuses."""
        if options.task.data not in self.datasets:
            raise UsageError(self.unknown_name("data", options.task.data, self.datasets))
        if self.model_builder(options.task.model) is None:
            every_model = {**(self.more_models() if self.more_models else {}), **self.models}
            raise UsageError(self.unknown_name("model", options.task.model, every_model))
        every = self.work_every(options)  # a number Task() checked, or what the TaskOptions field it names holds
        if isinstance(every, int) and every < 0:  # the user's flag
            raise UsageError(f"--{flag(self.rank_0_work[0])} must be >= 0 (0: never), got {every}")
        if not isinstance(every, int):
            raise UsageError(f"Task(rank_0_work=({self.rank_0_work[0]!r}, ...)) names a TaskOptions field for its "
                             f"steps; it holds {every!r}: give it an int option, >= 1 (0: never)")
        self.check_options(options)

    def work_every(self, options: TrainOptions) -> int:
        """After how many optimizer steps rank_0_work's work runs again; 0: never."""
        if self.rank_0_work is None:
            return 0
        every = self.rank_0_work[0]
        return getattr(options.task, every, None) if isinstance(every, str) else every

    def build_datasets(self, options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
        prepare = self.prepare_data.get(options.task.data)
        if prepare is not None:
            run_once_per_storage(options.task.data_dir, env, device, lambda: prepare(options),
                                 what=f"preparing --data {options.task.data} in {options.task.data_dir}")
        return self.datasets[options.task.data](options)

    def build_state(self, model: nn.Module, options: TrainOptions, taken: set[str]) -> dict[str, Any]:
        """The task's state (Task.state), checked: every entry saveable, none named like one of `taken` (the
        checkpoint entries train.py saves), and the one evaluate_with names among them."""
        state = self.state(model, options) if self.state is not None else {}
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
        if self.evaluate_with is not None and not hasattr(state.get(self.evaluate_with), "swapped_into"):
            raise UsageError(f"task.py: Task(evaluate_with={self.evaluate_with!r}) needs an entry of that name in "
                             "Task(state=...) with swapped_into(model)")
        return state

    def evaluation_weights(self, model: nn.Module, state: dict[str, Any]) -> contextlib.AbstractContextManager:
        """The weights evaluation runs with: the state entry evaluate_with names, swapped into the model."""
        if self.evaluate_with is None:
            return contextlib.nullcontext(model)
        return state[self.evaluate_with].swapped_into(model)

    def work_alone(self, step: Any, env: DistEnv, device: torch.device) -> None:
        """Task.rank_0_work's work after step.number: on rank 0, with a generator of its own, the model with the
        evaluation's weights in eval mode, without gradients, under the run's autocast, then torch's generators and
        the modules' modes restored, while the other ranks wait for it in a barrier. Every rank swaps the weights in
        (an EMA's shards, under FSDP2), then gathers an FSDP2 model whole for rank 0."""
        modes = [(module, module.training) for module in step.model.modules()]
        with self.evaluation_weights(step.model, step.state), whole_model(step.model, keep=env.rank == 0):
            if env.rank == 0:
                try:
                    step.model.eval()  # no dropout, and no BatchNorm statistics that rank 0 alone would update
                    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                            torch.no_grad(), step.amp.autocast():
                        self.rank_0_work[1](step, torch.Generator().manual_seed(step.options.seed + step.number))
                finally:
                    for module, training in modes:
                        module.train(training)
            barrier(device)

    def build_model(self, options: TrainOptions, train_set: Dataset | None) -> nn.Module:
        model = self.model_builder(options.task.model)(options, train_set)
        check_every_module_is_registered(model)
        log.info("%s", describe_parameters(model))
        return model

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


def leave_out_of_checkpoints(model: nn.Module, *names: str) -> nn.Module:
    """For a model builder: the named modules' parameters and buffers are left out of the model's state_dict
    (checkpoints, exports) and not expected by its load_state_dict; returns the model. Only frozen modules, which
    the builder makes again each run (a teacher from its weights file): a trained one would be rebuilt untrained
    on every resume.

        return leave_out_of_checkpoints(Distilled(student, teacher), "teacher")
    """
    modules = dict(model.named_modules())
    for name in names:
        if name not in modules or not name:
            top = ", ".join(child for child, _ in model.named_children())
            raise UsageError(f"leave_out_of_checkpoints(model, {name!r}): the model has no module {name!r}; its "
                             f"top-level modules: {top}")
        trained = [parameter for parameter, value in modules[name].named_parameters() if value.requires_grad]
        if trained:
            raise UsageError(f"leave_out_of_checkpoints(model, {name!r}): its parameter {trained[0]!r} is trained "
                             f"(requires_grad): resumed, it would start over; freeze it ({name}.requires_grad_(False) "
                             "in the model builder) or save it")
    if not names:
        return model
    model.left_out_of_checkpoints = (*getattr(model, "left_out_of_checkpoints", ()), *names)  # for the start-up line
    prefixes = tuple(f"{name}." for name in names)

    def drop(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        for key in [key for key in state if key.removeprefix(prefix).startswith(prefixes)]:
            del state[key]

    left_out = re.compile(rf"(^|\.)({'|'.join(map(re.escape, names))})\.")  # also under a parent's prefix

    def forgive(module: nn.Module, incompatible: Any) -> None:
        incompatible.missing_keys[:] = [key for key in incompatible.missing_keys if not left_out.search(key)]

    # (register_state_dict_post_hook is the public name of the first since torch 2.5.)
    getattr(model, "register_state_dict_post_hook", model._register_state_dict_hook)(drop)
    model.register_load_state_dict_post_hook(forgive)
    return model


class LeftOutWeights:
    """What checkpoints hold in place of the modules leave_out_of_checkpoints keeps out of them: a fingerprint of
    their weights. A resume whose model builder made them from other contents (a teacher's weights file replaced
    under the same path) stops with one line, or goes on with --resume-changed-state; it would otherwise train on
    silently against other weights."""

    NAME = "left_out_weights"  # its checkpoint entry

    def __init__(self, model: nn.Module, go_on: bool):
        self.names, self.go_on = model.left_out_of_checkpoints, go_on
        tensors = [(f"{name}.{key}", tensor) for name in self.names
                   for key, tensor in model.get_submodule(name).state_dict().items()]
        device = tensors[0][1].device if tensors else torch.device("cpu")
        sums = torch.stack([bit_sum(tensor.to_local() if hasattr(tensor, "to_local") else tensor)
                            for _, tensor in tensors]) if tensors else torch.zeros(0, dtype=torch.int64)
        sharded = torch.tensor([hasattr(tensor, "to_local") for _, tensor in tensors], dtype=torch.bool,
                               device=sums.device)
        if bool(sharded.any()):  # FSDP2's shards: their sums over ranks are the whole tensors', at any world size
            sums = torch.where(sharded, all_reduce(torch.where(sharded, sums, 0), "sum"), sums)
        described = [(key, list(tensor.shape), str(tensor.dtype), total)
                     for (key, tensor), total in zip(tensors, sums.tolist(), strict=True)]
        self.fingerprint = hashlib.sha256(repr(described).encode()).hexdigest()[:16]
        if not same_on_every_rank(self.fingerprint, device):  # a collective, on every rank in build_state
            raise UsageError(f"the modules checkpoints leave out ({', '.join(self.names)}) hold other weights on "
                             "some ranks than on others: the model builder read other contents (a weights file "
                             "that differs between machines?); give every rank the same")

    def state_dict(self) -> dict[str, str]:
        return {"fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, str]) -> None:
        if state["fingerprint"] == self.fingerprint:
            return
        line = (f"the modules checkpoints leave out ({', '.join(self.names)}) hold other weights than the run that "
                "wrote this checkpoint had: the model builder made them from other contents (a weights file changed "
                "under the same path?)")
        if not self.go_on:
            raise UsageError(f"{line}; resume with the same files, or pass --resume-changed-state to go on with these")
        log.warning("--resume-changed-state: %s; going on with them", line)


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
