"""The task's own state in checkpoints (Task(state=...) in task.py): an entry is the same on every rank and saved
once, which is checked at every save, or a PerRank one, each rank's own saved and resumed on that rank."""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_objects, all_reduce, same_on_every_rank
from .errors import UsageError
from .replicas import bit_sum

log = logging.getLogger(__name__)


class PerRank:
    """A task state entry whose value each rank holds apart (the hidden state a rank carries from batch to batch
    over its own part of the data): every rank's is saved, and each rank resumes its own. A job resumed on
    another number of ranks passes the saved ones, in rank order, to `resplit(states, world_size)`, which returns
    the new ranks'; without it such a resume stops in one line. `value` has state_dict() and load_state_dict();
    read it as step.state[name].value."""

    def __init__(self, value: Any, resplit: Callable[[list[dict], int], list[dict]] | None = None):
        self.value, self.resplit = value, resplit
        self.name = "?"  # its entry's, set by Task.build_state
        self.gathered: list[dict] | None = None

    def gather_from_ranks(self) -> None:  # before each save, on every rank (a collective)
        self.gathered = all_gather_objects(self.serialized())

    def serialized(self) -> bytes:
        """This rank's state as bytes: a list of them is saved whole, also in a DCP folder (which would load a
        list of tensors only as far as the resuming rank's own list reaches)."""
        buffer = io.BytesIO()
        torch.save(on_cpu(self.value.state_dict()), buffer)
        try:  # what a resume will do: refused now, not at the resume
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        except pickle.UnpicklingError as error:
            raise UsageError(f"the task state {self.name!r} holds what torch.load(weights_only=True) refuses "
                             f"({str(error).splitlines()[-1]}); make its state_dict() hold tensors and plain values"
                             ) from None
        return buffer.getvalue()

    def state_dict(self) -> dict:
        return {"ranks": self.gathered if self.gathered is not None else [self.serialized()]}

    def load_state_dict(self, state: dict) -> None:
        ranks = [torch.load(io.BytesIO(saved), weights_only=True) for saved in state["ranks"]]
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        if len(ranks) != world_size:
            if self.resplit is None:
                raise UsageError(f"the task state {self.name!r} is per rank: the checkpoint holds {len(ranks)} "
                                 f"ranks' and this job has {world_size}; resume on {len(ranks)} ranks, or give "
                                 "PerRank(..., resplit=...) in task.py to make the new ranks' from the saved ones")
            ranks = self.resplit(ranks, world_size)
            if len(ranks) != world_size:
                raise UsageError(f"PerRank({self.name!r}).resplit returned {len(ranks)} states for {world_size} "
                                 "ranks; return one per rank")
        self.value.load_state_dict(ranks[rank])


class Replicated:
    """A task state entry the same on every rank (an EMA under DDP, a learned temperature): saved from one rank,
    resumed on all. Before each save every rank's copy is compared (a fingerprint of its plain tensors and values;
    FSDP2's sharded DTensors differ by design and are left out): one that differs would resume every rank with
    rank 0's, without a word."""

    def __init__(self, name: str, value: Any, device: torch.device):
        self.name, self.value, self.device = name, value, device

    def gather_from_ranks(self) -> None:  # before each save, on every rank (a collective)
        if not same_on_every_rank(fingerprint(self.value.state_dict()), self.device):
            raise UsageError(f"the task state {self.name!r} differs between ranks at a save, which keeps rank 0's "
                             "for every rank: update it from values every rank shares (all-reduced ones), or, if "
                             f"each rank keeps its own, give it as PerRank(...) in Task(state=...)")

    def state_dict(self) -> Any:
        return self.value.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.value.load_state_dict(state)


def saved_entries(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The task state's checkpoint entries: a PerRank one as it is, any other compared across ranks at saves."""
    return {name: value if isinstance(value, PerRank) else Replicated(name, value, device)
            for name, value in state.items()}


def on_cpu(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {key: on_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_cpu(value) for value in state)
    return state


def fingerprint(state: Any) -> str:
    """What a state holds, as text: each plain tensor's bit sum (replicas.bit_sum), each other value's repr."""
    if isinstance(state, torch.Tensor):
        if type(state).__name__ == "DTensor":  # shards differ by design
            return "DTensor"
        plain = state if state.element_size() in (1, 2, 4, 8) else state.contiguous().view(torch.uint8)  # complex128
        return f"{state.dtype}{tuple(state.shape)}:{int(bit_sum(plain))}"
    if isinstance(state, dict):
        return "{" + ",".join(f"{key!r}:{fingerprint(value)}" for key, value in state.items()) + "}"
    if isinstance(state, (list, tuple)):
        return "[" + ",".join(map(fingerprint, state)) + "]"
    return repr(state)


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
