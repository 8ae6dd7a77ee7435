"""Loaders for any task's datasets (task.py builds them): a map-style training set sharded across ranks by a
resumable sampler, with per-sample seeded augmentation{% if cookiecutter.use_streaming == "yes" %}, or a streamed one (streaming.py){% endif %};
batches moved to the device."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import inspect
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from .collectives import same_on_every_rank
from .distributed import DistEnv
from .errors import UsageError
from .processes import detach_from_job_signals, start_forkserver_deaf_to_sigterm
{%- if cookiecutter.use_streaming == "yes" %}
from .streaming import StreamedDataset, StreamLoader, require_max_steps
{%- endif %}

if TYPE_CHECKING:  # for annotations only: the engine imports nothing around it
    from ..options import TrainOptions

log = logging.getLogger(__name__)


def training_steps(loader: DataLoader, progress: Any, grad_accum: int) -> Iterator[list | None]:
    """Each optimizer step's micro-batches (--grad-accum of them) from where `progress` (train.py's TrainingProgress)
    stands, epoch after epoch: None where an epoch has ended, after its last whole step; the next one starts at the
    epoch and sample that `progress` holds then (mid-epoch on resume, at the next unseen sample)."""
    while True:
        loader.start_epoch(progress.epoch, progress.samples_in_epoch)
        micro_batches = []
        for batch in loader:
            micro_batches.append(batch)
            if len(micro_batches) == grad_accum:
                yield micro_batches
                micro_batches = []
                if getattr(loader, "restart", False):  # a new data stage: the epoch's rest read anew with it
                    break
        else:
            yield None


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

    def __getitem__(self, key: tuple):
        epoch, index = key[:2]
        with torch.random.fork_rng(devices=[]):  # transforms draw from the global CPU generator
            # Not torch.manual_seed, which also seeds (lazily, expensively) every GPU backend: only the CPU
            # generator matters here.
            torch.default_generator.manual_seed(((self.seed * 1_000_003 + epoch) * 1_000_033 + index) % 2**63)
            if hasattr(self.dataset, "set_epoch"):  # told here, in the process that loads the sample: a worker,
                self.dataset.set_epoch(epoch)  # persistent or not, never holds a stale epoch (or stage)
            if len(key) > 2 and key[2] is not None:
                self.dataset.set_stage(key[2])  # Task.after_evaluation's data_stage
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

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, rank_samples_per_step: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start_sample = 0
        self.stage = None  # Task.after_evaluation's data_stage, carried to the dataset with each sample's key
        # This rank's share of a step: batch size x micro-batches. An epoch ends on a whole optimizer step, so
        # no half-accumulated gradient is left over (like drop_last, one level up).
        self.rank_samples_per_step = rank_samples_per_step

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
        return iter((self.epoch, index, self.stage) for index in mine)  # keys for SeededSampleDataset

    def __len__(self) -> int:
        remaining = math.ceil((len(self.dataset) - self.start_sample) / self.num_replicas)
        return remaining - remaining % self.rank_samples_per_step


class ShardedLoader(DataLoader):
    """The training DataLoader of a map-style set: it knows where an epoch starts, and the data stage it hands out
    (Task.after_evaluation's "data_stage")."""

    position_entry = None  # its position is TrainingProgress's sample count: nothing more to save
    restart = False  # the epoch's samples read on anew from the next step, with a new stage

    def start_epoch(self, epoch: int, samples_in_epoch: int) -> None:
        """Mid-epoch resume: skip exactly the samples this epoch has already trained on, on any world size."""
        self.sampler.set_epoch(epoch, start_sample=samples_in_epoch)
        self.restart = False

    @property
    def stage(self):
        return self.sampler.stage

    def set_stage(self, stage) -> None:
        """The data stage from the next step on, read from there anew in every loader worker (training_steps)."""
        if self.sampler.stage is None:
            raise UsageError("Task.after_evaluation returned a data_stage, which reaches the training set's "
                             "set_stage(stage): give the training set that method")
        self.sampler.stage, self.restart = stage, stage != self.sampler.stage

    def samples_in_epochs(self, epochs: int) -> int:  # all ranks together: what the lr schedule spans
        return epochs * len(self.dataset)

    def steps_in_epochs(self, epochs: int) -> int:  # at this world size; asked before the first epoch starts
        return epochs * (len(self) * self.batch_size // self.sampler.rank_samples_per_step)  # batches / --grad-accum

    @property
    def samples_per_step(self) -> int:  # all ranks together
        return self.sampler.rank_samples_per_step * self.sampler.num_replicas

    def samples_in_step(self, samples_in_epoch: int) -> int:
        return self.samples_per_step

    def samples_in_steps(self, steps: int) -> int:  # the first `steps` steps' (--max-steps): what the schedule spans
        return steps * self.samples_per_step

    def steps_to(self, samples: int, progress: Any) -> int:  # from where `progress` stands until `samples` in all
        return max(math.ceil((samples - progress.samples_seen) / self.samples_per_step), 0)


def made_batches(make: Callable, dataset: Dataset, options: TrainOptions, epoch: int, world_size: int) -> list:
    """Task.batches' batches of an epoch; told the world size where it takes a 4th argument, `world_size` (batches in
    order, each rank a contiguous part of the data: global batch j goes to rank j % world_size)."""
    takes_world_size = "world_size" in inspect.signature(make).parameters
    return make(dataset, options, epoch, world_size) if takes_world_size else make(dataset, options, epoch)


class TaskBatches:
    """The batch sampler of a task that makes its own batches (Task.batches: length buckets, a token budget, any
    number of samples each). The epoch's batches are the same list on every rank; global batch j goes to rank
    j % world size, --grad-accum of them a step, and the epoch ends where a whole step no longer fits. Its
    position is the samples trained on this epoch, always whole batches: a job resumed on any world size
    continues at the first batch not trained on, so no sample is trained twice or skipped."""

    def __init__(self, make: Callable[[Dataset, TrainOptions, int], list[list[int]]], dataset: Dataset,
                 options: TrainOptions, env: DistEnv, device: torch.device):
        self.make, self.dataset, self.options = make, dataset, options
        self.rank, self.world_size, self.grad_accum = env.rank, env.world_size, options.grad_accum
        self.device, self.epoch, self.start = device, 0, 0
        # An epoch's batches, the samples before each, and a hash of them (compared across ranks and on resume).
        self.cached: tuple[int, list[list[int]], list[int], str] = (-1, [], [0], "")
        self.saved: dict | None = None  # the checkpoint's (epoch, hash of its batches), until that epoch starts
        self.sizes: dict[int, list[int]] = {}  # each epoch's batch sizes, once made: what the plan counts

    def batches(self, epoch: int) -> list[list[int]]:
        if self.cached[0] != epoch:
            batches = [list(batch) for batch in made_batches(self.make, self.dataset, self.options, epoch,
                                                             self.world_size)]
            if not all(batches):
                raise UsageError(f"Task.batches made an empty batch for epoch {epoch}; leave empty ones out")
            self.cached = (epoch, batches, [0, *itertools.accumulate(map(len, batches))],
                           hashlib.sha256(repr(batches).encode()).hexdigest()[:16])
            self.sizes[epoch] = [len(batch) for batch in batches]
        return self.cached[1]

    def batch_sizes(self, epoch: int) -> list[int]:
        """The sizes of `epoch`'s batches, its batches made once for the plan of every epoch, not once per use."""
        if epoch not in self.sizes:
            self.batches(epoch)
        return self.sizes[epoch]

    def digest(self, epoch: int) -> str:
        self.batches(epoch)
        return self.cached[3]

    def first_batch(self, epoch: int, samples_in_epoch: int) -> int:
        """The index of the epoch's batch after those holding its first `samples_in_epoch` samples."""
        self.batches(epoch)
        before = self.cached[2]
        index = bisect.bisect_left(before, samples_in_epoch)
        if index == len(before) or before[index] != samples_in_epoch:
            raise UsageError(f"the checkpoint stands {samples_in_epoch} samples into epoch {epoch}, between two of "
                             "Task.batches' batches: they changed since it was written; resume with the code that "
                             "wrote it, or from the start of an epoch")
        return index

    def set_epoch(self, epoch: int, samples_in_epoch: int = 0) -> None:
        """Every rank, at the epoch's start or resumed in it (a collective): the batches must be one list."""
        if not same_on_every_rank(self.digest(epoch), self.device):
            raise UsageError(f"Task.batches made other batches for epoch {epoch} on other ranks: they depend on "
                             "something each rank holds apart: a value a rank decided from its own loss or data "
                             "(decide it from numbers all-reduced over the ranks), torch's global generator, which "
                             "each rank seeds apart (draw from options.seed and the epoch, a torch.Generator of "
                             "their own), or the rank itself; make them from what every rank shares")
        saved, self.saved = self.saved, None
        tail = len(self.batches(epoch)) % (self.world_size * self.grad_accum)
        if tail and not samples_in_epoch:  # said when it happens, each epoch: no sample is dropped unsaid
            log.info("epoch %d: Task.batches' last %d batch(es) (%d samples) fill no whole step of %d ranks x "
                     "--grad-accum %d and are not trained (a multiple of %d batches trains them all)", epoch, tail,
                     sum(self.batch_sizes(epoch)[-tail:]), self.world_size, self.grad_accum,
                     self.world_size * self.grad_accum)
        if saved is not None and saved["epoch"] == epoch and saved["batches"] != self.digest(epoch):
            raise UsageError(f"Task.batches makes other batches for epoch {epoch} than the run that wrote the "
                             f"checkpoint, so its count of samples trained on names no place in them: "
                             f"{self.why_other_batches(saved)}")
        self.epoch, self.start = epoch, self.first_batch(epoch, samples_in_epoch)

    def options_digest(self) -> str:
        return hashlib.sha256(repr(sorted(vars(self.options.task).items())).encode()).hexdigest()[:16]

    def why_other_batches(self, saved: dict) -> str:
        """The cause a resume can tell apart, from what the checkpoint recorded beside the batches' hash."""
        if saved.get("world_size", self.world_size) != self.world_size:
            return (f"the checkpoint was written by {saved['world_size']} ranks and Task.batches depends on the "
                    f"world size; resume on {saved['world_size']} ranks, or make the batches without it")
        if saved.get("task_options", self.options_digest()) != self.options_digest():
            return ("a task option changed (listed above, in the line of changed options); resume with the options "
                    "that wrote it")
        return ("state they depend on that the checkpoint does not hold (a value learnt during the run, such as a "
                "curriculum stage: keep it in the task's state, which checkpoints save), or code they depend on "
                "changed; resume with the code that wrote it")

    def __len__(self) -> int:  # this rank's micro-batches left this epoch
        per_step = self.world_size * self.grad_accum
        return (len(self.batches(self.epoch)) - self.start) // per_step * self.grad_accum

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        batches = self.batches(self.epoch)
        for micro_batch in range(len(self)):  # (epoch, index) keys, for SeededSampleDataset
            yield [(self.epoch, index) for index in batches[self.start + micro_batch * self.world_size + self.rank]]

    def samples_in_step(self, samples_in_epoch: int) -> int:
        """Every rank's samples in the step that starts `samples_in_epoch` samples into the current epoch."""
        first = self.first_batch(self.epoch, samples_in_epoch)
        return sum(map(len, self.batches(self.epoch)[first:first + self.world_size * self.grad_accum]))


class TaskBatchLoader(DataLoader):
    """The training DataLoader over a task's own batches (TaskBatches). Checkpoints hold a hash of the epoch's
    batches beside the count of samples trained on: a resume whose Task.batches makes other batches (an option
    they depend on changed) would otherwise go on with other samples than the count says, without a word."""

    position_entry = "batches_position"  # its checkpoint entry

    def state_dict(self) -> dict:  # what a resume whose batches differ names the cause with, besides their hash
        sampler = self.batch_sampler
        return {"epoch": sampler.epoch, "batches": sampler.digest(sampler.epoch), "world_size": sampler.world_size,
                "task_options": sampler.options_digest()}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.saved = state

    def start_epoch(self, epoch: int, samples_in_epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch, samples_in_epoch)

    def samples_in_epochs(self, epochs: int) -> int:
        """What the batches of `epochs` epochs hold, each epoch's own (a curriculum's grow): the lr schedule spans
        them all, also the untrained tail of an epoch (steps_in_epochs), so that it is the same at any world size."""
        return sum(sum(self.batch_sampler.batch_sizes(epoch)) for epoch in range(epochs))

    def steps_in_epochs(self, epochs: int) -> int:  # at this world size, each epoch's own
        return sum(len(self.step_sizes(epoch)) for epoch in range(epochs))

    def step_sizes(self, epoch: int, samples_in_epoch: int = 0) -> list[int]:
        """Every rank's samples in each whole step of `epoch` at this world size, from `samples_in_epoch` on."""
        sampler = self.batch_sampler
        sizes, per_step = sampler.batch_sizes(epoch), sampler.world_size * sampler.grad_accum
        first = bisect.bisect_left([0, *itertools.accumulate(sizes)], samples_in_epoch)
        steps = [sum(sizes[start:start + per_step]) for start in range(first, len(sizes) - per_step + 1, per_step)]
        if not steps and not samples_in_epoch:
            raise UsageError(f"Task.batches made {len(sizes)} batch(es) for epoch {epoch}, not one whole step of "
                             f"{sampler.world_size} ranks x --grad-accum {sampler.grad_accum}; make more batches, or "
                             "train on fewer ranks")
        return steps

    def samples_in_steps(self, steps: int) -> int:  # the first `steps` steps' (--max-steps): what the schedule spans
        samples, epoch = 0, 0
        while steps > 0:
            sizes = self.step_sizes(epoch)[:steps]
            samples, steps, epoch = samples + sum(sizes), steps - len(sizes), epoch + 1
        return samples

    def steps_to(self, samples: int, progress: Any) -> int:
        """Steps from where `progress` stands until `samples` in all are trained, epoch after epoch."""
        steps, seen, epoch, into = 0, progress.samples_seen, progress.epoch, progress.samples_in_epoch
        while seen < samples:
            for size in self.step_sizes(epoch, into):
                if seen >= samples:
                    break
                steps, seen = steps + 1, seen + size
            epoch, into = epoch + 1, 0
        return steps

    @property
    def samples_per_step(self) -> int:  # a mean over epoch 0: what --warmup-steps counts in
        sampler = self.batch_sampler
        sizes, per_step = sampler.batch_sizes(0), sampler.world_size * sampler.grad_accum
        return sum(sizes) // max(len(sizes) // per_step, 1)

    def samples_in_step(self, samples_in_epoch: int) -> int:
        return self.batch_sampler.samples_in_step(samples_in_epoch)


def build_loaders(train_set: Dataset{% if cookiecutter.use_streaming == "yes" %} | StreamedDataset{% endif %}, eval_set: Dataset, options: TrainOptions, env: DistEnv,
                  device: torch.device, collate: Callable[[list], Any],
                  batches: Callable[[Dataset, TrainOptions, int], list[list[int]]] | None = None,
{%- if cookiecutter.fault_tolerance == "torchft" %}
                  train_env: DistEnv | None = None,
{%- endif %}
                  ) -> tuple[ShardedLoader | TaskBatchLoader{% if cookiecutter.use_streaming == "yes" %} | StreamLoader{% endif %}, DataLoader]:
    """The training loader (resumable sharding, per-sample seeds{% if cookiecutter.use_streaming == "yes" %}; or a stream's{% endif %}) and the held-out one (each
    rank a disjoint shard, no padding); `collate` (task.py's) makes a list of samples one batch. `batches`
    (Task.batches): the task's own, for both.{% if cookiecutter.fault_tolerance == "torchft" %} `train_env`: how the training set is split, if not as `env`
    (replica groups: as if every group were present).{% endif %}"""
    if options.num_workers:
        start_forkserver_deaf_to_sigterm()  # a no-op unless loader workers are started by a forkserver
    unbatched = dict(num_workers=options.num_workers, collate_fn=collate, pin_memory=device.type == "cuda",
                     persistent_workers=options.num_workers > 0,
                     worker_init_fn=functools.partial(detach_from_job_signals, training_process=os.getpid()))
    common = dict(batch_size=options.batch_size, **unbatched)  # unbatched: for a batch_sampler (Task.batches)
    # Evaluation shards without padding, so sums and counts over ranks count every sample exactly once. Each
    # loader has a generator of its own: otherwise each new iterator draws a seed from the global RNG, and a
    # resumed run (restored RNG, one more iterator) would continue with other random numbers (dropout masks).
    if batches is not None:  # the task's batches: each rank every world_size-th
        eval_batches = [list(batch) for batch in made_batches(batches, eval_set, options, 0, env.world_size)
                        ][env.rank::env.world_size]
        eval_loader = DataLoader(eval_set, batch_sampler=eval_batches,
                                 generator=torch.Generator().manual_seed(options.seed), **unbatched)
    else:
        eval_shard = Subset(eval_set, range(env.rank, len(eval_set), env.world_size))
        eval_loader = DataLoader(eval_shard, shuffle=False, generator=torch.Generator().manual_seed(options.seed),
                                 **common)
{%- if cookiecutter.fault_tolerance == "torchft" %}
    env = train_env or env  # from here on, the training set's ranks
{%- endif %}
    sample_log = None
    if options.sample_log:
        Path(options.sample_log).mkdir(parents=True, exist_ok=True)
        sample_log = Path(options.sample_log) / f"rank-{env.rank}.txt"
{%- if cookiecutter.use_streaming == "yes" %}
    if isinstance(train_set, StreamedDataset):
        if batches is not None:
            raise UsageError("Task.batches makes batches of a map-style training set; a streamed one is batched by "
                             "--batch-size (give --data a map-style set, or leave Task.batches out)")
        require_max_steps(options)
        return StreamLoader(train_set, env, batch_size=options.batch_size, grad_accum=options.grad_accum,
                            num_workers=options.num_workers, seed=options.seed, collate=collate,
                            pin_memory=common["pin_memory"], worker_init_fn=common["worker_init_fn"],
                            sample_log=sample_log), eval_loader
{%- endif %}
    seeded = SeededSampleDataset(train_set, options.seed)
    if sample_log is not None:
        seeded = SampleLoggingDataset(seeded, sample_log)
    read_ahead = (dict(prefetch_factor=max(2, math.ceil((options.grad_accum + 1) / options.num_workers)))
                  if options.num_workers else {})
    if batches is not None:
        task_batches = TaskBatches(batches, train_set, options, env, device)
        if len(task_batches) == 0:
            raise UsageError(f"Task.batches makes {len(task_batches.batches(0))} batches of the training set, fewer "
                             f"than one step takes ({env.world_size} ranks x --grad-accum {options.grad_accum})")
        return TaskBatchLoader(seeded, batch_sampler=task_batches, generator=torch.Generator().manual_seed(
            options.seed), **unbatched, **read_ahead), eval_loader
    staged, train_set = hasattr(train_set, "set_stage"), seeded
    sampler = ResumableDistributedSampler(train_set, env.world_size, env.rank, seed=options.seed,
                                          rank_samples_per_step=options.batch_size * options.grad_accum)
    # drop_last keeps every step's batch the same size on every rank.
    # Workers read a whole step ahead: the step starts once its --grad-accum micro-batches are in.
    train_loader = ShardedLoader(train_set, sampler=sampler, drop_last=True,
                                 generator=torch.Generator().manual_seed(options.seed), **common, **read_ahead)
    sampler.stage = 0 if staged else None  # set_stage's: 0 until Task.after_evaluation decides another
    if len(train_loader) == 0:
        raise UsageError(
            f"the training set ({len(train_set)} samples) gives no full step of {options.grad_accum} x "
            f"{options.batch_size} samples per rank over {env.world_size} ranks; "
            "lower --batch-size or --grad-accum, or use more data")
    # An epoch ends on a whole step: what is left is not trained (nor, where ranks are evened out, repeated) unsaid.
    per_rank = math.ceil(len(train_set) / env.world_size)
    trained = (per_rank - per_rank % sampler.rank_samples_per_step) * env.world_size
    if trained != len(train_set):
        log.info("each epoch trains %d of the training set's %d samples, in whole steps of %d rank(s) x %d; %s (other "
                 "world sizes, other counts)", trained, len(train_set), env.world_size, sampler.rank_samples_per_step,
                 f"the other {len(train_set) - trained}, drawn anew each epoch, are not trained"
                 if trained < len(train_set) else f"{trained - len(train_set)} of them twice, to even out the ranks")
    return train_loader, eval_loader


def map_tensors(function: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """`batch` with `function` applied to every tensor in it, whatever its nesting: tuple, list, named tuple,
    dict, dataclass. Anything else (strings, numbers) is kept as it is."""
    if isinstance(batch, torch.Tensor):
        return function(batch)
    if isinstance(batch, Mapping):
        return type(batch)({key: map_tensors(function, value) for key, value in batch.items()})
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{spec.name: map_tensors(function, getattr(batch, spec.name))
                                             for spec in dataclasses.fields(batch) if spec.init})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(map_tensors(function, value) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(function, value) for value in batch)
    return batch


def tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a batch, in map_tensors' order, without building a new batch."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from tensors_in(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for spec in dataclasses.fields(batch):
            yield from tensors_in(getattr(batch, spec.name))
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from tensors_in(value)


class OnDevice(Sequence):
    """A step's micro-batches, left where the loader made them (pinned host memory) and each moved to the device
    when it is read: the inputs of one or two micro-batches on the device at a time, not those of all
    --grad-accum."""

    def __init__(self, batches: list, device: torch.device, channels_last: bool):
        self.batches, self.device, self.channels_last = batches, device, channels_last

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, slice):
            return [to_device(batch, self.device, self.channels_last) for batch in self.batches[index]]
        return to_device(self.batches[index], self.device, self.channels_last)


def to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Every tensor of a batch (any nesting: map_tensors) on the device; 4-d floating-point tensors (images)
    channels-last when asked.

    non_blocking: from pinned loader memory the host only queues the copy and goes on queueing the step's
    kernels. On the GPU the copy runs in order on the compute stream, between the previous step's kernels and
    this one's; a prefetch on a side stream would hide it too, worth it only where copies are a visible part
    of a step (large images, a small model)."""
    def move(tensor: torch.Tensor) -> torch.Tensor:
        image = channels_last and tensor.dim() == 4 and tensor.is_floating_point()
        return tensor.to(device, non_blocking=True,
                         memory_format=torch.channels_last if image else torch.contiguous_format)
    return map_tensors(move, batch)
