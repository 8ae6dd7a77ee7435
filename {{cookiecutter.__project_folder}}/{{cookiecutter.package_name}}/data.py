"""Datasets and loaders: fake, cifar10 or imagefolder, sharded across ranks by a resumable sampler."""

from __future__ import annotations

import math
import os
import signal
import threading
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import datasets, transforms

from .distributed import DistEnv, close_job_sockets, run_once_per_node
from .errors import UsageError
from .options import TrainOptions

# Per-channel statistics of CIFAR-10; close enough for natural images in general.
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class LearnableFakeData(Dataset):
    """Random images, deterministic per index, plus a faint pattern per class, so a model can learn
    something that generalises to the held-out split: loss falls, accuracy rises."""

    def __init__(self, size: int, image_size: int, num_classes: int, seed: int, first_index: int = 0):
        self.size = size
        self.shape = (3, image_size, image_size)
        self.num_classes = num_classes
        # Sample i is drawn from seed i + offset: splits with disjoint index ranges share no image.
        self.offset = seed * 1_000_003 + first_index
        patterns = torch.Generator().manual_seed(seed)
        self.class_patterns = torch.rand(num_classes, *self.shape, generator=patterns)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        # A generator of its own, not torch.manual_seed: that also queues a seed for every lazily
        # initialised GPU backend, with a stack trace each time, and cost 1 ms a sample (benchmarks/).
        generator = torch.Generator().manual_seed(self.offset + index)
        label = int(torch.randint(self.num_classes, (), generator=generator))
        noise = torch.rand(self.shape, generator=generator)
        return 0.5 * noise + 0.5 * self.class_patterns[label], label


class SeededSampleDataset(Dataset):
    """Makes a sample's random augmentation a function of (seed, epoch, index) alone.

    The sampler hands out (epoch, index) keys. Seeding per sample means a resumed run, a different number of
    ranks or of DataLoader workers all draw the same crops and flips for the same sample, which is what
    makes resuming exact for augmented data too.
    """

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        with torch.random.fork_rng(devices=[]):  # transforms draw from the global CPU generator
            # Not torch.manual_seed, which also seeds (lazily, expensively) every GPU backend: only the CPU
            # generator matters here.
            torch.default_generator.manual_seed(((self.seed * 1_000_003 + epoch) * 1_000_033 + index) % 2**63)
            return self.dataset[index]


class SampleLoggingDataset(Dataset):
    """Appends the index of every sample it is asked for to a file, one per line (--sample-log).

    Each line is a single O_APPEND write, so DataLoader worker processes can share the file.
    """

    def __init__(self, dataset: Dataset, log_path: Path):
        self.dataset = dataset
        self.log_path = log_path

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        with open(self.log_path, "a") as log_file:
            log_file.write(f"{key[1]}\n")
        return self.dataset[key]


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through.

    The position is a count of *global* samples already consumed this epoch, so a job restarted with a
    different number of ranks continues with exactly the samples the epoch has not seen yet.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, samples_per_step: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start_sample = 0
        # Per rank: batch size x micro-batches per step. An epoch ends on a whole optimizer step, so no
        # half-accumulated gradient is left over (like drop_last, one level up).
        self.samples_per_step = samples_per_step

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        super().set_epoch(epoch)
        self.start_sample = start_sample

    def _remaining_indices(self) -> list[int]:
        order = torch.Generator().manual_seed(self.seed + self.epoch)
        indices = torch.randperm(len(self.dataset), generator=order).tolist()[self.start_sample:]
        padded_size = math.ceil(len(indices) / self.num_replicas) * self.num_replicas
        # Like DistributedSampler: repeat a few samples so every rank gets the same number of batches.
        return (indices * math.ceil(padded_size / max(len(indices), 1)))[:padded_size]

    def __iter__(self):
        mine = self._remaining_indices()[self.rank::self.num_replicas][:len(self)]
        return iter((self.epoch, index) for index in mine)  # (epoch, index) keys, for SeededSampleDataset

    def __len__(self) -> int:
        remaining = math.ceil((len(self.dataset) - self.start_sample) / self.num_replicas)
        return remaining - remaining % self.samples_per_step


def build_datasets(options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    """(train, held-out) datasets for --data."""
    if options.data == "fake":
        shape = dict(image_size=options.image_size, num_classes=options.num_classes, seed=options.seed)
        return (LearnableFakeData(options.fake_samples, **shape),
                LearnableFakeData(max(options.fake_samples // 4, 1), **shape, first_index=options.fake_samples))
    if options.data == "cifar10":
        normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        augment = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                      normalize])
        run_once_per_node(env, device, lambda: datasets.CIFAR10(options.data_dir, download=True),
                          what=f"downloading CIFAR-10 into {options.data_dir}")
        return (datasets.CIFAR10(options.data_dir, train=True, transform=augment),
                datasets.CIFAR10(options.data_dir, train=False, transform=normalize))
    size = options.image_size
    augment = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                  transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    evaluate = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size),
                                   transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    root = Path(options.data_dir)
    return (datasets.ImageFolder(root / "train", transform=augment),
            datasets.ImageFolder(root / "val", transform=evaluate))


def check_data_source(options: TrainOptions) -> None:
    """Fail early, with what to do, when --data-dir cannot hold the chosen dataset."""
    if options.data != "imagefolder":
        return
    root = Path(options.data_dir)
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir() or not any(child.is_dir() for child in folder.iterdir()):
            raise UsageError(
                f"--data-dir {root}: expected class folders in {folder} "
                f"({folder}/<class>/<image>.jpg) for --data imagefolder")


def detach_from_job_signals(worker_id: int) -> None:
    """DataLoader workers leave the training process's process group, so the SIGTERM or Ctrl-C that torchrun
    (which signals its workers' groups) or a terminal sends the group does not reach them: the training
    process decides when to stop, saves, and then shuts its workers down itself.

    Slurm signals every process of a job step, workers included. So a worker obeys SIGTERM only from its
    training process: that is how the DataLoader ends a worker that does not stop when asked, and Python's
    exit ends daemonic children before joining them. A worker that ignored SIGTERM made every exit after an
    error wait for torchrun's SIGKILL, 30 s later; one that obeyed every SIGTERM died under Slurm's
    preemption signal, failing the step that was to be saved. A worker whose parent dies exits on its own
    (torch checks the parent)."""
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)  # the parent's watchdog pipe is not this process's
    close_job_sockets()  # so a dead training process's ports refuse, and its peers' collectives fail, at once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    training_process = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # held for the thread below, in every thread

    def obey_sigterm_from_the_training_process() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == training_process:
                os._exit(0)  # as torch's own worker handler does: a requested exit, not a failure

    threading.Thread(target=obey_sigterm_from_the_training_process, daemon=True).start()


def build_loaders(train_set: Dataset, eval_set: Dataset, options: TrainOptions, env: DistEnv,
                  device: torch.device) -> tuple[DataLoader, DataLoader]:
    train_set = SeededSampleDataset(train_set, options.seed)
    if options.sample_log:
        Path(options.sample_log).mkdir(parents=True, exist_ok=True)
        train_set = SampleLoggingDataset(train_set, Path(options.sample_log) / f"rank-{env.rank}.txt")
    sampler = ResumableDistributedSampler(train_set, env.world_size, env.rank, seed=options.seed,
                                          samples_per_step=options.batch_size * options.grad_accum)
    common = dict(batch_size=options.batch_size, num_workers=options.num_workers,
                  pin_memory=device.type == "cuda", persistent_workers=options.num_workers > 0,
                  worker_init_fn=detach_from_job_signals)
    # drop_last keeps every step's batch the same size on every rank. A generator of its own: otherwise each
    # new epoch's iterator draws a seed from the global RNG, and a resumed run (restored RNG, one more
    # iterator) would continue with other random numbers than the uninterrupted one (e.g. dropout masks).
    train_loader = DataLoader(train_set, sampler=sampler, drop_last=True,
                              generator=torch.Generator().manual_seed(options.seed), **common)
    # Evaluation shards without padding, so sums and counts over ranks count every sample exactly once.
    eval_shard = Subset(eval_set, range(env.rank, len(eval_set), env.world_size))
    eval_loader = DataLoader(eval_shard, shuffle=False, generator=torch.Generator().manual_seed(options.seed),
                             **common)
    if len(train_loader) == 0:
        raise UsageError(
            f"the training set ({len(train_set)} samples) gives no full step of {options.grad_accum} x "
            f"{options.batch_size} samples per rank over {env.world_size} ranks; "
            "lower --batch-size or --grad-accum, or use more data")
    return train_loader, eval_loader


def to_device(images: torch.Tensor, labels: torch.Tensor, device: torch.device,
              channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """non_blocking: from pinned loader memory the host only queues the copy and goes on queueing the step's
    kernels. On the GPU the copy runs in order on the compute stream, between the previous step's kernels and
    this one's; a prefetch on a side stream would hide it too, worth it only where copies are a visible part
    of a step (large images, a small model)."""
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return (images.to(device, non_blocking=True, memory_format=memory_format),
            labels.to(device, non_blocking=True))
