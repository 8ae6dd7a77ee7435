"""A checkpoint's model weights read in one plain process (no process group, no GPU): a step-<N>.pt file, or an
FSDP2 step-<N>/ folder whose shards DCP reassembles, for export and for inference (a task's sampling)."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from .folder import every_checkpoint
from .sharded import missing_pieces, saved_options


def is_whole(checkpoint: Path) -> bool:
    """A step-<N>.pt file, or a step-<N>/ folder with every shard its index names."""
    return checkpoint.is_file() or missing_pieces(checkpoint) is None


def newest_checkpoint(ckpt_dir: Path) -> Path:
    for _, path in every_checkpoint(ckpt_dir):
        if is_whole(path):
            return path
    raise SystemExit(f"error: no checkpoint in {ckpt_dir}; pass a step-<N>.pt file or step-<N>/ folder")


def checkpoint_at(path: Path) -> Path:
    """`path` if it is a checkpoint (a step-<N>.pt file or a step-<N>/ folder with DCP's .metadata), else the
    newest whole checkpoint of the --ckpt-dir it names."""
    return newest_checkpoint(path) if path.is_dir() and not (path / ".metadata").exists() else path


def load_checkpoint(checkpoint: Path, weights: str | None = None) -> tuple[dict[str, torch.Tensor], dict, int]:
    """(the model's full state_dict, the options the run had, its step) from either kind of checkpoint; with
    `weights`, the name of a task state entry (an EMA) whose tensors replace the model's of the same names."""
    entries = ("model",) if weights is None else ("model", weights)
    if checkpoint.is_dir():
        if problem := missing_pieces(checkpoint):
            raise SystemExit(f"error: {checkpoint} is not a complete checkpoint ({problem})")
        state = entries_and_step(checkpoint, entries)
        options, step = saved_options(checkpoint) or {}, int(state["progress"]["step"])
    else:
        try:
            state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
            raise SystemExit(f"error: {checkpoint} cannot be read ({str(error).splitlines()[0]}); pass another "
                             "checkpoint, or the --ckpt-dir to take its newest whole one") from None
        options, step = state.get("options", {}), int(state["step"])
    model = state["model"]
    if weights is not None:
        replaced = state.get(weights) or {}
        if not replaced or not replaced.keys() <= model.keys():
            raise SystemExit(f"error: {checkpoint} holds no {weights!r} entry of the model's tensors (TASK's "
                             "evaluate_with); export the weights as trained with --trained")
        model = {**model, **replaced}
    return model, options, step


def entries_and_step(folder: Path, entries: tuple[str, ...]) -> dict:
    """{entry: its whole state_dict, ..., "progress": {"step": N}} from a DCP folder, in this one process: DCP
    reads each tensor's shards from every rank's file into one tensor. Only these entries' values are read, not
    the optimizer's moments beside them (twice the model's size for Adam), nor written to a scratch file first,
    as DCP's own dcp_to_torch_save does."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    saved = reader.read_metadata().state_dict_metadata
    state: dict = {"progress": {"step": 0}}
    for entry in entries:
        state[entry] = {name.removeprefix(f"{entry}."): (torch.empty(value.size, dtype=value.properties.dtype)
                                                         if isinstance(value, TensorStorageMetadata) else None)
                        for name, value in saved.items() if name.startswith(f"{entry}.")}
    dcp.load(state, storage_reader=reader)  # no process group here: one process
    return state
