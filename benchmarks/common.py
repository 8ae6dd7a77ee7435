"""Shared by the benchmarks: bake the template once into a temporary folder and run its train.py."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

TEMPLATE_ROOT = Path(__file__).resolve().parents[1]


def bake_default_project() -> Path:
    output = Path(tempfile.mkdtemp(prefix="ddp-bench-"))
    return Path(cookiecutter(str(TEMPLATE_ROOT), no_input=True, output_dir=str(output)))


def spread(values: list[float], figure: str = ".2f") -> str:
    """"median (min-max)" of repeated measurements, each formatted as `figure`."""
    return f"{statistics.median(values):{figure}} ({min(values):{figure}}-{max(values):{figure}})"


def child_env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}
