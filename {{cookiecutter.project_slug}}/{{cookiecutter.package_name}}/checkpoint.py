"""Checkpoints: <ckpt-dir>/step-<N>.pt, written atomically, found newest-valid-first, loaded weights-only."""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .distributed import broadcast_from_main
from .errors import UsageError

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
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-<N>.pt, newest first."""
    found = []
    for path in ckpt_dir.glob("step-*.pt"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match:
            found.append((int(match[1]), path))
    return sorted(found, reverse=True)


def load_newest_valid(ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; unreadable ones are skipped with a warning naming them."""
    for _, path in list_checkpoints(ckpt_dir):
        try:
            return path, torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unreadable file is skipped, loudly
            log.warning("skipping unreadable checkpoint %s (%s: %s)", path, type(error).__name__, error)
    return None


def delete_old_checkpoints(ckpt_dir: Path, keep: int) -> None:
    for _, path in list_checkpoints(ckpt_dir)[keep:]:
        path.unlink(missing_ok=True)


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   progress: TrainingProgress, world_size: int) -> dict:
    """Only tensors and primitives, so it loads with weights_only=True."""
    return {
        "model": model.state_dict(),  # the unwrapped model: no "module." prefix
        "optimizer": optimizer.state_dict(),
        **asdict(progress),
        "world_size": world_size,
        "torch_rng_state": torch.get_rng_state(),
    }


def restore_training_state(state: dict, model: torch.nn.Module,
                           optimizer: torch.optim.Optimizer) -> TrainingProgress:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng_state"])
    return TrainingProgress(step=state["step"], epoch=state["epoch"], samples_in_epoch=state["samples_in_epoch"])


class Checkpointer:
    """Saving and resuming for a data-parallel job: rank 0 writes, every rank resumes from the same file.

    Assumes --ckpt-dir is one folder every node sees (a shared filesystem), as on most clusters.
    """

    def __init__(self, ckpt_dir: str, keep: int, is_main_process: bool, world_size: int):
        self.ckpt_dir = Path(ckpt_dir)
        self.keep = keep
        self.is_main_process = is_main_process
        self.world_size = world_size

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: TrainingProgress) -> None:
        # DDP keeps every replica identical, so one copy is the whole state.
        path = checkpoint_path(self.ckpt_dir, progress.step)
        if not self.is_main_process or path.exists():  # exists: this step was saved already
            return
        save_checkpoint_atomically(training_state(model, optimizer, progress, self.world_size), path)
        delete_old_checkpoints(self.ckpt_dir, self.keep)
        log.info("saved %s", path)

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainingProgress:
        """Load the newest valid checkpoint into model and optimizer; fresh progress when there is none."""
        newest = load_newest_valid(self.ckpt_dir) if self.is_main_process else None
        chosen = broadcast_from_main(str(newest[0]) if newest else None)
        if chosen is None:
            log.info("no checkpoint in %s; starting from scratch", self.ckpt_dir)
            return TrainingProgress()
        if newest is not None:
            state = newest[1]
        else:
            try:
                state = torch.load(chosen, map_location="cpu", weights_only=True)
            except FileNotFoundError:
                raise UsageError(f"rank 0 resumes from {chosen}, which this node cannot see; "
                                 "--ckpt-dir must be a folder shared by all nodes") from None
        progress = restore_training_state(state, model, optimizer)
        log.info("resuming from %s (step %d, epoch %d, %d samples into the epoch)",
                 chosen, progress.step, progress.epoch, progress.samples_in_epoch)
        return progress
