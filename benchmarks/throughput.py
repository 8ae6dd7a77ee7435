"""Issue 5's figures, side by side in one run on this machine:

1. the generated train.py against the torchrun tutorial's bare DDP loop (bare_ddp_loop.py bare): same model,
   data, batch, optimizer and loader workers, 2 CPU ranks; wall time of the whole torchrun command, ratio;
2. steady-state samples/s of train.py on 1 rank against pure compute (bare_ddp_loop.py compute);
3. startup to the first training step, and the training stall per checkpoint save.

    .venv/bin/python benchmarks/throughput.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import bake_default_project, child_env

BENCHMARKS = Path(__file__).resolve().parent
SHAPE = ["--model", "resnet18", "--image-size", "32", "--batch-size", "32", "--fake-samples", "4096",
         "--num-workers", "2"]


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return seconds, result.stdout + result.stderr


def train_py(project: Path, nproc: int, steps: int, folder: Path, *extra: str) -> list[str]:
    return ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "train.py", *SHAPE, "--data", "fake",
            "--device", "cpu", "--max-steps", str(steps), "--ckpt-dir", str(folder / "checkpoints"), *extra]


def against_bare_loop(project: Path, rounds: int, steps: int) -> None:
    env = {**child_env(), "PYTHONPATH": str(project)}
    bare_command = ["torchrun", "--standalone", "--nproc-per-node=2", str(BENCHMARKS / "bare_ddp_loop.py"), "bare",
                    *SHAPE, "--steps", str(steps), "--snapshot", str(project / "snapshot.pt")]
    ours, bare = [], []
    for round_number in range(rounds):  # alternate, so drift in the machine's speed hits both alike
        bare.append(timed(bare_command, project, env)[0])
        folder = project / f"ours-{round_number}"
        # Like for like: the tutorial loop neither evaluates nor writes metrics files.
        command = train_py(project, 2, steps, folder, "--log-every", "5", "--eval-every", "0")
        ours.append(timed(command, project, env)[0])
        print(f"round {round_number}: bare loop {bare[-1]:.2f} s, train.py {ours[-1]:.2f} s", flush=True)
    ratio = statistics.median(ours) / statistics.median(bare)
    print(f"1. {steps} steps on 2 CPU ranks, whole torchrun command (--eval-every 0): "
          f"train.py median {statistics.median(ours):.2f} s / bare DDP loop median {statistics.median(bare):.2f} s "
          f"= ratio {ratio:.3f} (goal <= 1.00)")


def against_pure_compute(project: Path, rounds: int, steps: int) -> None:
    env = child_env()
    env.pop("OMP_NUM_THREADS")  # one process: let both use every core, as a user's single run would
    compute, ours, waits = [], [], []
    for round_number in range(rounds):  # alternate, as above
        _, output = timed([sys.executable, str(BENCHMARKS / "bare_ddp_loop.py"), "compute", *SHAPE,
                           "--steps", str(steps)], project, env)
        compute.append(float(re.search(r"samples/s ([\d.]+)", output)[1]))
        folder = project / f"one-rank-{round_number}"
        timed(train_py(project, 1, steps, folder, "--log-every", "5", "--log-dir", str(folder / "logs")), project, env)
        rows = [json.loads(line) for line in (folder / "logs" / "metrics.jsonl").read_text().splitlines()]
        rows = [row for row in rows if row["kind"] == "train"]
        ours.append(statistics.median(row["samples_per_sec"] for row in rows[len(rows) // 4:]))  # after warm-up
        waits.append(statistics.median(row["data_wait_frac"] for row in rows))
        print(f"round {round_number}: pure compute {compute[-1]:.1f} samples/s, train.py {ours[-1]:.1f}", flush=True)
    ratio = statistics.median(ours) / statistics.median(compute)
    print(f"2. 1 rank, steady state (median of 5-step windows): train.py {statistics.median(ours):.1f} samples/s "
          f"(data wait {100 * statistics.median(waits):.0f}%) / pure compute {statistics.median(compute):.1f} "
          f"samples/s = {ratio:.3f} (goal >= 0.95)")


def startup_and_save_stall(project: Path) -> None:
    folder = project / "startup"
    command = train_py(project, 2, 30, folder, "--log-every", "1", "--ckpt-every", "10",
                       "--log-dir", str(folder / "logs"))
    started = time.perf_counter()
    launcher = subprocess.Popen(command, cwd=project, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    first_step, saves = None, []
    for line in launcher.stdout:
        if first_step is None and re.search(r"step 1 \| epoch", line):
            first_step = time.perf_counter() - started
        if match := re.search(r"saved .* in ([\d.]+) s", line):
            saves.append(float(match[1]))
    if launcher.wait() != 0 or first_step is None:
        sys.exit("startup run failed")
    size = (folder / "checkpoints" / "step-30.pt").stat().st_size / 2**20
    print(f"3. torchrun launch -> first step logged: {first_step:.2f} s; checkpoint save stall (rank 0): "
          f"median {statistics.median(saves):.3f} s, max {max(saves):.3f} s over {len(saves)} saves, {size:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    project = bake_default_project()
    print(f"baked {project}; torch threads per rank: 1 with 2 ranks; {os.cpu_count()} cores", flush=True)
    against_bare_loop(project, args.rounds, args.steps)
    against_pure_compute(project, args.rounds, 2 * args.steps)
    startup_and_save_stall(project)


if __name__ == "__main__":
    main()
