"""Recovery on the user's launch path (issue 10): the torchrun command from the docs with nothing exported,
2 CPU ranks, resnet18 on 32x32 fake images, batch 8, 2 DataLoader workers per rank. Each trial kills one
worker with SIGKILL at a random moment (mid-step, mid-save with a save every 5 steps, or in the evaluation
at the end of epoch 1) and measures the time from the kill to the next training step logged; every trial
must end with weights bitwise equal to an uninterrupted run.

    .venv/bin/python benchmarks/fault_recovery.py --trials 20
    DDP_BENCH_KEEP=1 .venv/bin/python benchmarks/fault_recovery.py --trials 20   # keeps the runs to read again:
    .venv/bin/python benchmarks/fault_recovery.py --analyze /tmp/ddp-bench-XXXX/ddp-training
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from common import bake_default_project, child_env

ARGS = ["--data", "fake", "--fake-samples", "512", "--image-size", "32", "--batch-size", "8", "--num-workers", "2",
        "--device", "cpu", "--max-steps", "48", "--ckpt-every", "5", "--keep-checkpoints", "100", "--log-every", "1"]
STEP_LINE = re.compile(r"^\S+ step (\d+) \|")


def launch(project: Path, ckpt_dir: Path, max_restarts: int) -> subprocess.Popen:
    environment = {name: value for name, value in child_env().items() if not name.startswith("TORCH")}
    command = ["torchrun", "--standalone", "--nproc-per-node=2", f"--max-restarts={max_restarts}", "train.py",
               *ARGS, "--ckpt-dir", str(ckpt_dir)]
    return subprocess.Popen(command, cwd=project, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def trial(project: Path, ckpt_dir: Path, kill_after_s: float) -> tuple[float | None, str, str]:
    """(seconds from the kill to the next step logged, output, the last line logged before the kill); kills
    kill_after_s after step 2 is logged."""
    launcher = launch(project, ckpt_dir, max_restarts=1)
    lines, killed_at, recovered_at, restarted = [], None, None, False
    timer, last_line_before_kill = None, ""

    def kill() -> None:
        nonlocal killed_at, last_line_before_kill
        workers = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        if workers:
            os.kill(int(random.choice(workers)), signal.SIGKILL)
            killed_at = time.monotonic()
            last_line_before_kill = lines[-1].strip() if lines else ""

    for line in launcher.stdout:
        # Lines after the kill are kept stamped with their arrival (the output is unbuffered).
        lines.append(line if killed_at is None else f"+{time.monotonic() - killed_at:6.2f}s {line}")
        if (match := STEP_LINE.match(line)) and timer is None and int(match[1]) >= 2:
            timer = threading.Timer(kill_after_s, kill)
            timer.start()
        restarted = restarted or "restart=1" in line
        if restarted and recovered_at is None and STEP_LINE.match(line):
            recovered_at = time.monotonic()
    launcher.wait()
    output = "".join(lines)
    if launcher.returncode != 0 or killed_at is None or recovered_at is None:
        return None, output, last_line_before_kill
    return recovered_at - killed_at, output, last_line_before_kill


def logged_at(output: str, step: int) -> float:
    """Seconds since midnight at which the first line of training step `step` was logged."""
    stamp = next(line.split(" ", 1)[0] for line in output.splitlines()
                 if line.split(" | ", 1)[0].endswith(f" step {step}"))
    hours, minutes, seconds = stamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


PHASES = (("torchrun sees the death", "failed (exitcode"), ("new workers up (process group joined)", "restart=1"),
          ("checkpoint loaded", "resuming from"), ("first step after it", " step "))


def phases(log: str) -> dict[str, float]:
    """Seconds after the kill at which each phase's first stamped line arrived."""
    stamped = [(float(line[1:].split("s ", 1)[0]), line.split("s ", 1)[1]) for line in log.splitlines()
               if line.startswith("+")]
    found, start = {}, 0
    for name, marker in PHASES:
        for index in range(start, len(stamped)):
            if marker in stamped[index][1]:
                found[name], start = stamped[index][0], index
                break
    return found


def print_phases(logs: list[str]) -> None:
    """Median (min-max) of each phase's arrival after the kill, over the trials."""
    table = [phases(log) for log in logs]
    for name, _ in PHASES:
        seen = [row[name] for row in table if name in row]
        if seen:
            print(f"  {name:40s} +{statistics.median(seen):5.2f} s ({min(seen):.2f}-{max(seen):.2f}), "
                  f"{len(seen)} trials")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--analyze", type=Path, help="only print the phases of the trial-*.log in this folder")
    args = parser.parse_args()
    if args.analyze:
        print_phases([path.read_text() for path in sorted(args.analyze.glob("trial-*.log"))])
        return
    random.seed(args.seed)
    project = bake_default_project()
    reference_dir = project / "reference"
    reference = launch(project, reference_dir, max_restarts=0)
    reference_output = reference.communicate()[0]
    if reference.returncode != 0:
        sys.exit(reference_output)
    expected = torch.load(reference_dir / "step-48.pt", weights_only=True)["model"]
    # Kills land within the first 80 % of what the reference took from step 2 to its end, never after the end
    # (a kill after it would find no job to recover: a faster machine once made that a "failed" trial).
    window = 0.8 * (logged_at(reference_output, 48) - logged_at(reference_output, 2))
    print(f"kills drawn within {window:.2f} s after step 2")
    recoveries, failures, stalls, logs = [], 0, 0, []
    for index in range(args.trials):
        kill_after = random.uniform(0.0, window)
        seconds, output, before = trial(project, project / f"trial-{index}", kill_after)
        stalls += "forcefully exiting via 9" in output
        (project / f"trial-{index}.log").write_text(output)
        logs.append(output)
        final = project / f"trial-{index}" / "step-48.pt"
        bitwise = final.exists() and all(
            torch.equal(tensor, expected[name])
            for name, tensor in torch.load(final, weights_only=True)["model"].items())
        if seconds is None or not bitwise:
            failures += 1
            print(f"trial {index}: kill {kill_after:.2f} s after step 2: FAILED (recovered: {seconds is not None}, "
                  f"bitwise: {bitwise})\n{output[-3000:]}")
            continue
        recoveries.append(seconds)
        print(f"trial {index}: kill {kill_after:.2f} s after step 2 -> next step {seconds:.2f} s later, bitwise equal "
              f"(last line before the kill: {before[-90:]})")
    print(f"\ntrial logs, lines stamped with the seconds since the kill: {project}/trial-*.log")
    print(f"{len(recoveries)} of {args.trials} trials recovered bitwise; {stalls} survivors needed SIGKILL")
    if recoveries:
        print(f"kill -9 -> next training step: median {statistics.median(recoveries):.2f} s, "
              f"min {min(recoveries):.2f} s, max {max(recoveries):.2f} s")
        print("where the time goes, after the kill:")
        print_phases(logs)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
