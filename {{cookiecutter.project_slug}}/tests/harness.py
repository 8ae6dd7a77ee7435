"""Test harness: launch the real train.py under real torchrun on CPU (gloo), the way a user does, and read what
it saved."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))  # the package, also when it is not installed

from {{ cookiecutter.package_name }}.task import TASK  # noqa: E402 - after the path above

# From task.py, so these tests keep passing after you change the task there: small enough that a run takes
# seconds on 2 CPU cores.
TINY_RUN = TASK.smoke_test_args


def launch(args: list[str], nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """torchrun --standalone with `nproc` CPU ranks; returns the finished process with its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={nproc}", "train.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def saved_checkpoint(ckpt_dir: Path, step: int) -> Path:
    """step-N.pt, or the folder step-N of a sharded (--strategy fsdp2) checkpoint."""
    folder = ckpt_dir / f"step-{step}"
    return folder if folder.is_dir() else ckpt_dir / f"step-{step}.pt"


def saved_state(checkpoint: Path) -> dict:
    """Everything a checkpoint holds, as one dict of tensors and plain values (a sharded one made whole)."""
    if not checkpoint.is_dir():
        return torch.load(checkpoint, weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(checkpoint, whole)
        return torch.load(whole, weights_only=True)


def differences(actual, expected, path: str = "") -> list[str]:
    """Where two saved states differ, bit for bit (tensors) or by value, as paths ("optimizer.state.0.exp_avg")."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        if actual.keys() != expected.keys():
            return [f"{path or 'the state'}: keys {sorted(map(str, actual))} against {sorted(map(str, expected))}"]
        return [found for key in expected
                for found in differences(actual[key], expected[key], f"{path}.{key}".lstrip("."))]
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)) and len(actual) == len(expected):
        return [found for index, (item, expected_item) in enumerate(zip(actual, expected, strict=True))
                for found in differences(item, expected_item, f"{path}.{index}")]
    if isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor):
        same = actual.dtype == expected.dtype and actual.shape == expected.shape and torch.equal(actual, expected)
        return [] if same else [path]
    return [] if type(actual) is type(expected) and actual == expected else [path]
