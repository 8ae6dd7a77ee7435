"""What is trained: the task's options, datasets, model, optimizer, loss and evaluation metrics.

This is the one file to edit to train something else; train.py, checkpoints, FSDP2, resuming and logging
work unchanged. TASK, at the end, is everything the package calls (spec.py's Task lists every hook, with the
defaults of those you leave out): a dataset builder named in its `datasets` is accepted by --data, a model
builder in `models` by --model. A batch is whatever `collate` makes of a list of samples (by default torch's
default_collate: here a tuple {% if cookiecutter.task == "image_classification" %}(images, labels){% else %}(tokens, next tokens){% endif %}); train.py calls

    loss = compute_loss(model, batch, step)

and evaluation adds up evaluation_sums(model, batch) over the held-out split, then calls summarize. (A task
that steps its optimizers itself, two networks trained in turn, gives TASK a training_step instead of
compute_loss: see step.py's Step.)

Random numbers: torch's generators start from --seed, the same on every rank while the model is built (every
replica starts equal); then each rank's CPU and CUDA generators get a seed of their own, so torch.randn in a
loss, or dropout, draws differently on each rank, as for different samples of one batch. Checkpoints hold each
rank's generators: a resumed run draws the same numbers it would have. What an evaluation draws (noise in a
held-out loss) is undone after it, and changes no training draw. A draw every rank must make alike (which
blocks LayerDrop skips) takes a torch.Generator of its own, seeded from options.seed and step.number.
{%- if cookiecutter.task == "language_model" %}

Here: a decoder-only transformer (GPT) learns to predict the next token. Text is read as bytes (a vocabulary
of 256, nothing to download); for large corpora, tokenize once into nanoGPT's format, uint16 token ids in
--data-dir/train.bin and val.bin, and train with --data tokens
{%- if cookiecutter.use_streaming == "yes" %}; or stream the raw text of jsonl, text or
parquet shards with --data stream --data-files 'corpus/*.jsonl', tokenized as it is read
{%- endif %}.
{%- endif %}
"""

{% if cookiecutter.task == "image_classification" -%}
from __future__ import annotations

{% if cookiecutter.use_streaming == "yes" -%}
import functools
import io
from collections.abc import Iterator
{% endif -%}
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .engine.errors import UsageError
{%- if cookiecutter.use_streaming == "yes" %}
from .engine.streaming import (
    StreamedDataset,
    check_first_records,
    expand_files,
    file_pieces,
    require_max_steps,
    tar_samples,
)
{%- endif %}
from .options import TrainOptions, option
from .spec import Task
from .step import Step


@dataclass
class TaskOptions:
    """This task's flags: each field is a --flag, its help the --help text; the training flags are in
    options.py. fixed=True: a checkpoint cannot be resumed once the value changes (its tensors would not fit).
    The code below reads them as options.task.<name>."""

    data: str = option(
        "fake", "a dataset in task.py's TASK: fake (generated, learnable), cifar10 (downloaded to "
        "--data-dir), imagefolder (--data-dir/train/<class>/*.jpg and --data-dir/val/<class>/*.jpg)
{%- if cookiecutter.use_streaming == "yes" %}, shards "
        "(tar files of --data-files, read as a stream)
{%- endif %}")
    data_dir: str = option("data", "where cifar10 is downloaded, or the imagefolder root")
{%- if cookiecutter.use_streaming == "yes" %}
    data_files: str = option(
        "", "for --data shards: a glob of tar shards in WebDataset's layout (quoted): <key>.jpg or .png and "
        "<key>.cls (the class number) for each image", fixed=True)
    eval_files: str = option("", "for --data shards: a glob of the held-out shards, read whole (keep them small)")
{%- endif %}
    fake_samples: int = option(2048, "size of the fake training set (the held-out set is a quarter of it)")
    model: str = option("resnet18", "a model in task.py's TASK: any torchvision classification model name "
                        "(e.g. resnet50), or small_cnn (a quick CPU model whose gradients do not depend on the "
                        "batch)", fixed=True)
    image_size: int = option(32, "images are resized (imagefolder) or generated (fake) at this side length")
    num_classes: int = option(10, "outputs of the model's head (cifar10 has 10 classes)", fixed=True)

{%- else -%}
from __future__ import annotations

import functools
import math
{% if cookiecutter.use_streaming == "yes" -%}
from collections.abc import Callable, Iterator
{% else -%}
from collections.abc import Callable
{% endif -%}
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from . import sample
from .engine.errors import UsageError
{%- if cookiecutter.use_streaming == "yes" %}
from .engine.streaming import (
    StreamedDataset,
    check_first_records,
    expand_files,
    file_pieces,
    read_documents,
    require_max_steps,
)
{%- endif %}
from .options import TrainOptions, option
from .spec import Task
from .step import Step


@dataclass
class TaskOptions:
    """This task's flags: each field is a --flag, its help the --help text; the training flags are in
    options.py. fixed=True: a checkpoint cannot be resumed once the value changes (its tensors would not fit).
    The code below reads them as options.task.<name>."""

    data: str = option(
        "fake", "a dataset in task.py's TASK: fake (generated sentences, learnable), text (bytes of "
        "--data-dir/train.txt and val.txt, or of input.txt split 90/10), tokens (nanoGPT's uint16 "
        "--data-dir/train.bin and val.bin)
{%- if cookiecutter.use_streaming == "yes" %}, stream (the raw text of --data-files, read as a stream)
{%- endif %}")
    data_dir: str = option("data", "the folder with the text corpus or the token files")
{%- if cookiecutter.use_streaming == "yes" %}
    data_files: str = option(
        "", "for --data stream: a glob of the training corpus's files (quoted): .jsonl (a 'text' field per line), "
        ".txt (each file one document) or .parquet (a 'text' column)", fixed=True)
    eval_files: str = option("", "for --data stream: a glob of the held-out files, read whole (keep them small)")
    piece_mb: float = option(
        16, "for --data stream: ranks and loader workers are dealt the corpus in pieces of about this many MB "
        "(a parquet row group is one piece)", fixed=True)
{%- endif %}
    tokenizer: str = option(
        "", "a tokenizer.json (Hugging Face tokenizers; prepare.py makes one) to read --data text"
        "{% if cookiecutter.use_streaming == "yes" %} and stream{% endif %} with, and what --data tokens' ids are "
        "(for sampling); default: bytes", fixed=True)
    fake_samples: int = option(2048, "sequences in the fake training set (the held-out set is a quarter of it)")
    model: str = option("gpt", "a model in task.py's TASK: gpt (a decoder-only transformer)", fixed=True)
    block_size: int = option(128, "context length in tokens; a training sample is one block", fixed=True)
    vocab_size: int | None = option(None, "tokens in the vocabulary (default: 256 for fake and text, which are "
                                    "bytes; 50304 for tokens, GPT-2's 50257 padded)", fixed=True)
    n_layer: int = option(4, "transformer blocks", fixed=True)
    n_head: int = option(4, "attention heads per block", fixed=True)
    n_embd: int = option(128, "width of the residual stream", fixed=True)
    dropout: float = option(0.0, "dropout probability in attention and MLP outputs")
    sample_every: int = option(0, "every this many steps, rank 0 appends text from the model to samples.txt in "
                               "--log-dir (else --ckpt-dir); 0: never (python -m <package>.sample: a checkpoint's)")

{%- endif %}

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
        # initialised GPU backend, with a stack trace each time, and cost 1 ms a sample.
        generator = torch.Generator().manual_seed(self.offset + index)
        label = int(torch.randint(self.num_classes, (), generator=generator))
        noise = torch.rand(self.shape, generator=generator)
        return 0.5 * noise + 0.5 * self.class_patterns[label], label


def fake_images(options: TrainOptions) -> tuple[Dataset, Dataset]:
    shape = dict(image_size=options.task.image_size, num_classes=options.task.num_classes, seed=options.seed)
    return (LearnableFakeData(options.task.fake_samples, **shape),
            LearnableFakeData(max(options.task.fake_samples // 4, 1), **shape, first_index=options.task.fake_samples))


def download_cifar10(options: TrainOptions) -> None:
    """Run before cifar10() on one rank per storage (TASK's prepare_data), while the others wait."""
    from torchvision import datasets
    datasets.CIFAR10(options.task.data_dir, download=True)


def cifar10(options: TrainOptions) -> tuple[Dataset, Dataset]:
    from torchvision import datasets, transforms  # here: as slow to import as torch, and fake data needs none
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    augment = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), normalize])
    return (datasets.CIFAR10(options.task.data_dir, train=True, transform=augment),
            datasets.CIFAR10(options.task.data_dir, train=False, transform=normalize))


def check_image_folders(root: Path) -> None:
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir() or not any(child.is_dir() for child in folder.iterdir()):
            raise UsageError(f"--data-dir {root}: expected class folders in {folder} "
                             f"({folder}/<class>/<image>.jpg) for --data imagefolder")


def image_folder(options: TrainOptions) -> tuple[Dataset, Dataset]:
    from torchvision import datasets, transforms
    root, size = Path(options.task.data_dir), options.task.image_size
    check_image_folders(root)  # also before any process group starts (check_options)
    augment = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                  transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    evaluate = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size),
                                   transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    return (datasets.ImageFolder(root / "train", transform=augment),
            datasets.ImageFolder(root / "val", transform=evaluate))
{%- if cookiecutter.use_streaming == "yes" %}


SHARDS, IMAGE_EXTENSIONS = (".tar",), ("jpg", "jpeg", "png")


def shard_images(piece: tuple, image_size: int, augment: bool) -> Iterator[tuple[torch.Tensor, int]]:
    """The (image, class) samples of one tar shard, in its order; random crops and flips when `augment` (drawn
    from the CPU generator, which the stream seeds for each sample: a resume redraws them identically)."""
    from PIL import Image
    from torchvision import transforms
    steps = ([transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip()] if augment
             else [transforms.Resize(image_size), transforms.CenterCrop(image_size)])
    transform = transforms.Compose([*steps, transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    for key, fields in tar_samples(piece[0]):
        image = next((fields[extension] for extension in IMAGE_EXTENSIONS if extension in fields), None)
        if image is None or "cls" not in fields:
            raise UsageError(f"{piece[0]}: sample {key} has {', '.join(sorted(fields))}; each needs an image "
                             f"({', '.join(IMAGE_EXTENSIONS)}) and a .cls file")
        yield transform(Image.open(io.BytesIO(image)).convert("RGB")), int(fields["cls"])


def image_shards(options: TrainOptions) -> tuple[StreamedDataset, list]:
    """--data-files as a stream, one tar shard a piece (nothing read until training starts); --eval-files whole."""
    task = options.task
    pieces = file_pieces(expand_files(task.data_files, "--data-files", SHARDS), piece_bytes=0)
    held_out = [sample for piece in file_pieces(expand_files(task.eval_files, "--eval-files", SHARDS), piece_bytes=0)
                for sample in shard_images(piece, task.image_size, augment=False)] if task.eval_files else []
    return StreamedDataset(pieces, functools.partial(shard_images, image_size=task.image_size, augment=True)), held_out
{%- endif %}


# ---- model -------------------------------------------------------------------------------------------------

def small_cnn(options: TrainOptions, train_set: Dataset, width: int = 32) -> nn.Module:
    """Three conv blocks and a linear head, quick on a CPU. GroupNorm, not BatchNorm, and no dropout: a
    sample's gradient does not depend on the rest of its batch, so a larger batch and the same samples in
    accumulated micro-batches give the same update."""
    def block(channels_in: int, channels_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.GroupNorm(8, channels_out),
                             nn.ReLU(inplace=True), nn.MaxPool2d(2))
    # Pooling to 2x2, not 1x1, keeps where in the image a feature was.
    return nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width * 4, options.task.num_classes))


def torchvision_models() -> dict:
    """Every torchvision classifier by name (module=torchvision.models: not detection, segmentation or video)."""
    import torchvision

    def torchvision_model(options: TrainOptions, train_set: Dataset) -> nn.Module:
        return torchvision.models.get_model(options.task.model, weights=None, num_classes=options.task.num_classes)
    return dict.fromkeys(torchvision.models.list_models(module=torchvision.models), torchvision_model)


def build_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """The warmup + decay schedule scales whatever lr this starts with. Frozen parameters (requires_grad False:
    a pretrained part you do not train) are left out."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return torch.optim.SGD(trained, lr=options.lr, momentum=0.9, weight_decay=5e-4)


# ---- loss and evaluation -----------------------------------------------------------------------------------

def outputs_and_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's outputs for a batch and their mean loss: the one path training and evaluation share."""
    inputs, targets = batch
    outputs = model(inputs).float()
    return outputs, F.cross_entropy(outputs, targets)


def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], step: Step) -> torch.Tensor:
    """The mean loss of a batch, what training minimises; `model` is the DDP- or FSDP2-wrapped one. `step` (step.py's
    Step): its number (1 for the first), the options (the task's as step.options.task), the plain model."""
    return outputs_and_loss(model, batch)[1]


def evaluation_sums(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums over one held-out batch, each a number or a tensor of any shape (per-class counts, a confusion
    matrix); they are added up exactly over batches and ranks, then passed to summarize (one-element sums as
    numbers, an int where the sum is an integer count; others as tensors). The throughput_unit key ("samples")
    counts what was evaluated."""
    outputs, loss = outputs_and_loss(model, batch)
    targets = batch[1]
    return {"loss": loss * targets.numel(),
            "correct": (outputs.argmax(dim=1) == targets).sum(),
            "samples": torch.tensor(targets.numel())}


def summarize(sums: dict, outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """The logged evaluation metrics, from sums over the whole held-out split (every rank). `outputs` holds the
    per-sample rows of evaluation_outputs(model, batch) from every rank, if you define it (here: {})."""
    count = sums["samples"]
    return {"loss": sums["loss"] / count, "accuracy": sums["correct"] / count, "samples": int(count)}


# ---- checks, before any process group starts ---------------------------------------------------------------

def check_options(options: TrainOptions) -> None:
    """Refuse values this task cannot use (spec.py has already checked the --data and --model names)."""
    if options.task.num_classes < 2:
        raise UsageError(f"--num-classes must be >= 2 for classification, got {options.task.num_classes}")
    for name in ("fake_samples", "image_size"):
        if getattr(options.task, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options.task, name)}")
    if options.task.data == "imagefolder":
        check_image_folders(Path(options.task.data_dir))
{%- if cookiecutter.use_streaming == "yes" %}
    if options.task.data == "shards":
        require_max_steps(options)
        for flag, pattern in (("--data-files", options.task.data_files or "(none given)"),
                              ("--eval-files", options.task.eval_files)):
            if pattern:
                check_first_records(expand_files(pattern, flag, SHARDS), field="cls")
        if not options.task.eval_files and (options.eval_every or options.eval_every_steps):
            raise UsageError("--data shards evaluates on --eval-files (small held-out shards, read whole); give "
                             "them, or --eval-every 0")
{%- endif %}


# ---- what the package calls --------------------------------------------------------------------------------

TASK = Task(
    options=TaskOptions,
    datasets={"fake": fake_images, "cifar10": cifar10, "imagefolder": image_folder
{%- if cookiecutter.use_streaming == "yes" %}, "shards": image_shards{% endif %}},
    models={"small_cnn": small_cnn},
    more_models=torchvision_models,  # any other --model name: torchvision's, imported only then
    build_optimizer=build_optimizer,
    compute_loss=compute_loss,
    evaluation_sums=evaluation_sums,
    summarize=summarize,
    check_options=check_options,
    prepare_data={"cifar10": download_cifar10},  # downloads, before the dataset is built
    throughput_unit="samples",
    # tests/ train with these (plus --ckpt-dir, --max-steps ...): keep them tiny and learnable, so the smoke
    # tests still pass after you change this file.
    smoke_test_args=["--data", "fake", "--fake-samples", "512", "--image-size", "16", "--batch-size", "16",
                     "--model", "small_cnn", "--num-workers", "0", "--device", "cpu", "--lr", "0.005"],
)
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


def fake_text(options: TrainOptions) -> tuple[Dataset, Dataset]:
    """--fake-samples blocks of generated sentences to train on, a quarter of that (other sentences) held out."""
    def blocks(count: int, seed: int) -> TokenBlocks:
        length = count * options.task.block_size + 1
        return TokenBlocks(byte_tokens(fake_corpus(length // 16 + 1, seed)[:length]), options.task.block_size)
    samples = options.task.fake_samples
    return blocks(samples, options.seed), blocks(max(samples // 4, 1), options.seed + 1)


@functools.cache  # once per process: each loader worker loads its own
def load_tokenizer(path: str):
    """(the tokenizer of a tokenizer.json, the id of its end-of-text token)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("--tokenizer needs the tokenizers library: pip install -e '.[tokenizers]'") from None
    if not Path(path).is_file():
        raise UsageError(f"--tokenizer {path}: no such file; give the path of a tokenizer.json, or leave it out "
                         "to read bytes")
    tokenizer = Tokenizer.from_file(path)
    end = tokenizer.token_to_id("<|endoftext|>")
    if end is None:
        raise UsageError(f"--tokenizer {path} has no <|endoftext|> token, which ends each document; add it to the "
                         "tokenizer's special tokens")
    return tokenizer, end


def text_files(data_dir: str) -> tuple[Path, Path | None]:
    root = Path(data_dir)
    if (root / "train.txt").is_file() and (root / "val.txt").is_file():
        return root / "train.txt", root / "val.txt"
    if (root / "input.txt").is_file():
        return root / "input.txt", None
    raise UsageError(f"--data-dir {root}: expected train.txt and val.txt, or one input.txt (split 90/10), "
                     "for --data text")


def text(options: TrainOptions) -> tuple[Dataset, Dataset]:
    """--data-dir's text as bytes, or as --tokenizer's ids (read whole: prepare.py writes a large corpus's ids
    once, for --data tokens)."""
    train_file, val_file = text_files(options.task.data_dir)
    if options.task.tokenizer:
        tokenizer = load_tokenizer(options.task.tokenizer)[0]
        def read(path: Path) -> np.ndarray:
            return np.array(tokenizer.encode(path.read_text(), add_special_tokens=False).ids, dtype=np.int64)
    else:
        def read(path: Path) -> np.ndarray:
            return byte_tokens(path.read_bytes())
    if val_file is not None:
        train, held_out = read(train_file), read(val_file)
    else:
        corpus = read(train_file)
        train, held_out = corpus[:len(corpus) * 9 // 10], corpus[len(corpus) * 9 // 10:]
    return TokenBlocks(train, options.task.block_size), TokenBlocks(held_out, options.task.block_size)


def check_token_files(root: Path) -> None:
    for name in ("train.bin", "val.bin"):
        if not (root / name).is_file():
            raise UsageError(f"--data-dir {root}: expected {root / name} (uint16 token ids, nanoGPT's format) "
                             "for --data tokens")


def token_files(options: TrainOptions) -> tuple[Dataset, Dataset]:
    root = Path(options.task.data_dir)
    check_token_files(root)
    block_size = options.task.block_size
    return TokenBlocks(root / "train.bin", block_size), TokenBlocks(root / "val.bin", block_size)
{%- if cookiecutter.use_streaming == "yes" %}


END_OF_TEXT = 256  # streamed bytes: the token after each document, one past the byte values
TEXT_FILES = (".jsonl", ".txt", ".parquet")


def text_windows(piece: tuple, block_size: int, tokenizer: str = "") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The samples of a piece of a streamed corpus: its documents as tokens (bytes, or `tokenizer`'s), each
    followed by an end-of-text token, packed into windows of block_size + 1 tokens (input, and target shifted by
    one), which overlap by one token as TokenBlocks' blocks do. A document's rest runs on into the next window;
    the piece's last tokens, short of a window, are dropped. The same piece gives the same windows every time
    (a resume counts on it)."""
    encoder, end = load_tokenizer(tokenizer) if tokenizer else (None, END_OF_TEXT)
    window = block_size + 1
    pending, pending_length = [], 0
    for text, ends_document in read_documents(piece):
        tokens = (np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64) if encoder is None
                  else np.array(encoder.encode(text, add_special_tokens=False).ids, dtype=np.int64))
        pending += [tokens, np.array([end])] if ends_document else [tokens]
        pending_length += len(tokens) + ends_document
        if pending_length < window:
            continue
        buffer, start = np.concatenate(pending), 0
        while len(buffer) - start >= window:
            block = torch.from_numpy(buffer[start:start + window].copy())
            yield block[:-1], block[1:]
            start += block_size
        pending, pending_length = [buffer[start:]], len(buffer) - start


def streamed_text(options: TrainOptions) -> tuple[StreamedDataset, Dataset]:
    """--data-files as a stream (nothing read until training starts); --eval-files read whole."""
    task = options.task
    read = functools.partial(text_windows, block_size=task.block_size, tokenizer=task.tokenizer)
    pieces = file_pieces(expand_files(task.data_files, "--data-files", TEXT_FILES), int(task.piece_mb * 2**20))
    held_out = [window for piece in file_pieces(expand_files(task.eval_files, "--eval-files", TEXT_FILES), 2**62)
                for window in read(piece)] if task.eval_files else []
    return StreamedDataset(pieces, read), held_out
{%- endif %}


def vocab_size(options: TrainOptions) -> int:
    if options.task.vocab_size is not None:
        return options.task.vocab_size
    if options.task.tokenizer:
        return load_tokenizer(options.task.tokenizer)[0].get_vocab_size()
{%- if cookiecutter.use_streaming == "yes" %}
    if options.task.data == "stream":
        return END_OF_TEXT + 1
{%- endif %}
    return 50304 if options.task.data == "tokens" else 256  # GPT-2's 50257, padded to a multiple of 64


# ---- model -------------------------------------------------------------------------------------------------

class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        """`cache` (sampling): the keys and values of the positions before x's, which x's are appended to; x is
        then the whole context or one new position."""
        batch, time, channels = x.shape
        q, k, v = (part.view(batch, time, self.n_head, -1).transpose(1, 2)
                   for part in self.qkv(x).split(channels, dim=2))
        if cache is not None:
            if cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=time > 1, dropout_p=self.dropout if self.training else 0)
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

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cache)
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

    def shardable_blocks(self) -> list[nn.Module]:
        """FSDP2 shards one group per transformer block (engine/parallel.py); the rest goes with the root."""
        return list(self.blocks)

    def forward(self, tokens: torch.Tensor, cache: list[dict] | None = None) -> torch.Tensor:
        """Logits (batch, time, vocab). `cache` (sampling, sample.py): a dict per block that keeps its keys and
        values, so that each new token costs one position; the logits are then the last position's alone."""
        start = cache[0]["k"].shape[2] if cache and cache[0] else 0
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for index, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[index])
        return self.head(self.norm(x if cache is None else x[:, -1:]))


def text_codec(options: TrainOptions) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """How text becomes the run's token ids and back (sampling): its --tokenizer's, else bytes."""
    if options.task.tokenizer:
        tokenizer = load_tokenizer(options.task.tokenizer)[0]
        return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), tokenizer.decode
    if options.task.data == "tokens":
        raise UsageError("--data tokens was trained without --tokenizer, so its ids' text is unknown here (GPT-2's "
                         "for nanoGPT's files): train with the tokenizer.json that made them")
    return (lambda text: list(text.encode())), (lambda ids: bytes(i for i in ids if i < 256).decode(errors="replace"))


def write_samples(step: Step, generator: torch.Generator) -> None:
    """Task.rank_0_work's (--sample-every): the model's text, as it stands, into samples.txt."""
    folder = Path(step.options.logging.log_dir or step.options.checkpoint.ckpt_dir)
    sample.write_samples(step, generator, folder, text_codec(step.options))


def gpt(options: TrainOptions, train_set: Dataset) -> nn.Module:
    task = options.task
    return GPT(vocab_size(options), task.block_size, task.n_layer, task.n_head, task.n_embd, task.dropout)


def build_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms or biases), as nanoGPT. The warmup + decay
    schedule scales whatever lr this starts with. Frozen parameters (requires_grad False) are left out."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    matrices = [p for p in trained if p.dim() >= 2]
    others = [p for p in trained if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=options.lr, betas=(0.9, 0.95))


# ---- loss and evaluation -----------------------------------------------------------------------------------

def logits_and_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits for a batch and the mean next-token cross-entropy over every position: the one path
    training and evaluation share."""
    tokens, next_tokens = batch
    logits = model(tokens).float()
    return logits, F.cross_entropy(logits.flatten(0, 1), next_tokens.flatten())


def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], step: Step) -> torch.Tensor:
    """The mean loss of a batch, what training minimises; `model` is the DDP- or FSDP2-wrapped one. `step` (step.py's
    Step): its number (1 for the first), the options (the task's as step.options.task), the plain model."""
    return logits_and_loss(model, batch)[1]


def evaluation_sums(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums over one held-out batch, each a number or a tensor of any shape; they are added up exactly over
    batches and ranks, then passed to summarize. The throughput_unit key ("tokens") counts what was evaluated."""
    _, loss = logits_and_loss(model, batch)
    count = batch[1].numel()
    return {"loss": loss * count, "tokens": torch.tensor(count)}


def summarize(sums: dict, outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """The logged evaluation metrics, from sums over the whole held-out split (every rank). `outputs` holds the
    per-sample rows of evaluation_outputs(model, batch) from every rank, if you define it (here: {})."""
    loss = sums["loss"] / sums["tokens"]
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(sums["tokens"])}


def units_in_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | int:
    """Throughput units in a batch: its target tokens (with padding, count only the real ones: a mask's sum)."""
    return batch[1].numel()


def model_flops_per_unit(model: nn.Module, options: TrainOptions) -> float | None:
    """Training FLOPs per token, for model FLOPs utilisation (PaLM's appendix B, as nanoGPT): 6 per parameter
    (forward 2, backward 4) plus attention's 12 x layers x width x context. Position embeddings are a lookup."""
    task = options.task
    parameters = sum(p.numel() for p in model.parameters()) - task.block_size * task.n_embd
    return 6 * parameters + 12 * task.n_layer * task.n_embd * task.block_size


# ---- checks, before any process group starts ---------------------------------------------------------------

def check_options(options: TrainOptions) -> None:
    """Refuse values this task cannot use (spec.py has already checked the --data and --model names)."""
    task = options.task
    for name in ("fake_samples", "block_size", "n_layer", "n_head", "n_embd"):
        if getattr(task, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(task, name)}")
    if task.n_embd % task.n_head:
        raise UsageError(f"--n-embd {task.n_embd} must be a multiple of --n-head {task.n_head}")
    if not 0 <= task.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {task.dropout}")
    if task.vocab_size is not None and not 1 <= task.vocab_size <= 65536:
        raise UsageError(f"--vocab-size must be between 1 and 65536 (uint16 token ids), got {task.vocab_size}")
    if task.data == "text":
        text_files(task.data_dir)
    if task.data == "tokens":
        check_token_files(Path(task.data_dir))
{%- if cookiecutter.use_streaming == "yes" %}
    if task.data == "stream":
        require_max_steps(options)
        if task.piece_mb <= 0:
            raise UsageError(f"--piece-mb must be > 0, got {task.piece_mb}")
        check_first_records(expand_files(task.data_files or "(none given)", "--data-files", TEXT_FILES))
        if task.eval_files:
            check_first_records(expand_files(task.eval_files, "--eval-files", TEXT_FILES))
        elif options.eval_every or options.eval_every_steps:
            raise UsageError("--data stream evaluates on --eval-files (a small held-out set, read whole); give "
                             "them, or --eval-every 0")
{%- endif %}
    if task.tokenizer:
        load_tokenizer(task.tokenizer)


# ---- what the package calls --------------------------------------------------------------------------------

TASK = Task(
    options=TaskOptions,
    datasets={"fake": fake_text, "text": text, "tokens": token_files
{%- if cookiecutter.use_streaming == "yes" %}, "stream": streamed_text{% endif %}},
    models={"gpt": gpt},
    build_optimizer=build_optimizer,
    compute_loss=compute_loss,
    evaluation_sums=evaluation_sums,
    summarize=summarize,
    units_in_batch=units_in_batch,
    model_flops_per_unit=model_flops_per_unit,
    check_options=check_options,
    rank_0_work=("sample_every", write_samples),  # text from the model every --sample-every steps
    throughput_unit="tokens",
    training_defaults={"batch_size": 16, "lr": 1e-3},  # training options whose defaults suit this task better
    # tests/ train with these (plus --ckpt-dir, --max-steps ...): keep them tiny and learnable, so the smoke
    # tests still pass after you change this file.
    smoke_test_args=["--data", "fake", "--fake-samples", "256", "--block-size", "32", "--n-layer", "2",
                     "--n-head", "2", "--n-embd", "64", "--batch-size", "8", "--num-workers", "0", "--device",
                     "cpu", "--lr", "3e-3", "--eval-every-steps", "8"],
)
{%- endif %}
