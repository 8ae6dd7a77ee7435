"""Test harness: launch the real train.py under real torchrun on CPU (gloo), the way a user does."""

import os
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))  # the package, also when it is not installed

from {{ cookiecutter.package_name }}.task import TASK  # noqa: E402 - after the path above

# From task.py, so these tests keep passing after you change the task there: small enough that a run takes
# seconds on 2 CPU cores, learnable enough that loss clearly falls.
TINY_RUN = TASK.smoke_test_args


def launch(args: list[str], nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """torchrun --standalone with `nproc` CPU ranks; returns the finished process with its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={nproc}", "train.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
