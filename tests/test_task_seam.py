"""task.py is the one file a user edits: the examples (a regression on a CSV, dict batches, a metric
over the whole held-out set, two networks stepped in turn, a frozen teacher) apply to a baked project and train
on 2 ranks; those that change training resume bitwise, and the project's own smoke tests pass; an unknown name
says where to add it; a bug in the evaluation path shows before the first step; evaluation sums of any shape,
with a collective inside, do not hang."""

from __future__ import annotations

import importlib
import io
import json
import math
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    assert_project_tests_pass,
    assert_same,
    assert_the_readme_rebuilds_the_trained_model,
    checkpoint,
    checkpoint_state,
    flags,
    free_port,
    kill_a_worker_and_finish,
    metric_rows,
    readme_block,
    run,
    run_job,
    smoke_test_args,
    start_job,
    task_field,
    tiny_run,
    with_task_code,
)


def write_table(path: Path, rows: int, seed: int) -> None:
    generator = random.Random(seed)
    lines = ["rooms,area,age,price"]
    for _ in range(rows):
        rooms, area, age = generator.uniform(1, 6), generator.uniform(0.3, 2), generator.uniform(0, 1)
        lines.append(f"{rooms:.3f},{area:.3f},{age:.3f},{0.5 * rooms + 2 * area - age + generator.gauss(0, 0.05):.3f}")
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_the_regression_example_is_the_whole_change(bake, tmp_path):
    # In the smallest bake: every optional part answered no, whose project still lints, trains and passes its tests.
    project = bake(project_name="House Prices", use_slurm="no", use_kubernetes="no", use_docker="no",
                   use_preflight="no", use_profiling="no", use_export="no", use_trackers="no", use_streaming="no")
    left_out = ("preflight", "profiling", "export", "trackers", "engine/streaming")
    assert not any((project / "house_prices" / f"{name}.py").exists() for name in left_out)
    assert not any((project / name).exists() for name in ("Dockerfile", ".dockerignore", "slurm", "k8s",
                                                          "docs/containers-and-schedulers.md"))
    patched = run(["patch", "-p1", "-i", "examples/regression/change.diff"], cwd=project)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    assert "house_prices/task.py" in patched.stdout, "one file changes"
    lint = run(["ruff", "check", "."], cwd=project)
    assert lint.returncode == 0, lint.stdout

    (project / "tables").mkdir()
    write_table(project / "tables" / "train.csv", 600, seed=0)
    write_table(project / "tables" / "val.csv", 150, seed=1)
    readme = readme_block(project, "bash", "# A regression", "examples/regression/README.md")
    command = next(line for line in readme.splitlines() if "./run_node.sh" in line)
    result = run(["bash", "-c", command], cwd=project)  # exactly as the example's README has it
    assert result.returncode == 0, result.stderr[-4000:]
    evaluations = re.findall(r"eval loss ([\d.]+) \| mean_absolute_error ([\d.]+) on 150 held-out samples",
                             result.stderr)
    assert len(evaluations) == 20, result.stderr  # one per epoch, every held-out row counted once
    assert float(evaluations[-1][1]) < 0.2 < float(evaluations[0][1]), evaluations
    newest = max(int(path.stem.split("-")[1]) for path in (project / "checkpoints").glob("step-*.pt"))
    assert_the_readme_rebuilds_the_trained_model(project, project / "checkpoints", newest, tmp_path)  # a builder
    # sized from its data: the table's columns

    assert_project_tests_pass(project)


def test_an_unknown_name_says_which_file_and_function_to_edit(default_project, tmp_path):
    # A process of its own: the whole of stderr is this one line, with nothing before it (a warning, say).
    result = run(["python", "train.py", "--data", "csv", "--ckpt-dir", str(tmp_path)], cwd=default_project)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: --data 'csv' is not in the task's datasets; known: cifar10, fake, imagefolder. To add it, "
        "write a builder and add 'csv': <builder> to TASK's datasets in ddp_training/task.py"], result.stderr


def test_a_frozen_module_left_out_of_checkpoints_and_a_task_spec_that_cannot_work_are_checked(baked_module):
    import torch
    from torch import nn

    spec, task, errors = baked_module("spec"), baked_module("task"), baked_module("engine.errors")
    tasks, task_state = baked_module("engine.tasks"), baked_module("engine.task_state")
    with pytest.raises(TypeError, match="compute_loss .* or training_step .*: one of the two"):
        spec.Task(**{**vars(task.TASK), "training_step": lambda step, batches: None})
    with pytest.raises(TypeError, match=r"compute_loss\(model, batch, step\); give two_arguments a third parameter"):
        def two_arguments(model, batch):
            return 0
        spec.Task(**{**vars(task.TASK), "compute_loss": two_arguments})
    # Modules in a plain list are not registered: never trained, synced or saved, and no error would say so.
    class Unregistered(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(2, 2)
            self.blocks = [nn.Linear(2, 2)]
            self.shortcuts = {"head": self.head}  # only a reference to a registered module: fine
    with pytest.raises(errors.UsageError, match=r"a plain list, blocks, which torch does not register.* an "
                                                r"nn.ModuleList in task.py"):
        tasks.check_every_module_is_registered(Unregistered())
    unregistered = Unregistered()
    unregistered.blocks = nn.ModuleList(unregistered.blocks)
    tasks.check_every_module_is_registered(unregistered)
    # State the task keeps beside the model: saveable, named apart from train.py's entries, evaluated with by name.
    with pytest.raises(TypeError, match="evaluate_with='ema'.* Task\\(state=...\\), which is not given"):
        spec.Task(**{**vars(task.TASK), "evaluate_with": "ema"})
    taken = {"model", "optimizer"}
    for state, message in (({"optimizer": nn.Linear(1, 1)}, "names an entry 'optimizer', which train.py saves"),
                           ({"queue": [1, 2]}, r"\['queue'\] is a list, which a checkpoint cannot hold"),
                           ({"ema": nn.Linear(1, 1)}, "evaluate_with='ema'.* with swapped_into")):
        keeping = spec.Task(**{**vars(task.TASK), "state": lambda model, options, state=state: state,
                               "evaluate_with": "ema"})
        with pytest.raises(errors.UsageError, match=message):
            tasks.build_state(keeping, nn.Linear(1, 1), None, taken)
    # A name a checkpoint keeps for itself (a DDP file is one flat dict): refused, not overwritten.
    checkpoint, distributed = baked_module("engine.checkpoint"), baked_module("engine.distributed")
    with pytest.raises(errors.UsageError, match="an entry named 'progress', a name checkpoints keep for themselves"):
        checkpoint.build_checkpointer(checkpoint.CheckpointOptions(), checkpoint.RecordedOptions({}, frozenset(), str),
                                      distributed.DistEnv(), torch.device("cpu"), sharded=False,
                                      model=nn.Linear(1, 1), progress=nn.Linear(1, 1))

    def distilled() -> nn.Module:
        torch.manual_seed(0)  # the teacher comes back the same, as from its own weights file
        model = nn.ModuleDict({"student": nn.Linear(4, 2), "teacher": nn.Linear(4, 2).requires_grad_(False)})
        return task_state.leave_out_of_checkpoints(model, "teacher")
    model = distilled()
    assert list(model.state_dict()) == ["student.weight", "student.bias"]
    assert tasks.describe_parameters(model) == (
        "model: 0.00 M parameters, 0.00 M trained; frozen: teacher; not saved (the model builder makes them each "
        "run): teacher")
    restored = distilled()
    restored.student.weight.data.zero_()
    restored.load_state_dict(model.state_dict())  # strict: the teacher alone may be missing
    assert torch.equal(restored.student.weight, model.student.weight)
    with pytest.raises(RuntimeError, match="Missing key.*student.bias"):
        restored.load_state_dict({"student.weight": model.student.weight})
    with pytest.raises(errors.UsageError, match="'teachr'\\): the model has no module 'teachr'; its top-level "
                                                "modules: student, teacher"):
        task_state.leave_out_of_checkpoints(model, "teachr")
    with pytest.raises(errors.UsageError, match=r"'student'\): its parameter 'weight' is trained \(requires_grad\): "
                                                "resumed, it would start over"):
        task_state.leave_out_of_checkpoints(model, "student")


def test_throughput_says_once_that_it_guessed_how_many_samples_a_dict_batch_holds(baked_module, caplog):
    import logging

    import torch

    tasks = baked_module("engine.tasks")
    tasks.say_samples_are_guessed.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert tasks.samples_in((torch.zeros(3, 2), torch.zeros(3))) == 3  # (inputs, targets): no guess
        batch = {"input_ids": torch.zeros(4, 7), "attention_mask": torch.ones(4, 7)}
        assert tasks.samples_in(batch) == tasks.samples_in(batch) == 4
    assert [record.getMessage() for record in caplog.records] == [
        "throughput counts 4 samples in a batch (a dict): the length of its first tensor. If that is not how many "
        "samples it holds (a flat tensor of packed tokens, a per-token first entry), give TASK units_in_batch(batch), "
        "and throughput_unit to count tokens"]


# A task's own step under FSDP2, one rank: the generator trains, then runs without gradients (in the critic's
# loss), then both optimizers step. A root FSDP2 module keeps its whole parameters after a forward without
# gradients; unless the step reshards it, its next forward computes with the parameters from before the update.
STALE_AFTER_NO_GRAD = """
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from ddp_training.engine.optim import MixedPrecision, NonFiniteGuard
from ddp_training.step import Step
from ddp_training.engine.parallel import wrap_networks

dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
cpu = torch.device("cpu")
torch.manual_seed(0)
model = nn.Module()
model.generator, model.critic = nn.Linear(4, 4), nn.Linear(4, 1)
networks = wrap_networks(model, cpu, "fsdp2", one_by_one=True)
optimizers = {name: torch.optim.SGD(getattr(model, name).parameters(), lr=0.1) for name in ("generator", "critic")}
amp = MixedPrecision("fp32", cpu)


def optimizer_step(optimizer, number):  # train.py's, less clipping and the non-finite check
    optimizer.step()
    return torch.zeros(())


step = Step(networks, model, optimizers, amp, SimpleNamespace(), NonFiniteGuard(0, amp, cpu), optimizer_step)


def generator_loss(networks, batch):
    return networks.critic(networks.generator(batch)).mean()


def critic_loss(networks, batch):
    with torch.no_grad():
        fakes = networks.generator(batch)
    return networks.critic(fakes).mean()


def training_step(step, batches):
    step.backward(generator_loss, batches)
    critic = step.backward(critic_loss, batches)
    step.update("generator", "critic")
    return critic


batch = torch.randn(8, 4)
before = model.generator.weight.full_tensor().clone()
step.run(training_step, [batch], number=1)
weight, bias = model.generator.weight.full_tensor(), model.generator.bias.full_tensor()
assert not torch.equal(weight, before), "the generator stepped"
with torch.no_grad():
    assert torch.equal(networks.generator(batch), nn.functional.linear(batch, weight, bias)), "stale parameters"
print("the next forward uses the stepped parameters")
dist.destroy_process_group()
"""


def test_fsdp2_shards_the_members_of_top_level_containers_which_have_no_forward(baked_module):
    from torch import nn

    model = nn.Module()  # a transformer's layers, adapters by name, a head, and a child with nothing to shard
    model.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    model.adapters = nn.ModuleDict({"a": nn.Linear(2, 2)})
    model.head, model.activation = nn.Linear(2, 1), nn.ReLU()
    assert baked_module("engine.parallel").shardable_blocks(model) == [*model.layers, model.adapters["a"], model.head]


def test_a_task_step_under_fsdp2_computes_with_the_parameters_it_just_stepped(default_project, tmp_path):
    script = tmp_path / "stale.py"
    script.write_text(STALE_AFTER_NO_GRAD)
    result = run([sys.executable, str(script)], cwd=default_project, PYTHONPATH=str(default_project),
                 OMP_NUM_THREADS="1", PORT=str(free_port()))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "the next forward uses the stepped parameters" in result.stdout


@pytest.mark.slow
def test_a_bug_in_evaluation_shows_before_the_first_step(default_project, tmp_path):
    project = shutil.copytree(default_project, tmp_path / "project")
    task = project / "ddp_training" / "task.py"
    task.write_text(task.read_text().replace('sums["correct"]', 'sums["corect"]'))  # a typo a user might make
    result = run_job(project, tiny_run(num_workers=0, ckpt_dir=tmp_path), nproc=1)
    assert result.returncode != 0
    assert "KeyError: 'corect'" in result.stderr, result.stderr[-3000:]
    assert "| loss " not in result.stderr, "no training step before the evaluation path has run once"


# A confusion matrix as one sum (a tensor, not a number), and a collective inside the evaluation path, as a
# loss that takes negatives from every rank has: with 129 held-out samples on 2 ranks, one rank has 9 batches
# of 8 and the other 8, and a rank that stopped early would leave the other waiting in its collective.
CONFUSION_AND_COLLECTIVE = '''

import torch.distributed as dist

_plain_sums, _plain_summary = evaluation_sums, summarize


def evaluation_sums(model, batch):
    every_rank = torch.ones(1)
    dist.all_reduce(every_rank)
    logits, labels = model(batch[0]), batch[1]
    classes = logits.shape[1]
    confusion = torch.bincount(labels * classes + logits.argmax(dim=1), minlength=classes * classes)
    return {**_plain_sums(model, batch), "confusion": confusion.view(classes, classes)}


def summarize(sums, outputs):
    confusion = sums["confusion"]
    return {**_plain_summary(sums, outputs), "confusion_total": float(confusion.sum()),
            "confusion_accuracy": float(confusion.trace() / confusion.sum())}


import dataclasses

TASK = dataclasses.replace(TASK, evaluation_sums=evaluation_sums, summarize=summarize)
'''


@pytest.mark.slow
def test_evaluation_sums_any_shape_and_a_collective_in_it_does_not_hang(default_project, tmp_path):
    project = with_task_code(default_project, tmp_path, CONFUSION_AND_COLLECTIVE)
    result = run_job(project, tiny_run(fake_samples=516, num_workers=0, max_steps=4, io_timeout=60,
                                       ckpt_dir=tmp_path / "c"), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    # 516 training samples on 2 ranks of 8 a step: an epoch's last 4 fill no step, which is said, not left out unsaid.
    assert ("each epoch trains 512 of the training set's 516 samples, in whole steps of 2 rank(s) x 8; the other 4, "
            "drawn anew each epoch, are not trained (other world sizes, other counts)") in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "eval loss" in line]
    metrics = dict(re.findall(r"(\w+) ([\d.]+)", line.split("eval ", 1)[1]))
    assert line.endswith("on 129 held-out samples (closing the run)"), line
    assert float(metrics["confusion_total"]) == 129, line
    assert metrics["confusion_accuracy"] == metrics["accuracy"], line


# A model with a method besides forward, and a loss that calls it (HOW=method) or the plain model (HOW=plain).
BYPASSING_FORWARD = '''

import dataclasses
import os


class WithMethods(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, images):
        return self.inner(images)

    def classify(self, images):
        return self.inner(images)


def bypassing_loss(model, batch, step):
    images, labels = batch
    logits = model.classify(images) if os.environ["HOW"] == "method" else step.model(images)
    return nn.functional.cross_entropy(logits, labels)


TASK = dataclasses.replace(TASK, compute_loss=bypassing_loss,
                           models={"small_cnn": lambda options, train_set: WithMethods(small_cnn(options, train_set))})
'''


@pytest.mark.slow
def test_a_loss_that_bypasses_forward_is_refused_alike_by_one_process_and_by_torchrun(default_project, tmp_path):
    project = with_task_code(default_project, tmp_path, BYPASSING_FORWARD)
    expected = ("error: the loss gave the model compute_loss was given gradients without calling it: it ran the plain "
                "model (step.model) or a method other than forward (such as model.decode(...)), and DDP and FSDP2 "
                "sync gradients only through forward, so under torchrun the ranks would train different models; call "
                "the model itself (model(batch)) and do that work in its forward")
    for how, via, nproc in [("method", "python", 1), ("method", "torchrun", 2), ("plain", "torchrun", 2)]:
        result = run_job(project, tiny_run(num_workers=0, max_steps=4, ckpt_dir=tmp_path / how / via), via=via,
                         nproc=nproc, HOW=how)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 1 and errors == [expected], (how, via, result.stderr[-3000:])
        assert "| loss " not in result.stderr and not list((tmp_path / how / via).glob("step-*")), "no step trained"


def trains_learns_and_resumes_bitwise_after_kill_9(project: Path, tmp_path: Path, *args: str) -> list[dict]:
    """The project's own tiny run (task.py's TASK.smoke_test_args, plus `args`) on 2 ranks to the end, and again with
    a worker killed (kill -9) after the first checkpoint: torchrun restarts the group, and the last checkpoints
    agree bit for bit. What the project's own smoke tests check, here without their two launches more: the
    tiny run trains, its loss falls, and a restart continues it. Returns the uninterrupted run's metric rows."""
    def run_args(ckpt_dir: Path) -> list[str]:
        return [*smoke_test_args(project), *args, *flags(ckpt_every=4, keep_checkpoints=100, ckpt_dir=ckpt_dir)]
    uninterrupted = run_job(project, [*run_args(tmp_path / "uninterrupted"), "--log-dir", str(tmp_path / "logs")])
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    killed = start_job(project, run_args(tmp_path / "killed"), max_restarts=1)
    kill_a_worker_and_finish(killed, tmp_path / "killed" / "step-4.pt")
    final = max(int(path.stem.split("-")[1]) for path in (tmp_path / "uninterrupted").glob("step-*.pt"))
    resumed, expected = checkpoint(tmp_path / "killed", final), checkpoint(tmp_path / "uninterrupted", final)
    assert_bitwise_equal(resumed, expected)  # each rank's generator state among them
    assert_the_readme_rebuilds_the_trained_model(project, tmp_path / "uninterrupted", final, tmp_path)
    rows = metric_rows(tmp_path / "logs")
    losses = [row["loss"] for row in rows if row["kind"] == "train"]
    assert losses[-1] < 0.7 * losses[0], losses  # the smoke tests' own bar: learnable in a few dozen steps
    return rows


def apply_example(project: Path, name: str) -> None:
    """examples/<name>/change.diff, applied as its README says: `patch -p1 < examples/<name>/change.diff`."""
    patched = run(["patch", "-p1", "-i", f"examples/{name}/change.diff"], cwd=project)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    assert patched.stdout.split() == ["patching", "file", f"{project.name.replace('-', '_')}/task.py"], \
        "one file changes"
    lint = run(["ruff", "check", "."], cwd=project)
    assert lint.returncode == 0, lint.stdout


@pytest.mark.slow
@pytest.mark.starts_first  # two launches, one with a restart: among the longest
def test_the_dict_batch_example_trains_resumes_and_counts_words(bake, tmp_path):
    project = bake(project_name="Word Tags")
    apply_example(project, "dict-batches")
    assert "--data tagged --fake-samples 512 --batch-size 16 --model tagger" in " ".join(smoke_test_args(project))
    rows = trains_learns_and_resumes_bitwise_after_kill_9(project, tmp_path, *flags(log_every=8, max_steps=24))
    evaluation = [row for row in rows if row["kind"] == "eval"][0]  # after epoch 0
    assert evaluation["accuracy"] > 0.6 and 500 < evaluation["tokens"] < 128 * 12, evaluation  # words, no padding
    assert all("tokens_per_sec" in row for row in rows if row["kind"] == "train")
    # Its own batches (Task.batches: length buckets of 1 to 42 sentences): samples seen count what they hold,
    # and one rank resuming the 2-rank job at step 4 trains on the epoch's next batches, one a step.
    sys.path.insert(0, str(project))
    try:
        task = importlib.import_module("word_tags.task")
    finally:
        sys.path.remove(str(project))
    at_step_4 = checkpoint(tmp_path / "uninterrupted", 4)
    options = SimpleNamespace(seed=at_step_4["options"]["seed"], batch_size=16)
    batches = task.length_buckets(task.TaggedSentences(512, 4, options.seed), options, 0)
    assert sorted(index for batch in batches for index in batch) == list(range(512))
    assert len({len(batch) for batch in batches}) > 3, "batches of many sizes"
    assert at_step_4["samples_seen"] == sum(map(len, batches[:8]))  # 4 steps of 2 ranks
    resized = tmp_path / "resized"
    resized.mkdir()
    shutil.copy(tmp_path / "uninterrupted" / "step-4.pt", resized)
    result = run([sys.executable, "train.py", *smoke_test_args(project), *flags(
        ckpt_dir=resized, max_steps=24, stop_at_step=10, sample_log=tmp_path / "samples")], cwd=project)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = [int(line) for line in (tmp_path / "samples" / "rank-0.txt").read_text().split()]
    assert trained == [index for batch in batches[8:14] for index in batch]
    assert checkpoint(resized, 10)["samples_seen"] == sum(map(len, batches[:14]))
    # Under FSDP2 the same batches train the same model (up to the order of additions), and count the same.
    fsdp2 = run_job(project, [*smoke_test_args(project), *flags(log_every=8, max_steps=24, ckpt_every=4,
                                                                ckpt_dir=tmp_path / "fsdp2", strategy="fsdp2")])
    assert fsdp2.returncode == 0, fsdp2.stderr[-4000:]
    sharded, final = checkpoint_state(tmp_path / "fsdp2", 24, tmp_path), checkpoint(tmp_path / "uninterrupted", 24)
    assert sharded["progress"]["samples_seen"] == final["samples_seen"]
    assert sharded["model"].keys() == final["model"].keys()
    for name, tensor in final["model"].items():
        assert (sharded["model"][name] - tensor).abs().max() < 1e-5, name


@pytest.mark.slow
def test_the_curriculum_example_learns_its_stage_and_resumes_it_after_kill_9_and_a_resize(bake, tmp_path):
    """examples/curriculum: a stage the run learns from the held-out loss (Task.after_evaluation), decided after an
    evaluation, saved, and handed to persistent loader workers with each sample; a kill -9 right before it fired
    resumes bitwise, a resize to 1 rank (loader in the training process) raises it at the same steps; a stage a
    rank decides alone stops the job in one line."""
    project = bake(project_name="Curriculum")
    apply_example(project, "curriculum")
    args = [*smoke_test_args(project), *flags(num_workers=1, eval_every_steps=8, max_steps=48, log_every=8,
                                              ckpt_every=8, keep_checkpoints=100)]
    uninterrupted = run_job(project, [*args, *flags(ckpt_dir=tmp_path / "uninterrupted")])
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    raised = re.findall(r"step (\d+): data_stage (\d+) from the next step on", uninterrupted.stderr)
    assert raised == [("16", "1"), ("24", "2")], uninterrupted.stderr[-4000:]
    stages = {step: json.loads(checkpoint(tmp_path / "uninterrupted", step)["learned"]["values"]).get("data_stage", 0)
              for step in (8, 16, 24, 48)}
    assert stages == {8: 0, 16: 0, 24: 1, 48: 2}  # saved before the evaluation that raises it, which a resume redoes
    # Killed at step 16's checkpoint, before its evaluation raised the stage: the resume evaluates again, decides
    # the same stage, and reads the epoch's rest with it.
    killed = start_job(project, [*args, *flags(ckpt_dir=tmp_path / "killed")], max_restarts=1)
    output = kill_a_worker_and_finish(killed, tmp_path / "killed" / "step-16.pt")
    assert "step 16: data_stage 1" in output.split("restart=1", 1)[1], output[-4000:]
    assert_bitwise_equal(checkpoint(tmp_path / "killed", 48), checkpoint(tmp_path / "uninterrupted", 48))
    assert_the_readme_rebuilds_the_trained_model(project, tmp_path / "uninterrupted", 48, tmp_path)
    # 1 rank of 32 samples from step 16: the same global batch and stages, the loader in the training process.
    resized = tmp_path / "resized"
    resized.mkdir()
    shutil.copy(tmp_path / "uninterrupted" / "step-16.pt", resized)
    one_rank = run([sys.executable, "train.py", *args, *flags(batch_size=32, num_workers=0, ckpt_dir=resized)],
                   cwd=project)
    assert one_rank.returncode == 0, one_rank.stderr[-3000:]
    assert re.findall(r"step (\d+): data_stage (\d+)", one_rank.stderr) == raised, one_rank.stderr[-3000:]
    end, expected = checkpoint(resized, 48), checkpoint(tmp_path / "uninterrupted", 48)
    assert (end["learned"], end["samples_seen"]) == (expected["learned"], expected["samples_seen"])
    # (Not the same weights: its loss is a mean over each rank's words, which a resize weighs otherwise.)
    # A stage each rank decides from what it alone holds (here its rank) would train other data on each.
    local = with_task_code(project, tmp_path, "\nimport dataclasses as _dataclasses\nimport os as _os\n\n"
                           "TASK = _dataclasses.replace(TASK, after_evaluation=lambda learned, results, closes, "
                           "options: {'data_stage': int(_os.environ['RANK'])})\n")
    refused = run_job(local, [*args, *flags(ckpt_dir=tmp_path / "local")])
    line = ("error: Task.after_evaluation returned other values of 'data_stage' on the ranks (0, 1); decide from the "
            "evaluation results it is given, the same on every rank, not from a rank's own loss, data or generator")
    assert refused.returncode != 0 and refused.stderr.count(line) == 1, refused.stderr[-3000:]
    assert "data_stage 1" not in refused.stderr and not (tmp_path / "local" / "step-16.pt").exists()


@pytest.mark.slow
def test_the_word_language_model_port_resumes_every_ranks_hidden_state_and_refuses_a_resize(bake, tmp_path):
    """examples/word-language-model: batches in order (each rank its own streams), an LSTM state each rank carries
    (PerRank), plain SGD (an optimizer without state) and the plateau rule (after_evaluation): killed in mid-epoch
    (step 4 of 22), it resumes bitwise; on 1 rank its 2 ranks' streams and states are refused in one line."""
    project = bake(project_name="Words")
    apply_example(project, "word-language-model")
    rows = trains_learns_and_resumes_bitwise_after_kill_9(project, tmp_path, *flags(log_every=4, max_steps=30))
    assert [row for row in rows if row["kind"] == "eval"][0]["perplexity"] < 4, rows  # after epoch 0
    end = checkpoint(tmp_path / "uninterrupted", 30)
    hidden = [torch.load(io.BytesIO(rank), weights_only=True) for rank in end["hidden"]["ranks"]]
    assert len(hidden) == 2 and not torch.equal(hidden[0]["hidden"][0], hidden[1]["hidden"][0])  # each its own
    assert end["optimizer"]["state"] == {}  # plain SGD keeps none, and the project's own tests accept that
    resized = tmp_path / "resized"
    resized.mkdir()
    shutil.copy(tmp_path / "uninterrupted" / "step-8.pt", resized)
    refused = run_job(project, [*smoke_test_args(project), *flags(ckpt_dir=resized, max_steps=30)], nproc=1)
    line = ("error: the task state 'hidden' is per rank: the checkpoint holds 2 ranks' and this job has 1; resume on "
            "2 ranks, or give PerRank(..., resplit=...) in task.py to make the new ranks' from the saved ones")
    assert refused.returncode != 0 and refused.stderr.count(line) == 1, refused.stderr[-3000:]


@pytest.mark.slow
def test_the_language_models_examples_ema_and_lr_per_group_apply_together_and_resume_bitwise(bake, tmp_path):
    """The language-model bake's examples: ema (its own diff of that task.py) and lr-per-group, applied together,
    trained, killed by kill -9 and resumed bit for bit."""
    project = bake(task="language_model", project_name="LM Examples")
    for name in ("ema", "lr-per-group"):
        apply_example(project, name)
    # Paused at step 30, as the project's own smoke test runs it: the lr near its peak, where the loss falls.
    trains_learns_and_resumes_bitwise_after_kill_9(project, tmp_path, *flags(log_every=5, stop_at_step=30))
    state = checkpoint(tmp_path / "uninterrupted", 30)
    embeddings, matrices, norms = (group["lr"] for group in state["optimizer"]["param_groups"])
    assert embeddings == pytest.approx(matrices * 10) and matrices == norms  # each group's peak, one schedule
    assert state["ema"].keys() == state["model"].keys()



MAKE_BASE = "import sys; from pathlib import Path; from {}.task import base_file; print(*base_file(Path(sys.argv[1])))"


@pytest.mark.slow
@pytest.mark.parametrize("example", ["lora", "mixture-of-experts"])
def test_the_language_models_lora_and_mixture_of_experts_train_and_resume_bitwise(bake, tmp_path, example):
    """The language-model bake's lora (adapters on a base checkpoint the example's base_file makes, left out of
    every checkpoint) and mixture-of-experts (its load-balancing loss logged): each trained, killed by kill -9 and
    resumed bit for bit."""
    project = bake(task="language_model", project_name=f"LM {example}")
    apply_example(project, example)
    package = project.name.replace("-", "_")
    base = run([sys.executable, "-c", MAKE_BASE.format(package), str(tmp_path)], cwd=project) if example == "lora" \
        else None
    extra = base.stdout.split() if base else []
    assert not base or (base.returncode == 0 and extra[0] == "--base"), base and base.stderr[-2000:]
    run_args = [*extra, *flags(log_every=5, stop_at_step=30)]
    rows = trains_learns_and_resumes_bitwise_after_kill_9(project, tmp_path, *run_args)
    state = checkpoint(tmp_path / "uninterrupted", 30)
    if example == "lora":
        assert state["model"] and not any(key.startswith("base.") for key in state["model"]), list(state["model"])
        assert "left_out_weights" in state  # the base's fingerprint, checked at every resume
        ups = [tensor for key, tensor in state["model"].items() if key.endswith(".1.weight")]
        assert len(ups) == 2 * 4 + 1 and all(tensor.abs().sum() > 0 for tensor in ups)  # every update trained
    else:
        balance = [row["balance"] for row in rows if row["kind"] == "train"]
        assert len(balance) == 6 and all(0.9 < value < 4 for value in balance), balance  # 4 experts: 1 is even

# The example's summarize, checked: one row per evaluated sample (the sums count 129 held-out samples: the log
# line), from every rank, none twice.
EVERY_ROW_ONCE = '''

_example_summary = summarize


def summarize(sums, outputs):
    assert len(outputs["score"]) == sums["samples"], (len(outputs["score"]), sums["samples"])
    return _example_summary(sums, outputs)


import dataclasses

TASK = dataclasses.replace(TASK, summarize=summarize)
'''


@pytest.mark.slow
def test_the_whole_set_metric_example_gathers_every_row_once(bake, tmp_path):
    # One launch: the example changes evaluation alone, and the training state it resumes is the default's.
    project = bake(project_name="Auc Check")
    apply_example(project, "whole-set-metric")
    task = project / "auc_check" / "task.py"
    task.write_text(task.read_text() + EVERY_ROW_ONCE)
    assert "--num-classes 2" in " ".join(smoke_test_args(project))
    # 129 held-out samples on 2 ranks: 5 batches of 16 against 4 (the short rank repeats one, uncounted); 16
    # steps an epoch.
    run_args = flags(fake_samples=516, log_every=4, max_steps=24, ckpt_dir=tmp_path / "ckpt", log_dir=tmp_path / "logs")
    result = run_job(project, [*smoke_test_args(project), *run_args])
    assert result.returncode == 0, result.stderr[-4000:]
    rows = metric_rows(tmp_path / "logs")
    losses = [row["loss"] for row in rows if row["kind"] == "train"]
    assert losses[-1] < 0.7 * losses[0], losses  # the project's smoke tests' bar: learnable in a few dozen steps
    evaluations = [row for row in rows if row["kind"] == "eval"]  # after epoch 0 and at the end
    assert len(evaluations) == 2 and all(row["samples"] == 129 and 0.5 < row["auc"] <= 1 for row in evaluations), \
        evaluations
    assert_the_readme_rebuilds_the_trained_model(project, tmp_path / "ckpt", 24, tmp_path)


SHAPES = {"adversarial": "gan", "distilled": "distillation", "lora": "lora"}  # --model: its example

MERGED_LORA_COMPUTES_WHAT_THE_ADAPTERS_DO = """
import sys
from types import SimpleNamespace as N

import torch

from shape_lora.task import TaskOptions, lora, small_cnn

checkpoint = torch.load(sys.argv[1], weights_only=True)
task = N(task=TaskOptions(**{key: value for key, value in checkpoint["options"].items()
                             if key in TaskOptions.__dataclass_fields__}))
adapted, fresh, merged = lora(task, None).eval(), lora(task, None).eval(), small_cnn(task, None).eval()
assert adapted.load_state_dict(checkpoint["model"], strict=False).unexpected_keys == []  # the base: from its file
merged.load_state_dict(torch.load(sys.argv[2], weights_only=True))
images = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    print((adapted(images) - merged(images)).abs().max().item(), (adapted(images) - fresh(images)).abs().max().item())
"""


@pytest.mark.slow
@pytest.mark.starts_first  # three launches, one with a restart
@pytest.mark.parametrize("model", SHAPES)
def test_networks_stepped_in_turn_and_a_frozen_teacher_need_task_py_alone(bake, tmp_path, model):
    """Each example's diff, task.py alone: the project's own tests pass (2 ranks train one model under DDP; a run
    resumed from a copy of the middle checkpoint ends with every checkpoint entry bit for bit where theirs did),
    and an FSDP2 job with a worker killed (kill -9) ends bit for bit where their uninterrupted DDP run ended: the
    weights and every rank's generators (what the optimizers' state and the draws after the restart decide),
    since on 2 CPU ranks FSDP2 adds the same two gradients as DDP, and its checkpoint keys the optimizer state by
    name. (A DDP job killed the same way is the restart path of tests/test_fault_tolerance.py, any task's.)"""
    project = bake(project_name=f"Shape {model}", use_export="yes")  # LoRA exports its merged weights
    apply_example(project, SHAPES[model])
    assert f"--model {model}" in " ".join(smoke_test_args(project))
    own = run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "own")],
              cwd=project, timeout=600)
    assert own.returncode == 0 and re.search(r"\b2 passed\b", own.stdout), own.stdout[-4000:]
    steps = (task_field(project, "smoke_test_learning") or (20,))[0]  # as the project's tests run it
    uninterrupted = checkpoint_state(tmp_path / "own" / "checkpoints0", steps, tmp_path)
    assert_the_readme_rebuilds_the_trained_model(project, tmp_path / "own" / "checkpoints0", steps, tmp_path)
    killed = start_job(project, [*smoke_test_args(project), "--strategy", "fsdp2", *flags(
        ckpt_dir=tmp_path / "fsdp2", stop_at_step=steps, ckpt_every=2, log_every=1)], max_restarts=1)
    output = kill_a_worker_and_finish(killed, tmp_path / "fsdp2" / "step-2")  # a checkpoint every 2: an early kill
    resumed = checkpoint_state(tmp_path / "fsdp2", steps, tmp_path)
    for entry in ("model", "cpu_rng_states", "torch_rng_state", "lr_schedule", "selection"):
        expected, actual = uninterrupted[entry], resumed[entry]
        if isinstance(expected, dict):  # DDP's model state is an OrderedDict, FSDP2's a dict
            expected, actual = dict(expected), dict(actual)
        assert_same(actual, expected, entry)

    import torch

    # Each rank resumes its own CPU generator: the GAN draws its noise from it on every rank, so a resume that
    # gave every rank one state (or the ranks each other's) would have changed the weights compared above.
    assert uninterrupted["cpu_rng_states"].shape[0] == 2 and not torch.equal(*uninterrupted["cpu_rng_states"]), \
        "each rank draws its own noise"
    if model == "adversarial":  # each network its own optimizer, each stepped once a step
        assert {name: {float(state["step"]) for state in optimizer["state"].values()}
                for name, optimizer in uninterrupted["optimizer"].items()} == {"critic": {steps}, "generator": {steps}}
        # Task.rank_0_work: rank 0 alone ran the generator, under FSDP2 gathered whole for it (its forward would
        # otherwise wait for rank 1's all-gathers), and drew the grid DDP drew, bit for bit.
        grids = sorted(path.name for path in (tmp_path / "fsdp2" / "samples").iterdir())
        assert grids == ["step-000010.png", "step-000020.png"] == sorted(
            path.name for path in (tmp_path / "own" / "checkpoints0" / "samples").iterdir()), grids
        for grid in grids:
            assert (tmp_path / "fsdp2" / "samples" / grid).read_bytes() == \
                (tmp_path / "own" / "checkpoints0" / "samples" / grid).read_bytes(), grid
    elif model == "lora":  # the frozen base in no checkpoint; each layer's adapter an lr of its own; merged export
        assert "frozen: base; not saved (the model builder makes them each run): base" in output, output[-3000:]
        assert all(key.startswith("adapters.") for key in uninterrupted["model"]), list(uninterrupted["model"])
        peaks = [group["lr"] for group in uninterrupted["optimizer"]["param_groups"]]  # each on the same schedule
        assert len(peaks) == 4 and all(peaks[depth] / peaks[depth + 1] == pytest.approx(0.5) for depth in range(3))
        saved = tmp_path / "own" / "checkpoints0" / f"step-{steps}.pt"
        exported = run([sys.executable, "-m", "shape_lora.export", str(saved), str(tmp_path / "merged.pt")],
                       cwd=project)
        assert exported.returncode == 0 and "in the form TASK's export_weights makes" in exported.stdout, \
            exported.stderr
        compared = run([sys.executable, "-c", MERGED_LORA_COMPUTES_WHAT_THE_ADAPTERS_DO, str(saved),
                        str(tmp_path / "merged.pt")], cwd=project)
        assert compared.returncode == 0, compared.stderr[-3000:]
        merged_gap, trained = map(float, compared.stdout.split())
        assert merged_gap < 1e-5 and trained > 1e-3, (merged_gap, trained)  # adapters that moved, merged exactly
    else:  # the frozen teacher in no checkpoint and no optimizer; the student's every parameter in both
        assert "0.01 M trained; frozen: teacher; not saved (the model builder makes them each run): teacher" \
            in output
        assert all(key.startswith("student.") for key in uninterrupted["model"]), list(uninterrupted["model"])
        assert len(uninterrupted["optimizer"]["state"]) == len(uninterrupted["model"])
        # In the teacher's place, a fingerprint of its weights: a teacher file replaced under the same path stops
        # the resume with one line (one plain process each), or goes on with --resume-changed-state.
        made = run([sys.executable, "-c", "import torch; from types import SimpleNamespace as N; "
                    "from shape_distilled.task import small_cnn\nfor name in ('teacher.pt', 'other.pt'): "
                    "torch.save(small_cnn(N(task=N(num_classes=10)), None).state_dict(), name)"], cwd=project)
        assert made.returncode == 0, made.stderr

        def resume(max_steps: int, *more: str) -> subprocess.CompletedProcess:
            return run([sys.executable, "train.py", *smoke_test_args(project), "--teacher", "teacher.pt", *flags(
                ckpt_dir=tmp_path / "teacher", max_steps=max_steps, ckpt_every=2), *more], cwd=project)
        assert resume(2).returncode == 0
        shutil.copy(project / "other.pt", project / "teacher.pt")
        refused = resume(4)
        line = ("the modules checkpoints leave out (teacher) hold other weights than the run that wrote this "
                "checkpoint had: the model builder made them from other contents (a weights file changed under the "
                "same path?)")
        assert refused.returncode == 1 and refused.stderr.splitlines()[-1] == (
            f"error: {line}; resume with the same files, or pass --resume-changed-state to go on with these"), \
            refused.stderr[-3000:]
        went_on = resume(4, "--resume-changed-state")
        assert went_on.returncode == 0 and f"--resume-changed-state: {line}; going on with them" in went_on.stderr


@pytest.mark.slow
def test_a_contrastive_loss_logs_its_temperature_keeps_its_clamp_and_says_what_its_batch_becomes(bake, tmp_path):
    """examples/contrastive: an in-batch loss over every rank's features (gathered with their gradients), a learned
    temperature logged beside the loss (step.log) and clamped after each step (after_step), under DDP and FSDP2
    (under DDP killed by kill -9 and resumed bitwise), and what --grad-accum and a resize do to the batch it
    contrasts, said."""
    project = bake(project_name="Contrastive")
    apply_example(project, "contrastive")
    task = project / "contrastive" / "task.py"  # started above the clamp's bound: after_step brings it down
    task.write_text(task.read_text().replace("math.log(1 / 0.07)))", "math.log(100) + 1))"))
    args = [*smoke_test_args(project), *flags(grad_accum=2, max_steps=24, ckpt_every=8, log_every=4)]

    ddp = run_job(project, [*args, *flags(ckpt_dir=tmp_path / "ddp", log_dir=tmp_path / "logs")])
    assert ddp.returncode == 0, ddp.stderr[-4000:]
    assert ("the loss couples the samples of a batch (Task.loss_couples='global_batch'): a step of --grad-accum 2 is "
            "2 batches of 32 samples each coupled alone, not one of 64") in ddp.stderr, ddp.stderr[-4000:]
    assert ("logged beside the loss, each a mean over ranks and the steps since the previous line: temperature"
            in ddp.stderr)
    assert re.search(r"step 24 \| epoch \d+ \| loss [\d.]+ \| temperature 0\.01\d* \| grad norm", ddp.stderr)
    rows = [row for row in metric_rows(tmp_path / "logs") if row["kind"] == "train"]
    assert [row["step"] for row in rows] == [4, 8, 12, 16, 20, 24]
    assert rows[0]["temperature"] < 0.009 and all(row["temperature"] > 0.01 - 1e-7 for row in rows[1:]), rows

    import torch

    bound = torch.tensor(math.log(100)).item()  # as a float32
    assert all(checkpoint(tmp_path / "ddp", step)["model"]["logit_scale"].item() <= bound for step in (16, 24))
    final = checkpoint(tmp_path / "ddp", 24)
    killed = start_job(project, [*args, *flags(ckpt_dir=tmp_path / "killed")], max_restarts=1)
    kill_a_worker_and_finish(killed, tmp_path / "killed" / "step-8.pt")
    resumed = checkpoint(tmp_path / "killed", 24)
    for state in (resumed, final):
        state["options"].pop("ckpt_dir"), state["options"].pop("log_dir")
    assert_same(resumed, final)
    assert_the_readme_rebuilds_the_trained_model(project, tmp_path / "ddp", 24, tmp_path)
    # FSDP2: the gathered features, the temperature (a 1-element parameter, sharded) and its clamp as under DDP,
    # up to the order of additions (its gradient norm for --clip-grad is summed shard by shard).
    fsdp2 = run_job(project, [*args, *flags(ckpt_dir=tmp_path / "fsdp2", strategy="fsdp2")])
    assert fsdp2.returncode == 0, fsdp2.stderr[-4000:]
    sharded = checkpoint_state(tmp_path / "fsdp2", 24, tmp_path)["model"]
    assert sharded["logit_scale"].item() <= bound
    for name, tensor in final["model"].items():
        assert (sharded[name] - tensor).abs().max() < 1e-5, name

    # One rank resumes the 2-rank job from step 16: its loss now contrasts 16 samples, not 32. Refused where the
    # task keeps its coupled batch, naming the --batch-size that keeps it; else said, and trained.
    (tmp_path / "ddp" / "step-24.pt").unlink()
    keeping = with_task_code(project, tmp_path / "keeping", "\nimport dataclasses\n\n"
                             "TASK = dataclasses.replace(TASK, keep_coupled_batch=True)\n")
    line = ("the loss couples the samples of every rank (Task.loss_couples='global_batch'): 32 samples before (2 "
            "ranks), 16 now (1 x --batch-size 16), which changes the loss; --batch-size 32 keeps it")
    refused = run([sys.executable, "train.py", *args, *flags(ckpt_dir=tmp_path / "ddp")], cwd=keeping)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert refused.stderr.splitlines()[-1] == f"error: {line} (Task.keep_coupled_batch)", refused.stderr[-3000:]
    resize = run([sys.executable, "train.py", *args, *flags(ckpt_dir=tmp_path / "ddp")], cwd=project)
    assert resize.returncode == 0 and line in resize.stderr, resize.stderr[-4000:]


def test_the_work_before_an_evaluation_is_left_out_of_the_throughput_once(baked_module, monkeypatch, caplog):
    import torch

    metrics = baked_module("engine.metrics")
    now = iter([0.0, 10.0, 30.0, 35.0])  # reset; the work from 10 s to 30 s; the evaluation's end at 35 s
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(now))
    meter = metrics.TrainingMeter(torch.device("cpu"), 10, None, None)
    with meter.excluded():
        pass
    with caplog.at_level("INFO"):
        meter.log_evaluation(10, 1, {"loss": 1.0, "correct": 3, "samples": 4}, "epoch")
    assert meter.paused == 25.0  # 20 s of work, then 5 s of evaluation: the work once, not again in the evaluation
    # A count as itself, and what the evaluation closes.
    assert caplog.messages == ["step 10 | epoch 1 | eval loss 1.0000 | correct 3 on 4 held-out samples (closing an "
                               "epoch)"]


def test_what_a_coupled_batch_becomes_is_said_and_step_log_takes_one_number_per_name(baked_module, caplog):
    import torch
    from torch import nn

    optim, errors = baked_module("engine.optim"), baked_module("engine.errors")
    options = SimpleNamespace(batch_size=16, grad_accum=4)
    with caplog.at_level("INFO"):  # BatchNorm is found: each micro-batch is normalised alone
        optim.check_coupled_batch(None, False, nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), options, 2, None)
    assert ("the loss couples the samples of a batch (BatchNorm): a step of --grad-accum 4 is 4 batches of 16 samples "
            "each coupled alone, not one of 64") in caplog.text
    synced = nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4))  # every rank's batch together; 2 -> 3 ranks
    optim.check_coupled_batch(None, False, synced, options, 3, (2, {"batch_size": 16}))
    assert ("the loss couples the samples of every rank (SyncBatchNorm): 32 samples before (2 ranks), 48 now (3 x "
            "--batch-size 16), which changes the loss; no --batch-size keeps it on 3 ranks") in caplog.text
    with pytest.raises(errors.UsageError, match=r"--batch-size 8 keeps it \(Task.keep_coupled_batch\)$"):
        optim.check_coupled_batch("global_batch", True, nn.Linear(1, 1), options, 4, (2, {"batch_size": 16}))

    with pytest.raises(errors.UsageError, match=r"find_unused_parameters=True\) is DDP's: under FSDP2"):
        baked_module("engine.parallel").wrap_model(nn.Linear(2, 1), torch.device("cpu"), "fsdp2",
                                                   find_unused_parameters=True)

    model = nn.Linear(2, 1)
    step = baked_module("step").Step(SimpleNamespace(model=model), model, torch.optim.SGD(model.parameters()), None,
                                     options, None, None)
    step.log(temperature=torch.tensor([0.5]), aux=1.0)
    step.log(temperature=0.25, aux=torch.tensor(3.0))  # a second micro-batch: each name's mean
    assert {name: value.item() for name, value in step.logged_means().items()} == {"temperature": 0.375, "aux": 2.0}
    with pytest.raises(errors.UsageError, match="'lr' is a column the loop logs itself"):
        step.log(lr=0.1)
    with pytest.raises(errors.UsageError, match=r"logs one number, got a tensor of shape \[2\]"):
        step.log(features=torch.zeros(2))


@pytest.mark.slow
def test_a_mixture_of_experts_trains_with_unused_experts_counts_their_shares_and_resumes_bitwise(bake, tmp_path):
    """examples/mixture-of-experts: top-1 routing leaves experts without a gradient on some steps and ranks
    (Task.find_unused_parameters); the held-out shares per expert are whole-set sums; a kill -9 resumes bitwise."""
    project = bake(project_name="Mixture")
    apply_example(project, "mixture-of-experts")
    args = [*smoke_test_args(project), *flags(max_steps=24, ckpt_every=8)]
    uninterrupted = run_job(project, [*args, *flags(ckpt_dir=tmp_path / "uninterrupted")])
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    assert "step 1: every rank holds the same parameters" in uninterrupted.stderr
    shares = re.findall(r"\| eval loss [\d.]+ \| accuracy [\d.]+ \| expert_0 ([\d.]+) \| expert_1 ([\d.]+) \| "
                        r"expert_2 ([\d.]+) \| expert_3 ([\d.]+) on 128 held-out samples", uninterrupted.stderr)
    assert shares and all(sum(map(float, row)) == pytest.approx(1, abs=2e-4) for row in shares), uninterrupted.stderr
    killed = start_job(project, [*args, *flags(ckpt_dir=tmp_path / "killed")], max_restarts=1)
    kill_a_worker_and_finish(killed, tmp_path / "killed" / "step-8.pt")
    expected, resumed = checkpoint(tmp_path / "uninterrupted", 24), checkpoint(tmp_path / "killed", 24)
    for state in (expected, resumed):
        state["options"].pop("ckpt_dir")
    assert_same(resumed, expected)
    assert_the_readme_rebuilds_the_trained_model(project, tmp_path / "uninterrupted", 24, tmp_path)


def test_a_tasks_batches_go_to_the_ranks_in_turn_and_resume_at_a_whole_batch(baked_module, monkeypatch):
    import torch

    data, errors = baked_module("engine.data"), baked_module("engine.errors")
    made = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15], [16]]  # 17 samples, 8 batches
    task_options = SimpleNamespace(max_length=64)

    def sampler(rank: int, world_size: int) -> object:
        options = SimpleNamespace(grad_accum=2, task=task_options)
        return data.TaskBatches(lambda dataset, options, epoch: made, None, options,
                                SimpleNamespace(rank=rank, world_size=world_size), torch.device("cpu"))
    ranks = [sampler(rank, 2) for rank in range(2)]
    for batches in ranks:
        batches.set_epoch(0)
    # A step is 2 ranks x 2 micro-batches: two whole steps; each rank takes every other batch.
    assert [[index for _, index in batch] for batch in ranks[1]] == [[3], [6, 7, 8, 9], [11, 12], [16]]
    assert ranks[0].samples_in_step(0) == 10 and ranks[0].samples_in_step(10) == 7
    one = sampler(0, 1)  # resumed alone after the first step (10 samples): the next batches, one rank's turn each
    one.set_epoch(0, 10)
    assert [[index for _, index in batch] for batch in one] == [[10], [11, 12], [13, 14, 15], [16]]
    with pytest.raises(errors.UsageError, match="stands 5 samples into epoch 0, between two of Task.batches'"):
        one.set_epoch(0, 5)
    # A checkpoint of other batches: refused, not resumed at a count, with the cause the resume can tell apart.
    loader = SimpleNamespace(batch_sampler=one)
    saved = data.TaskBatchLoader.state_dict(loader)
    made.reverse()
    refused = "Task.batches makes other batches for epoch 0 than the run that wrote the checkpoint, so its count "
    for change, cause in [
            (dict(world_size=2), "the checkpoint was written by 2 ranks and Task.batches depends on the world size; "
                                 "resume on 2 ranks, or make the batches without it"),
            (dict(task_options="0" * 16), "a task option changed (listed above, in the line of changed options); "),
            ({}, "state they depend on that the checkpoint does not hold (a value learnt during the run, such as a "
                 "curriculum stage: keep it in the task's state, which checkpoints save), or code they depend on ")]:
        one.cached = (-1, [], [0])
        data.TaskBatchLoader.load_state_dict(loader, {**saved, **change})
        with pytest.raises(errors.UsageError) as error:
            one.set_epoch(0, 10)
        assert str(error.value).startswith(refused) and cause in str(error.value), str(error.value)
    made.append([])
    with pytest.raises(errors.UsageError, match="made an empty batch for epoch 1"):
        one.set_epoch(1)
    made.pop()
    # What the ranks' comparison (an all-reduce of the batches' hashes) says when they differ: every cause.
    monkeypatch.setattr(data, "same_on_every_rank", lambda value, device: False)
    with pytest.raises(errors.UsageError) as error:
        one.set_epoch(1)
    assert str(error.value) == (
        "Task.batches made other batches for epoch 1 on other ranks: they depend on something each rank holds apart: "
        "a value a rank decided from its own loss or data (decide it from numbers all-reduced over the ranks), "
        "torch's global generator, which each rank seeds apart (draw from options.seed and the epoch, a "
        "torch.Generator of their own), or the rank itself; make them from what every rank shares")


def test_what_an_evaluation_draws_leaves_the_training_runs_generators_as_they_were(baked_module):
    # A diffusion model's held-out loss draws its noise from torch's generator. The start-up check evaluates one
    # batch once per launch: had it changed the generator, a resumed run would differ from an uninterrupted one.
    import dataclasses

    import torch
    from torch.utils.data import DataLoader

    evaluation, optim, task = baked_module("engine.evaluation"), baked_module("engine.optim"), baked_module("task")
    drawn = []

    def noisy_sums(model, batch):
        drawn.append(torch.randn(3))
        return task.TASK.evaluation_sums(model, batch)
    noisy = dataclasses.replace(task.TASK, evaluation_sums=noisy_sums)
    model = task.small_cnn(SimpleNamespace(task=SimpleNamespace(num_classes=10)), None)
    loader = DataLoader(task.LearnableFakeData(32, 16, 10, seed=0), batch_size=16,
                        generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    torch.manual_seed(3)
    before = torch.get_rng_state()
    results = evaluation.evaluate(model, loader, cpu, optim.MixedPrecision("fp32", cpu), noisy, max_batches=1)
    assert results["samples"] == 16 and len(drawn) == 1
    assert torch.equal(torch.get_rng_state(), before), "the evaluation's draws changed the training's generator"


def test_a_count_the_evaluation_reads_missing_from_the_tasks_dicts_is_one_line_not_a_nan(baked_module):
    # Without the throughput unit's count every evaluation was "eval loss nan on 0 held-out samples", silently.
    import dataclasses

    import torch
    from torch.utils.data import DataLoader

    evaluation, optim, task = baked_module("engine.evaluation"), baked_module("engine.optim"), baked_module("task")
    usage_error = baked_module("engine.errors").UsageError

    def sums_without_count(model, batch):
        return {name: value for name, value in task.TASK.evaluation_sums(model, batch).items() if name != "samples"}

    def summary_without_count(sums, outputs):
        return {name: value for name, value in task.TASK.summarize(sums, outputs).items() if name != "samples"}
    model = task.small_cnn(SimpleNamespace(task=SimpleNamespace(num_classes=10)), None)
    loader = DataLoader(task.LearnableFakeData(32, 16, 10, seed=0), batch_size=16)
    cpu = torch.device("cpu")
    for change, expected in [
            (dict(evaluation_sums=sums_without_count),
             "task.evaluation_sums returned no 'samples' (it returned correct, loss): the count of held-out samples "
             "in the batch, which the evaluation divides its sums by and logs; add it to the dict evaluation_sums "
             "returns in task.py"),
            (dict(summarize=summary_without_count),
             "task.summarize returned no 'samples' (it returned accuracy, loss): the count of held-out samples, "
             "logged beside the metrics; add 'samples': sums['samples'] to the dict summarize returns in task.py")]:
        with pytest.raises(usage_error) as refused:
            evaluation.evaluate(model, loader, cpu, optim.MixedPrecision("fp32", cpu),
                                dataclasses.replace(task.TASK, **change), max_batches=1)
        assert str(refused.value) == expected
    # Counts the task summed as integers reach summarize as ints (logged "correct 5", not "correct 5.0000").
    sums = evaluation.evaluate(model, loader, cpu, optim.MixedPrecision("fp32", cpu),
                               dataclasses.replace(task.TASK, summarize=lambda sums, outputs: sums), max_batches=1)
    assert type(sums["samples"]) is int and type(sums["correct"]) is int and type(sums["loss"]) is float, sums


def test_epochs_of_different_sizes_are_planned_each_by_its_own_batches(baked_module, caplog):
    # A curriculum whose epochs hold 16, 25 and 34 batches of 4 samples: the plan (the progress bar's steps, the lr
    # schedule's span and its 5 % warmup) counts each epoch's own, not epoch 0's three times, by --epochs or by
    # --max-steps (its samples, and the steps to them from a resumed place); on 2 ranks the odd epoch's last batch
    # fills no step, and that is said when the epoch starts.
    import torch

    data = baked_module("engine.data")
    sizes = [16, 25, 34]
    task_options = SimpleNamespace(max_length=64)

    def loader(world_size: int) -> object:
        sampler = data.TaskBatches(lambda dataset, options, epoch: [[4 * i + j for j in range(4)]
                                                                     for i in range(sizes[epoch])],
                                   None, SimpleNamespace(grad_accum=1, task=task_options),
                                   SimpleNamespace(rank=0, world_size=world_size), torch.device("cpu"))
        made = data.TaskBatchLoader.__new__(data.TaskBatchLoader)  # its plan alone: no DataLoader behind it
        made.batch_sampler = sampler
        return made
    two, one = loader(2), loader(1)
    assert two.samples_in_epochs(3) == one.samples_in_epochs(3) == 4 * (16 + 25 + 34)  # at any world size
    assert two.steps_in_epochs(3) == 8 + 12 + 17 and one.steps_in_epochs(3) == 75
    assert two.samples_in_steps(10) == 80 and two.samples_in_steps(21) == 64 + 96 + 8  # across epoch 0's end
    start = SimpleNamespace(epoch=0, samples_in_epoch=0, samples_seen=0)
    assert two.steps_to(290, start) == 37 and one.steps_to(290, start) == 73
    resumed = SimpleNamespace(epoch=1, samples_in_epoch=40, samples_seen=104)  # 10 of epoch 1's 25 batches
    assert two.steps_to(160, resumed) == 7  # its 15 batches left: 7 whole steps
    with caplog.at_level("INFO"):
        two.batch_sampler.set_epoch(0)
        two.batch_sampler.set_epoch(1)
        two.batch_sampler.set_epoch(1, samples_in_epoch=40)  # a resume in it: said at its start already
    assert caplog.messages == ["epoch 1: Task.batches' last 1 batch(es) (4 samples) fill no whole step of 2 ranks x "
                               "--grad-accum 1 and are not trained (a multiple of 2 batches trains them all)"]


def test_a_dataset_with_set_epoch_is_told_each_samples_epoch_in_the_workers_that_load_it(baked_module):
    # A curriculum or an augmentation's strength by epoch: the sampler's keys carry the epoch to the worker that
    # loads the sample, persistent or not, with no module global and nothing stale.
    from torch.utils.data import DataLoader, Dataset

    data = baked_module("engine.data")

    class EpochAware(Dataset):
        epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> tuple[int, int]:
            return self.epoch, index

    dataset = data.SeededSampleDataset(EpochAware(), seed=0)
    keys = [[(0, 1), (0, 2)]]
    loader = DataLoader(dataset, batch_sampler=keys, num_workers=1, persistent_workers=True)
    assert [batch[0].tolist() for batch in loader] == [[0, 0]]
    keys[0] = [(3, 1), (3, 2)]  # the next epoch, in the same (persistent) worker
    assert [batch[0].tolist() for batch in loader] == [[3, 3]]


def test_rank_0_work_every_names_a_number_or_an_int_task_option(baked_module):
    # Task.rank_0_work's N: a number Task() checks, or a TaskOptions field whose value each run checks (0: never).
    import dataclasses

    task, usage_error = baked_module("task").TASK, baked_module("engine.errors").UsageError
    tasks = baked_module("engine.tasks")

    def spec(work):  # the task's own checks of its options left out: these options hold only what is named here
        return dataclasses.replace(task, rank_0_work=None if work is None else (work, print),
                                   check_options=lambda options: None)

    def options(**fields):
        return SimpleNamespace(task=SimpleNamespace(data="fake", model="small_cnn", **fields))
    for work, fields, every in [(None, {}, 0), (4, {}, 4), ("sample_every", {"sample_every": 3}, 3),
                                ("sample_every", {"sample_every": 0}, 0)]:
        tasks.check_task_options(spec(work), options(**fields))
        assert tasks.work_every(spec(work), options(**fields)) == every
    for fields, held in [({}, "None"), ({"sample_every": "x"}, "'x'")]:  # the task's code
        with pytest.raises(usage_error) as refused:
            tasks.check_task_options(spec("sample_every"), options(**fields))
        assert str(refused.value) == (f"Task(rank_0_work=('sample_every', ...)) names a TaskOptions field for its "
                                      f"steps; it holds {held}: give it an int option, >= 1 (0: never)")
    with pytest.raises(usage_error) as refused:  # the user's flag
        tasks.check_task_options(spec("sample_every"), options(sample_every=-1))
    assert str(refused.value) == "--sample-every must be >= 0 (0: never), got -1"


def test_each_lr_schedule_follows_its_flags_and_an_lr_set_elsewhere_is_said(baked_module, caplog):
    import torch

    optim = baked_module("engine.optim")
    curve = optim.warmup_then_decay
    # 1,000 samples, 100 of warmup: wsd holds 1 until the last --decay-fraction 0.2 (sample 800), then a line to 0.
    assert [curve(s, 100, 1000, "wsd", 0.2) for s in (50, 100, 799, 800, 900, 1000)] == [0.5, 1, 1, 1, 0.5, 0]
    assert [curve(s, 100, 1000, "linear") for s in (100, 550, 1000)] == [1, 0.5, 0]
    assert curve(550, 100, 1000, "cosine") == pytest.approx(0.5) and curve(900, 100, 1000, "constant") == 1
    options = SimpleNamespace(lr=0.1, lr_schedule="constant", decay_fraction=0.2, max_steps=10, epochs=1,
                              warmup_steps=0)
    loader = SimpleNamespace(samples_per_step=8, samples_in_steps=lambda steps: steps * 8)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = optim.LearningRateSchedule(optimizer, options, loader)
    schedule.scale = 0.5  # Task.after_evaluation's lr_scale
    with caplog.at_level("INFO"):
        assert schedule.set_lr(4) == 0.05 and optimizer.param_groups[0]["lr"] == 0.05
        optimizer.param_groups[0]["lr"] = 0.3  # a task's own rule, which the schedule would undo unsaid
        schedule.set_lr(12)
        optimizer.param_groups[0]["lr"] = 0.3
        schedule.set_lr(20)
    assert caplog.messages == ["param group 0's lr was set to 0.3 outside the lr schedule, which sets it again at "
                               "every step; scale it from Task.after_evaluation (its lr_scale), or choose "
                               "--lr-schedule"]


def test_batches_in_order_are_told_the_world_size_and_each_rank_reads_its_own_part_in_order(baked_module):
    # Task.batches with a world_size parameter: rank r's contiguous part of 16 samples, one a step (a stream
    # carried across steps, BPTT's way); global batch j goes to rank j % world_size.
    import torch

    data = baked_module("engine.data")

    def in_order(dataset, options, epoch, world_size):
        part = len(dataset) // world_size
        return [[rank * part + chunk] for chunk in range(part) for rank in range(world_size)]
    for world_size in (1, 2):
        read = []
        for rank in range(world_size):
            sampler = data.TaskBatches(in_order, list(range(16)), SimpleNamespace(grad_accum=1, task=None),
                                       SimpleNamespace(rank=rank, world_size=world_size), torch.device("cpu"))
            sampler.set_epoch(0)
            read.append([index for batch in sampler for _, index in batch])
        part = 16 // world_size
        assert read == [list(range(part * rank, part * (rank + 1))) for rank in range(world_size)]


def test_a_finished_run_resized_past_its_end_by_less_than_a_step_is_finished_not_refused(baked_module):
    # 1 rank of 8 a step, then 2 ranks of 16 (24 samples a step on 3): a run of 100 samples ends at 112 there.
    optim = baked_module("engine.optim")
    loader = SimpleNamespace(samples_per_step=16, steps_to=lambda samples, progress: 0, steps_in_epochs=None)
    options = SimpleNamespace(max_steps=12, stop_at_step=None, epochs=1)
    schedule = SimpleNamespace(run_samples=100, replanned="")
    finished = SimpleNamespace(step=9, samples_seen=112)
    assert optim.planned_steps(options, loader, finished, schedule) == 9
    with pytest.raises(Exception, match=r"--max-steps 12 ends the run before the 10 steps the checkpoint already "
                                        r"holds; pass --max-steps 14 or more"):
        optim.planned_steps(options, loader, SimpleNamespace(step=10, samples_seen=116), schedule)
