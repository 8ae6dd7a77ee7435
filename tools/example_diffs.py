"""Regenerate the generated project's examples/<name>/change.diff from the template's own sources.

Each example is a diff that users apply with `patch -p1`, and tests apply them to a freshly baked project: a diff
whose context no longer matches the code fails there. When task.py, train.py or step.py change, run

    .venv/bin/python tools/example_diffs.py           # --check: only say whether they are current (a test does)

which bakes the default project, applies each recipe's edits below to its files and writes the resulting
diffs into examples/<name>/change.diff. The edits are (old, new) replacements of whole lines.
"""
# ruff: noqa: E501 - the recipes' lines are the project's, each inside a string

from __future__ import annotations

import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
EXAMPLES = TEMPLATE / "{{cookiecutter.project_slug}}" / "examples"
PACKAGE = "ddp_training"  # the default bake's package name, written back as the Jinja variable
STREAMING = '{% if cookiecutter.use_streaming == "yes" %}'  # a bake with streamed training sets: its own diffs
STREAMED_FROM, STREAMED_TO = '"imagefolder": image_folder', '"imagefolder": image_folder, "shards": image_shards'
FUTURE = "from __future__ import annotations\n\n"  # an import added below it is sorted into place by ruff

IMAGE_SMOKE_ARGS = '''    smoke_test_args=["--data", "fake", "--fake-samples", "512", "--image-size", "16", "--batch-size", "16",
                     "--model", "small_cnn", "--num-workers", "0", "--device", "cpu", "--lr", "0.005"],
'''
IMAGE_TABLES = '''    datasets={"fake": fake_images, "cifar10": cifar10, "imagefolder": image_folder},
    models={"small_cnn": small_cnn},
'''
BEFORE_FAKE_IMAGES = "\n\ndef fake_images(options: TrainOptions) -> tuple[Dataset, Dataset]:\n"
BEFORE_SMALL_CNN = "def small_cnn(options: TrainOptions, train_set: Dataset, width: int = 32) -> nn.Module:\n"
IMAGE_SUMMARY = '''    count = sums["samples"]
    return {"loss": sums["loss"] / count, "accuracy": sums["correct"] / count, "samples": int(count)}
'''

BUILD_OPTIMIZER = '''def build_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """The warmup + decay schedule scales whatever lr this starts with. Frozen parameters (requires_grad False:
    a pretrained part you do not train) are left out."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return torch.optim.SGD(trained, lr=options.lr, momentum=0.9, weight_decay=5e-4)
'''

REGRESSION = {"PACKAGE/task.py": [
    (IMAGE_SMOKE_ARGS, '''    smoke_test_args=["--data", "fake_table", "--fake-samples", "512", "--batch-size", "16", "--model", "mlp",
                     "--num-workers", "0", "--device", "cpu", "--lr", "0.01"],
    smoke_test_learning=(30, "mean_absolute_error", "<", 0.4),  # in the target's units, after 30 steps
'''),
    (BEFORE_FAKE_IMAGES, '''

class Table(Dataset):
    """Rows of numbers: every column but the last is a feature, the last is the target."""

    def __init__(self, rows: torch.Tensor):
        self.features, self.targets = rows[:, :-1], rows[:, -1]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[index], self.targets[index]


def csv_tables(options: TrainOptions) -> tuple[Dataset, Dataset]:
    """--data-dir/train.csv and --data-dir/val.csv, numbers only, after one header line."""
    def read(name: str) -> Table:
        lines = (Path(options.task.data_dir) / name).read_text().splitlines()[1:]
        return Table(torch.tensor([[float(value) for value in line.split(",")] for line in lines if line]))
    return read("train.csv"), read("val.csv")


def fake_table(options: TrainOptions) -> tuple[Dataset, Dataset]:
    """A learnable table for the smoke tests: 8 features, target = a fixed linear function of them + noise."""
    samples, generator = options.task.fake_samples, torch.Generator().manual_seed(options.seed)
    features = torch.randn(samples * 5 // 4, 8, generator=generator)
    targets = features @ torch.randn(8, generator=generator) + 0.1 * torch.randn(len(features), generator=generator)
    rows = torch.cat([features, targets[:, None]], dim=1)
    return Table(rows[:samples]), Table(rows[samples:])
''' + BEFORE_FAKE_IMAGES),
    (BEFORE_SMALL_CNN, '''def mlp(options: TrainOptions, train_set: Table) -> nn.Module:
    """As many inputs as the table has feature columns, one output."""
    return nn.Sequential(nn.Linear(train_set.features.shape[1], 64), nn.ReLU(), nn.Linear(64, 1), nn.Flatten(0))


''' + BEFORE_SMALL_CNN),
    ("    return outputs, F.cross_entropy(outputs, targets)\n", "    return outputs, F.mse_loss(outputs, targets)\n"),
    ('            "correct": (outputs.argmax(dim=1) == targets).sum(),\n',
     '            "absolute_error": (outputs - targets).abs().sum(),\n'),
    (IMAGE_SUMMARY, '''    count = sums["samples"]
    return {"loss": sums["loss"] / count, "mean_absolute_error": sums["absolute_error"] / count,
            "samples": int(count)}
'''),
    (IMAGE_TABLES, '''    datasets={"fake": fake_images, "cifar10": cifar10, "imagefolder": image_folder,
              "csv": csv_tables, "fake_table": fake_table},
    models={"small_cnn": small_cnn, "mlp": mlp},
'''),
]}

TAGGER = {"PACKAGE/task.py": [
    (BEFORE_FAKE_IMAGES, '''

class TaggedSentences(Dataset):
    """Sentences of 3 to 12 random words (ids 1-19; 0 is padding), each word's tag a fixed function of it and
    of the word before: a dict of tensors per sample, and batches of many lengths."""

    def __init__(self, size: int, tags: int, seed: int):
        self.size, self.tags, self.seed = size, tags, seed

    def __len__(self) -> int:
        return self.size

    def length(self, index: int) -> int:
        return int(torch.randint(3, 13, (), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + index)))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        words = torch.randint(1, 20, (int(torch.randint(3, 13, (), generator=generator)),), generator=generator)
        before = torch.cat([torch.zeros(1, dtype=torch.long), words[:-1]])
        return {"input_ids": words, "labels": (words + (before > 10)) % self.tags}


def length_buckets(dataset: TaggedSentences, options: TrainOptions, epoch: int) -> list[list[int]]:
    """The epoch's batches (Task.batches): sentences of one length together, as many as fit --batch-size x 8
    words (more short ones than long ones), so batches need little padding; in an order drawn from the seed and
    the epoch, the same on every rank."""
    generator = torch.Generator().manual_seed(options.seed * 1_000_003 + epoch)
    by_length: dict[int, list[int]] = {}
    for index in torch.randperm(len(dataset), generator=generator).tolist():
        by_length.setdefault(dataset.length(index), []).append(index)
    batches = [indices[start:start + options.batch_size * 8 // length]
               for length, indices in sorted(by_length.items())
               for start in range(0, len(indices), options.batch_size * 8 // length)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest sentence: input_ids with 0, labels with -100 (ignored by the loss)."""
    def pad(key: str, value: int) -> torch.Tensor:
        return nn.utils.rnn.pad_sequence([sample[key] for sample in samples], batch_first=True, padding_value=value)
    input_ids = pad("input_ids", 0)
    return {"input_ids": input_ids, "attention_mask": input_ids != 0, "labels": pad("labels", -100)}


def tagged(options: TrainOptions) -> tuple[Dataset, Dataset]:
    samples, tags = options.task.fake_samples, options.task.num_classes
    return TaggedSentences(samples, tags, options.seed), TaggedSentences(samples // 4, tags, options.seed + 1)
''' + BEFORE_FAKE_IMAGES),
    (BEFORE_SMALL_CNN, '''@dataclass
class TaggerOutput:  # as a Hugging Face model's output: its own loss, and the logits
    loss: torch.Tensor | None
    logits: torch.Tensor


class Tagger(nn.Module):
    """A word's embedding and its neighbours' (a convolution over the sentence), then a tag per word."""

    def __init__(self, tags: int, width: int = 32):
        super().__init__()
        self.embedding = nn.Embedding(20, width, padding_idx=0)
        self.context = nn.Conv1d(width, width, kernel_size=3, padding=1)
        self.head = nn.Linear(width, tags)

    def forward(self, input_ids, attention_mask, labels=None) -> TaggerOutput:
        words = self.embedding(input_ids) * attention_mask[..., None]
        logits = self.head(torch.relu(self.context(words.transpose(1, 2))).transpose(1, 2)).float()
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return TaggerOutput(loss, logits)


def tagger(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return Tagger(options.task.num_classes)


''' + BEFORE_SMALL_CNN),
    ('''def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], step: Step) -> torch.Tensor:
    """The mean loss of a batch, what training minimises; `model` is the DDP- or FSDP2-wrapped one. `step` (step.py's
    Step): its number (1 for the first), the options (the task's as step.options.task), the plain model."""
    return outputs_and_loss(model, batch)[1]
''', '''def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor], step: Step) -> torch.Tensor:
    """The mean loss of a batch, what training minimises; `model` is the DDP- or FSDP2-wrapped one. `step` (step.py's
    Step): its number (1 for the first), the options (the task's as step.options.task), the plain model."""
    return model(**batch).loss
'''),
    ('''    outputs, loss = outputs_and_loss(model, batch)
    targets = batch[1]
    return {"loss": loss * targets.numel(),
            "correct": (outputs.argmax(dim=1) == targets).sum(),
            "samples": torch.tensor(targets.numel())}
''', '''    output, mask = model(**batch), batch["labels"] != -100
    return {"loss": output.loss * mask.sum(),
            "correct": ((output.logits.argmax(dim=-1) == batch["labels"]) & mask).sum(),
            "tokens": mask.sum()}
'''),
    (IMAGE_SUMMARY, '''    count = sums["tokens"]
    return {"loss": sums["loss"] / count, "accuracy": sums["correct"] / count, "tokens": int(count)}


def units_in_batch(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Throughput counts the words, not the padding."""
    return batch["attention_mask"].sum()
'''),
    (IMAGE_TABLES, '''    datasets={"fake": fake_images, "cifar10": cifar10, "imagefolder": image_folder,
              "tagged": tagged},
    models={"small_cnn": small_cnn, "tagger": tagger},
    collate=collate,
    batches=length_buckets,
    units_in_batch=units_in_batch,
'''),
    ('    throughput_unit="samples",\n', '    throughput_unit="tokens",\n'),
    (IMAGE_SMOKE_ARGS, '''    smoke_test_args=["--data", "tagged", "--fake-samples", "512", "--batch-size", "16", "--model", "tagger",
                     "--num-classes", "4", "--num-workers", "0", "--device", "cpu", "--lr", "0.5"],
'''),
]}

AUC = {"PACKAGE/task.py": [
    (FUTURE, FUTURE + "import math\n"),
    ('''            "samples": torch.tensor(targets.numel())}
''', '''            "samples": torch.tensor(targets.numel())}


def evaluation_outputs(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-sample rows, gathered from every rank for summarize: each sample's score for class 1, its label."""
    outputs, _ = outputs_and_loss(model, batch)
    return {"score": outputs.softmax(dim=1)[:, 1], "label": batch[1]}
'''),
    (IMAGE_SUMMARY, '''    count = sums["samples"]
    return {"loss": sums["loss"] / count, "accuracy": sums["correct"] / count, "samples": int(count),
            "auc": area_under_roc(outputs["score"], outputs["label"] == 1)}


def area_under_roc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """The chance that a positive sample scores above a negative one (ties count half), over every pair."""
    positives, negatives = scores[positive], scores[~positive]
    above = (positives[:, None] > negatives[None, :]).double() + 0.5 * (positives[:, None] == negatives[None, :])
    return above.mean().item() if above.numel() else math.nan
'''),
    ("    summarize=summarize,\n", "    summarize=summarize,\n    evaluation_outputs=evaluation_outputs,\n"),
    (IMAGE_SMOKE_ARGS, '''    smoke_test_args=["--data", "fake", "--fake-samples", "512", "--image-size", "16", "--batch-size", "16",
                     "--model", "small_cnn", "--num-classes", "2", "--num-workers", "0", "--device", "cpu",
                     "--lr", "0.005"],
'''),
]}

IMAGE_LOSS = '''def outputs_and_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    \"\"\"The model's outputs for a batch and their mean loss: the one path training and evaluation share.\"\"\"
    inputs, targets = batch
    outputs = model(inputs).float()
    return outputs, F.cross_entropy(outputs, targets)


def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], step: Step) -> torch.Tensor:
    \"\"\"The mean loss of a batch, what training minimises; `model` is the DDP- or FSDP2-wrapped one. `step` (step.py's
    Step): its number (1 for the first), the options (the task's as step.options.task), the plain model.\"\"\"
    return outputs_and_loss(model, batch)[1]
'''
IMAGE_EVALUATION_SUMS = '''    outputs, loss = outputs_and_loss(model, batch)
    targets = batch[1]
    return {"loss": loss * targets.numel(),
            "correct": (outputs.argmax(dim=1) == targets).sum(),
            "samples": torch.tensor(targets.numel())}
'''

ADVERSARIAL = {"PACKAGE/task.py": [
    (BEFORE_SMALL_CNN, '''NOISE = 32  # the generator's input


class Adversarial(nn.Module):
    \"\"\"A generator of images from noise and a critic that tells them from real ones, trained in turn (a GAN).\"\"\"

    def __init__(self, image_size: int, width: int = 128):
        super().__init__()
        pixels = 3 * image_size * image_size
        self.generator = nn.Sequential(nn.Linear(NOISE, width), nn.ReLU(), nn.Linear(width, pixels), nn.Sigmoid(),
                                       nn.Unflatten(1, (3, image_size, image_size)))
        self.critic = nn.Sequential(nn.Flatten(), nn.Linear(pixels, width), nn.LeakyReLU(0.2), nn.Linear(width, 1),
                                    nn.Flatten(0))


def adversarial(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return Adversarial(options.task.image_size)


''' + BEFORE_SMALL_CNN),
    (BUILD_OPTIMIZER, '''def build_optimizer(model: nn.Module, options: TrainOptions) -> dict[str, torch.optim.Optimizer]:
    \"\"\"An Adam for each network; the warmup + decay schedule scales both.\"\"\"
    return {name: torch.optim.Adam(getattr(model, name).parameters(), lr=options.lr, betas=(0.5, 0.999))
            for name in ("critic", "generator")}
'''),
    (IMAGE_LOSS, '''def critic_loss(networks, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    \"\"\"The critic learns to score real images 1 and generated ones 0: one forward of each network (DDP's rule).\"\"\"
    images = batch[0]
    with torch.no_grad():
        fakes = networks.generator(torch.randn(len(images), NOISE, device=images.device))
    scores = networks.critic(torch.cat([images, fakes])).float()
    real = torch.cat([torch.ones(len(images)), torch.zeros(len(images))]).to(scores)
    return F.binary_cross_entropy_with_logits(scores, real)


def generator_loss(networks, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    \"\"\"The generator learns to make images the critic scores real.\"\"\"
    images = batch[0]
    scores = networks.critic(networks.generator(torch.randn(len(images), NOISE, device=images.device))).float()
    return F.binary_cross_entropy_with_logits(scores, torch.ones_like(scores))


def training_step(step: Step, batches: list) -> torch.Tensor:
    \"\"\"The critic takes its step, then the generator, each on its own loss; the critic's is logged.\"\"\"
    critic = step.backward(critic_loss, batches)
    step.update("critic")
    step.backward(generator_loss, batches)
    step.update("generator")
    return critic


def write_samples(step: Step, generator: torch.Generator) -> None:
    \"\"\"A grid of 16 generated images, samples/step-<N>.png in --log-dir (else --ckpt-dir): on rank 0 alone, from
    noise of the generator it is given, so that what it draws changes nothing the run trains (TASK.rank_0_work).\"\"\"
    from torchvision.utils import save_image

    model = step.model  # the plain model (under FSDP2 gathered whole for this)
    noise = torch.randn(16, NOISE, generator=generator).to(next(model.parameters()).device)
    with torch.no_grad():
        images = model.generator(noise).float()
    folder = Path(step.options.logging.log_dir or step.options.checkpoint.ckpt_dir) / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    save_image(images, folder / f"step-{step.number:06d}.png", nrow=4)
'''),
    (IMAGE_EVALUATION_SUMS, '''    images = batch[0]  # against as many generated ones, from the same noise at every evaluation
    noise = torch.randn(len(images), NOISE, generator=torch.Generator().manual_seed(0)).to(images.device)
    scores = model.critic(torch.cat([images, model.generator(noise)])).float()
    real = torch.cat([torch.ones(len(images)), torch.zeros(len(images))]).to(scores)
    return {"loss": F.binary_cross_entropy_with_logits(scores, real, reduction="sum") / 2,
            "correct": ((scores > 0) == (real > 0)).sum() / 2, "samples": torch.tensor(len(images))}
'''),
    ('    models={"small_cnn": small_cnn},\n', '    models={"small_cnn": small_cnn, "adversarial": adversarial},\n'),
    ("    compute_loss=compute_loss,\n", "    training_step=training_step,  # two optimizers stepped in turn\n"
     "    rank_0_work=(10, write_samples),  # sample images every 10 steps\n"
     "    smoke_test_learning=None,  # the critic's loss need not fall\n"),
    (IMAGE_SMOKE_ARGS, IMAGE_SMOKE_ARGS.replace('"small_cnn"', '"adversarial"').replace('"0.005"', '"0.001"')),
]}

TEACHER = {"PACKAGE/task.py": [
    ("from pathlib import Path\n", "from pathlib import Path\nfrom types import SimpleNamespace\n"),
    ("from .spec import Task\n", "from .engine.task_state import leave_out_of_checkpoints\nfrom .spec import Task\n"),
    ('''    num_classes: int = option(10, "outputs of the model's head (cifar10 has 10 classes)", fixed=True)
''', '''    num_classes: int = option(10, "outputs of the model's head (cifar10 has 10 classes)", fixed=True)
    teacher: str = option("", "for --model distilled: the teacher's weights, a small_cnn's state dict (none: a "
                          "random teacher, to try it out)")
'''),
    (BEFORE_SMALL_CNN, '''class Distilled(nn.Module):
    \"\"\"A small student that learns from the labels and from a frozen teacher's outputs. The teacher is built again
    each run from its weights file, so checkpoints leave it out.\"\"\"

    def __init__(self, student: nn.Module, teacher: nn.Module):
        super().__init__()
        self.student, self.teacher = student, teacher.requires_grad_(False)

    def train(self, mode: bool = True) -> Distilled:
        super().train(mode)
        self.teacher.eval()  # always: its BatchNorm statistics or dropout would change what it teaches
        return self

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            teacher = self.teacher(images)
        return self.student(images), teacher


def distilled(options: TrainOptions, train_set: Dataset) -> nn.Module:
    teacher = small_cnn(options, train_set)
    if options.task.teacher:
        teacher.load_state_dict(torch.load(options.task.teacher, weights_only=True))
    return leave_out_of_checkpoints(Distilled(small_cnn(options, train_set, width=8), teacher), "teacher")


def teacher_file(folder: Path) -> list[str]:
    """For tests/ (TASK.smoke_test_files): a teacher's weights file, as yours would be, and the flag naming it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        teacher = small_cnn(SimpleNamespace(task=TaskOptions()), None)
    torch.save(teacher.state_dict(), folder / "teacher.pt")
    return ["--teacher", str(folder / "teacher.pt")]


''' + BEFORE_SMALL_CNN),
    ("    outputs = model(inputs).float()\n", "    outputs = model(inputs)\n"
     "    outputs = (outputs[0] if isinstance(outputs, tuple) else outputs).float()  # distilled: the student's\n"),
    ('''    return outputs_and_loss(model, batch)[1]
''', '''    images, labels = batch
    outputs = model(images)
    if not isinstance(outputs, tuple):  # a model without a teacher: small_cnn, trained to be one
        return F.cross_entropy(outputs.float(), labels)
    student, teacher = (output.float() for output in outputs)
    imitation = F.kl_div(F.log_softmax(student / 2, dim=1), F.log_softmax(teacher / 2, dim=1), log_target=True,
                         reduction="batchmean") * 4  # at temperature 2
    return 0.5 * F.cross_entropy(student, labels) + 0.5 * imitation
'''),
    ('    models={"small_cnn": small_cnn},\n', '    models={"small_cnn": small_cnn, "distilled": distilled},\n'),
    ("    compute_loss=compute_loss,\n", "    compute_loss=compute_loss,\n"
     "    smoke_test_learning=(30, 0.85),  # half the loss imitates the teacher: it falls less\n"
     "    smoke_test_files=teacher_file,\n"),
    (IMAGE_SMOKE_ARGS, IMAGE_SMOKE_ARGS.replace('"small_cnn"', '"distilled"')),
]}

EMA = {"PACKAGE/task.py": [
    ("from .step import Step\n", "from .step import ExponentialMovingAverage, Step\n"),
    ("# ---- what the package calls ", '''def after_step(step: Step) -> None:
    """After each optimizer step, on every rank: the averages follow the weights just stepped."""
    step.state["ema"].update(step.model)


# ---- what the package calls '''),
    ("    compute_loss=compute_loss,\n", "    compute_loss=compute_loss,\n"
     '    state=lambda model, options: {"ema": ExponentialMovingAverage(model, decay=0.99)},  # saved with the rest\n'
     "    after_step=after_step,\n"
     '    evaluate_with="ema",  # every evaluation, the run\'s last included, uses the averages\n'),
]}

TWO_OPTIMIZERS = {"PACKAGE/task.py": [
    (BUILD_OPTIMIZER, '''def build_optimizer(model: nn.Module, options: TrainOptions) -> dict[str, torch.optim.Optimizer]:
    """The head (the last layer with parameters) learns with AdamW, the backbone with SGD. The warmup + decay
    schedule scales both."""
    head = [module for module in model.children() if any(True for _ in module.parameters())][-1]
    in_head = {id(parameter) for parameter in head.parameters()}
    backbone = [parameter for parameter in model.parameters() if id(parameter) not in in_head]
    return {"backbone": torch.optim.SGD(backbone, lr=options.lr, momentum=0.9, weight_decay=5e-4),
            "head": torch.optim.AdamW(head.parameters(), lr=options.lr / 10)}
'''),
]}

LOSS_WEIGHT = {
    "train.py": [
        ("    samples_seen: int = 0  # global samples trained on in all, what the lr schedule follows\n",
         "    samples_seen: int = 0  # global samples trained on in all, what the lr schedule follows\n"
         "    loss_weight: float = 1.0  # annealed after each step\n"),
        ("            return task.compute_loss(networks.model, batch, step)  # the task runs the model\n",
         "            return progress.loss_weight * task.compute_loss(networks.model, batch, step)\n"),
        ("            amp.scaler.update()  # once a step, after every optimizer stepped: the fp16 scale for the next\n",
         "            amp.scaler.update()  # once a step, after every optimizer stepped: the fp16 scale for the next\n"
         "            progress.loss_weight = max(0.5, 0.98 * progress.loss_weight)  # halves over the first 35 steps\n"),
    ],
}

CONTRASTIVE = {"PACKAGE/task.py": [
    (FUTURE, FUTURE + "import math\n"),
    ("import torch\nimport torch.nn.functional as F\n", "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n"),
    (BEFORE_SMALL_CNN, '''class Contrastive(nn.Module):
    """An encoder trained to match each image's two views against every other image of the global batch (SimCLR's
    loss, CLIP's learned temperature). Its outputs are still the class scores that evaluation reads."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(1 / 0.07)))  # 1-d: FSDP2 shards no 0-d parameter

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(images), self.logit_scale.exp()


def contrastive(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return Contrastive(small_cnn(options, train_set))


class GatherWithGradient(torch.autograd.Function):
    """Every rank's rows, in rank order; the backward pass gives each rank the gradient of its own rows, summed
    over every rank's loss (as torch.distributed.nn's all_gather, deprecated in torch 2.14)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, rows.contiguous())
        return torch.cat(gathered)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> torch.Tensor:
        gradient = gradient.contiguous()
        dist.all_reduce(gradient)
        return gradient.chunk(dist.get_world_size())[dist.get_rank()]


''' + BEFORE_SMALL_CNN),
    ("    outputs = model(inputs).float()\n", "    outputs = model(inputs)\n"
     "    outputs = (outputs[0] if isinstance(outputs, tuple) else outputs).float()  # contrastive: the features\n"),
    ('''    return outputs_and_loss(model, batch)[1]
''', '''    images, _ = batch  # the labels are not used: each image is its own class
    views = torch.cat([images + 0.1 * torch.randn_like(images), images + 0.1 * torch.randn_like(images)])
    features, scale = model(views)
    first, second = F.normalize(features.float(), dim=1).chunk(2)
    targets = torch.arange(len(first), device=first.device)
    if dist.is_initialized():  # every rank's second views, with their gradients: the negatives of the global batch
        targets += dist.get_rank() * len(first)
        second = GatherWithGradient.apply(second)
    step.log(temperature=1 / scale)  # beside the loss in the log, metrics.jsonl and the --tracker
    return F.cross_entropy(scale * first @ second.T, targets)


def after_step(step: Step) -> None:
    """After each optimizer step, as CLIP does: the temperature's scale stays at most 100."""
    with torch.no_grad():
        step.model.logit_scale.clamp_(max=math.log(100))
'''),
    ('    models={"small_cnn": small_cnn},\n', '    models={"small_cnn": small_cnn, "contrastive": contrastive},\n'),
    ("    compute_loss=compute_loss,\n", "    compute_loss=compute_loss,\n"
     "    after_step=after_step,\n"
     '    loss_couples="global_batch",  # --grad-accum and resizes say what they do to the batch the loss contrasts\n'
     "    smoke_test_learning=(30, 0.85),\n"),
    (IMAGE_SMOKE_ARGS, IMAGE_SMOKE_ARGS.replace('"small_cnn"', '"contrastive"').replace(
        '"0.005"]', '"0.005", "--clip-grad",\n                     "0.5"]')),
]}

MIXTURE = {"PACKAGE/task.py": [
    (BEFORE_SMALL_CNN, '''class MixtureOfExperts(nn.Module):
    """small_cnn's scores, refined by one of several experts per sample, chosen by a router (top-1, as the Switch
    Transformer): an expert that no sample of a rank's batch is sent to gets no gradient that step."""

    def __init__(self, features: nn.Module, width: int, experts: int = 4):
        super().__init__()
        self.features = features
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def route(self, images: torch.Tensor) -> torch.Tensor:
        """Each sample's expert."""
        return self.router(self.features(images)).argmax(dim=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.features(images)
        gates = self.router(features).softmax(dim=1)
        chosen = gates.argmax(dim=1)
        refined = torch.zeros_like(features)
        for index, expert in enumerate(self.experts):
            sent = chosen == index
            if sent.any():  # an expert no sample is sent to takes no part in this step: no gradient
                refined[sent] = expert(features[sent]) * gates[sent, index, None]  # its gate: the router learns
        return features + refined


def mixture(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return MixtureOfExperts(small_cnn(options, train_set), options.task.num_classes)


''' + BEFORE_SMALL_CNN),
    ('''    targets = batch[1]
    return {"loss": loss * targets.numel(),
            "correct": (outputs.argmax(dim=1) == targets).sum(),
            "samples": torch.tensor(targets.numel())}
''', '''    targets = batch[1]
    sums = {"loss": loss * targets.numel(),
            "correct": (outputs.argmax(dim=1) == targets).sum(),
            "samples": torch.tensor(targets.numel())}
    if isinstance(model, MixtureOfExperts):  # how many samples each expert got, over the whole held-out set
        sums["per_expert"] = torch.bincount(model.route(batch[0]), minlength=len(model.experts))
    return sums
'''),
    (IMAGE_SUMMARY, '''    count = sums["samples"]
    shares = {f"expert_{index}": float(n) / count for index, n in enumerate(sums.get("per_expert", []))}
    return {"loss": sums["loss"] / count, "accuracy": sums["correct"] / count, **shares, "samples": int(count)}
'''),
    ('    models={"small_cnn": small_cnn},\n', '    models={"small_cnn": small_cnn, "mixture": mixture},\n'),
    ("    compute_loss=compute_loss,\n", "    compute_loss=compute_loss,\n"
     "    find_unused_parameters=True,  # an expert that gets no sample has no gradient: DDP must look for it\n"),
    (IMAGE_SMOKE_ARGS, IMAGE_SMOKE_ARGS.replace('"small_cnn"', '"mixture"')),
]}

LORA = {"PACKAGE/task.py": [
    (FUTURE, FUTURE + "import functools\n"),
    ("from pathlib import Path\n", "from pathlib import Path\nfrom types import SimpleNamespace\n"),
    ("from .spec import Task\n", "from .engine.task_state import leave_out_of_checkpoints\nfrom .spec import Task\n"),
    ('''    num_classes: int = option(10, "outputs of the model's head (cifar10 has 10 classes)", fixed=True)
''', '''    num_classes: int = option(10, "outputs of the model's head (cifar10 has 10 classes)", fixed=True)
    base: str = option("", "for --model lora: the frozen base's weights, a small_cnn's state dict (none: a random "
                       "base, to try it out)")
    lora_rank: int = option(4, "for --model lora: the rank of each layer's trained update", fixed=True)
    layer_decay: float = option(0.5, "for --model lora: each layer's lr is this times the next one's, the head's --lr")
'''),
    (BEFORE_SMALL_CNN, '''class LoRA(nn.Module):
    """Low-rank adapters on a frozen base: each convolution and linear layer of the base gets a trained update,
    B(A(input)), added to its output. B starts at zero, so training starts from the base's own outputs. The base is
    read again each run from --base, so checkpoints leave it out."""

    def __init__(self, base: nn.Module, rank: int):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.adapters = nn.ModuleDict()
        for name, layer in base.named_modules():
            if isinstance(layer, nn.Conv2d):
                down = nn.Conv2d(layer.in_channels, rank, layer.kernel_size, layer.stride, layer.padding, bias=False)
                up = nn.Conv2d(rank, layer.out_channels, 1, bias=False)
            elif isinstance(layer, nn.Linear):
                down = nn.Linear(layer.in_features, rank, bias=False)
                up = nn.Linear(rank, layer.out_features, bias=False)
            else:
                continue
            nn.init.zeros_(up.weight)
            self.adapters[adapter_name(name)] = nn.Sequential(down, up)
            layer.register_forward_hook(functools.partial(self.add_update, adapter_name(name)))

    def add_update(self, name: str, layer: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + self.adapters[name](inputs[0])

    def train(self, mode: bool = True) -> LoRA:
        super().train(mode)
        self.base.eval()  # always: the base as it was trained
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.base(images)


def adapter_name(layer: str) -> str:
    return layer.replace(".", "_")  # a ModuleDict key has no dots


def lora_base(task: TaskOptions) -> nn.Module:
    base = small_cnn(SimpleNamespace(task=task), None)
    if task.base:
        base.load_state_dict(torch.load(task.base, weights_only=True))
    return base


def lora(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return leave_out_of_checkpoints(LoRA(lora_base(options.task), options.task.lora_rank), "base")


def merged_lora(weights: dict[str, torch.Tensor], task: TaskOptions) -> dict[str, torch.Tensor]:
    """TASK.export_weights, what the export writes: for --model lora, each update merged into its base layer, W + B A,
    a plain small_cnn's weights; for another model, its weights as they are."""
    if task.model != "lora":
        return weights
    base = lora_base(task)
    merged = base.state_dict()
    for name, layer in base.named_modules():
        down, up = (weights.get(f"adapters.{adapter_name(name)}.{index}.weight") for index in (0, 1))
        if down is not None:  # a convolution's update is one too: a 1x1 convolution after a k x k one
            merged[f"{name}.weight"] = layer.weight + (up.flatten(1) @ down.flatten(1)).view_as(layer.weight)
    return merged


def base_file(folder: Path) -> list[str]:
    """For tests/ (TASK.smoke_test_files): a base's weights file, as yours would be, and the flag naming it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        base = small_cnn(SimpleNamespace(task=TaskOptions()), None)
    torch.save(base.state_dict(), folder / "base.pt")
    return ["--base", str(folder / "base.pt")]


''' + BEFORE_SMALL_CNN),
    (BUILD_OPTIMIZER, '''def build_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """The warmup + decay schedule scales whatever lr this starts with. Frozen parameters (requires_grad False:
    a pretrained part you do not train) are left out. For --model lora, an AdamW with a group for each layer's
    adapter, its lr --layer-decay times the next layer's: the head's is --lr."""
    if options.task.model != "lora":
        trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
        return torch.optim.SGD(trained, lr=options.lr, momentum=0.9, weight_decay=5e-4)
    adapters = list(model.adapters.values())  # in the base's order: the first layer's first
    decay = options.task.layer_decay
    groups = [{"params": adapter.parameters(), "lr": options.lr * decay ** (len(adapters) - 1 - depth)}
              for depth, adapter in enumerate(adapters)]
    return torch.optim.AdamW(groups, lr=options.lr, weight_decay=0.0)
'''),
    ('    models={"small_cnn": small_cnn},\n', '    models={"small_cnn": small_cnn, "lora": lora},\n'),
    ("    compute_loss=compute_loss,\n", "    compute_loss=compute_loss,\n"
     "    export_weights=merged_lora,  # adapters merged into their base\n"
     "    smoke_test_learning=(30, 0.85),  # low-rank updates of a random base: the loss falls less\n"
     "    smoke_test_files=base_file,\n"),
    (IMAGE_SMOKE_ARGS, IMAGE_SMOKE_ARGS.replace('"small_cnn"', '"lora"').replace('"0.005"', '"0.03"')),
]}

def curriculum_edit(old: str, new: str) -> tuple[str, str]:
    """One of TAGGER's edits made a curriculum's: the template's sampler in place of Task.batches, sentences cut to
    the stage's length in the training set, and the rule that raises the stage."""
    if "\n\ndef length_buckets" in new:
        new = new.replace(new[new.index("\n\ndef length_buckets"):new.index("\n\ndef collate")], "")
    new = new.replace('''of the word before: a dict of tensors per sample, and batches of many lengths."""

    def __init__(self, size: int, tags: int, seed: int):
        self.size, self.tags, self.seed = size, tags, seed
''', '''of the word before: a dict of tensors per sample. A curriculum: at stage s, only their first 4 x (s + 1) words
    (Task.after_evaluation raises it; set_stage is called with it in the process that loads each sample)."""

    def __init__(self, size: int, tags: int, seed: int):
        self.size, self.tags, self.seed = size, tags, seed
        self.longest = 12  # whole sentences: the held-out set's, never staged

    def set_stage(self, stage: int) -> None:
        self.longest = 4 * (stage + 1)
''')
    new = new.replace('''
    def length(self, index: int) -> int:
        return int(torch.randint(3, 13, (), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + index)))
''', "")
    new = new.replace('''generator=generator)
        before = ''', '''generator=generator)
        words = words[:self.longest]
        before = ''')
    new = new.replace("    batches=length_buckets,\n", "    after_evaluation=next_stage,\n")
    new = new.replace('''def units_in_batch(batch: dict[str, torch.Tensor]) -> torch.Tensor:''', '''def next_stage(learned: dict, results: dict, closes: str, options: TrainOptions) -> dict:
    """Task.after_evaluation: longer sentences (the next data_stage) once the held-out loss, on whole sentences
    and every rank's, is below 0.8 at an evaluation that closes an interval or an epoch."""
    stage = learned.get("data_stage", 0)
    if closes in ("interval", "epoch") and results["loss"] < 0.8:
        stage = min(stage + 1, 2)
    return {"data_stage": stage}


def units_in_batch(batch: dict[str, torch.Tensor]) -> torch.Tensor:''')
    return old, new


CURRICULUM = {"PACKAGE/task.py": [curriculum_edit(old, new) for old, new in TAGGER["PACKAGE/task.py"]]}

WORD_LM = {"PACKAGE/task.py": [
    (BEFORE_FAKE_IMAGES, '''

class Words(Dataset):
    """A corpus as word ids (pytorch/examples' word_language_model: <eos> ends each line); sample i is the window
    of --bptt words from word i, and the words after each. Task.batches cuts the corpus into streams."""

    def __init__(self, ids: torch.Tensor, vocabulary: int, bptt: int):
        self.ids, self.vocabulary, self.bptt = ids, vocabulary, bptt

    def __len__(self) -> int:
        return len(self.ids) - self.bptt

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.ids[index:index + self.bptt + 1]
        return {"input_ids": window[:-1], "labels": window[1:], "offset": torch.tensor(index)}


def word_ids(texts: list[str], bptt: int) -> list[Words]:
    """Each text's words as ids of one vocabulary, in order of first appearance (as the original's Dictionary)."""
    vocabulary: dict[str, int] = {}
    ids = [torch.tensor([vocabulary.setdefault(word, len(vocabulary)) for line in text.splitlines()
                         for word in [*line.split(), "<eos>"]]) for text in texts]
    return [Words(each, len(vocabulary), bptt) for each in ids]


def word_files(options: TrainOptions) -> tuple[Dataset, Dataset]:
    """--data-dir/train.txt and --data-dir/valid.txt (wikitext-2's layout)."""
    folder = Path(options.task.data_dir)
    return tuple(word_ids([(folder / name).read_text() for name in ("train.txt", "valid.txt")], options.task.bptt))


def fake_words(options: TrainOptions) -> tuple[Dataset, Dataset]:
    """Sentences of a small grammar, learnable in a few dozen steps (the smoke tests')."""
    generator = torch.Generator().manual_seed(options.seed)
    parts = [["the", "a"], ["cat", "dog", "bird"], ["sees", "likes"], ["the", "a"], ["tree", "house", "car"]]

    def text(lines: int) -> str:
        return "\\n".join(" ".join(part[int(torch.randint(len(part), (), generator=generator))] for part in parts)
                         for _ in range(lines))
    return tuple(word_ids([text(options.task.fake_samples), text(options.task.fake_samples // 4)],
                          options.task.bptt))


def streams_in_order(dataset: Words, options: TrainOptions, epoch: int, world_size: int) -> list[list[int]]:
    """Task.batches in order (the original's batchify): the corpus cut into world_size x --batch-size streams,
    each rank the --batch-size streams of its own contiguous part, and step j the j-th --bptt words of each."""
    streams = world_size * options.batch_size
    length = (len(dataset.ids) - 1) // streams
    return [[stream * length + chunk * dataset.bptt for stream in range(rank * options.batch_size,
                                                                         (rank + 1) * options.batch_size)]
            for chunk in range((length - 1) // dataset.bptt) for rank in range(world_size)]
''' + BEFORE_FAKE_IMAGES),
    (BEFORE_SMALL_CNN, '''class WordLSTM(nn.Module):
    """pytorch/examples' RNNModel with an LSTM: embedding, LSTM layers, a linear decoder; dropout between."""

    def __init__(self, vocabulary: int, width: int = 64, layers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.embedding = nn.Embedding(vocabulary, width)
        self.lstm = nn.LSTM(width, width, layers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(width, vocabulary)

    def forward(self, input_ids: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor] | None = None):
        output, hidden = self.lstm(self.drop(self.embedding(input_ids)), hidden)
        return self.decoder(self.drop(output)), hidden


def word_lstm(options: TrainOptions, train_set: Words) -> nn.Module:
    return WordLSTM(train_set.vocabulary)


class CarriedHidden:
    """This rank's LSTM state from one of its batches to the next (truncated backpropagation through time): kept
    without its graph, and used where the next batch continues the same streams (else, as at an epoch's start,
    the LSTM starts from zeros). Each rank's own: PerRank in Task(state=...)."""

    def __init__(self):
        self.hidden: tuple[torch.Tensor, ...] | None = None
        self.next: torch.Tensor | None = None  # the offsets that continue the streams

    def before(self, offsets: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        if self.next is None or not torch.equal(self.next.to(offsets.device), offsets):
            return None
        return tuple(part.to(offsets.device) for part in self.hidden)

    def after(self, hidden: tuple[torch.Tensor, ...], offsets: torch.Tensor, bptt: int) -> None:
        self.hidden, self.next = tuple(part.detach() for part in hidden), offsets + bptt

    def state_dict(self) -> dict:
        return {} if self.next is None else {"hidden": list(self.hidden), "next": self.next}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.hidden, self.next = tuple(state["hidden"]), state["next"]


def carried_hidden(model: nn.Module, options: TrainOptions) -> dict:
    return {"hidden": PerRank(CarriedHidden())}


def anneal_on_plateau(learned: dict, results: dict, closes: str, options: TrainOptions) -> dict:
    """The original's rule after each epoch's evaluation: the lr divided by 4 when the held-out loss is no better
    than the best so far."""
    if closes != "epoch":
        return learned
    best = learned.get("best_loss")
    if best is not None and results["loss"] >= best:
        return {**learned, "lr_scale": learned.get("lr_scale", 1.0) / 4}
    return {**learned, "best_loss": results["loss"]}


def words_in_batch(batch: dict[str, torch.Tensor]) -> int:
    """Throughput counts words."""
    return batch["labels"].numel()


''' + BEFORE_SMALL_CNN),
    ('''def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], step: Step) -> torch.Tensor:
    """The mean loss of a batch, what training minimises; `model` is the DDP- or FSDP2-wrapped one. `step` (step.py's
    Step): its number (1 for the first), the options (the task's as step.options.task), the plain model."""
    return outputs_and_loss(model, batch)[1]
''', '''def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor], step: Step) -> torch.Tensor:
    """The mean loss of a batch, what training minimises; `model` is the DDP- or FSDP2-wrapped one. `step` (step.py's
    Step): its number (1 for the first), the options (the task's as step.options.task), the plain model."""
    carried = step.state["hidden"].value
    logits, hidden = model(batch["input_ids"], carried.before(batch["offset"]))
    carried.after(hidden, batch["offset"], step.options.task.bptt)
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
'''),
    ('''    outputs, loss = outputs_and_loss(model, batch)
    targets = batch[1]
    return {"loss": loss * targets.numel(),
            "correct": (outputs.argmax(dim=1) == targets).sum(),
            "samples": torch.tensor(targets.numel())}
''', '''    logits, _ = model(batch["input_ids"])  # each window from zeros: held-out streams are not carried
    return {"loss": F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum"),
            "tokens": torch.tensor(batch["labels"].numel())}
'''),
    (IMAGE_SUMMARY, '''    count = sums["tokens"]
    return {"loss": sums["loss"] / count, "perplexity": math.exp(sums["loss"] / count), "tokens": int(count)}
'''),
    ('''    return torch.optim.SGD(trained, lr=options.lr, momentum=0.9, weight_decay=5e-4)
''', '''    return torch.optim.SGD(trained, lr=options.lr)  # plain SGD, as the original: no state to keep
'''),
    ('''    num_classes: int = option(10, "outputs of the model's head (cifar10 has 10 classes)", fixed=True)
''', '''    num_classes: int = option(10, "outputs of the model's head (cifar10 has 10 classes)", fixed=True)
    bptt: int = option(35, "--data words: words a step backpropagates through; the LSTM's state is carried on")
'''),
    (IMAGE_TABLES, '''    datasets={"fake": fake_images, "cifar10": cifar10, "imagefolder": image_folder,
              "words": word_files, "fake_words": fake_words},
    models={"small_cnn": small_cnn, "word_lstm": word_lstm},
    collate=default_collate,
    batches=streams_in_order,
    state=carried_hidden,
    after_evaluation=anneal_on_plateau,
    units_in_batch=words_in_batch,
    training_defaults={"lr": 20.0, "clip_grad": 0.25, "lr_schedule": "constant", "warmup_steps": 0},
'''),
    ('    throughput_unit="samples",\n', '    throughput_unit="tokens",\n'),
    (IMAGE_SMOKE_ARGS, '''    smoke_test_args=["--data", "fake_words", "--fake-samples", "300", "--batch-size", "4", "--model",
                     "word_lstm", "--bptt", "10", "--num-workers", "0", "--device", "cpu"],
'''),
    (FUTURE, FUTURE + "import math\n"),
    ("from .spec import Task\n", "from .engine.task_state import PerRank\nfrom .spec import Task\n"),
    ("from torch.utils.data import Dataset\n", "from torch.utils.data import Dataset, default_collate\n"),
]}


RECIPES = {"regression": REGRESSION, "dict-batches": TAGGER, "whole-set-metric": AUC, "gan": ADVERSARIAL,
           "distillation": TEACHER, "ema": EMA, "two-optimizers": TWO_OPTIMIZERS, "loss-weight": LOSS_WEIGHT, "contrastive": CONTRASTIVE,
           "mixture-of-experts": MIXTURE, "lora": LORA, "curriculum": CURRICULUM,
           "word-language-model": WORD_LM}


LM_BUILD_OPTIMIZER = '''def build_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms or biases), as nanoGPT. The warmup + decay
    schedule scales whatever lr this starts with. Frozen parameters (requires_grad False) are left out."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    matrices = [p for p in trained if p.dim() >= 2]
    others = [p for p in trained if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=options.lr, betas=(0.9, 0.95))
'''

LR_PER_GROUP = {"PACKAGE/task.py": [
    (LM_BUILD_OPTIMIZER, '''def build_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """AdamW with an lr per group: the embeddings at ten times --lr (a row learns only from its own token's
    gradients), the matrices at --lr with weight decay, the norms at --lr without. The schedule scales each
    group's own peak; the log names the peaks once."""
    embedding = ("token_embedding.", "position_embedding.")
    trained = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    embeddings = [parameter for name, parameter in trained if name.startswith(embedding)]
    rest = [parameter for name, parameter in trained if not name.startswith(embedding)]
    return torch.optim.AdamW([{"params": embeddings, "lr": options.lr * 10, "weight_decay": 0.0},
                              {"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                             lr=options.lr, betas=(0.9, 0.95))
'''),
]}

LM_MODEL_OPTION = '''    model: str = option("gpt", "a model in task.py's TASK: gpt (a decoder-only transformer)", fixed=True)
'''
LM_DROPOUT_OPTION = '''    dropout: float = option(0.0, "dropout probability in attention and MLP outputs")
'''
LM_GPT_BUILDER = '''def gpt(options: TrainOptions, train_set: Dataset) -> nn.Module:
    task = options.task
    return GPT(vocab_size(options), task.block_size, task.n_layer, task.n_head, task.n_embd, task.dropout)
'''
LM_SMOKE_ARGS = '''    smoke_test_args=["--data", "fake", "--fake-samples", "256", "--block-size", "32", "--n-layer", "2",
                     "--n-head", "2", "--n-embd", "64", "--batch-size", "8", "--num-workers", "0", "--device",
                     "cpu", "--lr", "3e-3", "--eval-every-steps", "8"],
'''
LM_COMPUTE_LOSS_END = '''    Step): its number (1 for the first), the options (the task's as step.options.task), the plain model."""
    return logits_and_loss(model, batch)[1]
'''


def lm_smoke_args(model: str) -> str:
    """LM_SMOKE_ARGS training --model `model`."""
    return LM_SMOKE_ARGS.replace('"8"],\n', f'"8",\n                     "--model", "{model}"],\n')


LM_LORA = {"PACKAGE/task.py": [
    ("from pathlib import Path\n", "from pathlib import Path\nfrom types import SimpleNamespace\n"),
    ("from .spec import Task\n", "from .engine.checkpoint.weights import load_checkpoint\n"
     "from .engine.task_state import leave_out_of_checkpoints\nfrom .spec import Task\n"),
    (LM_MODEL_OPTION, '''    model: str = option("gpt", "a model in task.py's TASK: gpt (a decoder-only transformer), lora (low-rank "
                        "adapters on the frozen gpt of --base)", fixed=True)
'''),
    (LM_DROPOUT_OPTION, LM_DROPOUT_OPTION + '''    base: str = option("", "for --model lora: the frozen base, a checkpoint of a gpt run of this shape (its "
                       "step-<N>.pt or step-<N>/); none: a random base, to try it out")
    lora_rank: int = option(8, "for --model lora: the rank of each linear layer's trained update", fixed=True)
'''),
    ("\n\ndef text_codec(", '''


class LoRA(nn.Module):
    """Low-rank adapters on a frozen GPT (Hu et al., 2021): each linear layer of the base gets a trained update,
    B(A(input)), added to its output. B starts at zero, so training starts from the base's own outputs. The base is
    read again each run from --base, so checkpoints leave it out (and hold its fingerprint)."""

    def __init__(self, base: GPT, rank: int):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.block_size = base.block_size
        self.adapters = nn.ModuleDict()
        for name, layer in base.named_modules():
            if isinstance(layer, nn.Linear):
                down = nn.Linear(layer.in_features, rank, bias=False)
                up = nn.Linear(rank, layer.out_features, bias=False)
                nn.init.zeros_(up.weight)
                self.adapters[adapter_name(name)] = nn.Sequential(down, up)
                layer.register_forward_hook(functools.partial(self.add_update, adapter_name(name)))

    def add_update(self, name: str, layer: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + self.adapters[name](inputs[0])

    @property
    def blocks(self) -> nn.Sequential:  # sampling keeps a cache per block
        return self.base.blocks

    def forward(self, tokens: torch.Tensor, cache: list[dict] | None = None) -> torch.Tensor:
        return self.base(tokens, cache)


def text_codec('''),
    (LM_GPT_BUILDER, LM_GPT_BUILDER + '''

def adapter_name(layer: str) -> str:
    return layer.replace(".", "_")  # a ModuleDict key has no dots


def lora_base(options: TrainOptions) -> GPT:
    """The frozen gpt of --base, of this run's shape (a random one without --base)."""
    base = gpt(options, None)
    if options.task.base:
        weights, saved, _ = load_checkpoint(Path(options.task.base))
        expected = {**vars(options.task), "model": "gpt"}  # a gpt of this run's shape
        shape = ("model", "vocab_size", "tokenizer", "block_size", "n_layer", "n_head", "n_embd")
        differs = [f"--{name.replace('_', '-')} {saved.get(name)}" for name in shape
                   if saved.get(name) != expected[name]]
        if differs:
            raise UsageError(f"--base {options.task.base} was trained with {', '.join(differs)}; train --model lora "
                             "with its flags, or give a gpt checkpoint of this shape")
        base.load_state_dict(weights)
    return base


def lora(options: TrainOptions, train_set: Dataset) -> nn.Module:
    return leave_out_of_checkpoints(LoRA(lora_base(options), options.task.lora_rank), "base")


def merged_lora(weights: dict[str, torch.Tensor], task: TaskOptions) -> dict[str, torch.Tensor]:
    """TASK.export_weights, what the export writes: for --model lora, each update merged into its base layer, W + B A,
    a plain gpt's weights; for another model, its weights as they are."""
    if task.model != "lora":
        return weights
    base = lora_base(SimpleNamespace(task=task))
    merged = base.state_dict()
    for name, layer in base.named_modules():
        down, up = (weights.get(f"adapters.{adapter_name(name)}.{index}.weight") for index in (0, 1))
        if down is not None:
            merged[f"{name}.weight"] = layer.weight + up @ down
    return merged


def base_file(folder: Path) -> list[str]:
    """For tests/ (TASK.smoke_test_files): a base checkpoint of smoke_test_args' shape, as a gpt run writes one (a
    random gpt here; yours: a run's step-<N>.pt), and the flag naming it."""
    task = TaskOptions(block_size=32, n_layer=2, n_head=2, n_embd=64)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        base = gpt(SimpleNamespace(task=task), None)
    torch.save({"model": base.state_dict(), "options": vars(task), "step": 0}, folder / "base.pt")
    return ["--base", str(folder / "base.pt")]
'''),
    ('    models={"gpt": gpt},\n', '    models={"gpt": gpt, "lora": lora},\n'),
    ("    compute_loss=compute_loss,\n", "    compute_loss=compute_loss,\n"
     "    export_weights=merged_lora,  # adapters merged into their base\n"
     "    smoke_test_files=base_file,\n"),
    (LM_SMOKE_ARGS, lm_smoke_args("lora")),
]}

LM_MIXTURE = {"PACKAGE/task.py": [
    (LM_MODEL_OPTION, '''    model: str = option("gpt", "a model in task.py's TASK: gpt (a decoder-only transformer), moe (gpt with each "
                        "block's MLP a mixture of --experts experts)", fixed=True)
'''),
    (LM_DROPOUT_OPTION, LM_DROPOUT_OPTION + '''    experts: int = option(4, "for --model moe: experts per block, each token sent to one", fixed=True)
    balance_weight: float = option(0.01, "for --model moe: the load-balancing loss's weight in the loss")
'''),
    ("\n\nclass Block(nn.Module):\n", '''


class MixtureOfExperts(nn.Module):
    """A block's MLP as several experts, each token sent to one by a router and its output scaled by its gate (top-1,
    the Switch Transformer's). Every expert runs every step, on the tokens it got, none included: an expert that got
    none has a zero gradient, not none, so DDP and FSDP2 reduce the same parameters on every rank, every step."""

    def __init__(self, n_embd: int, experts: int, dropout: float, n_layer: int):
        super().__init__()
        self.router = nn.Linear(n_embd, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                                   nn.Linear(4 * n_embd, n_embd, bias=False)) for _ in range(experts))
        self.dropout = nn.Dropout(dropout)
        for name, parameter in self.named_parameters():  # as GPT's own MLP
            nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * n_layer) if name.endswith("2.weight") else 0.02)
        self.balance_loss = torch.zeros(())  # the last forward's (compute_loss adds it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        gates = self.router(tokens).float().softmax(dim=-1)
        chosen = gates.argmax(dim=-1)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            sent = (chosen == index).nonzero().squeeze(1)
            out.index_add_(0, sent, expert(tokens[sent]) * gates[sent, index, None].to(tokens.dtype))
        # The Switch Transformer's load-balancing loss: experts x the sum over experts of (the share of tokens
        # sent there) x (its mean gate); 1 when every expert gets as many tokens, up to `experts` when one gets all.
        shares = torch.bincount(chosen, minlength=len(self.experts)) / len(chosen)
        self.balance_loss = len(self.experts) * (shares * gates.mean(dim=0)).sum()
        return self.dropout(out.view_as(x))


class Block(nn.Module):
'''),
    (LM_GPT_BUILDER, LM_GPT_BUILDER + '''

def mixture(options: TrainOptions, train_set: Dataset) -> nn.Module:
    """gpt with each block's MLP a mixture of --experts experts."""
    task, model = options.task, gpt(options, train_set)
    for block in model.blocks:
        block.mlp = MixtureOfExperts(task.n_embd, task.experts, task.dropout, task.n_layer)
    return model
'''),
    (LM_COMPUTE_LOSS_END, '''    Step): its number (1 for the first), the options (the task's as step.options.task), the plain model. A mixture
    of experts adds each block's load-balancing loss, their mean logged as `balance`."""
    loss = logits_and_loss(model, batch)[1]
    losses = [block.mlp.balance_loss for block in step.model.blocks if isinstance(block.mlp, MixtureOfExperts)]
    if not losses:
        return loss
    balance = torch.stack(losses).mean()
    step.log(balance=balance)
    return loss + step.options.task.balance_weight * balance
'''),
    ('    models={"gpt": gpt},\n', '    models={"gpt": gpt, "moe": mixture},\n'),
    (LM_SMOKE_ARGS, lm_smoke_args("moe")),
]}

# Recipes for the language-model bake's task.py (the same names as an image recipe: one example, two diffs).
LM_RECIPES = {"ema": EMA, "lr-per-group": LR_PER_GROUP, "lora": LM_LORA, "mixture-of-experts": LM_MIXTURE}
LANGUAGE_MODEL = '{% if cookiecutter.task == "language_model" %}'


def sorted_imports(project: Path, relative: str, text: str) -> str:
    """`text` with its imports in the order the project's ruff (isort) wants, as a user's editor would put them."""
    ruff = Path(sys.executable).parent / "ruff"
    result = subprocess.run([str(ruff), "check", "--select", "I", "--fix", "--quiet", "--stdin-filename", relative,
                             "-"], input=text, cwd=project, capture_output=True, text=True, check=False)
    if not result.stdout:
        sys.exit(f"{relative}: ruff could not sort its imports: {result.stderr.strip()}")
    return result.stdout


def diff_of(project: Path, recipe: dict[str, list[tuple[str, str]]], streaming: bool) -> str:
    parts = []
    for relative, edits in recipe.items():
        relative = relative.replace("PACKAGE", PACKAGE)
        before = (project / relative).read_text()
        after = before
        for old, new in edits:
            old, new = old.replace("PACKAGE", PACKAGE), new.replace("PACKAGE", PACKAGE)
            if streaming:  # the image task's table of datasets there has one more
                old, new = (text.replace(STREAMED_FROM, STREAMED_TO) for text in (old, new))
            if old == "END":
                after += new
                continue
            if after.count(old) != 1:
                sys.exit(f"{relative}: the recipe's line(s) {old.splitlines()[0]!r} occur {after.count(old)} times")
            after = after.replace(old, new)
        if relative.endswith(".py"):
            after = sorted_imports(project, relative, after)
        lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                     f"a/{relative}", f"b/{relative}", n=3)
        parts.append("".join(lines))
    text = "".join(parts)
    text = re.sub(r"^(---|\+\+\+) ([ab]/\S+)\s*$", r"\1 \2", text, flags=re.M)  # no timestamps
    return text.replace(PACKAGE, "{{ cookiecutter.package_name }}")


def hunks(diff: str) -> str:
    """A diff without its hunks' line numbers."""
    return re.sub(r"^@@ .* @@$", "@@", diff, flags=re.M)


def main(check: bool = "--check" in sys.argv) -> None:
    """Write the diffs; with --check, only say whether the examples hold them already (exit 1 if not)."""
    diffs, lm_diffs = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for task, recipes, found in (("image_classification", RECIPES, diffs), ("language_model", LM_RECIPES, lm_diffs)):
            for streaming in (False, True):
                project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=f"{folder}/{task}{streaming}",
                                            extra_context={"use_streaming": "yes" if streaming else "no", "task": task}))
                for name, recipe in recipes.items():
                    found.setdefault(name, []).append(diff_of(project, recipe, streaming))
            # The optional parts' own lines (profiling's in train.py) must not reach a diff's context: one diff
            # serves bakes with and without them (patch finds a hunk whose line numbers moved).
            project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=f"{folder}/{task}full", extra_context={
                "task": task, **{name: "yes" for name in ("use_preflight", "use_profiling", "use_export", "use_trackers")}}))
            for name, recipe in recipes.items():
                if hunks(diff_of(project, recipe, False)) != hunks(found[name][0]):
                    sys.exit(f"examples/{name}: its diff differs in a bake with every optional part; move its edits "
                             "away from their lines")

    def one_file(plain: str, streamed: str) -> str:  # for both bakes, rendered by cookiecutter
        return plain if plain == streamed else f"{STREAMING}{streamed}{{% else %}}{plain}{{% endif %}}"
    diffs = {name: one_file(*variants) for name, variants in diffs.items()}
    for name, variants in lm_diffs.items():  # the language model's own, or both tasks' in one file
        lm = one_file(*variants)
        diffs[name] = lm if name not in diffs else f"{LANGUAGE_MODEL}{lm}{{% else %}}{diffs[name]}{{% endif %}}"
    written = {name: path.read_text() if (path := EXAMPLES / name / "change.diff").exists() else None
               for name in diffs}
    stale = [name for name, diff in diffs.items() if written[name] != diff]
    if check:
        if stale:
            sys.exit(f"examples {', '.join(stale)}: their diffs no longer match the template's code; run "
                     "python tools/example_diffs.py")
        return
    for name in stale:
        (EXAMPLES / name / "change.diff").write_text(diffs[name])
    print(f"{EXAMPLES.relative_to(TEMPLATE)}: {len(stale)} of {len(diffs)} diffs written")


if __name__ == "__main__":
    main()
