"""Regenerate the diffs in the generated project's README from the template's own sources.

Each recipe in the README ("Make it yours", "Editing the loop") is a diff that users apply with `patch -p1`, and
tests apply them to a freshly baked project: a diff whose context no longer matches the code fails there. When
task.py, train.py or checkpoint/common.py change, run

    .venv/bin/python tools/readme_diffs.py           # --check: only say whether they are current (a test does)

which bakes the default project, applies each recipe's edits below to its files and writes the resulting
diffs into the README's ```diff blocks, in order. The edits are (old, new) replacements of whole lines.
"""
# ruff: noqa: E501 - the recipes' lines are the project's, each inside a string

from __future__ import annotations

import difflib
import re
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
README = TEMPLATE / "{{cookiecutter.project_slug}}" / "README.md"
PACKAGE = "ddp_training"  # the default bake's package name, written back as the Jinja variable
EMA_CLASS = '''

class ExponentialMovingAverage:
    """An exponential moving average of a model's parameters, e.g. to evaluate with. Under DDP the averages are
    plain tensors; under FSDP2 they are DTensors sharded like the parameters, so each rank averages its own
    shard without communicating (torch.optim.swa_utils.AveragedModel deep-copies the module, which FSDP2
    refuses). Pass it to build_checkpointer() and a resume continues it exactly."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.averages = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After each optimizer step: average += (1 - decay) * (parameter - average)."""
        for name, parameter in model.named_parameters():
            self.averages[name].lerp_(parameter.detach(), 1 - self.decay)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_into(self, model: torch.nn.Module):
        """The averages in the model's parameters inside the block (evaluate them), the trained values after."""
        trained = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
        for name, parameter in model.named_parameters():
            parameter.copy_(self.averages[name])
        try:
            yield model
        finally:
            for name, parameter in model.named_parameters():
                parameter.copy_(trained[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.averages)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, average in self.averages.items():
                average.copy_(state[name])
'''

IMAGE_SMOKE_ARGS = '''    smoke_test_args=["--data", "fake", "--fake-samples", "512", "--image-size", "16", "--batch-size", "16",
                     "--model", "small_cnn", "--num-workers", "0", "--device", "cpu", "--lr", "0.005"],
'''
IMAGE_TABLES = '''    datasets={"fake": fake_images, "cifar10": cifar10, "imagefolder": image_folder, "shards": image_shards},
    models={"small_cnn": small_cnn},
'''
BEFORE_FAKE_IMAGES = "\n\ndef fake_images(options: TrainOptions) -> tuple[Dataset, Dataset]:\n"
BEFORE_SMALL_CNN = "def small_cnn(options: TrainOptions, train_set: Dataset, width: int = 32) -> nn.Module:\n"
IMAGE_SUMMARY = '''    count = sums["samples"]
    return {"loss": sums["loss"] / count, "accuracy": sums["correct"] / count, "samples": int(count)}
'''

REGRESSION = {"PACKAGE/task.py": [
    (IMAGE_SMOKE_ARGS, '''    smoke_test_args=["--data", "fake_table", "--fake-samples", "512", "--batch-size", "16", "--model", "mlp",
                     "--num-workers", "0", "--device", "cpu", "--lr", "0.01"],
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
    (IMAGE_TABLES, '''    datasets={"fake": fake_images, "cifar10": cifar10, "imagefolder": image_folder, "shards": image_shards,
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

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        words = torch.randint(1, 20, (int(torch.randint(3, 13, (), generator=generator)),), generator=generator)
        before = torch.cat([torch.zeros(1, dtype=torch.long), words[:-1]])
        return {"input_ids": words, "labels": (words + (before > 10)) % self.tags}


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
    ('''def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean loss of a batch, what training minimises; `model` is the DDP- or FSDP2-wrapped one there."""
    return outputs_and_loss(model, batch)[1]
''', '''def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean loss of a batch, what training minimises; `model` is the DDP- or FSDP2-wrapped one there."""
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
    (IMAGE_TABLES, '''    datasets={"fake": fake_images, "cifar10": cifar10, "imagefolder": image_folder, "shards": image_shards,
              "tagged": tagged},
    models={"small_cnn": small_cnn, "tagger": tagger},
    collate=collate,
    units_in_batch=units_in_batch,
'''),
    ('    throughput_unit="samples",\n', '    throughput_unit="tokens",\n'),
    (IMAGE_SMOKE_ARGS, '''    smoke_test_args=["--data", "tagged", "--fake-samples", "512", "--batch-size", "16", "--model", "tagger",
                     "--num-classes", "4", "--num-workers", "0", "--device", "cpu", "--lr", "0.5"],
'''),
]}

AUC = {"PACKAGE/task.py": [
    ("import io\n", "import io\nimport math\n"),
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

EMA = {
    "PACKAGE/optim.py": [("END", EMA_CLASS)],
    "train.py": [
        ("from PACKAGE.optim import (\n", "from PACKAGE.optim import (\n    ExponentialMovingAverage,\n"),
        ('''    checkpointer = build_checkpointer(options, env, device, model=model, optimizer=optimizer,
                                      lr_schedule=lr_schedule, grad_scaler=amp, selection=selection, **stream)
''', '''    ema = ExponentialMovingAverage(model, decay=0.99)  # what each epoch's evaluation uses
    checkpointer = build_checkpointer(options, env, device, model=model, optimizer=optimizer,
                                      lr_schedule=lr_schedule, grad_scaler=amp, ema=ema, selection=selection,
                                      **stream)
'''),
        ('            with watchdog.slow_phase("evaluating"):\n',
         '            with watchdog.slow_phase("evaluating"), ema.swapped_into(model):\n'),
        ("            optimizer.zero_grad(set_to_none=True)\n",
         "            optimizer.zero_grad(set_to_none=True)\n            ema.update(model)\n"),
    ],
}

TWO_OPTIMIZERS = {"PACKAGE/task.py": [
    ('''def build_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    """The warmup + decay schedule scales whatever lr this starts with."""
    return torch.optim.SGD(model.parameters(), lr=options.lr, momentum=0.9, weight_decay=5e-4)
''', '''def build_optimizer(model: nn.Module, options: TrainOptions) -> dict[str, torch.optim.Optimizer]:
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
    "PACKAGE/checkpoint/common.py": [
        ("    samples_seen: int = 0  # global samples trained on in all, what the lr schedule follows\n",
         "    samples_seen: int = 0  # global samples trained on in all, what the lr schedule follows\n"
         "    loss_weight: float = 1.0  # annealed in train.py\n"),
    ],
    "train.py": [
        ("                    loss = task.compute_loss(training_model, batch)  # the task runs the model on its batch\n",
         "                    loss = progress.loss_weight * task.compute_loss(training_model, batch)\n"),
        ("            progress.advance(samples_per_step)\n",
         "            progress.advance(samples_per_step)\n"
         "            progress.loss_weight = max(0.5, 0.98 * progress.loss_weight)  # halves over the first 35 steps\n"),
    ],
}

RECIPES = [REGRESSION, TAGGER, AUC, EMA, TWO_OPTIMIZERS, LOSS_WEIGHT]  # the README's ```diff blocks, in order


def diff_of(project: Path, recipe: dict[str, list[tuple[str, str]]]) -> str:
    parts = []
    for relative, edits in recipe.items():
        relative = relative.replace("PACKAGE", PACKAGE)
        before = (project / relative).read_text()
        after = before
        for old, new in edits:
            old, new = old.replace("PACKAGE", PACKAGE), new.replace("PACKAGE", PACKAGE)
            if old == "END":
                after += new
                continue
            if after.count(old) != 1:
                sys.exit(f"{relative}: the recipe's line(s) {old.splitlines()[0]!r} occur {after.count(old)} times")
            after = after.replace(old, new)
        lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                     f"a/{relative}", f"b/{relative}", n=3)
        parts.append("".join(lines))
    text = "".join(parts)
    text = re.sub(r"^(---|\+\+\+) ([ab]/\S+)\s*$", r"\1 \2", text, flags=re.M)  # no timestamps
    return text.replace(PACKAGE, "{{ cookiecutter.package_name }}")


def main(check: bool = "--check" in sys.argv) -> None:
    """Write the diffs; with --check, only say whether the README holds them already (exit 1 if not)."""
    with tempfile.TemporaryDirectory() as folder:
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=folder))
        diffs = [diff_of(project, recipe) for recipe in RECIPES]
    text = README.read_text()
    blocks = list(re.finditer(r"```diff\n(.*?)```", text, re.DOTALL))
    if len(blocks) != len(diffs):
        sys.exit(f"{README}: {len(blocks)} diff blocks, {len(diffs)} recipes")
    for block, diff in reversed(list(zip(blocks, diffs, strict=True))):
        text = text[:block.start(1)] + diff + text[block.end(1):]
    if check:
        if text != README.read_text():
            sys.exit(f"{README.relative_to(TEMPLATE)}: its diffs no longer match the template's code; run "
                     "python tools/readme_diffs.py")
        return
    README.write_text(text)
    print(f"{README.relative_to(TEMPLATE)}: {len(diffs)} diffs written")


if __name__ == "__main__":
    main()
