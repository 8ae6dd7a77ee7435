"""task.py is the one file a user edits: the README's regression diff applies to a baked project, trains on a CSV
on 2 ranks and leaves the project's own smoke tests passing; names say where to register them; a bug in the
evaluation path shows before the first step; a usage error is printed once per job and torchrun does not
restart it."""

from __future__ import annotations

import os
import random
import re
import shutil
import time
from pathlib import Path

import pytest
from helpers import (
    assert_bitwise_equal,
    assert_project_tests_pass,
    checkpoint,
    flags,
    free_port,
    kill_a_worker_and_finish,
    metric_rows,
    readme_block,
    run,
    run_job,
    smoke_test_args,
    start_job,
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
def test_readme_regression_diff_is_the_whole_change(bake, tmp_path):
    project = bake(project_name="House Prices")
    (tmp_path / "regression.diff").write_text(readme_block(project, "diff"))
    patched = run(["patch", "-p1", "-i", str(tmp_path / "regression.diff")], cwd=project)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    assert "house_prices/task.py" in patched.stdout, "one file changes"
    lint = run(["ruff", "check", "."], cwd=project)
    assert lint.returncode == 0, lint.stdout

    (project / "tables").mkdir()
    write_table(project / "tables" / "train.csv", 600, seed=0)
    write_table(project / "tables" / "val.csv", 150, seed=1)
    command = next(line for line in readme_block(project, "bash").splitlines() if "./run_node.sh" in line)
    result = run(["bash", "-c", command], cwd=project)  # exactly as the README has it
    assert result.returncode == 0, result.stderr[-4000:]
    evaluations = re.findall(r"eval loss ([\d.]+) \| mean_absolute_error ([\d.]+) on 150 held-out samples",
                             result.stderr)
    assert len(evaluations) == 20, result.stderr  # one per epoch, every held-out row counted once
    assert float(evaluations[-1][1]) < 0.2 < float(evaluations[0][1]), evaluations

    assert_project_tests_pass(project)


def test_an_unknown_name_says_which_file_and_function_to_edit(default_project, tmp_path):
    # A process of its own: the whole of stderr is this one line, with nothing before it (a warning, say).
    result = run(["python", "train.py", "--data", "csv", "--ckpt-dir", str(tmp_path)], cwd=default_project)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: --data 'csv' is not in the task's datasets; known: cifar10, fake, imagefolder. To add it, write a "
        "builder and add 'csv': <builder> to TASK's datasets in ddp_training/task.py"], result.stderr


@pytest.mark.slow
def test_a_bug_in_evaluation_shows_before_the_first_step(default_project, tmp_path):
    project = shutil.copytree(default_project, tmp_path / "project")
    task = project / "ddp_training" / "task.py"
    task.write_text(task.read_text().replace('sums["correct"]', 'sums["corect"]'))  # a typo a user might make
    result = run_job(project, tiny_run(num_workers=0, ckpt_dir=tmp_path), nproc=1)
    assert result.returncode != 0
    assert "KeyError: 'corect'" in result.stderr, result.stderr[-3000:]
    assert "| loss " not in result.stderr, "no training step before the evaluation path has run once"


@pytest.mark.slow
def test_a_usage_error_is_printed_once_per_job_and_its_retries_are_silent(default_project, tmp_path):
    # torchrun as PID 1 of a pid namespace, as in a Kubernetes pod, where a signal from a child is ignored: the
    # job must not depend on ending its launcher. Both attempts fail (exit 1, not 137: a killed job would be
    # requeued), and only the first says why, once, also to the file train.sbatch reads.
    as_pid_1 = ("unshare", "--pid", "--fork", "--mount-proc") if os.geteuid() == 0 else ()
    result = run_job(default_project, ["--model", "nope", "--ckpt-dir", str(tmp_path)], max_restarts=1,
                     prefix=as_pid_1, STOP_REQUEUE_FILE=str(tmp_path / "stop-requeue"))
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith("error: --model 'nope' is not in the task's models"), output
    assert len(re.findall(r"failed \(exitcode: 1\) local_rank: \d", output)) == 2, output  # the retry ran
    assert (tmp_path / "stop-requeue").read_text() == ours[0] + "\n"
    assert not (tmp_path / ".crashes").exists(), "a usage error is not a crash to compare with the next"


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
    [line] = [line for line in result.stderr.splitlines() if "eval loss" in line]
    metrics = dict(re.findall(r"(\w+) ([\d.]+)", line.split("eval ", 1)[1]))
    assert line.endswith("on 129 held-out samples") and float(metrics["confusion_total"]) == 129, line
    assert metrics["confusion_accuracy"] == metrics["accuracy"], line


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
    assert_bitwise_equal(resumed, expected)
    assert resumed["cpu_rng_states"] == expected["cpu_rng_states"]
    rows = metric_rows(tmp_path / "logs")
    losses = [row["loss"] for row in rows if row["kind"] == "train"]
    assert losses[-1] < 0.7 * losses[0], losses  # the smoke tests' own bar: learnable in a few dozen steps
    return rows


def apply_readme_example(project: Path, tmp_path: Path, section: str) -> None:
    (tmp_path / "example.diff").write_text(readme_block(project, "diff", section))
    patched = run(["patch", "-p1", "-i", str(tmp_path / "example.diff")], cwd=project)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    assert patched.stdout.split() == ["patching", "file", f"{project.name.replace('-', '_')}/task.py"], \
        "one file changes"
    lint = run(["ruff", "check", "."], cwd=project)
    assert lint.returncode == 0, lint.stdout


@pytest.mark.slow
@pytest.mark.starts_first  # two launches, one with a restart: among the longest
def test_readme_dict_batch_example_trains_resumes_and_counts_words(bake, tmp_path):
    project = bake(project_name="Word Tags")
    apply_readme_example(project, tmp_path, "### Dict batches of many lengths")
    assert "--data tagged --fake-samples 512 --batch-size 16 --model tagger" in " ".join(smoke_test_args(project))
    rows = trains_learns_and_resumes_bitwise_after_kill_9(project, tmp_path, *flags(log_every=8, max_steps=24))
    evaluation = [row for row in rows if row["kind"] == "eval"][0]  # after epoch 0
    assert evaluation["accuracy"] > 0.6 and 500 < evaluation["tokens"] < 128 * 12, evaluation  # words, no padding
    assert all("tokens_per_sec" in row for row in rows if row["kind"] == "train")


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
@pytest.mark.starts_first  # two launches, one with a restart: among the longest
def test_readme_whole_set_metric_example_gathers_every_row_once(bake, tmp_path):
    project = bake(project_name="Auc Check")
    apply_readme_example(project, tmp_path, "### A metric over the whole held-out set")
    task = project / "auc_check" / "task.py"
    task.write_text(task.read_text() + EVERY_ROW_ONCE)
    assert "--num-classes 2" in " ".join(smoke_test_args(project))
    # 129 held-out samples on 2 ranks: 5 batches of 16 against 4 (the short rank repeats one, uncounted); 16
    # steps an epoch.
    rows = trains_learns_and_resumes_bitwise_after_kill_9(project, tmp_path,
                                                          *flags(fake_samples=516, log_every=4, max_steps=24))
    evaluations = [row for row in rows if row["kind"] == "eval"]  # after epoch 0 and at the end
    assert len(evaluations) == 2 and all(row["samples"] == 129 and 0.5 < row["auc"] <= 1 for row in evaluations), \
        evaluations


# A bug in task code that shows on the same batch every time (here: in collate, inside a DataLoader worker).
COLLATE_BUG = '''

from torch.utils.data import default_collate


def collate(samples):
    images, labels = default_collate(samples)
    if int(labels.sum()) % 7 == 3:
        raise ValueError(f"bad batch: label sum {int(labels.sum())}")
    return images, labels


import dataclasses

TASK = dataclasses.replace(TASK, collate=collate)
'''


@pytest.mark.slow
def test_a_bug_in_task_code_is_reported_once_per_job_and_not_retrained(default_project, tmp_path):
    project = with_task_code(default_project, tmp_path, COLLATE_BUG)
    stop_requeue = tmp_path / "slurm-1.bug"
    result = run_job(project, tiny_run(num_workers=1, max_steps=100, ckpt_dir=tmp_path / "ckpt"), max_restarts=2,
                     STOP_REQUEUE_FILE=str(stop_requeue))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    ours = output.split("train.py FAILED")[0]  # torchrun's own summary follows
    assert len(re.findall(r"\[rank\d\]: Traceback", ours)) == 1, output  # one rank's, once per job
    assert ours.count("ValueError: bad batch: label sum") == 1, output
    bug_lines = [line for line in ours.splitlines() if line.startswith("error: ")]
    assert len(bug_lines) == 1 and "a bug, not a fault, so the job is not retried" in bug_lines[0], output
    assert stop_requeue.read_text() == bug_lines[0] + "\n"  # for train.sbatch: no requeue
    # Attempts 0 and 1 trained (a retry may meet a transient fault's end); 2 ended before training.
    assert [int(n) for n in re.findall(r"run_id=\S+ restart=(\d)", ours)] == [0, 1], output


@pytest.mark.slow
def test_every_machine_of_a_job_ends_at_once_on_a_known_bug(default_project, tmp_path):
    # Two 1-rank "machines" (two torchruns), one checkpoint folder: the rank that meets the bug writes the crash
    # record under its own machine's torchrun; the other's rank only loses its peer. At the attempt after the
    # bug was found, both end before training: one machine stopping alone would leave the other waiting in its
    # first collective for the 31-minute timeout.
    project = with_task_code(default_project, tmp_path, COLLATE_BUG)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start_job(project, tiny_run(num_workers=0, max_steps=100, ckpt_dir=tmp_path / "ckpt"),
                       via="run_node.sh", nproc=1, max_restarts=2, NNODES="2", RDZV_ENDPOINT=endpoint,
                       RDZV_ID="known-bug") for _ in range(2)]
    outputs = [node.communicate(timeout=400)[0] for node in nodes]
    assert all(node.returncode != 0 for node in nodes), outputs
    output = "".join(outputs)
    assert output.count("a bug, not a fault, so the job is not retried") == 1, output
    # Two attempts trained (rank 0 says so; a machine restarted because the other failed counts no restart of
    # its own), and the third ended on both machines before training.
    assert len(re.findall(r"run_id=known-bug restart=\d", output)) == 2, output


@pytest.mark.slow
def test_a_usage_error_that_one_machine_alone_sees_ends_every_machine_at_once(default_project, tmp_path):
    # Machine 1 was given another flag: before, machine 0's rank waited for it in the process group's start-up
    # until the timeout (31 minutes), while machine 1's torchrun spent its restarts. Machine 1 is started
    # late, so that machine 0 already waits for it.
    endpoint = f"127.0.0.1:{free_port()}"
    args = tiny_run(num_workers=0, max_steps=4, ckpt_dir=tmp_path / "ckpt")
    launch = dict(via="run_node.sh", nproc=1, max_restarts=2, NNODES="2", RDZV_ENDPOINT=endpoint, RDZV_ID="one-sees")
    started = time.monotonic()
    waiting = start_job(default_project, args, **launch)
    time.sleep(5)
    odd = start_job(default_project, [*args, "--batch-size", "0"], **launch)
    outputs = [node.communicate(timeout=120)[0] for node in (waiting, odd)]
    assert waiting.returncode != 0 and odd.returncode != 0, outputs
    assert time.monotonic() - started < 90, outputs
    line = "error: --batch-size must be >= 1, got 0"
    assert outputs[1].count(line) == 1, outputs[1]  # once, though its torchrun had restarts left
    assert outputs[0].count(f"{line} (found on another machine of this job)") == 1, outputs[0]
    assert "UsageError" not in outputs[0] and 'train.py", line' not in outputs[0], outputs[0]  # no worker traceback


@pytest.mark.slow
def test_a_fault_of_the_machine_that_repeats_uses_every_restart_and_lets_the_scheduler_requeue(default_project,
                                                                                              tmp_path):
    # What NCCL raises on a bad NIC, at the same batch in every attempt: torchrun restarts on the same machine,
    # where only a requeue onto another one helps. No line calls it a bug, and train.sbatch is not told to stop.
    project = with_task_code(default_project, tmp_path, COLLATE_BUG.replace(
        'raise ValueError(f"bad batch: label sum {int(labels.sum())}")',
        'raise __import__("torch").distributed.DistBackendError("NCCL error: unhandled system error")'))
    stop_requeue = tmp_path / "slurm-1.bug"
    result = run_job(project, tiny_run(num_workers=0, max_steps=100, ckpt_dir=tmp_path / "ckpt"), nproc=1,
                     max_restarts=2, STOP_REQUEUE_FILE=str(stop_requeue))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert [int(n) for n in re.findall(r"run_id=\S+ restart=(\d)", output)] == [0, 1, 2], output
    assert output.count("DistBackendError: NCCL error: unhandled system error") >= 3, output
    assert "a bug, not a fault" not in output and not stop_requeue.exists(), output


@pytest.mark.slow
def test_a_transient_exception_is_retried(default_project, tmp_path):
    # Raised once (the first attempt only): the retry trains to the end and exits 0.
    once = tmp_path / "raised"
    project = with_task_code(default_project, tmp_path, COLLATE_BUG.replace(
        "int(labels.sum()) % 7 == 3", f"int(labels.sum()) % 7 == 3 and not Path({str(once)!r}).exists()"
        f" and Path({str(once)!r}).touch() is None"))
    result = run_job(project, tiny_run(num_workers=0, ckpt_dir=tmp_path / "ckpt"), nproc=1, max_restarts=3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restart=1" in result.stderr and "a bug, not a fault" not in result.stderr
