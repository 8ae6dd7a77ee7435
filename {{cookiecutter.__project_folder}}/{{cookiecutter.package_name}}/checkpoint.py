"""Checkpoints: <ckpt-dir>/step-<N>.pt, written atomically, found newest-valid-first, loaded weights-only."""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .distributed import DistEnv, all_reduce_int, barrier, broadcast_object
from .options import TrainOptions, UsageError, flag
from .parallel import sync_buffers_from_main
from .reproducibility import gather_cuda_rng_states, restore_cuda_rng_state

log = logging.getLogger(__name__)
CHECKPOINT_NAME = re.compile(r"step-(\d+)\.pt")


@dataclass
class TrainingProgress:
    """Where training stands: what a resumed run needs besides weights and optimizer state."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0
    samples_in_epoch: int = 0  # global samples (all ranks) of this epoch already trained on

    def advance(self, global_batch_size: int) -> None:
        self.step += 1
        self.samples_in_epoch += global_batch_size

    def finished(self, epochs: int, max_steps: int | None) -> bool:
        return self.epoch >= epochs or (max_steps is not None and self.step >= max_steps)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.samples_in_epoch = 0


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step}.pt"


def check_checkpoint_dir(ckpt_dir: str) -> None:
    """Create --ckpt-dir and prove it is writable, so a bad path fails now and not after hours of training."""
    try:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=ckpt_dir):
            pass
    except OSError as error:
        raise UsageError(f"--ckpt-dir {ckpt_dir} cannot be written ({error.strerror}); choose another folder") from None


def save_checkpoint_atomically(state: dict, path: Path) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over the final name.

    A crash at any point leaves either the previous checkpoint set or the new file complete, never a
    truncated step-N.pt. The temporary name does not match step-<N>.pt, so it is never loaded.
    """
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(folder: Path) -> None:
    """Make a rename into `folder` durable, not just the renamed file's contents."""
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def checkpoint_mismatch(path: Path, error: Exception) -> UsageError:
    """The one line for a checkpoint that loads but does not fit what this run built."""
    first_line = str(error).strip().splitlines()[0]
    return UsageError(f"{path} does not fit this model or optimizer ({first_line}); "
                      "use another --ckpt-dir, or the options it was trained with")


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-<N>.pt, newest first."""
    found = []
    for path in ckpt_dir.glob("step-*.pt"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match:
            found.append((int(match[1]), path))
    return sorted(found, reverse=True)


REQUIRED_KEYS = {"model", "optimizer", "step", "epoch", "samples_in_epoch", "torch_rng_state"}


def load_newest_valid(ckpt_dir: Path, required_keys: set[str] = REQUIRED_KEYS) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads and is complete; bad ones are skipped with a warning naming them."""
    for step, path in list_checkpoints(ckpt_dir):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            missing = required_keys - set(state)
            if missing or state["step"] != step:
                raise ValueError(f"missing {sorted(missing)}" if missing else f"holds step {state['step']}")
            return path, state
        except Exception as error:  # noqa: BLE001 - any unreadable file is skipped, loudly
            log.warning("skipping unreadable checkpoint %s (%s: %s)", path, type(error).__name__, error)
    return None


def delete_old_checkpoints(ckpt_dir: Path, keep: int) -> None:
    for _, path in list_checkpoints(ckpt_dir)[keep:]:
        path.unlink(missing_ok=True)


def training_state(components: dict, progress: TrainingProgress, world_size: int) -> dict:
    """Only tensors and primitives, so it loads with weights_only=True."""
    return {
        # "model" is the unwrapped model: no "module." or "_orig_mod." prefix.
        **{name: component.state_dict() for name, component in components.items()},
        **asdict(progress),
        "world_size": world_size,
        "torch_rng_state": torch.get_rng_state(),
    }


def restore_training_state(state: dict, components: dict) -> TrainingProgress:
    for name, component in components.items():
        component.load_state_dict(state[name])
    torch.set_rng_state(state["torch_rng_state"])
    return TrainingProgress(step=state["step"], epoch=state["epoch"], samples_in_epoch=state["samples_in_epoch"])


# Options a checkpoint cannot be resumed under once changed: its tensors would not fit them.
FIXED_UNDER_A_CHECKPOINT = ("model", "num_classes", "vocab_size", "block_size", "n_layer", "n_head", "n_embd")
# What a changed option does to a resumed run, where that is not plain from its --help.
EFFECT_OF_CHANGING = {
    "epochs": "the LR schedule is re-planned over the new --epochs from this step on",
    "lr": "the LR schedule continues from this step towards the new peak",
    "lr_schedule": "the new schedule applies from this step on",
    "warmup_steps": "the LR schedule is re-planned from this step on",
    "seed": "the rest of this epoch and later epochs draw another sample order",
    "batch_size": "this epoch continues with its unseen samples, in batches of the new size",
    "grad_accum": "this epoch continues with its unseen samples, in steps of the new size",
}
# Expected to change between runs of one job; not worth a line.
CHANGED_BY_EVERY_RESUME = ("max_steps", "ckpt_dir")


def check_resumed_options(saved: dict | None, options: TrainOptions, source: Path) -> None:
    """Stop on a changed option the checkpoint cannot take; log the others in one line with their effect."""
    if not saved:  # a checkpoint from before options were recorded
        return
    current = asdict(options)
    changed = [name for name, value in current.items()
               if name in saved and saved[name] != value and name not in CHANGED_BY_EVERY_RESUME]
    fixed = [name for name in changed if name in FIXED_UNDER_A_CHECKPOINT]
    if fixed:
        was = ", ".join(f"--{flag(name)} {saved[name]}" for name in fixed)
        asked = ", ".join(f"--{flag(name)} {current[name]}" for name in fixed)
        raise UsageError(f"{source} was trained with {was}, but this run asks for {asked}; "
                         "resume with the same values, or start a new run with another --ckpt-dir")
    if changed:
        log.info("resuming with changed options: %s", "; ".join(
            f"--{flag(name)} {saved[name]} -> {current[name]}"
            + (f" ({EFFECT_OF_CHANGING[name]})" if name in EFFECT_OF_CHANGING else "") for name in changed))


def check_checkpoint_format(ckpt_dir: Path, strategy: str) -> None:
    """A folder of the other strategy's checkpoints would otherwise be ignored, and training start over."""
    folders = [path for path in ckpt_dir.glob("step-*") if path.is_dir()]
    files = list_checkpoints(ckpt_dir)
    if strategy == "ddp" and folders and not files:
        raise UsageError(f"--ckpt-dir {ckpt_dir} holds --strategy fsdp2 checkpoints (step-<N>/ folders); "
                         "resume with --strategy fsdp2, or use another --ckpt-dir")
    if strategy == "fsdp2" and files and not folders:
        raise UsageError(f"--ckpt-dir {ckpt_dir} holds --strategy ddp checkpoints (step-<N>.pt files); "
                         "resume with --strategy ddp, or use another --ckpt-dir")


def elect_writers(ckpt_dir: Path, env: DistEnv, device: torch.device) -> tuple[bool, int]:
    """(is this rank a writer, how many writers): one per distinct storage behind --ckpt-dir.

    The first rank of every node leaves a probe file; a node writes only if no lower-numbered node's
    probe is visible to it, i.e. it is the first node on its storage. A collective: call on every rank.
    """
    token = broadcast_object(uuid.uuid4().hex if env.is_main_process else None)
    probe = ckpt_dir / f".writer-probe-{token}-node{env.node_rank}"
    if env.is_local_main_process:
        probe.touch()
    barrier(device)
    is_writer = False
    if env.is_local_main_process:
        visible = [int(path.name.rsplit("node", 1)[1]) for path in ckpt_dir.glob(f".writer-probe-{token}-*")]
        is_writer = min(visible) == env.node_rank
    barrier(device)
    if env.is_local_main_process:
        probe.unlink()
    writers = all_reduce_int(int(is_writer), device, "sum")
    return is_writer, writers


def build_checkpointer(options: TrainOptions, env: DistEnv, device: torch.device, **components):
    """A Checkpointer (one step-<N>.pt) for DDP, a ShardedCheckpointer (step-<N>/ folders) for FSDP2."""
    check_checkpoint_format(Path(options.ckpt_dir), options.strategy)
    if options.strategy == "fsdp2":
        from .sharded_checkpoint import ShardedCheckpointer  # here, not at the top: it imports this module

        checkpointer = ShardedCheckpointer(options.ckpt_dir, options.keep_checkpoints, env, device, **components)
    else:
        checkpointer = Checkpointer(options.ckpt_dir, options.keep_checkpoints, env, device, **components)
    checkpointer.options = options  # recorded in every checkpoint, compared on resume
    return checkpointer


class Checkpointer:
    """Saving and resuming for a data-parallel job, whether or not --ckpt-dir is shared between nodes.

    DDP keeps every replica's parameters identical and buffers are synced from rank 0 before saving, so one
    copy is the whole state. On a shared filesystem rank 0 alone
    writes it; on node-local disks the first rank of each node writes its node's copy, because after a
    restart rank 0 may land on another machine. Resuming, the ranks agree on the newest valid step any node
    holds and the rank that holds it broadcasts it.

    `components` are what a checkpoint holds besides progress: anything with state_dict/load_state_dict
    (model, optimizer, lr schedule, gradient scaler). Add yours here.
    """

    def __init__(self, ckpt_dir: str, keep: int, env: DistEnv, device: torch.device, **components):
        self.components = components
        self.required_keys = REQUIRED_KEYS | set(components)
        self.ckpt_dir = Path(ckpt_dir)
        self.keep = keep
        self.env = env
        self.device = device
        self.last_saved_step: int | None = None
        self.is_writer, writers = elect_writers(self.ckpt_dir, env, device)
        log.info("checkpoints in %s, written by %d %s", self.ckpt_dir, writers,
                 "node (shared folder)" if writers == 1 else "nodes (node-local folders)")
        if self.is_writer:
            self._remove_interrupted_saves()

    def _remove_interrupted_saves(self) -> None:
        # Only this rank writes here, and it is not saving yet: any temporary file is a dead save's.
        for leftover in self.ckpt_dir.glob(".step-*.pt.*.tmp"):
            leftover.unlink(missing_ok=True)
            log.warning("removed %s, left by a save that was interrupted", leftover)

    def save(self, progress: TrainingProgress) -> None:
        if progress.step == self.last_saved_step:  # e.g. the final save right after a periodic one
            return
        self.last_saved_step = progress.step
        sync_buffers_from_main(self.components["model"])  # a collective: every rank saves at the same steps
        cuda_rng_states = gather_cuda_rng_states(self.env, self.device)  # each rank's own, a collective too
        if not self.is_writer:
            return
        started = time.perf_counter()
        path = checkpoint_path(self.ckpt_dir, progress.step)
        state = training_state(self.components, progress, self.env.world_size)
        save_checkpoint_atomically({**state, "cuda_rng_states": cuda_rng_states,
                                    "options": asdict(self.options)}, path)
        delete_old_checkpoints(self.ckpt_dir, self.keep)
        log.info("saved %s in %.2f s", path, time.perf_counter() - started)

    def resume(self) -> TrainingProgress:
        """Load the newest valid checkpoint any node holds into the components (a collective)."""
        newest = load_newest_valid(self.ckpt_dir, self.required_keys) if self.is_writer else None
        own_step = newest[1]["step"] if newest else -1
        best_step = all_reduce_int(own_step, self.device, "max")
        if best_step < 0:
            log.info("no valid checkpoint in %s; starting from scratch", self.ckpt_dir)
            return TrainingProgress()
        # The lowest rank holding the newest step sends it; with a shared folder that is rank 0.
        source = all_reduce_int(self.env.rank if own_step == best_step else self.env.world_size, self.device, "min")
        path, state = broadcast_object(newest if self.env.rank == source else None, source_rank=source)
        check_resumed_options(state.get("options"), self.options, path)
        try:
            progress = restore_training_state(state, self.components)
        except (RuntimeError, ValueError, KeyError) as error:
            raise checkpoint_mismatch(path, error) from None
        restore_cuda_rng_state(state.get("cuda_rng_states"), self.env, self.device)
        self.last_saved_step = progress.step
        log.info("resuming from %s (step %d, epoch %d, %d samples into the epoch, saved by %d ranks)",
                 path, progress.step, progress.epoch, progress.samples_in_epoch, state["world_size"])
        return progress
