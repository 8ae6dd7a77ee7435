"""The baselines the generated train.py is measured against (not part of the template).

`bare`: the training loop of PyTorch's torchrun tutorial (pytorch/examples, distributed/ddp-tutorial-series/
multigpu_torchrun.py): init_process_group, DDP, DataLoader with DistributedSampler, zero_grad / forward /
loss / backward / step, a snapshot saved by rank 0 at the end. Same model, data, batch and optimizer as the
generated project. Launch with torchrun, the baked project's folder on PYTHONPATH.

`compute`: forward, backward and optimizer step on one batch held in memory: no loader, no DDP, one process.
Prints steady-state samples/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


def build(args):
    model = torchvision.models.get_model(args.model, weights=None, num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    return model, optimizer


def bare(args) -> None:
    from ddp_training.data import LearnableFakeData  # the generated project's data: same samples

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model, optimizer = build(args)
    model = DistributedDataParallel(model)
    dataset = LearnableFakeData(args.fake_samples, args.image_size, 10, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, pin_memory=False, shuffle=False,
                        sampler=DistributedSampler(dataset), num_workers=args.num_workers, drop_last=True)
    steps = 0
    for epoch in range(10**6):
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(source), targets)
            loss.backward()
            optimizer.step()
            steps += 1
            if steps == args.steps:
                break
        if steps == args.steps:
            break
    if int(os.environ["RANK"]) == 0:
        torch.save({"MODEL_STATE": model.module.state_dict(), "EPOCHS_RUN": epoch}, args.snapshot)
    dist.destroy_process_group()


def compute(args) -> None:
    torch.manual_seed(0)
    model, optimizer = build(args)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 10, (args.batch_size,))
    window, rates = 5, []  # samples/s per 5 steps, as train.py's metrics.jsonl rows with --log-every 5
    for step in range(args.steps):
        if step % window == 0:
            started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if step % window == window - 1:
            rates.append(window * args.batch_size / (time.perf_counter() - started))
    print(f"samples/s {statistics.median(rates[len(rates) // 4:]):.2f}")  # after warm-up


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["bare", "compute"])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fake-samples", type=int, default=4096)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--snapshot", default="snapshot.pt")
    arguments = parser.parse_args()
    bare(arguments) if arguments.mode == "bare" else compute(arguments)
