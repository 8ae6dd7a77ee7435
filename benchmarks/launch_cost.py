"""What one launch costs (issue 13): the CPU-seconds and wall time of a whole `torchrun` command, with the
garbage-collector recipe of train.py (gc.disable() while importing, then gc.freeze()) and without it.

    .venv/bin/python benchmarks/launch_cost.py --rounds 5

On a 2-core machine each launch is mostly Python processes starting and stopping (torchrun's agent, one
process per rank, the DataLoader workers), so this is also what the template's test suite pays per torchrun
job. Both sides run the same baked project: "without" is a copy of train.py with its three gc calls replaced by `pass`.
Runs alternate between the sides, so drift in a shared machine's speed hits both alike; figures are medians.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from common import bake_default_project, child_env

# The test suite's reference run (tests/conftest.py BARE): small_cnn, 2 ranks of 8, 40 steps, 2 loader workers.
ARGS = ["--model", "small_cnn", "--data", "fake", "--fake-samples", "512", "--image-size", "16", "--batch-size", "8",
        "--device", "cpu", "--ckpt-every", "4", "--keep-checkpoints", "100", "--log-every", "1", "--num-workers", "2",
        "--max-steps", "40"]
GC_LINES = ("gc.disable()", "gc.freeze()", "gc.enable()")


def without_gc_recipe(project: Path) -> str:
    """A copy of train.py with each gc statement replaced by `pass`; returns its file name."""
    lines = (project / "train.py").read_text().splitlines(keepends=True)
    changed = [line.replace(line.strip(), "pass") if line.strip().startswith(GC_LINES) else line for line in lines]
    assert sum(a != b for a, b in zip(lines, changed, strict=True)) == len(GC_LINES), "train.py changed"
    (project / "train_without_gc_recipe.py").write_text("".join(changed))
    return "train_without_gc_recipe.py"


def launch(project: Path, script: str, nproc: int) -> tuple[float, float]:
    """(wall seconds, CPU-seconds of every process it started) of one whole torchrun command."""
    ckpt_dir = project / "checkpoints"
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(["torchrun", "--standalone", f"--nproc-per-node={nproc}", script, *ARGS,
                             "--ckpt-dir", str(ckpt_dir)], cwd=project, env=child_env(), capture_output=True,
                            text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (ckpt_dir / "step-40.pt").exists()
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def compare(sides: dict[str, tuple[Path, str]], rounds: int, nproc: int, heading: str) -> None:
    """Launch every side (its project folder and script) once a round, sides alternating, and print a table of
    median (min-max) CPU-seconds and wall seconds per launch, a row per side."""
    figures: dict[str, dict[str, list[float]]] = {side: {"wall": [], "cpu": []} for side in sides}
    launch(*next(iter(sides.values())), nproc)  # warm-up: file caches, bytecode
    for round_number in range(1, rounds + 1):
        for side, (folder, script) in sides.items():
            wall, cpu = launch(folder, script, nproc)
            figures[side]["wall"].append(wall)
            figures[side]["cpu"].append(cpu)
            print(f"round {round_number} {side:10}: {wall:.2f} s wall, {cpu:.2f} CPU-s", flush=True)
    print(f"\n{nproc} ranks, {rounds} rounds; median (min-max)")
    print(f"| {heading} | CPU-seconds per launch | wall seconds per launch |")
    print("| --- | --- | --- |")
    for side in sides:
        print(f"| {side} | {summary(figures[side]['cpu'])} | {summary(figures[side]['wall'])} |")


def launch_arguments(description: str) -> argparse.Namespace:
    """--rounds and --nproc, for a benchmark that compares launches."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    return parser.parse_args()


def main() -> None:
    args = launch_arguments(__doc__)
    project = bake_default_project()
    compare({"with the gc recipe": (project, "train.py"),
             "without the gc recipe": (project, without_gc_recipe(project))}, args.rounds, args.nproc, "train.py")


if __name__ == "__main__":
    main()
