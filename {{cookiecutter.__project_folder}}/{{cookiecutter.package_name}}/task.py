{%- if cookiecutter.task == "image_classification" -%}
"""What is trained: the datasets, the model, the loss, the evaluation metrics and the unit of throughput.

This is the one file to edit to train something else; train.py, checkpoints, FSDP2, resuming and logging
work unchanged. Register a dataset with @register_dataset("name") and a model with @register_model("name"):
the name is then accepted by --data / --model. A batch is (inputs, targets); train.py computes

    loss = compute_loss(model(inputs), targets)

for training, and evaluation uses the same compute_loss (evaluation_sums below).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.data import Dataset
from torchvision import datasets, transforms

from .distributed import DistEnv, run_once_per_node
from .options import TrainOptions, UsageError

# Throughput is logged as <unit>/s, and the held-out count as "on N held-out <unit>".
THROUGHPUT_UNIT = "samples"
# The tests in tests/ train with these (plus --ckpt-dir, --max-steps ...): keep them tiny and learnable, so the
# smoke tests still pass after you change this file.
SMOKE_TEST_ARGS = ["--data", "fake", "--fake-samples", "512", "--image-size", "16", "--batch-size", "16",
                   "--model", "resnet18", "--num-workers", "0", "--device", "cpu", "--lr", "0.005"]

DatasetBuilder = Callable[[TrainOptions, DistEnv, torch.device], tuple[Dataset, Dataset]]
ModelBuilder = Callable[[TrainOptions, Dataset], nn.Module]
DATASETS: dict[str, DatasetBuilder] = {}  # --data name -> builder of (train, held-out)
MODELS: dict[str, ModelBuilder] = {}  # --model name -> builder


def register_dataset(name: str) -> Callable[[DatasetBuilder], DatasetBuilder]:
    """Register a builder of (train, held-out) datasets under a --data name."""
    def register(builder: DatasetBuilder) -> DatasetBuilder:
        DATASETS[name] = builder
        return builder
    return register


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Register a model builder under a --model name; it sees the options and the training set."""
    def register(builder: ModelBuilder) -> ModelBuilder:
        MODELS[name] = builder
        return builder
    return register


# ---- data --------------------------------------------------------------------------------------------------

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


@register_dataset("fake")
def fake_images(options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    shape = dict(image_size=options.image_size, num_classes=options.num_classes, seed=options.seed)
    return (LearnableFakeData(options.fake_samples, **shape),
            LearnableFakeData(max(options.fake_samples // 4, 1), **shape, first_index=options.fake_samples))


@register_dataset("cifar10")
def cifar10(options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    augment = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), normalize])
    run_once_per_node(env, device, lambda: datasets.CIFAR10(options.data_dir, download=True),
                      what=f"downloading CIFAR-10 into {options.data_dir}")
    return (datasets.CIFAR10(options.data_dir, train=True, transform=augment),
            datasets.CIFAR10(options.data_dir, train=False, transform=normalize))


@register_dataset("imagefolder")
def image_folder(options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    root, size = Path(options.data_dir), options.image_size
    for split in ("train", "val"):  # checked before any process group starts (check_options)
        folder = root / split
        if not folder.is_dir() or not any(child.is_dir() for child in folder.iterdir()):
            raise UsageError(f"--data-dir {root}: expected class folders in {folder} "
                             f"({folder}/<class>/<image>.jpg) for --data imagefolder")
    augment = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                  transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    evaluate = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size),
                                   transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    return (datasets.ImageFolder(root / "train", transform=augment),
            datasets.ImageFolder(root / "val", transform=evaluate))


# ---- model -------------------------------------------------------------------------------------------------

@register_model("small_cnn")
def small_cnn(options: TrainOptions, train_set: Dataset, width: int = 32) -> nn.Module:
    """Three conv blocks and a linear head, quick on a CPU. GroupNorm, not BatchNorm, and no dropout: a
    sample's gradient does not depend on the rest of its batch, so a larger batch and the same samples in
    accumulated micro-batches give the same update."""
    def block(channels_in: int, channels_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.GroupNorm(8, channels_out),
                             nn.ReLU(inplace=True), nn.MaxPool2d(2))
    # Pooling to 2x2, not 1x1, keeps where in the image a feature was.
    return nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width * 4, options.num_classes))


def torchvision_model(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return torchvision.models.get_model(options.model, weights=None, num_classes=options.num_classes)


# Every torchvision classifier by name (module=torchvision.models: not detection, segmentation or video).
for _name in torchvision.models.list_models(module=torchvision.models):
    MODELS.setdefault(_name, torchvision_model)


def build_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """The warmup + decay schedule scales whatever lr this starts with."""
    return torch.optim.SGD(model.parameters(), lr=options.lr, momentum=0.9, weight_decay=5e-4)


# ---- loss and evaluation -----------------------------------------------------------------------------------

def compute_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean loss of a batch: what training minimises and evaluation reports."""
    return F.cross_entropy(outputs.float(), targets)


def evaluation_sums(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over one held-out batch; they are added up over batches and ranks, then passed to summarize.
    The THROUGHPUT_UNIT key counts what was evaluated."""
    count = targets.numel()
    return {"loss": compute_loss(outputs, targets) * count,
            "correct": (outputs.argmax(dim=1) == targets).sum(),
            "samples": torch.tensor(count)}


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """The logged evaluation metrics, from sums over the whole held-out split (every rank)."""
    count = sums["samples"]
    return {"loss": sums["loss"] / count, "accuracy": sums["correct"] / count, "samples": int(count)}


def units_per_sample(options: TrainOptions) -> int:
    """THROUGHPUT_UNITs in one sample of the training set."""
    return 1


def model_flops_per_unit(model: nn.Module, options: TrainOptions) -> float | None:
    """Training FLOPs (forward and backward) per THROUGHPUT_UNIT, for model FLOPs utilisation; None: not logged."""
    return None


# ---- checks, before any process group starts ---------------------------------------------------------------

def check_options(options: TrainOptions) -> None:
    """Refuse a --data or --model name nothing is registered under, and values this task cannot use."""
    if options.data not in DATASETS:
        raise UsageError(unknown_name("data", options.data, DATASETS, "register_dataset"))
    if options.model not in MODELS:
        raise UsageError(f"--model {options.model!r} is not a torchvision classification model; "
                         + unknown_name("model", options.model, MODELS, "register_model").split("; ", 1)[1])
    if options.num_classes < 2:
        raise UsageError(f"--num-classes must be >= 2 for classification, got {options.num_classes}")
    for name in ("fake_samples", "image_size"):
        if getattr(options, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.data == "imagefolder":
        image_folder(options, DistEnv(), torch.device("cpu"))  # only checks the folders: cheap


def unknown_name(kind: str, name: str, registry: dict, decorator: str) -> str:
    close = difflib.get_close_matches(name, list(registry), n=3)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(sorted(registry)[:8])}, ..."
    return (f"--{kind} {name!r} is not registered; {hint} To add it, register a builder with "
            f"@{decorator}({name!r}) in {__name__.replace('.', '/')}.py")


def build_datasets(options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    return DATASETS[options.data](options, env, device)


def build_model(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return MODELS[options.model](options, train_set)
{%- else -%}
LANGUAGE_MODEL_PLACEHOLDER
{%- endif %}
