"""Checkpoints, one package whose imports run one way: common (what both kinds share) <- replicated (DDP:
step-<N>.pt files) and sharded (FSDP2: step-<N>/ folders of DCP shards) <- this module, which picks one."""

from __future__ import annotations

from pathlib import Path

import torch

from ..distributed import DistEnv
from ..errors import UsageError
from .common import Checkpointer, CheckpointOptions, RecordedOptions, check_checkpoint_dir
from .folder import list_checkpoints, list_sharded_checkpoints
from .replicated import ReplicatedCheckpointer
from .sharded import ShardedCheckpointer, missing_pieces

__all__ = ["Checkpointer", "CheckpointOptions", "RecordedOptions", "build_checkpointer", "check_checkpoint_dir",
           "list_checkpoints", "list_sharded_checkpoints", "missing_pieces"]


def build_checkpointer(options: CheckpointOptions, recorded: RecordedOptions, env: DistEnv, device: torch.device,
                       sharded: bool, **components) -> Checkpointer:
    """One step-<N>.pt per save for DDP, step-<N>/ folders of shards for FSDP2 (`sharded`)."""
    check_checkpoint_format(Path(options.ckpt_dir), "fsdp2" if sharded else "ddp")
    kind = ShardedCheckpointer if sharded else ReplicatedCheckpointer
    return kind(options, recorded, env, device, **components)


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
