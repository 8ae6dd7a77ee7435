"""Several optimizers as one, and their settings across a resume: what train.py steps, the lr schedule scales
and checkpoints hold, whatever task.build_optimizer returned."""

from __future__ import annotations

from typing import Any

import torch

from .errors import UsageError


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


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings as they stand (weight_decay, betas, momentum, ...: all but its parameters and
    the lr, which the schedule sets before every step)."""
    return [{key: value for key, value in group.items() if key not in ("params", "lr")}
            for group in optimizer.param_groups]


def take_built_settings(optimizer: torch.optim.Optimizer, built: list[dict]) -> tuple[list[str], list[str]]:
    """After a resume's load_state_dict, which restores every param-group key from the checkpoint: torch's own
    optimizers take again the settings this run's code and flags `built` (their groups hold nothing else), so a
    changed --weight-decay is the one trained with. Another optimizer may keep state of its own in its groups (a
    schedule-free one's step count): it keeps the checkpoint's. Returns (settings changed back to the built ones,
    as "weight_decay 0.0005 -> 0.5"; names of the others that differ from what was built)."""
    torch_own = type(optimizer).__module__.startswith("torch.optim")
    changed, kept = [], []
    for index, (group, settings) in enumerate(zip(optimizer.param_groups, built, strict=True)):
        for key, value in settings.items():
            if key in group and not same_setting(group[key], value):
                where = f"{key}{f' (group {index})' if len(built) > 1 else ''}"
                if torch_own:
                    changed.append(f"{where} {group[key]} -> {value}")
                    group[key] = value
                else:
                    kept.append(where)
    return changed, kept


def same_setting(saved: Any, built: Any) -> bool:
    """Equal as settings: a tuple saved as a list (betas, through DCP) is the same; tensors by value."""
    if isinstance(saved, torch.Tensor) or isinstance(built, torch.Tensor):
        return torch.equal(torch.as_tensor(saved), torch.as_tensor(built))
    if isinstance(saved, list | tuple) and isinstance(built, list | tuple):
        return len(saved) == len(built) and all(map(same_setting, saved, built))
    return saved == built
