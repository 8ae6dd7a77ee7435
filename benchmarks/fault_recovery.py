"""Issue 3's figures: time from a worker's death to the next training step, and the training stall per
checkpoint save, for the default model (resnet18, 32x32 images) on 2 CPU ranks.

    .venv/bin/python benchmarks/fault_recovery.py
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import bake_default_project, child_env

ARGS = ["--data", "fake", "--fake-samples", "4096", "--batch-size", "32", "--num-workers", "0", "--device", "cpu",
        "--max-steps", "40", "--ckpt-every", "10", "--log-every", "1"]


def main() -> None:
    project = bake_default_project()
    ckpt_dir = project / "checkpoints"
    command = ["torchrun", "--standalone", "--nproc-per-node=2", "--max-restarts=1", "train.py", *ARGS,
               "--ckpt-dir", str(ckpt_dir)]
    launcher = subprocess.Popen(command, cwd=project, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    killed_at = recovered_at = None
    step_times, save_seconds, last_step_at = [], [], None
    for line in launcher.stdout:
        now = time.monotonic()
        if re.search(r"\| epoch \d+ \| loss", line):
            if last_step_at is not None and killed_at is None:
                step_times.append(now - last_step_at)
            last_step_at = now
            if killed_at is not None and recovered_at is None:
                recovered_at = now
        if match := re.search(r"saved .* in ([\d.]+) s", line):
            save_seconds.append(float(match[1]))
        if killed_at is None and "step-10.pt" in line and "saved" in line:
            workers = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
            os.kill(int(workers[-1]), signal.SIGKILL)
            killed_at = time.monotonic()
    launcher.wait()
    if launcher.returncode != 0 or recovered_at is None:
        sys.exit(f"run failed (exit {launcher.returncode}); see {project}")
    print(f"step time before the kill (median): {statistics.median(step_times):.3f} s")
    print(f"worker killed -> next training step logged: {recovered_at - killed_at:.2f} s "
          "(torchrun notices, stops the group, re-rendezvous, restarts, loads, runs one step)")
    print(f"checkpoint save stall (rank 0): median {statistics.median(save_seconds):.3f} s, "
          f"max {max(save_seconds):.3f} s over {len(save_seconds)} saves; "
          f"file size {(ckpt_dir / 'step-40.pt').stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
