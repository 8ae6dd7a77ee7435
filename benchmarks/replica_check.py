"""What the replica check costs, and what DDP's static_graph would save, on 2 CPU ranks (gloo).

For resnet18 and resnet50 (torchvision, 32x32 inputs, batch 16 per rank, SGD): the median and spread of
`engine.replicas.check_replicas_match` of the baked project over 20 calls, and the median step time of 30 DDP steps
with static_graph off (the template's choice) and on, in alternating rounds.

    .venv/bin/python benchmarks/replica_check.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import bake_default_project, child_env


def worker(project: Path, model_name: str, rounds: int) -> None:
    sys.path.insert(0, str(project))
    import torch
    import torch.distributed as dist
    import torchvision
    from ddp_training.engine.replicas import check_replicas_match
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torchvision.models.get_model(model_name, num_classes=10)
    images, labels = torch.randn(16, 3, 32, 32), torch.randint(10, (16,))

    def step_times(static_graph: bool) -> list[float]:
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True, static_graph=static_graph)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
        times = []
        for _ in range(35):
            started = time.perf_counter()
            torch.nn.functional.cross_entropy(wrapped(images), labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
        return times[5:]  # after warm-up (static_graph records its graph in the first iterations)

    steps = {"off": [], "on": []}
    for _ in range(rounds):
        for setting in ("off", "on"):
            steps[setting].append(statistics.median(step_times(setting == "on")))
    checks = []
    for _ in range(20):
        started = time.perf_counter()
        check_replicas_match(model, step=1)
        checks.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        print(json.dumps({"model": model_name, "parameters": sum(p.numel() for p in model.parameters()),
                          "check_ms": [1000 * value for value in checks],
                          "step_ms": {key: [1000 * value for value in values] for key, values in steps.items()}}))
    dist.destroy_process_group()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("PROJECT", "MODEL"))
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker[0]), args.worker[1], args.rounds)
    project = bake_default_project()
    print("| model | parameters | replica check, ms (median, min-max of 20) | step ms, static_graph off | on |")
    print("| --- | --- | --- | --- | --- |")
    for model_name in ("resnet18", "resnet50"):
        result = subprocess.run(["torchrun", "--standalone", "--nproc-per-node=2", __file__, "--rounds",
                                 str(args.rounds), "--worker", str(project), model_name],
                                env=child_env(), capture_output=True, text=True, cwd=os.path.dirname(__file__))
        if result.returncode != 0:
            sys.exit(result.stderr[-3000:])
        figures = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
        print(f"| {model_name} | {figures['parameters'] / 1e6:.1f} M | {spread(figures['check_ms'])} | "
              f"{spread(figures['step_ms']['off'])} | {spread(figures['step_ms']['on'])} |")


if __name__ == "__main__":
    main()
