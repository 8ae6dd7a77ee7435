"""The baselines the generated train.py is measured against (not part of the template).

`bare`: the training loop of PyTorch's torchrun tutorial (pytorch/examples, distributed/ddp-tutorial-series/
multigpu_torchrun.py): init_process_group, DDP, DataLoader with DistributedSampler, zero_grad / forward /
loss / backward / step, a snapshot saved by rank 0 at the end. Same model, data, batch and optimizer as the
generated project. Launch with torchrun, the baked project's folder on PYTHONPATH.

`compute`: forward, backward and optimizer step on one batch held in memory: no loader, no DDP, one process.

Both print steady-state samples/s (rank 0) and, on CUDA, peak memory. `--device cuda --precision bf16
--channels-last` give both the usual GPU settings (autocast, NHWC, pinned memory, NCCL): what gpu_check.py
compares train.py with.
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


def build(args, device: torch.device):
    model = torchvision.models.get_model(args.model, weights=None, num_classes=10).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    return model, optimizer


def autocast(args, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")


class Rates:
    """samples/s per 5 steps, as train.py's metrics.jsonl rows with --log-every 5; the median after warm-up."""

    def __init__(self, batch_size: int, device: torch.device, window: int = 5):
        self.batch_size, self.device, self.window, self.rates = batch_size, device, window, []

    def tick(self, step: int) -> None:
        if step % self.window == 0:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # once per window, as train.py's logging does
            now = time.perf_counter()
            if step:
                self.rates.append(self.window * self.batch_size / (now - self.started))
            self.started = now

    def report(self) -> None:
        print(f"samples/s {statistics.median(self.rates[len(self.rates) // 4:]):.2f}")
        if self.device.type == "cuda":
            print(f"peak memory GiB {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f}")


def bare(args) -> None:
    from ddp_training.task import LearnableFakeData  # the generated project's data: same samples

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model, optimizer = build(args, device)
    model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    dataset = LearnableFakeData(args.fake_samples, args.image_size, 10, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, pin_memory=cuda, shuffle=False,
                        sampler=DistributedSampler(dataset), num_workers=args.num_workers, drop_last=True)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    steps, rates = 0, Rates(args.batch_size * dist.get_world_size(), device)
    for epoch in range(10**6):
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            rates.tick(steps)
            source = source.to(device, non_blocking=True, memory_format=memory_format)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad()
            with autocast(args, device):
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
        rates.report()
    dist.destroy_process_group()


def compute(args) -> None:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, optimizer = build(args, device)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    images = images.contiguous(memory_format=memory_format)
    labels = torch.randint(0, 10, (args.batch_size,), device=device)
    rates = Rates(args.batch_size, device)
    for step in range(args.steps + 1):
        rates.tick(step)
        if step == args.steps:
            break
        optimizer.zero_grad()
        with autocast(args, device):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    rates.report()


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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--channels-last", action="store_true")
    arguments = parser.parse_args()
    bare(arguments) if arguments.mode == "bare" else compute(arguments)
