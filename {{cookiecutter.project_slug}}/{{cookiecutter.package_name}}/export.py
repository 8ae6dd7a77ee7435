"""Turn a training checkpoint into one plain file of model weights, for inference or sharing:

    python -m {{ cookiecutter.package_name }}.export checkpoints/step-1000 model.pt   # an FSDP2 folder of shards
    python -m {{ cookiecutter.package_name }}.export checkpoints/step-1000.pt model.pt  # a DDP checkpoint
    python -m {{ cookiecutter.package_name }}.export checkpoints model.pt              # the newest in a --ckpt-dir

One process, no GPU or torchrun needed. Load the result with
    model = task.build_model(options, train_set); model.load_state_dict(torch.load("model.pt", weights_only=True))
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from .checkpoint import list_checkpoints, list_sharded_checkpoints, missing_pieces


def newest_checkpoint(ckpt_dir: Path) -> Path:
    candidates = sorted(list_checkpoints(ckpt_dir) + list_sharded_checkpoints(ckpt_dir), reverse=True)
    for _, path in candidates:
        if path.is_file() or missing_pieces(path) is None:
            return path
    raise SystemExit(f"error: no checkpoint in {ckpt_dir}; pass a step-<N>.pt file or step-<N>/ folder")


def load_model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state_dict from either kind of checkpoint."""
    if checkpoint.is_dir():
        if problem := missing_pieces(checkpoint):
            raise SystemExit(f"error: {checkpoint} is not a complete checkpoint ({problem})")
        with tempfile.TemporaryDirectory() as scratch:  # DCP reassembles every shard into one torch.save file
            whole = Path(scratch) / "whole.pt"
            dcp_to_torch_save(checkpoint, whole)
            return torch.load(whole, weights_only=True)["model"]
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a checkpoint's model weights to one .pt file.")
    parser.add_argument("checkpoint", type=Path, help="step-<N>.pt, step-<N>/ or a --ckpt-dir (newest)")
    parser.add_argument("output", type=Path, help="the .pt file to write: the model's state_dict")
    args = parser.parse_args(argv)
    if not args.checkpoint.exists():
        sys.exit(f"error: {args.checkpoint} does not exist")
    checkpoint = args.checkpoint
    if checkpoint.is_dir() and not (checkpoint / ".metadata").exists():
        checkpoint = newest_checkpoint(checkpoint)
    weights = load_model_weights(checkpoint)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, args.output)
    print(f"wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values()):,} values) "
          f"from {checkpoint} to {args.output}")


if __name__ == "__main__":
    main()
