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
{%- else -%}
"""What is trained: the datasets, the model, the loss, the evaluation metrics and the unit of throughput.

This is the one file to edit to train something else; train.py, checkpoints, FSDP2, resuming and logging
work unchanged. Register a dataset with @register_dataset("name") and a model with @register_model("name"):
the name is then accepted by --data / --model. A batch is (inputs, targets); train.py computes

    loss = compute_loss(model(inputs), targets)

for training, and evaluation uses the same compute_loss (evaluation_sums below).

Here: a decoder-only transformer (GPT) learns to predict the next token. Text is read as bytes (a vocabulary
of 256, nothing to download); for large corpora, tokenize once into nanoGPT's format, uint16 token ids in
--data-dir/train.bin and val.bin, and train with --data tokens.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .distributed import DistEnv
from .options import TrainOptions, UsageError

# Throughput is logged as <unit>/s, and the held-out count as "on N held-out <unit>".
THROUGHPUT_UNIT = "tokens"
# The tests in tests/ train with these (plus --ckpt-dir, --max-steps ...): keep them tiny and learnable, so the
# smoke tests still pass after you change this file.
SMOKE_TEST_ARGS = ["--data", "fake", "--fake-samples", "256", "--block-size", "32", "--n-layer", "2",
                   "--n-head", "2", "--n-embd", "64", "--batch-size", "8", "--num-workers", "0", "--device", "cpu",
                   "--lr", "3e-3"]
{%- endif %}

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


{% if cookiecutter.task == "image_classification" -%}
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
    """Sums over one held-out batch, each a number or a tensor of any shape (per-class counts, a confusion
    matrix); they are added up exactly over batches and ranks, then passed to summarize (one-element sums as
    floats, others as tensors). The THROUGHPUT_UNIT key counts what was evaluated."""
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
    known = sorted(registry)
    hint = (f"did you mean {', '.join(close)}?" if close
            else f"known: {', '.join(known[:8])}{', ...' if len(known) > 8 else ''}.")
    return (f"--{kind} {name!r} is not registered; {hint} To add it, register a builder with "
            f"@{decorator}({name!r}) in {__name__.replace('.', '/')}.py")
{%- else -%}
# ---- data --------------------------------------------------------------------------------------------------

class TokenBlocks(Dataset):
    """Sample i: block i of the token stream as input, the same block shifted by one token as target.

    Blocks do not overlap, so an epoch sees every token once and the resumable sampler's "every sample once"
    holds for tokens too. `tokens` is an array, or the path of a uint16 file opened anew on every access:
    a memmap kept open grows the process's memory with every page read (as nanoGPT notes)."""

    def __init__(self, tokens: np.ndarray | Path, block_size: int):
        self.tokens = tokens
        self.block_size = block_size
        length = len(tokens) if isinstance(tokens, np.ndarray) else Path(tokens).stat().st_size // 2
        self.size = max(length - 1, 0) // block_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokens
        if not isinstance(tokens, np.ndarray):
            tokens = np.memmap(tokens, dtype=np.uint16, mode="r")
        start = index * self.block_size
        block = torch.from_numpy(tokens[start:start + self.block_size + 1].astype(np.int64))
        return block[:-1], block[1:]


def fake_corpus(sentences: int, seed: int) -> bytes:
    """Sentences from a tiny grammar: a byte-level model learns its words and their order within a few dozen
    steps, so the loss falls clearly (tests, demos)."""
    generator = np.random.default_rng(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "our teacher", "a small bird"]
    verbs = ["sees", "likes", "finds", "follows", "paints", "remembers"]
    objects = ["the river", "a red ball", "the garden", "an apple", "the moon", "a quiet song"]
    words = [subjects, verbs, objects]
    return "".join(" ".join(part[generator.integers(len(part))] for part in words) + ". "
                   for _ in range(sentences)).encode()


def byte_tokens(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8)


@register_dataset("fake")
def fake_text(options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    """--fake-samples blocks of generated sentences to train on, a quarter of that (other sentences) held out."""
    def blocks(count: int, seed: int) -> TokenBlocks:
        length = count * options.block_size + 1
        return TokenBlocks(byte_tokens(fake_corpus(length // 16 + 1, seed)[:length]), options.block_size)
    return blocks(options.fake_samples, options.seed), blocks(max(options.fake_samples // 4, 1), options.seed + 1)


def text_files(data_dir: str) -> tuple[Path, Path | None]:
    root = Path(data_dir)
    if (root / "train.txt").is_file() and (root / "val.txt").is_file():
        return root / "train.txt", root / "val.txt"
    if (root / "input.txt").is_file():
        return root / "input.txt", None
    raise UsageError(f"--data-dir {root}: expected train.txt and val.txt, or one input.txt (split 90/10), "
                     "for --data text")


@register_dataset("text")
def text(options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    train_file, val_file = text_files(options.data_dir)
    if val_file is not None:
        train, held_out = byte_tokens(train_file.read_bytes()), byte_tokens(val_file.read_bytes())
    else:
        corpus = byte_tokens(train_file.read_bytes())
        train, held_out = corpus[:len(corpus) * 9 // 10], corpus[len(corpus) * 9 // 10:]
    return TokenBlocks(train, options.block_size), TokenBlocks(held_out, options.block_size)


@register_dataset("tokens")
def token_files(options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    root = Path(options.data_dir)
    for name in ("train.bin", "val.bin"):
        if not (root / name).is_file():
            raise UsageError(f"--data-dir {root}: expected {root / name} (uint16 token ids, nanoGPT's format) "
                             "for --data tokens")
    return TokenBlocks(root / "train.bin", options.block_size), TokenBlocks(root / "val.bin", options.block_size)


def vocab_size(options: TrainOptions) -> int:
    if options.vocab_size is not None:
        return options.vocab_size
    return 50304 if options.data == "tokens" else 256  # GPT-2's 50257, padded to a multiple of 64


# ---- model -------------------------------------------------------------------------------------------------

class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = (part.view(batch, time, self.n_head, -1).transpose(1, 2)
                   for part in self.qkv(x).split(channels, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        return self.proj_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, channels)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.attention_norm = nn.LayerNorm(n_embd, bias=False)
        self.attention = SelfAttention(n_embd, n_head, dropout)
        self.mlp_norm = nn.LayerNorm(n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=False), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """nanoGPT's model (GPT-2's layout, no biases), without weight tying: the embedding and the output head
    are separate matrices, which keeps FSDP2 sharding and DCP checkpoints plain."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(block_size, n_embd)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.norm = nn.LayerNorm(n_embd, bias=False)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        for name, parameter in self.named_parameters():  # GPT-2's initialisation
            if parameter.dim() == 2:
                # Residual projections scaled down by depth, so the residual stream's variance stays put.
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(parameter, mean=0.0, std=std)

    def sharding_units(self) -> list[nn.Module]:
        """FSDP2 shards one group per transformer block (parallel.py); the rest goes with the root."""
        return list(self.blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        return self.head(self.norm(self.blocks(x)))  # logits: (batch, time, vocab)


@register_model("gpt")
def gpt(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return GPT(vocab_size(options), options.block_size, options.n_layer, options.n_head, options.n_embd,
               options.dropout)


def build_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms or biases), as nanoGPT. The warmup + decay
    schedule scales whatever lr this starts with."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=options.lr, betas=(0.9, 0.95))


# ---- loss and evaluation -----------------------------------------------------------------------------------

def compute_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(outputs.float().flatten(0, 1), targets.flatten())


def evaluation_sums(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over one held-out batch, each a number or a tensor of any shape (per-class counts, a confusion
    matrix); they are added up exactly over batches and ranks, then passed to summarize (one-element sums as
    floats, others as tensors). The THROUGHPUT_UNIT key counts what was evaluated."""
    count = targets.numel()
    return {"loss": compute_loss(outputs, targets) * count, "tokens": torch.tensor(count)}


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """The logged evaluation metrics, from sums over the whole held-out split (every rank)."""
    loss = sums["loss"] / sums["tokens"]
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(sums["tokens"])}


def units_per_sample(options: TrainOptions) -> int:
    """THROUGHPUT_UNITs in one sample of the training set: the tokens of a block."""
    return options.block_size


def model_flops_per_unit(model: nn.Module, options: TrainOptions) -> float | None:
    """Training FLOPs per token, for model FLOPs utilisation (PaLM's appendix B, as nanoGPT): 6 per parameter
    (forward 2, backward 4) plus attention's 12 x layers x width x context. Position embeddings are a lookup."""
    parameters = sum(p.numel() for p in model.parameters()) - options.block_size * options.n_embd
    return 6 * parameters + 12 * options.n_layer * options.n_embd * options.block_size


# ---- checks, before any process group starts ---------------------------------------------------------------

def check_options(options: TrainOptions) -> None:
    """Refuse a --data or --model name nothing is registered under, and values this task cannot use."""
    if options.data not in DATASETS:
        raise UsageError(unknown_name("data", options.data, DATASETS, "register_dataset"))
    if options.model not in MODELS:
        raise UsageError(unknown_name("model", options.model, MODELS, "register_model"))
    for name in ("fake_samples", "block_size", "n_layer", "n_head", "n_embd"):
        if getattr(options, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.n_embd % options.n_head:
        raise UsageError(f"--n-embd {options.n_embd} must be a multiple of --n-head {options.n_head}")
    if not 0 <= options.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {options.dropout}")
    if options.vocab_size is not None and not 1 <= options.vocab_size <= 65536:
        raise UsageError(f"--vocab-size must be between 1 and 65536 (uint16 token ids), got {options.vocab_size}")
    if options.data == "text":
        text_files(options.data_dir)
    if options.data == "tokens":
        token_files(options, DistEnv(), torch.device("cpu"))  # only checks the files: cheap


def unknown_name(kind: str, name: str, registry: dict, decorator: str) -> str:
    close = difflib.get_close_matches(name, list(registry), n=3)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(sorted(registry))}."
    return (f"--{kind} {name!r} is not registered; {hint} To add it, register a builder with "
            f"@{decorator}({name!r}) in {__name__.replace('.', '/')}.py")
{%- endif %}


def build_datasets(options: TrainOptions, env: DistEnv, device: torch.device) -> tuple[Dataset, Dataset]:
    return DATASETS[options.data](options, env, device)


def build_model(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return MODELS[options.model](options, train_set)
