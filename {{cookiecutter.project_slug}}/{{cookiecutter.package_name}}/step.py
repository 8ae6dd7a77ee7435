"""Step: the optimizer step as task.py's compute_loss and training_step see it, and ExponentialMovingAverage, a
state a task keeps beside the model (Task.state). The step itself is written out in train.py; the machinery
around it (precision, the non-finite guard, the schedule) is engine/optim.py's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from .engine.errors import UsageError
from .engine.optim import (
    RESERVED_LOG_NAMES,
    MixedPrecision,
    NonFiniteGuard,
    forward_called,
    parameters_without_gradient,
    wrapper_lacks,
)
from .engine.optimizers import as_one_optimizer
from .engine.parallel import gradient_sync, whole
from .engine.replicas import is_sharded
from .options import TrainOptions


class Step:
    """The optimizer step being taken, as the task sees it: compute_loss(model, batch, step) and a task's own
    training_step(step, batches) are given this one object.

    number: the step's number (1 for the first); options: the run's (the task's own as options.task); model: the
    plain model, for its attributes (the `model` compute_loss runs is wrapped: DDP, FSDP2, torch.compile);
    networks: what is wrapped, by name (`networks.model`, or with a training_step each top-level module of the
    model); optimizers: task.build_optimizer's, by name ("optimizer" for one); log(name=value): a value logged
    beside the loss (below). Two calls do the step's work:

        def training_step(step, batches):   # a GAN: two networks stepped in turn, each on its own loss
            critic = step.backward(critic_loss, batches)  # critic_loss(step.networks, batch), each micro-batch
            step.update("critic")  # only the critic's parameters move
            step.backward(generator_loss, batches)
            step.update("generator")
            return critic  # logged

    backward(loss_of, batches): for each micro-batch (the step's --grad-accum, each moved to the device as it is
    read), loss_of(networks, batch) under autocast, its backward scaled for fp16 and divided by the number of micro-
    batches; gradients are all-reduced on the last one only. Returns the mean loss (detached). DDP's rules hold for
    each network: one forward with gradients per backward (to score real and generated samples, concatenate them),
    and a network used without gradients (the generator in the critic's loss) runs under torch.no_grad(), not with
    its output .detach()ed, which leaves DDP waiting for a backward that never comes.
    update(*names): those optimizers (none named: every one) take train.py's `optimizer_step`, each in turn:
    gradients unscaled (fp16), clipped (--clip-grad, over their parameters), checked (a NaN or inf loss or
    gradient norm: skipped or the job stops; one small all-reduce and host sync per update), stepped. Each
    optimizer once a step at most (the fp16 gradient scaler's rule; a critic stepped five times per generator
    step takes five steps, the generator's when step.number % 5 == 0). Every gradient is zeroed once, when the
    step ends (the critic's from the generator's loss too). Every rank must call these in the same order: they
    hold collectives."""

    def __init__(self, networks: SimpleNamespace, model: torch.nn.Module,
                 built: torch.optim.Optimizer | dict[str, torch.optim.Optimizer], amp: MixedPrecision,
                 options: TrainOptions, nonfinite: NonFiniteGuard,
                 optimizer_step: Callable[[torch.optim.Optimizer, int], torch.Tensor],
                 state: dict[str, Any] | None = None):
        self.networks = networks
        self.model = model
        self.state = state or {}  # the task's own (Task.state), by name
        self.options = options
        self.optimizers = built if isinstance(built, dict) else {"optimizer": built}  # task.build_optimizer's
        self.optimizer = as_one_optimizer(built)  # all of them, stepped as one by update()
        self.amp = amp
        self.nonfinite = nonfinite
        self.optimizer_step = optimizer_step  # train.py's: (optimizer, step number) -> gradient norm
        self.number = 0
        self.grad_norms: list[torch.Tensor] = []
        self.stepped: set[str] = set()  # this step's
        self.logged: dict[str, tuple[torch.Tensor, int]] = {}  # this step's log(...) values: (sum, calls)
        self.first_number: int | None = None  # this run's first step
        self.finds_unused = any(getattr(network, "find_unused_parameters", False)  # DDP's own search is on
                                for network in vars(networks).values())
        self.without_gradient: list[str] = []  # trained parameters its updates found with no gradient (DDP's
        # unused parameters), named by the replica check if the ranks' models then differ

    def backward(self, loss_of: Callable[[SimpleNamespace, Any], torch.Tensor], batches: list) -> torch.Tensor:
        total = 0.0
        for index, batch in enumerate(batches, start=1):
            with contextlib.ExitStack() as sync:
                for network in vars(self.networks).values():  # all-reduce only on the last micro-batch
                    sync.enter_context(gradient_sync(network, enabled=index == len(batches)))
                first = self.number == self.first_number and index == 1
                with forward_called(self.networks) if first else contextlib.nullcontext():
                    with self.amp.autocast():
                        try:
                            loss = loss_of(self.networks, batch)
                        except AttributeError as error:  # a method of the model, asked of DDP's wrapper
                            if refused := wrapper_lacks(self.networks, error):
                                raise refused from None
                            raise
                    self.amp.backward(loss / len(batches))
            self.nonfinite.watch(loss)
            total = total + loss.detach()
        return total / len(batches)

    def log(self, **values: float | torch.Tensor) -> None:
        """Values to log beside the loss (a learned temperature, an auxiliary loss, the terms of a sum): in the log
        line, metrics.jsonl and the --tracker (TensorBoard by default), each the mean over this step's calls
        (compute_loss calls it once per micro-batch), then over ranks and the --log-every steps, as the loss is.
        Every rank logs the same names; the loss logged is what compute_loss returned, these terms in it only if
        the task added them."""
        for name, value in values.items():
            if name in RESERVED_LOG_NAMES or name.endswith("_per_sec"):
                raise UsageError(f"step.log({name}=...): {name!r} is a column the loop logs itself; name it otherwise")
            value = torch.as_tensor(value).detach().float()
            if value.numel() != 1:
                raise UsageError(f"step.log({name}=...) logs one number, got a tensor of shape {list(value.shape)}; "
                                 "log its mean, or each part under a name of its own")
            total, calls = self.logged.get(name, (0.0, 0))
            self.logged[name] = (total + value.reshape(()), calls + 1)

    def logged_means(self) -> dict[str, torch.Tensor]:
        """This step's log(...) values, each the mean of its calls."""
        return {name: total / calls for name, (total, calls) in self.logged.items()}

    def update(self, *names: str) -> None:
        unknown = [name for name in names if name not in self.optimizers]
        if unknown:
            raise UsageError(f"training_step: step.update({', '.join(map(repr, names))}): name optimizers that "
                             f"task.build_optimizer returned: {', '.join(self.optimizers)}")
        twice = self.stepped.intersection(names or self.optimizers)
        if twice:
            raise UsageError(f"training_step: step.update({sorted(twice)[0]!r}) twice in one step; an optimizer steps "
                             "once a step (the fp16 gradient scaler's rule): take more steps, updating it in each")
        # None named: every optimizer as one, clipped by one norm over all parameters (torch's usual clipping).
        stepping = [self.optimizers[name] for name in names] if names else [self.optimizer]
        self.stepped.update(names or self.optimizers)
        if self.number == self.first_number and not self.finds_unused:
            self.without_gradient += parameters_without_gradient(self.model, stepping)
        for optimizer in stepping:
            self.grad_norms.append(self.optimizer_step(optimizer, self.number))
        for network in vars(self.networks).values():
            network = getattr(network, "_orig_mod", network)  # under torch.compile
            if is_sharded(network):  # an FSDP2 root keeps its whole parameters after a forward without gradients
                network.reshard()  # (no backward reshards it): its next forward would use them, not the stepped ones

    def run(self, training_step: Callable[[Step, list], torch.Tensor], batches: list, number: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: (the loss training_step returned, the norm of all gradients it clipped)."""
        self.number, self.grad_norms, self.stepped, self.logged = number, [], set(), {}
        self.first_number = self.first_number or number
        loss = training_step(self, batches)
        if not isinstance(loss, torch.Tensor):
            raise UsageError(f"task.training_step returned {type(loss).__name__}; return the loss to log, a tensor")
        if not self.stepped:  # the fp16 scaler, too, needs at least one optimizer stepped a step
            raise UsageError(f"task.training_step updated no optimizer at step {number}; call step.update(...) for "
                             "at least one in every step (skip a network's update with a condition on step.number)")
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        norms = [whole(norm).float() for norm in self.grad_norms]  # one norm over every optimizer
        norms = torch.stack(norms) if norms else torch.zeros(1)
        return loss.detach(), torch.linalg.vector_norm(norms)


class ExponentialMovingAverage:
    """An exponential moving average of a model's parameters, to evaluate with (Task(state=..., after_step=...,
    evaluate_with=...) in task.py). Under DDP the averages are plain tensors; under FSDP2 they are DTensors
    sharded like the parameters, so each rank averages its own shard without communicating
    (torch.optim.swa_utils.AveragedModel deep-copies the module, which FSDP2 refuses). Built after wrapping, it
    holds what each rank holds; saved with the checkpoints, a resume continues it exactly."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.averages = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After each optimizer step: average += (1 - decay) * (parameter - average)."""
        for name, parameter in model.named_parameters():
            self.averages[name].lerp_(parameter.detach(), 1 - self.decay)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_into(self, model: torch.nn.Module):
        """The averages in the model's parameters inside the block (evaluate them), the trained values after."""
        trained = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
        for name, parameter in model.named_parameters():
            parameter.copy_(self.averages[name])
        try:
            yield model
        finally:
            for name, parameter in model.named_parameters():
                parameter.copy_(trained[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.averages)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, average in self.averages.items():
                average.copy_(state[name])
