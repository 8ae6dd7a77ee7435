"""Preflight: check a job's ranks, devices and network before a long run, with the same launch as training.

    ./run_node.sh --preflight                          # on every machine, like a training run
    torchrun --standalone --nproc-per-node=2 -m {{ cookiecutter.package_name }}.preflight

Checks, across all ranks: the rank / local rank / node map is consistent, every rank sees its device, an
all-reduce gives the right answer, all-reduce bandwidth per rank (flagging a rank much slower than the
rest), and a few DDP training steps that keep replicas identical. Rank 0 prints a PASS/FAIL summary; the
exit status is 0 only if everything passed.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time

import torch

from .engine.collectives import all_gather_objects, all_reduce
from .engine.distributed import DistEnv, distributed_session, select_device
from .engine.errors import UsageError
from .engine.parallel import wrap_model

SLOW_RANK_FACTOR = 2.0  # a rank whose all-reduce takes this many times the median is flagged


def check_rank_map(env: DistEnv) -> tuple[bool, str]:
    places = all_gather_objects((env.rank, env.local_rank, env.node_rank, env.local_world_size, socket.gethostname()))
    problems = []
    if sorted(place[0] for place in places) != list(range(env.world_size)):
        problems.append("global ranks are not 0..world_size-1 exactly once")
    nodes: dict[int, list[int]] = {}
    for _, local_rank, node_rank, _, _ in places:
        nodes.setdefault(node_rank, []).append(local_rank)
    for node_rank, local_ranks in nodes.items():
        if sorted(local_ranks) != list(range(env.local_world_size)):
            problems.append(f"node {node_rank} has local ranks {sorted(local_ranks)}")
    if sorted(nodes) != list(range(env.num_nodes)):
        problems.append(f"node ranks {sorted(nodes)} are not 0..{env.num_nodes - 1}")
    hosts = sorted({place[4] for place in places})
    return not problems, "; ".join(problems) or f"{env.world_size} ranks on {len(nodes)} nodes ({', '.join(hosts)})"


def check_devices(env: DistEnv, device: torch.device) -> tuple[bool, str]:
    usable = True
    try:
        torch.ones(1, device=device).add_(1)
    except RuntimeError:
        usable = False
    reports = all_gather_objects((env.rank, str(device), usable))
    broken = [f"rank {rank} ({name})" for rank, name, ok in reports if not ok]
    devices = sorted({name for _, name, _ in reports})
    return not broken, (f"unusable: {', '.join(broken)}" if broken else f"all usable: {', '.join(devices)}")


def check_all_reduce_result(env: DistEnv, device: torch.device) -> tuple[bool, str]:
    world_size = env.world_size
    values = all_reduce(torch.full((1024,), float(env.rank + 1), device=device), "sum")
    expected = world_size * (world_size + 1) / 2
    correct = bool(torch.all(values == expected).item())
    return correct, f"sum over ranks = {values[0].item():g}, expected {expected:g}"


def measure_all_reduce_bandwidth(env: DistEnv, device: torch.device, megabytes: int,
                                 repeats: int) -> tuple[bool, str, list]:
    """Bus bandwidth per rank (the nccl-tests convention: 2 (W-1)/W bytes moved per byte reduced)."""
    world_size = env.world_size
    tensor = torch.ones(megabytes * 2**20 // 4, device=device)
    all_reduce(tensor, "sum")  # warm-up: connections and buffers
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        all_reduce(tensor, "sum")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    bus_gb_per_s = 2 * (world_size - 1) / world_size * tensor.numel() * 4 / seconds / 1e9
    per_rank = all_gather_objects((env.rank, seconds, bus_gb_per_s))
    median_seconds = statistics.median(entry[1] for entry in per_rank)
    slow = [rank for rank, took, _ in per_rank if took > SLOW_RANK_FACTOR * median_seconds]
    summary = ", ".join(f"rank {rank}: {rate:.2f} GB/s" for rank, _, rate in per_rank)
    detail = f"{megabytes} MiB, median of {repeats}: {summary}"
    if slow:
        detail += f"; SLOW (> {SLOW_RANK_FACTOR:g}x median): ranks {slow}"
    return not slow, detail, per_rank


def check_training_steps(env: DistEnv, device: torch.device, steps: int = 3) -> tuple[bool, str]:
    torch.manual_seed(env.rank)  # different data per rank, as in training
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    ddp_model = wrap_model(model, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        inputs, targets = torch.randn(16, 32, device=device), torch.randint(0, 4, (16,), device=device)
        loss = torch.nn.functional.cross_entropy(ddp_model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    checksum = torch.cat([parameter.detach().flatten() for parameter in model.parameters()]).sum()
    highest, lowest = all_reduce(checksum.clone(), "max"), all_reduce(checksum.clone(), "min")
    identical = bool(highest == lowest)
    finite = all(torch.isfinite(torch.tensor(losses)))
    return identical and finite, (f"{steps} DDP steps, losses {', '.join(f'{loss:.3f}' for loss in losses)}, "
                                  f"replicas {'identical' if identical else 'DIVERGED'}")


def run_checks(env: DistEnv, device: torch.device, megabytes: int, repeats: int) -> bool:
    results = [
        ("rank map", *check_rank_map(env)),
        ("devices", *check_devices(env, device)),
        ("all-reduce result", *check_all_reduce_result(env, device)),
        ("all-reduce bandwidth", *measure_all_reduce_bandwidth(env, device, megabytes, repeats)[:2]),
        ("training steps", *check_training_steps(env, device)),
    ]
    if env.is_main_process:
        for name, passed, detail in results:
            print(f"preflight {'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)
        verdict = "PASS" if all(passed for _, passed, _ in results) else "FAIL"
        print(f"preflight {verdict}: world_size={env.world_size} nodes={env.num_nodes} device={device.type}",
              flush=True)
    return all(passed for _, passed, _ in results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Check ranks, devices and network before a long run.")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--megabytes", type=int, default=64, help="all-reduce size for the bandwidth test")
    parser.add_argument("--repeats", type=int, default=5, help="timed all-reduces per rank")
    options = parser.parse_args(argv)
    try:
        env = DistEnv.from_environ()
        if not env.launched_by_torchrun:
            raise UsageError("run the preflight under torchrun (./run_node.sh --preflight), not plain python")
        device = select_device(options.device, env)
        with distributed_session(env, device):
            passed = run_checks(env, device, options.megabytes, options.repeats)
    except UsageError as error:
        sys.exit(f"error: {error}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
