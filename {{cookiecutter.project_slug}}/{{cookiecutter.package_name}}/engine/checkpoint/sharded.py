"""FSDP2 checkpoints: <ckpt-dir>/step-<N>/ folders of torch.distributed.checkpoint (DCP) shards, every rank
writing its own, loadable by any number of ranks (DCP reshards on load).

A save goes to .step-<N>.partial/ and is renamed to step-<N>/ only after every rank has written its shards
and DCP has written the folder's .metadata, so a crash mid-save never leaves a folder that looks complete.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shutil
import threading
import uuid
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import all_gather_objects, barrier, broadcast_object, first_node_on_its_storage
from ..distributed import new_lazy_gloo_group, session_timeout
from ..errors import UsageError
from ..optimizers import member_optimizers
from ..processes import recording_job_sockets
from ..reproducibility import gather_rng_states
from .common import (
    Checkpointer,
    hold_checkpoint_folder,
)
from .folder import fsync_directory, list_sharded_checkpoints, set_aside, write_json

log = logging.getLogger(__name__)

# torch.distributed.checkpoint is imported where it is used: it imports DTensor, which costs every rank's
# start (and restart) half a second where nothing is sharded.

OPTIONS_FILE = "options.json"  # the TrainOptions the run had, beside DCP's files
# The CRC-32 of every other file in the folder, written once DCP has written them all and checked before a
# resume: DCP records no checksum, and a flipped bit in a shard (bit rot, a bad copy) would load silently.
CHECKSUMS_FILE = "checksums.json"
RANK_FILE = re.compile(r"__(\d+)_")  # DCP's shard files: __<rank>_<n>.distcp, each written by that rank


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):  # within a core's cache: 16 MiB chunks were half as fast
            crc = zlib.crc32(chunk, crc)
    return crc


def own_checksums(folder: Path, rank: int) -> dict[str, int]:
    """The CRC-32 of the files `rank` wrote into `folder` (its shards; rank 0 also DCP's .metadata), read back
    by the rank that wrote them, while they are in its page cache: the cost of a save is spread over the ranks."""
    def own(name: str) -> bool:
        match = RANK_FILE.match(name)
        return int(match[1]) == rank if match else rank == 0
    # By name first: at thousands of ranks, each rank asking the shared file system about every file is N^2.
    return {entry.name: file_crc32(Path(entry.path)) for entry in sorted(os.scandir(folder), key=lambda e: e.name)
            if own(entry.name) and entry.is_file()}


def changed_files(folder: Path, rank: int, world_size: int) -> list[str]:
    """This rank's share of the files of `folder` whose bytes are not those its checksums recorded (a
    collective's part: each rank checks every world_size-th file). [] for a folder saved before checksums were."""
    try:
        recorded = json.loads((folder / CHECKSUMS_FILE).read_text())
    except FileNotFoundError:
        return []
    except ValueError:
        return [CHECKSUMS_FILE] if rank == 0 else []
    return [name for name in sorted(recorded)[rank::world_size]
            if not (folder / name).is_file() or file_crc32(folder / name) != recorded[name]]


def saved_options(folder: Path) -> dict | None:
    """The TrainOptions a step-<N>/ folder was saved with (None: saved before options were recorded, or the file
    is torn)."""
    try:
        return json.loads((folder / OPTIONS_FILE).read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("%s is torn; resuming without comparing options", folder / OPTIONS_FILE)
        return None


def missing_pieces(folder: Path) -> str | None:
    """Why a checkpoint folder cannot be loaded (no metadata, a shard file missing or cut short), or None.

    Reads only DCP's index: every byte range it lists must exist, so a torn copy is caught before loading.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unreadable index disqualifies the folder
        return f"unreadable .metadata ({type(error).__name__}: {error})"
    needed: dict[str, int] = {}
    for item in metadata.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        path = folder / name
        if not path.is_file() or path.stat().st_size < size:
            return f"{name} is missing or shorter than {size} bytes"
    return None


class ShardedCheckpointer(Checkpointer):
    """Saving and resuming for FSDP2, with the same rules as the replicated kind: newest valid step-<N>/ wins,
    incomplete ones are skipped with a warning, newest --keep-checkpoints are kept.

    Every rank holds only its shards, so every rank writes; --ckpt-dir must be one folder all nodes share.
    """

    def __init__(self, options, recorded, env, device, **components):
        super().__init__(options, recorded, env, device, **components)
        is_writer, storages = first_node_on_its_storage(self.ckpt_dir, env, device)
        self.lease = hold_checkpoint_folder(self.ckpt_dir, env, device, holder=is_writer)
        if storages > 1:
            raise UsageError(f"--ckpt-dir {self.ckpt_dir} is a different folder on each node, but --strategy "
                             "fsdp2 checkpoints are written by every rank; use a folder all nodes share")
        log.info("sharded checkpoints in %s, written by all %d ranks", self.ckpt_dir, env.world_size)
        if env.is_main_process:  # under the lease: no other job's save is in progress here
            recover_published(self.ckpt_dir)
            for leftover in self.ckpt_dir.glob(".step-*.partial"):
                shutil.rmtree(leftover, ignore_errors=True)
                log.warning("removed %s, left by a save that was interrupted", leftover)
            for leftover in self.ckpt_dir.glob(".step-*.deleting-*"):  # retention cut short by the job's end
                shutil.rmtree(leftover, ignore_errors=True)
        barrier(device)
        # The model and every optimizer, whatever its name, go through torch's distributed state_dict API:
        # parameter names without wrapper prefixes, optimizer state keyed by those names (not by position) and
        # filled in before an optimizer's first step (a fresh optimizer's own state_dict() is empty, and a
        # load into it would restore nothing, silently), each rank's tensors only its shards.
        self.restored_by_read = frozenset(
            name for name, component in components.items()
            if name == "model" or isinstance(component, torch.optim.Optimizer))
        self._metadata: tuple[Path, dict] | None = None  # (folder, DCP's index of it), read once per resume
        self._planner = save_planner()
        # DCP's async save runs collectives in a thread of its own: they need a group of their own.
        self._save_group = (async_save_group(session_timeout())
                            if options.async_save and dist.is_initialized() else None)
        self._stager = reused_stager(device) if self._save_group is not None else None
        self._deleting: threading.Thread | None = None

    def _state(self, progress: Any, world_size: int) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model = self.components["model"]
        state = {}
        for name, component in self.components.items():
            if name == "model":
                state[name] = get_model_state_dict(model)
            elif isinstance(component, torch.optim.Optimizer):
                state[name] = get_optimizer_state_dict(model, member_optimizers(component))
            else:
                state[name] = component.state_dict()  # lr schedule, gradient scaler, an EMA: DCP takes any
        # Every rank's own CPU and CUDA generator states (a collective).
        return {**state, **gather_rng_states(self.env, self.device),
                "progress": {**asdict(progress), "world_size": world_size}}

    def write(self, progress: Any) -> Path | None:
        from torch.distributed import checkpoint as dcp

        self.wait()  # the previous save (--async-save), on every rank
        final = self.ckpt_dir / f"step-{progress.step}"
        partial = self.ckpt_dir / f".step-{progress.step}.partial"
        state = self._state(progress, self.env.world_size)
        if self._save_group is None:  # all shards and .metadata, written now
            dcp.save(state, checkpoint_id=partial, planner=self._planner)
            checksums = all_gather_objects(own_checksums(partial, self.env.rank))
            if self.env.is_main_process:
                self.publish_and_prune(partial, final, self.kept_steps(), checksums)
            barrier(self.device)
        else:  # copied to host memory before async_save returns; DCP's thread writes, and exchanges with the
            # other ranks on a gloo group of its own (not the side group, which the loop uses meanwhile)
            stager = {"async_stager": self._stager} if self._stager is not None else {}
            saving = dcp.async_save(state, checkpoint_id=partial, planner=self._planner,
                                    process_group=self._save_group, **stager)
            saving = getattr(saving, "upload_completion", saving)  # a response, not a future, in newer torch
            self.in_background(self.publish_when_written, saving, partial, final, self.kept_steps())
        return final if self.env.is_main_process else None

    def publish_when_written(self, saving, partial: Path, final: Path, kept: set[int]) -> None:
        saving.result()  # this rank's shards and, on rank 0, .metadata: once rank 0 has it, the save is whole
        # On the save's own group, which DCP's thread no longer uses: the next save waits for this thread.
        own = own_checksums(partial, self.env.rank)
        checksums = [None] * self.env.world_size if self.env.is_main_process else None
        dist.gather_object(own, checksums, dst=0, group=self._save_group)
        if self.env.is_main_process:
            self.publish_and_prune(partial, final, kept, checksums)
        # No rank's wait() returns before the folder is published: a job's last save, then its exit, must not let
        # a scheduler end rank 0's machine while it renames the folder into place (srun --kill-on-bad-exit).
        dist.barrier(group=self._save_group)

    def publish_and_prune(self, partial: Path, final: Path, kept: set[int], checksums: list[dict]) -> None:
        """Rank 0: the options and every file's checksum (`checksums`: each rank's of its own files) beside the
        shards, the folder in place, older ones deleted (never the one just written, whatever older ones claim,
        nor those of the `kept` steps: the best)."""
        write_json(partial / OPTIONS_FILE, self.recorded.values, durable=True)
        recorded = {name: crc for own in checksums for name, crc in own.items()}
        recorded |= {path.name: file_crc32(path) for path in partial.iterdir()  # a file no rank claimed
                     if path.is_file() and path.name not in recorded}
        write_json(partial / CHECKSUMS_FILE, recorded, durable=True)
        publish(partial, final)
        self.delete_in_background([old for step, old in list_sharded_checkpoints(self.ckpt_dir)[self.keep:]
                                   if old != final and step not in kept])

    def wait(self) -> None:
        """The save in the background, and the retention thread: the last save returns only once both are
        done, inside the watchdog's slow phase, not during the interpreter's exit that would wait for them."""
        super().wait()
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    def delete_in_background(self, folders: list[Path]) -> None:
        """Retention without keeping every rank waiting (at the barrier after a save, or in the next step's
        collective) while rank 0 deletes a folder of one file per rank: each is renamed out of the checkpoints
        at once, then deleted by a thread (as torchtitan purges). One deletion at a time; what a killed job
        leaves half deleted, the next start removes."""
        doomed = []
        for folder in folders:
            aside = folder.with_name(f".{folder.name}.deleting-{uuid.uuid4().hex}")
            os.replace(folder, aside)
            doomed.append(aside)
        if self._deleting is not None:
            self._deleting.join()
        self._deleting = threading.Thread(target=lambda: [shutil.rmtree(aside, ignore_errors=True)
                                                          for aside in doomed], name="checkpoint-retention")
        self._deleting.start()

    def find_newest(self) -> tuple[Path, dict | None] | None:
        """The newest folder that is complete (rank 0 reads DCP's index) and whose every byte is what was written
        (every rank checks its share of the files' checksums). A collective."""
        folders = iter(list_sharded_checkpoints(self.ckpt_dir) if self.env.is_main_process else [])
        while True:
            newest = None
            for _, folder in folders:  # rank 0: the next complete folder
                if not (problem := missing_pieces(folder)):
                    newest = folder
                    break
                log.warning("skipping incomplete checkpoint %s (%s)", folder, problem)
            newest = broadcast_object(newest)
            if newest is None:
                return None
            changed = sorted(name for names in all_gather_objects(
                changed_files(newest, self.env.rank, self.env.world_size)) for name in names)
            if not changed:
                return newest, saved_options(newest)
            if self.env.is_main_process:
                log.warning("skipping unreadable checkpoint %s (its bytes changed after it was written: the CRC-32 "
                            "of %s is not the one recorded at the save (bit rot on the storage, or a bad copy)); "
                            "kept as %s", newest,
                            ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else ""),
                            set_aside(newest).name)

    def saved_metadata(self, source: Path) -> dict:
        """DCP's index of `source` (path in the state dict -> what is stored), read once per resume."""
        from torch.distributed.checkpoint import FileSystemReader

        if self._metadata is None or self._metadata[0] != source:
            self._metadata = source, FileSystemReader(str(source)).read_metadata().state_dict_metadata
        return self._metadata[1]

    def saved_entries(self, source: Path) -> tuple[set[str], set[str]]:
        top_level, progress_fields = saved_names(self.saved_metadata(source))
        empty = {name for name, component in self.components.items() if not component.state_dict()}
        return (top_level | empty) - {"torch_rng_state", "cpu_rng_states", "cuda_rng_states", "progress"}, \
            progress_fields

    def read(self, source: Path, components: set[str]) -> dict:
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        metadata = self.saved_metadata(source)
        top_level, progress_fields = saved_names(metadata)
        # The shape to fill, less what the folder does not hold (DCP refuses a key it cannot find).
        # An empty state (a disabled gradient scaler) adds no key to a folder, and none to the load either.
        state = {name: value for name, value in self._state(self.progress_type(), world_size=0).items()
                 if (name in top_level or value == {}) and (name in components or name not in self.components)}
        state["progress"] = {name: value for name, value in state["progress"].items()
                             if name in progress_fields | {"world_size"}}
        for name in ("cpu_rng_states", "cuda_rng_states"):  # a row per rank of the job that saved: its size
            if isinstance(saved := metadata.get(name), TensorStorageMetadata):
                state[name] = torch.empty(saved.size, dtype=torch.uint8)
            elif saved is not None:  # saved as lists before the rows were bytes: DCP replaces the list whole
                state[name] = []
        # Into this rank's shards, from whichever ranks saved them (DCP reads the index once more, itself).
        dcp.load(state, checkpoint_id=source)
        self._metadata = None  # at thousands of ranks, a record per shard of every tensor: not kept
        model = self.components["model"]
        for name in [name for name in self.components if name in self.restored_by_read & components]:  # collectives:
            if name == "model":  # the same order on every rank
                set_model_state_dict(model, state[name])
            else:
                set_optimizer_state_dict(model, member_optimizers(self.components[name]), state[name])
        return state


def async_save_group(timeout) -> dist.ProcessGroup:
    """A lazily connected gloo group for DCP's async save, whose collectives (plans gathered to rank 0 and
    scattered back, the metadata's results gathered) run in DCP's own thread: rank 0 talks to every rank, each
    other rank to rank 0 alone. Those connections are made here, while the job's sockets are recorded, so
    DataLoader workers forked later close them."""
    group = new_lazy_gloo_group(timeout)
    with recording_job_sockets():
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(dist.get_rank(), gathered, dst=0, group=group)
        received = [None]
        dist.scatter_object_list(received, gathered, src=0, group=group)
        dist.broadcast_object_list(received, src=0, group=group)
    return group


def reused_stager(device: torch.device):
    """One stager for every --async-save of the run (torchtitan's way): its host copies are allocated once, pinned
    on CUDA, where a new stager per save allocated them anew each time. Its copy runs before async_save returns
    (use_async_staging=False): the next optimizer step changes the parameters in place, so a copy still running in
    a thread could save a model half updated. None on a torch without DefaultStager (2.8 and older): DCP's own."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import staging

    if not hasattr(staging, "DefaultStager") or "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return None
    on_cuda = device.type == "cuda"
    return staging.DefaultStager(staging.StagingOptions(
        use_pinned_memory=on_cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=on_cuda))


def save_planner():
    """DCP's default planner, caching plans where this torch offers it: every save gathers each rank's plan to
    rank 0, which checks and merges them (N plans on one rank); with the cache, a rank whose plan is the last
    save's (every save of one model, after the first) sends an empty one and reuses the merged plan."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    if "enable_plan_caching" in inspect.signature(DefaultSavePlanner).parameters:
        return DefaultSavePlanner(enable_plan_caching=True)
    return DefaultSavePlanner()


def saved_names(metadata: dict) -> tuple[set[str], set[str]]:
    """(the top-level names a DCP folder holds, the progress fields it holds), from its metadata, which names
    every value by its path in the state dict: model.<parameter>, progress.step, torch_rng_state."""
    paths = [path.split(".") for path in metadata]
    return {path[0] for path in paths}, {path[1] for path in paths if path[0] == "progress" and len(path) > 1}


def publish(partial: Path, final: Path) -> None:
    """Rename the finished folder into place, and make the rename durable. A same-step folder from an earlier
    attempt is moved aside first (a folder cannot be renamed over a full one) and deleted only once the new one
    is in place; a kill in between leaves it aside, and recover_published() puts it back."""
    stale = final.with_name(f".{final.name}.stale-{uuid.uuid4().hex}")
    if final.exists():
        os.replace(final, stale)
    os.replace(partial, final)
    fsync_directory(final.parent)
    shutil.rmtree(stale, ignore_errors=True)


def recover_published(ckpt_dir: Path) -> None:
    """After a kill during publish(): a step moved aside whose new folder never arrived goes back in place; one
    that was replaced is deleted."""
    for stale in ckpt_dir.glob(".step-*.stale-*"):
        final = ckpt_dir / stale.name[1:].split(".stale-")[0]
        if final.exists():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(stale, final)
            log.warning("put %s back in place: a save of the same step was interrupted", final)
