"""Turn a training checkpoint into plain model weights, for inference or sharing:

    python -m {{ cookiecutter.package_name }}.export checkpoints/step-1000 model.pt   # an FSDP2 folder of shards
    python -m {{ cookiecutter.package_name }}.export checkpoints/step-1000.pt model.pt  # a DDP checkpoint
    python -m {{ cookiecutter.package_name }}.export checkpoints model.pt              # the newest in a --ckpt-dir
    python -m {{ cookiecutter.package_name }}.export --best checkpoints model.pt       # the one --keep-best kept

writes model.pt (the state_dict, for torch.load), model.safetensors (the same tensors, loadable by any
safetensors reader without pickle) and model.json (the task options that rebuild the model, and the step).
A task that evaluates with other weights (TASK's evaluate_with: an EMA) has those written, unless --trained
asks for the weights as trained; TASK's export_weights gives them the task's form (LoRA merged into its
base). One process, no GPU or torchrun needed; the README shows loading them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from .engine.checkpoint.folder import BEST_RECORD, every_checkpoint
from .engine.checkpoint.weights import checkpoint_at, is_whole, load_checkpoint
from .task import TASK, TaskOptions


def best_checkpoint(ckpt_dir: Path) -> Path:
    """The checkpoint that CKPT_DIR/best.json names: the best evaluation of a run with --keep-best."""
    if not ckpt_dir.is_dir() or (ckpt_dir / ".metadata").exists():
        raise SystemExit(f"error: --best takes the --ckpt-dir that holds best.json, not a checkpoint ({ckpt_dir})")
    try:
        step = int(json.loads((ckpt_dir / BEST_RECORD).read_text())["step"])
    except FileNotFoundError:
        raise SystemExit(f"error: {ckpt_dir} has no {BEST_RECORD}: train with --keep-best METRIC:min|max, or "
                         "leave out --best to export the newest checkpoint") from None
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"error: {ckpt_dir / BEST_RECORD} is not what training writes (a step number); the "
                         "next start of the job rewrites it") from None
    for found, path in every_checkpoint(ckpt_dir):
        if found == step and is_whole(path):
            return path
    raise SystemExit(f"error: {ckpt_dir / BEST_RECORD} names step {step}, whose checkpoint is not there whole; "
                     "the next start of the job rewrites it from the newest checkpoint")


def one_storage_each(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors keeps each tensor in its own bytes: tied weights (one storage under two names, e.g. an
    embedding shared with the output layer) are written as copies, which load back into the tie unchanged."""
    seen, separate = set(), {}
    for name, tensor in weights.items():
        storage = tensor.untyped_storage().data_ptr()
        separate[name] = tensor.clone() if storage in seen else tensor.contiguous()
        seen.add(storage)
    return separate


def main(argv: list[str] | None = None) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:  # an environment made without this project's dependencies
        sys.exit("error: export writes model.safetensors with the safetensors package, which is not installed; "
                 "pip install -e . (this project depends on it) or pip install safetensors")

    parser = argparse.ArgumentParser(description="Write a checkpoint's model weights to a .pt file, and beside it "
                                     "the same tensors as .safetensors with a .json of the options that rebuild "
                                     "the model.")
    parser.add_argument("checkpoint", type=Path, help="step-<N>.pt, step-<N>/ or a --ckpt-dir (newest)")
    parser.add_argument("output", type=Path, help="the .pt file to write: the model's state_dict")
    parser.add_argument("--best", action="store_true",
                        help="with a --ckpt-dir: the checkpoint --keep-best kept (best.json), not the newest")
    parser.add_argument("--trained", action="store_true",
                        help=f"the weights as trained, not TASK's evaluate_with ({TASK.evaluate_with!r})"
                        if TASK.evaluate_with else argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.checkpoint.exists():
        sys.exit(f"error: {args.checkpoint} does not exist")
    if args.output.suffix in (".safetensors", ".json"):
        sys.exit(f"error: {args.output} would be overwritten by the export's own {args.output.suffix} file; "
                 f"name the .pt file, e.g. {args.output.with_suffix('.pt')}")
    checkpoint = args.checkpoint
    if args.best:
        checkpoint = best_checkpoint(checkpoint)
    else:
        checkpoint = checkpoint_at(checkpoint)
    evaluated = None if args.trained else TASK.evaluate_with  # what every evaluation used: an EMA, say
    weights, options, step = load_checkpoint(checkpoint, evaluated)
    task_options = {spec.name: options[spec.name] for spec in dataclasses.fields(TaskOptions) if spec.name in options}
    if TASK.export_weights is not None:  # the task's form of them: adapters merged into their base, say
        weights = TASK.export_weights(weights, TaskOptions(**task_options))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, args.output)
    # "format": "pt" is what Hugging Face's loaders look for in a safetensors file written from torch.
    save_file(one_storage_each(weights), args.output.with_suffix(".safetensors"),
              metadata={"format": "pt", "step": str(step)})
    umask = os.umask(0)  # read (one thread here): save_file leaves its file 0600, unlike a plain write
    os.umask(umask)
    args.output.with_suffix(".safetensors").chmod(0o666 & ~umask)  # readable by whom model.pt is
    args.output.with_suffix(".json").write_text(json.dumps({"step": step, "task": task_options}, indent=1) + "\n")
    print(f"wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values()):,} values) "
          f"from {checkpoint} to {args.output}, {args.output.with_suffix('.safetensors').name} and "
          f"{args.output.with_suffix('.json').name}"
          + (f"; the model's tensors of the {evaluated!r} entry, as evaluation used them (--trained: as trained)"
             if evaluated else "") + ("; in the form TASK's export_weights makes" if TASK.export_weights else ""))


if __name__ == "__main__":
    main()
