"""How a failed attempt ends (failure.py): a usage error printed once per job, also when one machine alone
sees it, and torchrun's retries silent; a bug in task code reported once and not retrained, on every machine at
once; a fault of the machine retried to the last restart and left to the scheduler; a transient error retried."""

from __future__ import annotations

import os
import re
import time

import pytest
from helpers import free_port, run_job, start_job, tiny_run, with_task_code

pytestmark = pytest.mark.slow  # torchrun jobs: `make test-fast` leaves these out


@pytest.mark.slow
def test_a_usage_error_is_printed_once_per_job_and_its_retries_are_silent(default_project, tmp_path):
    # torchrun as PID 1 of a pid namespace, as in a Kubernetes pod, where a signal from a child is ignored: the
    # job must not depend on ending its launcher. Both attempts fail (exit 1, not 137: a killed job would be
    # requeued), and only the first says why, once (rank 0 for the job: every rank stops, none repeats it),
    # also to the file train.sbatch reads.
    as_pid_1 = ("unshare", "--pid", "--fork", "--mount-proc") if os.geteuid() == 0 else ()
    result = run_job(default_project, ["--model", "nope", "--ckpt-dir", str(tmp_path)], max_restarts=1,
                     prefix=as_pid_1, STOP_REQUEUE_FILE=str(tmp_path / "stop-requeue"))
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith("error: --model 'nope' is not in the task's models"), output
    assert "UsageError" not in output, "a usage error must not surface as a worker traceback"
    assert len(re.findall(r"failed \(exitcode: 1\) local_rank: \d", output)) == 2, output  # the retry ran
    assert (tmp_path / "stop-requeue").read_text() == ours[0] + "\n"
    assert not (tmp_path / ".crashes").exists(), "a usage error is not a crash to compare with the next"


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
def test_a_bug_in_task_code_is_reported_once_per_job_not_retrained_and_ends_every_machine_at_once(default_project,
                                                                                                   tmp_path):
    # Two 1-rank "machines" (two torchruns), one checkpoint folder; the bug is met in a DataLoader worker. The
    # rank that meets it writes the crash record under its own machine's torchrun; the other's rank only loses
    # its peer. At the attempt after the bug was found, both end before training: one machine stopping alone
    # would leave the other waiting in its first collective for the 31-minute timeout.
    project = with_task_code(default_project, tmp_path, COLLATE_BUG)
    endpoint = f"127.0.0.1:{free_port()}"
    stop_requeue = tmp_path / "slurm-1.bug"
    nodes = [start_job(project, tiny_run(num_workers=1, max_steps=100, ckpt_dir=tmp_path / "ckpt"),
                       via="run_node.sh", nproc=1, max_restarts=2, NNODES="2", RDZV_ENDPOINT=endpoint,
                       RDZV_ID="known-bug", STOP_REQUEUE_FILE=str(stop_requeue)) for _ in range(2)]
    outputs = [node.communicate(timeout=400)[0] for node in nodes]
    assert all(node.returncode != 0 for node in nodes), outputs
    output = "".join(outputs)
    ours = "".join(output.split("train.py FAILED")[0] for output in outputs)  # torchrun's own summary follows
    assert len(re.findall(r"\[rank\d\]: Traceback", ours)) == 1, output  # one rank's, once per job
    assert ours.count("ValueError: bad batch: label sum") == 1, output
    bug_lines = [line for line in ours.splitlines() if line.startswith("error: ")]
    assert len(bug_lines) == 1 and "a bug, not a fault, so the job is not retried" in bug_lines[0], output
    assert stop_requeue.read_text() == bug_lines[0] + "\n"  # for train.sbatch: no requeue
    # Attempts 0 and 1 trained (a retry may meet a transient fault's end; rank 0 says so; a machine restarted
    # because the other failed counts no restart of its own), and the third ended on both before training.
    assert len(re.findall(r"run_id=known-bug restart=\d", ours)) == 2, output


# A 0-d parameter, as reference CLIP code has (a learned temperature): FSDP2 refuses it inside torch, at start-up.
SCALAR_PARAMETER = '''

import dataclasses

_small_cnn = TASK.models["small_cnn"]


def small_cnn(*args, **kwargs):
    model = _small_cnn(*args, **kwargs)
    model.temperature = torch.nn.Parameter(torch.ones([]))
    return model


TASK = dataclasses.replace(TASK, models={**TASK.models, "small_cnn": small_cnn})
'''


@pytest.mark.slow
def test_an_error_inside_torch_at_start_up_is_reported_once_and_not_retried(default_project, tmp_path):
    # Raised in torch's files, not the project's, but before the first step and the same at each attempt:
    # retrying cannot help. Before, its traceback was printed once per restart and every restart was used.
    project = with_task_code(default_project, tmp_path, SCALAR_PARAMETER)
    result = run_job(project, [*tiny_run(num_workers=0, ckpt_dir=tmp_path / "ckpt"), "--strategy", "fsdp2"],
                     nproc=1, max_restarts=2)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    ours = output.split("train.py FAILED")[0]  # torchrun's summary repeats the last attempt's error
    assert ours.count("fully_shard doesn't support scalar parameters") == 2, output  # a traceback, and the line
    bug_lines = [line for line in ours.splitlines() if line.startswith("error: ")]
    assert len(bug_lines) == 1 and "a bug, not a fault, so the job is not retried" in bug_lines[0], output
    assert bug_lines[0].startswith("error: ValueError: fully_shard doesn't support scalar parameters"), output
    assert ours.count("[rank0]: Traceback") == 1, output  # the first attempt's; the third ends in silence
    assert len(re.findall(r"run_id=\S+ restart=\d", ours)) == 2, output


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


# One head's loss on a batch without its labels: the mean of nothing, NaN, on one rank at step 6. Its gradient is
# empty, so every gradient stays finite: only rank 1 sees it. (compute_loss's third argument says which step; it
# also gives the options and the plain model, which the edit checks.)
NAN_ON_RANK_1_AT_STEP_6 = '''

import dataclasses
import os

_compute_loss = compute_loss


def compute_loss(model, batch, step):
    assert not hasattr(step.model, "module") and step.options.task.num_classes == 10  # plain model, options
    loss = _compute_loss(model, batch, step)
    unlabelled = torch.zeros(0, device=loss.device)
    return loss + unlabelled.mean() if step.number == 6 and os.environ.get("RANK") == "1" else loss


TASK = dataclasses.replace(TASK, compute_loss=compute_loss)
'''


def test_a_nan_loss_on_one_rank_stops_every_rank_before_its_update_and_a_resume_can_skip_it(default_project,
                                                                                             tmp_path):
    project = with_task_code(default_project, tmp_path, NAN_ON_RANK_1_AT_STEP_6)
    ckpt_dir = tmp_path / "ckpt"
    args = tiny_run(num_workers=0, max_steps=10, ckpt_every=4, ckpt_dir=ckpt_dir)
    stopped = run_job(project, args, max_restarts=1)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 1, output
    assert [line for line in output.splitlines() if "not finite" in line] == [
        "error: step 6: the loss on rank 1 was not finite; stopped before its update, and the checkpoints hold "
        "only finite models. Find the cause (a batch with nothing to predict, a learning rate too high), or run "
        "the same command with --skip-nonfinite 1 to skip such steps"], output
    assert "step 5 | epoch 0" in output and "step 6 | epoch 0" not in output, output  # every rank stopped there
    assert sorted(path.name for path in ckpt_dir.glob("step-*")) == ["step-4.pt"], "the last good checkpoint kept"
    assert "restart=1" not in output, "a resume would meet the same batch: not retried"

    resumed = run_job(project, [*args, "--skip-nonfinite", "1"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming from {ckpt_dir / 'step-4.pt'}" in resumed.stderr
    assert "step 6: the loss on rank 1 was not finite; skipped on every rank (1 of --skip-nonfinite 1)" \
        in resumed.stderr
    assert "step 8: every rank holds the same parameters" not in resumed.stderr  # (only the first step logs it)
    losses = [float(loss) for loss in re.findall(r"step (?:7|8|9|10) \| epoch 0 \| loss (\S+)", resumed.stderr)]
    assert len(losses) == 4 and all(loss == loss and abs(loss) < 1e3 for loss in losses), resumed.stderr
    assert (ckpt_dir / "step-10.pt").exists()  # saved: a save refuses a model that is not finite


# Rank 0's own work (a beam search, samples) that runs past --io-timeout at step 2, every time.
RANK_0_WORK_NEVER_ENDS = '''

import dataclasses
import time

TASK = dataclasses.replace(TASK, rank_0_work=(2, lambda step, generator: time.sleep(3600)))
'''


@pytest.mark.slow
def test_a_hang_that_recurs_at_the_same_step_is_named_with_its_flag_once_and_not_retried(default_project, tmp_path):
    project = with_task_code(default_project, tmp_path, RANK_0_WORK_NEVER_ENDS)
    result = run_job(project, tiny_run(num_workers=0, ckpt_dir=tmp_path / "ckpt", io_timeout=4, step_timeout=4),
                     max_restarts=3, STOP_REQUEUE_FILE=str(tmp_path / "stop-requeue"), timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    hangs = [line for line in output.splitlines() if "HANG: " in line and "traceback" not in line]
    assert len(hangs) == 2, output[-6000:]  # the first attempt's, and the retry's that met it again
    assert hangs[0].startswith("HANG: rank(s) 0 stopped making progress (past --io-timeout 4 s). Where each rank "
                               "was: rank 0: step 2, the task's work on rank 0, not waiting"), hangs[0]
    assert hangs[0].endswith("; exiting so torchrun restarts the group from the last checkpoint."), hangs[0]
    assert hangs[1].startswith("error: HANG: rank(s) 0 stopped making progress (past --io-timeout 4 s)"), hangs[1]
    assert hangs[1].endswith("; the same hang as the previous attempt, at the same step and phase from the same "
                             "checkpoint: it recurs, so torchrun does not retry it; if that work needs longer, raise "
                             "--io-timeout (now 4 s)"), hangs[1]
    assert not (tmp_path / "stop-requeue").exists(), "a requeue, maybe on other machines, may still try"
    # Two attempts trained; the next ones ended at once, and the log kept a few frames of each stack.
    assert output.count("world_size=2") == 2 and len(re.findall(r"failed \(exitcode", output)) >= 3, output[-4000:]
    run_id = re.search(r"run_id=(\S+)", output)[1]
    assert "time.sleep(3600)" in (project / "hang-reports" / run_id / "stack-rank-0.txt").read_text()
    assert len(output.splitlines()) < 150, output
