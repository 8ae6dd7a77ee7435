"""The environment the suite runs in: the template's root, the venv's tools, child processes' environment,
free ports, and the requirement that CI runs every test."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE_ROOT = Path(__file__).resolve().parents[2]


BIN = Path(sys.executable).parent  # the one venv the suite runs in: cookiecutter, torchrun, ruff, shellcheck


# .ci/run sets this so that a test needing root or system packages fails instead of skipping there.
REQUIRE_ALL = os.environ.get("DDP_TEMPLATE_REQUIRE_ALL") == "1"


def require(condition: bool, reason: str) -> pytest.MarkDecorator:
    """Skip on a machine that lacks what the test needs (a laptop); in CI run it anyway, so it fails there
    instead of passing by skipping."""
    return pytest.mark.skipif(not condition and not REQUIRE_ALL, reason=reason)


def tool_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: this venv first on PATH, one thread per rank."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def run(command: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=tool_env(**env), capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A TCP port nothing listens on now, for a rendezvous endpoint on loopback. Just below the kernel's
    ephemeral range, which a port of its choosing (bind to port 0, as this used to) is in: there the other
    jobs' connections and stores could take it before torchrun binds it, seconds later."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low, high = map(int, ephemeral.read_text().split()) if ephemeral.exists() else (32768, 60999)
    # Below the range, or above it where the range starts too low (some containers start it at 1024).
    band = range(low - 2000, low) if low - 2000 >= 1024 else range(high + 1, min(high + 2001, 65536))
    for _ in range(100):
        port = random.choice(band)
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free TCP port in {band.start}-{band.stop - 1}, outside the ephemeral range {low}-{high}")
