"""The step stall a DDP checkpoint costs, written at once and with --async-save.

    python benchmarks/async_save.py --trials 3

The default project, --model resnet152 (SGD with momentum: a 445 MiB checkpoint) on 2 CPU ranks, 12 steps with
a save every 2 (6 saves, the newest kept). For each mode and trial: the time every save held the training
loop ("saved ... in X s": the whole write, or the copy to memory with --async-save) and the whole run's wall
time. Median (min-max) over trials. On this 2-core machine the write thread shares the cores with the two
training processes, so the run's time gains less than the stall removed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from common import bake_default_project, child_env, scratch_dir, spread


def run(project: Path, ckpt_dir: Path, *extra: str) -> tuple[list[float], float]:
    command = ["torchrun", "--standalone", "--nproc-per-node=2", "train.py", "--model", "resnet152", "--data", "fake",
               "--fake-samples", "64", "--image-size", "16", "--batch-size", "2", "--num-workers", "0", "--device",
               "cpu", "--max-steps", "12", "--ckpt-every", "2", "--keep-checkpoints", "1", "--eval-every", "0",
               "--log-every", "100", "--ckpt-dir", str(ckpt_dir), *extra]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=project, env=child_env(), capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - started
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    stalls = [float(seconds) for seconds in re.findall(r"saved \S+ in ([\d.]+) s", result.stderr)]
    return stalls, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    project = bake_default_project()
    scratch = scratch_dir("async-save-")
    print("| mode | stall per save, s | saves | whole run, s |\n| --- | --- | --- | --- |")
    for mode, extra in (("written at once", ()), ("--async-save", ("--async-save",))):
        stalls, walls = [], []
        for trial in range(args.trials):
            trial_stalls, wall = run(project, scratch / f"{mode}-{trial}".replace(" ", "-"), *extra)
            stalls += trial_stalls
            walls.append(wall)
        print(f"| {mode} | {spread(stalls)} | {len(stalls)} | {spread(walls)} |", flush=True)
    print(f"median (min-max) over {args.trials} trials")


if __name__ == "__main__":
    main()
