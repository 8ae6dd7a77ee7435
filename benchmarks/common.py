"""Shared by the benchmarks: bake the template once into a temporary folder and run its train.py."""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

TEMPLATE_ROOT = Path(__file__).resolve().parents[1]


def scratch_dir(prefix: str = "ddp-bench-") -> Path:
    """A temporary folder removed when the benchmark exits (a run's checkpoints reach gigabytes, and a disk
    filled by old runs fails the next job); DDP_BENCH_KEEP=1 keeps it, to read its logs again."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if os.environ.get("DDP_BENCH_KEEP") == "1":
        print(f"keeping {path}", file=sys.stderr)
    else:
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def bake_default_project(**answers: str) -> Path:
    """The template with its default answers, but for `answers` (the optional parts a benchmark runs)."""
    return Path(cookiecutter(str(TEMPLATE_ROOT), no_input=True, output_dir=str(scratch_dir()), extra_context=answers))


def spread(values: list[float], figure: str = ".2f") -> str:
    """"median (min-max)" of repeated measurements, each formatted as `figure`."""
    return f"{statistics.median(values):{figure}} ({min(values):{figure}}-{max(values):{figure}})"


def child_env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}
