"""DDP checkpoints: <ckpt-dir>/step-<N>.pt, written atomically, found newest-valid-first, loaded weights-only."""

from __future__ import annotations

import logging
import os
import pickle
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import all_reduce_int, broadcast_object, first_node_on_its_storage, from_first_rank_with
from ..errors import UsageError
from ..reproducibility import gather_rng_states
from .common import (
    RESERVED_NAMES,
    Checkpointer,
    first_line,
    hold_checkpoint_folder,
)
from .folder import fsync_directory, list_checkpoints, set_aside

log = logging.getLogger(__name__)



def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step}.pt"


def save_checkpoint_atomically(state: dict, path: Path) -> str | None:
    """Write to a temporary file in the same folder, fsync, then rename over the final name.

    A crash at any point leaves either the previous checkpoint set or the new file complete, never a
    truncated step-N.pt. The temporary name does not match step-<N>.pt, so it is never loaded. Returns why
    the file was not published, if it holds objects that torch.load(weights_only=True) would refuse: a
    checkpoint that cannot be resumed is no checkpoint.
    """
    # Made with the mode a plain write gets (0666 less the umask), which the rename keeps: mkstemp's 0600 left
    # every checkpoint unreadable to the teammates a shared folder is for.
    temporary = str(path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp"))
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        if unsafe := unsafe_globals(Path(temporary)):
            Path(temporary).unlink()
            return (f"a checkpoint state_dict() holds {', '.join(sorted(unsafe))}, which torch.load(weights_only=True) "
                    "refuses; make each component's state_dict() hold tensors and plain Python values (e.g. "
                    "float(x) for a numpy scalar)")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return None


# What makes a file one of our checkpoints; which components it holds is checked on resume (common.py).
FORMAT_KEYS = {"step", "epoch", "samples_in_epoch", "torch_rng_state"}
NOT_COMPONENTS = FORMAT_KEYS | RESERVED_NAMES


def load_newest_valid(ckpt_dir: Path) -> tuple[tuple[Path, dict] | None, str | None]:
    """(the newest checkpoint that loads, why the job must stop instead). A damaged one (a write cut short, or
    bytes changed since torch.save wrote them: a member failing the CRC-32 the zip records) is renamed to
    <name>.unreadable, out of the way of resuming and retention but kept, with a warning naming it, and the one
    before it is tried. torch.load checks no CRC, so every member is read and checked first: a flipped bit in a
    tensor would otherwise be resumed from silently. Any other failure stops the job: one that cannot be read
    now (an I/O error, not enough memory), or a whole file that this code or this torch refuses (weights_only, a
    newer format, another step inside). It is not damaged, and falling back would throw its steps away."""
    for step, path in list_checkpoints(ckpt_dir):
        try:
            if damage := damaged(path):
                log.warning("skipping unreadable checkpoint %s (%s); kept as %s", path, damage, set_aside(path).name)
                continue
            state = load_mapped(path)
        except OSError as error:
            return None, f"{path} cannot be read ({error.strerror or error}); fix the storage and run again"
        except Exception as error:  # noqa: BLE001 - whole, and refused
            if isinstance(error, pickle.UnpicklingError) and (unsafe := unsafe_globals(path)):
                return None, (f"{path} holds {', '.join(sorted(unsafe))}, which torch.load(weights_only=True) "
                              "refuses; resume with the code that wrote it, or load and re-save it without them")
            return None, (f"{path} is a whole file that this run cannot load ({type(error).__name__}: "
                          f"{first_line(error)}); resume with the code and torch that wrote it, or move it "
                          f"out of {ckpt_dir}")
        missing = FORMAT_KEYS - set(state) if isinstance(state, dict) else FORMAT_KEYS
        if missing or state["step"] != step:
            held = f"lacks {', '.join(sorted(missing))}" if missing else f"holds step {state['step']}"
            return None, (f"{path} is no training checkpoint of step {step} ({held}); move it out of {ckpt_dir}, "
                          "or use another --ckpt-dir")
        return (path, state), None
    return None, None


def load_mapped(path: Path) -> dict:
    """A checkpoint, weights-only, its tensors mapped from the file rather than read into this process: the
    ranks of a machine share one copy in the page cache, where each held a whole copy of its own. Read whole
    where the file system cannot map it (some FUSE mounts: a RuntimeError, not an OSError)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        return torch.load(path, map_location="cpu", weights_only=True)


def load_if_readable(path: Path) -> dict | None:
    """The checkpoint a writer chose and checked, or None where this rank cannot read it (not on its machine's
    disk, an I/O error): then the ranks agree to have it sent instead of some of them failing alone."""
    try:
        return load_mapped(path)
    except Exception as error:  # noqa: BLE001 - every rank learns of it through the all-reduce that follows
        if path.exists():
            log.warning("cannot read %s here (%s: %s); it is sent by the rank that holds it", path,
                        type(error).__name__, first_line(error))
        return None


def damaged(path: Path) -> str | None:
    """How `path` provably differs from what torch.save wrote whole, or None: no complete zip archive (a write
    cut short loses the archive's directory at its end), or a member whose bytes fail the CRC-32 recorded when it
    was written (bit rot, a bad copy between clusters). Reads the whole file; an OSError is raised as it is
    (unreadable now proves nothing)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                # A CRC of 0 on bytes: written with torch.serialization.set_crc32_options(False), none to check.
                if member.CRC == 0 and member.file_size:
                    continue
                try:
                    with archive.open(member) as stored:  # zipfile checks the CRC-32 as the last chunk is read
                        while stored.read(1 << 20):
                            pass
                except zipfile.BadZipFile as error:
                    if "CRC" not in str(error):
                        raise
                    return (f"its bytes changed after it was written: {member.filename} fails its CRC-32 check "
                            "(bit rot on the storage, or a bad copy)")
    except (zipfile.BadZipFile, EOFError, ValueError) as error:
        return f"cut short: no complete archive ({first_line(error)})"
    return None


def unsafe_globals(path: Path) -> list[str]:
    """What makes a readable checkpoint fail weights_only loading; [] for a file that is no checkpoint."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - not a torch.save file at all
        return []


def delete_old_checkpoints(ckpt_dir: Path, keep: int, just_written: Path, kept: set[int]) -> None:
    """Keep the newest `keep` checkpoints by step, always the one just written, and those of the `kept` steps."""
    for step, path in list_checkpoints(ckpt_dir)[keep:]:
        if path != just_written and step not in kept:
            path.unlink(missing_ok=True)


def broadcast_tensor_by_tensor(state: dict | None, source: int, device: torch.device) -> dict:
    """`source`'s state on every rank: its structure as one small object, then each tensor on its own through
    `device` (NCCL's). Pickling the whole state into one object to broadcast held two copies of it on every
    rank, in host memory and again on the GPU (broadcast_object_list), at once."""
    tensors: list[torch.Tensor] = []

    def hollow(value):  # the structure, each tensor replaced by its place in `tensors`
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)
        if isinstance(value, (dict, list, tuple)):
            return walk(value, hollow)
        return value

    def fill(value):  # every rank walks the same structure in the same order: the broadcasts pair up
        if isinstance(value, TensorSlot):
            # Contiguous on every rank: a collective moves bytes, and a channels-last tensor's bytes sent into a
            # row-major buffer would arrive permuted, silently.
            buffer = (tensors[value.index].to(device).contiguous() if tensors
                      else torch.empty(value.shape, dtype=value.dtype, device=device))
            dist.broadcast(buffer, src=source)
            return buffer.cpu()
        if isinstance(value, (dict, list, tuple)):
            return walk(value, fill)
        return value

    return fill(broadcast_object(hollow(state) if state is not None else None, source_rank=source))


def walk(container: dict | list | tuple, visit: Callable) -> dict | list | tuple:
    if isinstance(container, dict):
        return {key: visit(item) for key, item in container.items()}
    return type(container)(visit(item) for item in container)


@dataclass(frozen=True)
class TensorSlot:
    """A tensor's place in a state sent by broadcast_tensor_by_tensor."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def tensors_in(value) -> Iterator[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def copy_to_host(value):
    """`value` with every tensor copied to host memory, of its own."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (dict, list, tuple)):
        return walk(value, copy_to_host)
    return value


def training_state(components: dict, progress: Any, world_size: int) -> dict:
    """Only tensors and primitives, so it loads with weights_only=True."""
    return {
        # "model" is the unwrapped model: no "module." or "_orig_mod." prefix.
        **{name: component.state_dict() for name, component in components.items()},
        **asdict(progress),
        "entries": sorted(components),
        "world_size": world_size,
    }


class ReplicatedCheckpointer(Checkpointer):
    """Saving and resuming for a data-parallel job, whether or not --ckpt-dir is shared between nodes.

    DDP keeps every replica's parameters identical and buffers are synced from rank 0 before saving, so one
    copy is the whole state. On a shared filesystem rank 0 alone writes it; on node-local disks the first rank
    of each node writes its node's copy, because after a restart rank 0 may land on another machine.
    Resuming, the ranks agree on the newest valid step any node holds. Where every rank sees that file (a
    shared folder, or every node has its copy) each maps it itself; else the rank that holds it sends it, one
    tensor at a time.
    """

    def __init__(self, options, recorded, env, device, **components):
        super().__init__(options, recorded, env, device, **components)
        # One writer per storage behind --ckpt-dir: shared by every node, or local to each.
        self.is_writer, writers = first_node_on_its_storage(self.ckpt_dir, env, device)
        self.lease = hold_checkpoint_folder(self.ckpt_dir, env, device, holder=self.is_writer)
        log.info("checkpoints in %s, written by %d %s", self.ckpt_dir, writers,
                 "node (shared folder)" if writers == 1 else "nodes (node-local folders)")
        if self.is_writer:
            # Only this rank writes here (the lease keeps other jobs out), and it is not saving yet: any
            # temporary file is a dead save's.
            for leftover in self.ckpt_dir.glob(".step-*.pt.*.tmp"):
                leftover.unlink(missing_ok=True)
                log.warning("removed %s, left by a save that was interrupted", leftover)
        self._newest_state: dict | None = None

    def write(self, progress: Any) -> Path | None:
        rng_states = gather_rng_states(self.env, self.device)  # each rank's own, a collective
        if not self.is_writer:
            return None
        self.wait()  # the previous save's write, and its error if it failed
        path = checkpoint_path(self.ckpt_dir, progress.step)
        state = {**training_state(self.components, progress, self.env.world_size), **rng_states,
                 "options": self.recorded.values}
        if self.options.async_save:  # a copy, taken now: the next step changes parameters and moments
            self.in_background(self.publish, copy_to_host(state), path, self.kept_steps())
        else:
            self.publish(state, path, self.kept_steps())
        return path

    def publish(self, state: dict, path: Path, kept: set[int]) -> None:
        """Write `state` to `path` atomically, then apply retention."""
        if problem := save_checkpoint_atomically(state, path):
            raise UsageError(problem)  # found alike by every writer, rank 0 among them, which reports it
        delete_old_checkpoints(self.ckpt_dir, self.keep, just_written=path, kept=kept)

    def find_newest(self) -> tuple[Path, dict | None] | None:
        newest, problem = load_newest_valid(self.ckpt_dir) if self.is_writer else (None, None)
        problem = from_first_rank_with(problem, self.device)  # a collective: every rank stops, or none
        if problem:
            raise UsageError(problem)
        own_step = newest[1]["step"] if newest else -1
        best_step = all_reduce_int(own_step, self.device, "max")
        if best_step < 0:
            return None
        path = checkpoint_path(self.ckpt_dir, best_step)
        self._newest_state = newest[1] if own_step == best_step else load_if_readable(path)
        if not all_reduce_int(int(self._newest_state is not None), self.device, "min"):  # some rank cannot read it:
            # the lowest rank holding the newest step sends it
            source = all_reduce_int(self.env.rank if own_step == best_step else self.env.world_size, self.device,
                                    "min")
            path = broadcast_object(newest[0] if self.env.rank == source else None, source_rank=source)
            self._newest_state = broadcast_tensor_by_tensor(newest[1] if self.env.rank == source else None, source,
                                                            self.device)
        return path, self._newest_state.get("options")

    def saved_entries(self, source: Path) -> tuple[set[str], set[str]]:
        state = self._newest_state
        progress_fields = {spec.name for spec in fields(self.progress_type)} & set(state)
        if "entries" in state:
            return set(state["entries"]), progress_fields
        return set(state) - NOT_COMPONENTS - progress_fields, progress_fields  # saved before "entries" was

    def read(self, source: Path, components: set[str]) -> dict:
        state = self._newest_state
        self._newest_state = None
        return {**state, "progress": state}  # a flat file: progress's fields and world_size at the top

    def own_what_was_loaded(self, state: dict) -> None:
        """The file is mapped (load_mapped), and a component may keep what it was given: Optimizer.load_state_dict
        keeps every state tensor whose device and dtype are its parameter's already (all of them on CPU) and
        each state["step"] on any device (kept on the host unless capturable or fused). Such a view reads the
        file again at every step, keeps its blocks allocated once retention has deleted it (NFS: a .nfsXXXX
        file in --ckpt-dir), and SIGBUSes if the file is truncated. A component holding one is loaded again,
        with those tensors copied: on GPU that copies little (the steps), on CPU the optimizer's moments."""
        mapped = {pointer for tensor in tensors_in(state) if (pointer := tensor.untyped_storage().data_ptr())}

        def owned(value):
            if isinstance(value, torch.Tensor):
                return value.clone() if value.untyped_storage().data_ptr() in mapped else value
            return walk(value, owned) if isinstance(value, (dict, list, tuple)) else value

        for component in self.components.values():
            held = component.state_dict()
            if any(tensor.untyped_storage().data_ptr() in mapped for tensor in tensors_in(held)):
                component.load_state_dict(owned(held))
