"""Around the optimizer step: several optimizers stepped as one, mixed precision (autocast, and the gradient
scaler fp16 needs), the learning-rate schedule (linear warmup, then cosine decay or constant) and an
exponential moving average of the weights. The optimizers themselves are built in task.py; the step is
written out in train.py."""

from __future__ import annotations

import contextlib
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from .options import TrainOptions, UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Optimizers(torch.optim.Optimizer):
    """Several named optimizers (a backbone's SGD, a head's AdamW) that train.py steps as one: the gradient
    scaler unscales and steps them all, the LR schedule scales every one's param groups, and a checkpoint holds
    each one's state under its name.

    Optimizer.__init__ is not called: this object holds no parameters or state of its own, only views of its
    members' groups (torchtitan's OptimizersContainer is the larger version of this)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        owners: dict[int, str] = {}
        for name, optimizer in optimizers.items():
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if owners.setdefault(id(parameter), name) != name:
                        raise UsageError(f"task.build_optimizer: optimizers {owners[id(parameter)]!r} and {name!r} "
                                         "share a parameter, which would be stepped twice; give each its own")
        self.optimizers = optimizers
        self.defaults = {}
        self.state = {}

    @property
    def param_groups(self) -> list[dict]:
        # Looked up each time: an optimizer's load_state_dict replaces its group objects, and the LR schedule
        # must scale the ones it steps with.
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def step(self, closure=None) -> None:
        for optimizer in self.optimizers.values():
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: optimizer.state_dict() for name, optimizer in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state[name])

    def __repr__(self) -> str:
        return f"Optimizers({', '.join(f'{name}={type(opt).__name__}' for name, opt in self.optimizers.items())})"


def as_one_optimizer(built: torch.optim.Optimizer | dict[str, torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """What task.build_optimizer returned, as one optimizer: itself, or several named ones as Optimizers."""
    if isinstance(built, torch.optim.Optimizer):
        return built
    if isinstance(built, dict) and built and all(isinstance(value, torch.optim.Optimizer) for value in built.values()):
        return built[next(iter(built))] if len(built) == 1 else Optimizers(built)
    raise UsageError(f"task.build_optimizer returned {type(built).__name__}; return an optimizer, or a dict of "
                     "named optimizers over disjoint parameters")


def member_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The plain optimizers behind `optimizer`: its members if it is Optimizers, else itself."""
    return list(optimizer.optimizers.values()) if isinstance(optimizer, Optimizers) else [optimizer]


def resolve_precision(requested: str, device: torch.device) -> str:
    """auto: bf16 where the GPU computes it natively (Ampere and newer), else fp32."""
    if requested != "auto":
        if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError(f"--precision bf16 but {torch.cuda.get_device_name(device)} has no bf16; use fp16")
        return requested
    if device.type == "cuda" and computes_bf16_natively(device):
        return "bf16"
    return "fp32"  # CPU autocast is correct but rarely faster, so it is opt-in there


def computes_bf16_natively(device: torch.device) -> bool:
    """Ampere (compute capability 8.0) and newer, or ROCm. Not torch.cuda.is_bf16_supported(): by default it
    also counts emulation, which V100s and T4s have, and there bf16 is slower than fp32."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


class MixedPrecision:
    """Parameters, gradients and optimizer state stay fp32; autocast runs matmuls and convolutions in the
    lower precision. fp16's narrow range needs the loss scaled up before backward and the gradients
    unscaled before clipping and stepping (GradScaler); bf16 has fp32's range and needs no scaler."""

    def __init__(self, precision: str, device: torch.device):
        self.precision = precision
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    @property
    def param_dtype(self) -> torch.dtype | None:
        """What FSDP2 all-gathers parameters in for compute (its shards stay fp32); None: unchanged."""
        return None if self.precision == "fp32" else DTYPES[self.precision]

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around training and evaluation forwards alike."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()  # empty unless fp16

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)


def warmup_then_decay(step: int, warmup_steps: int, total_steps: int, decay: str) -> float:
    """lr multiplier for an optimizer step: linear warmup from ~0 to 1, then cosine to 0 (or constant 1)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant":
        return 1.0
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def planned_steps(options: TrainOptions, steps_per_epoch: int) -> int:
    """Optimizer steps this run will take: --epochs worth, or --max-steps if that comes first."""
    total_steps = options.epochs * steps_per_epoch
    return total_steps if options.max_steps is None else min(total_steps, options.max_steps)


def build_lr_schedule(optimizer: torch.optim.Optimizer, options: TrainOptions, steps_per_epoch: int) -> LambdaLR:
    """Stepped once per optimizer step; the decay spans --epochs. --max-steps only stops the run early, so a
    run stopped by it and restarted with a larger one continues the same schedule.

    A checkpoint holds the schedule's step count; the plan itself comes from the current options, so
    resuming on another world size (another number of steps per epoch) re-plans the rest of the run.
    """
    total_steps = options.epochs * steps_per_epoch
    warmup_steps = options.warmup_steps if options.warmup_steps is not None else total_steps // 20
    # A lambda, which LambdaLR leaves out of its state_dict: nothing but the step count is restored.
    return ResumableLambdaLR(
        optimizer, lambda step: warmup_then_decay(step, warmup_steps, total_steps, options.lr_schedule))


class ResumableLambdaLR(LambdaLR):
    """LambdaLR whose checkpoint restores where the schedule stands (its step count), not the peak lr it
    scales: that stays what the optimizer was built with in this run. LambdaLR's own load_state_dict brings
    back the saved base_lrs, so a resume with another --lr would go on with the old one, without a word."""

    def load_state_dict(self, state_dict: dict) -> None:
        peaks = list(self.base_lrs)
        super().load_state_dict(state_dict)
        self.base_lrs = peaks
        for group, peak, lr in zip(self.optimizer.param_groups, peaks, self.get_lr(), strict=True):
            group["initial_lr"], group["lr"] = peak, lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class ExponentialMovingAverage:
    """An exponential moving average of a model's parameters, e.g. to evaluate with. Under DDP the averages are
    plain tensors; under FSDP2 they are DTensors sharded like the parameters, so each rank averages its own
    shard without communicating (torch.optim.swa_utils.AveragedModel deep-copies the module, which FSDP2
    refuses). Pass it to build_checkpointer() and a resume continues it exactly."""

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
