"""Training features of the generated project, with numbers: mixed precision, gradient accumulation,
clipping, the LR schedule, compile, and what a run records (metrics.jsonl, TensorBoard, progress bar)."""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    assert_trains_like_bare,
    checkpoint,
    checkpoint_state,
    kill_a_worker_and_finish,
    metric_rows,
    run,
    run_job,
    start_job,
    tiny_run,
    tool_env,
    with_task_code,
)

pytestmark = pytest.mark.slow  # torchrun jobs: `make test-fast` leaves these out

# small_cnn has no batch statistics and no dropout, so accumulated micro-batches must match a larger batch.
# 512 samples over 2 ranks of 16 per step: 16 optimizer steps an epoch.
SMALL = dict(num_workers=0, log_every=2)


def torchrun(project: Path, nproc: int, **options: object) -> subprocess.CompletedProcess:
    result = run_job(project, tiny_run(**{**SMALL, **options}), nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max((first[name] - second[name]).abs().max().item() for name in first)


@pytest.fixture(scope="module")
def batch_16_run(default_project, tmp_path_factory) -> Path:
    """6 plain steps of 16 samples per rank: what accumulated micro-batches must equal, and what a compiled
    model is compared with. The tests that use it are one xdist group, so it runs once."""
    ckpt_dir = tmp_path_factory.mktemp("batch-16")
    torchrun(default_project, 2, batch_size=16, max_steps=6, ckpt_dir=ckpt_dir)
    return ckpt_dir


@pytest.mark.xdist_group("batch_16_run")
def test_accumulated_micro_batches_equal_one_larger_batch(default_project, batch_16_run, uninterrupted_bare,
                                                          tmp_path):
    """2 micro-batches of 8 per rank (all-reduce on the second only) against 1 batch of 16, same samples."""
    accumulated = tmp_path / "accumulated"
    torchrun(default_project, 2, grad_accum=2, max_steps=6, ckpt_dir=accumulated)
    expected = checkpoint(batch_16_run, 6)["model"]
    assert max_difference(checkpoint(accumulated, 6)["model"], expected) < 1e-6
    # The same samples as 12 plain steps of 8, a different training run, which the comparison must tell apart:
    # the session's reference run is one (SMALL's settings with batch 8; loader workers and logging aside).
    assert_trains_like_bare(tiny_run(**SMALL))
    assert max_difference(checkpoint(uninterrupted_bare, 12)["model"], expected) > 1e-3


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_with_accumulation_and_clipping_learns_and_records_metrics(default_project, tmp_path,
                                                                                  precision):
    ckpt_dir, log_dir = tmp_path / "checkpoints", tmp_path / "logs"
    # 3 epochs evaluated every 2nd: after the 2nd, and at the run's end although 3 is not a multiple of 2.
    result = torchrun(default_project, 2, precision=precision, grad_accum=2, clip_grad=1.0, lr=0.05, epochs=3,
                      eval_every=2, max_steps=None, warmup_steps=2, log_every=5, ckpt_dir=ckpt_dir, log_dir=log_dir)
    assert "samples/s" in result.stderr and "data wait" in result.stderr

    rows = metric_rows(log_dir)
    train_rows = [row for row in rows if row["kind"] == "train"]
    eval_rows = [row for row in rows if row["kind"] == "eval"]
    # 3 epochs of 16 steps, every 5th, and the run's last 3 steps, in a line that says so.
    assert [(row["step"], row["steps"]) for row in train_rows] == [*((step, 5) for step in range(5, 46, 5)), (48, 3)]
    [partial] = [line for line in result.stderr.splitlines() if "| over " in line]
    assert " step 48 | " in partial and partial.endswith(" | over 3 steps"), partial
    for row in train_rows:
        assert {"loss", "lr", "samples_per_sec", "step_time_s", "data_wait_frac"} <= row.keys()
        assert row["samples_per_sec"] > 0 and 0 <= row["data_wait_frac"] < 1
    assert train_rows[-1]["loss"] < 0.7 * train_rows[0]["loss"], "loss did not fall"
    # The lr each logged step ran with, at the middle of its samples (32 a step): 2 steps (64 samples) of linear
    # warmup, then cosine from 0.05 to 0 over the 3 epochs' other 1472 samples.
    for row in train_rows:
        assert row["samples_seen"] == 32 * row["step"], row
        middle = row["samples_seen"] - 16
        expected = 0.05 * middle / 64 if middle < 64 else 0.05 * 0.5 * (1 + math.cos(math.pi * (middle - 64) / 1472))
        assert row["lr"] == pytest.approx(expected), row
    assert [(row["step"], row["samples"]) for row in eval_rows] == [(32, 128), (48, 128)]
    assert all(isinstance(row["samples"], int) for row in eval_rows), "a count is logged as one, not as 128.0"
    assert eval_rows[-1]["accuracy"] > 0.3  # 10 classes: chance is 0.1

    scalars = tensorboard_scalars(log_dir)
    assert [step for step, _ in scalars["train/loss"]] == [row["step"] for row in train_rows]
    assert scalars["eval/accuracy"][-1][1] == pytest.approx(eval_rows[-1]["accuracy"])

    state = checkpoint(ckpt_dir, 48)
    assert state["samples_seen"] == 1536  # the schedule's position, for an exact resume at any world size
    assert not state["evaluation_due"], "the run's end was evaluated before its last checkpoint"
    assert state["lr_schedule"] == {"warmup_steps": 2, "warmup_samples": 64, "spans_steps": None,
                                    "total_samples": 1536}  # the run's length: --epochs
    if precision == "fp16":
        assert state["grad_scaler"]["scale"] > 0, "the gradient scaler's state is saved for an exact resume"


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.xdist_group("batch_16_run")
def test_compiled_model_trains_like_the_eager_one(default_project, batch_16_run, tmp_path):
    compiled = tmp_path / "compiled"
    torchrun(default_project, 2, compile=True, batch_size=16, max_steps=6, ckpt_dir=compiled)
    # Compiled kernels may fuse and reorder float operations: close, not bitwise.
    assert max_difference(checkpoint(compiled, 6)["model"], checkpoint(batch_16_run, 6)["model"]) < 1e-4


def test_progress_bar_on_a_terminal_and_plain_lines_otherwise(default_project, tmp_path):
    args = [sys.executable, "train.py", *tiny_run(**SMALL, batch_size=16, max_steps=4)]
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # 30 rows, 100 columns
    terminal = [*args, "--ckpt-dir", str(tmp_path / "terminal")]
    with subprocess.Popen(terminal, cwd=default_project, env=tool_env(), stdin=subprocess.DEVNULL,
                          stdout=follower, stderr=follower) as process:
        os.close(follower)
        screen = read_until_closed(leader)
        assert process.wait(timeout=300) == 0, screen
    assert "4/4" in screen and "step/s" in screen, screen  # the tqdm bar, finished
    assert "saved" in screen, "log lines still reach the terminal, above the bar"

    piped = run([*args, "--ckpt-dir", str(tmp_path / "piped"), "--eval-every", "0"], cwd=default_project)
    assert piped.returncode == 0 and "step/s" not in piped.stderr
    assert "step 4 | epoch 0 | loss" in piped.stderr
    assert "eval loss" not in piped.stderr  # --eval-every 0


def read_until_closed(descriptor: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(descriptor, 65536)
        except OSError:  # EIO: the child side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(descriptor)
    return b"".join(chunks).decode(errors="replace")


# Each rank writes its CPU generator's state as its first step's loss is computed.
GENERATOR_AT_STEP_1 = '''

import dataclasses as _dataclasses
import os as _os

_plain_loss = compute_loss


def _recording_loss(model, batch, step):
    if step.number == 1:
        folder = _os.environ["GENERATOR_AT_STEP_1"]
        torch.save(torch.get_rng_state(), f"{folder}/rank-{_os.environ.get('RANK', '0')}.pt")
    return _plain_loss(model, batch, step)


TASK = _dataclasses.replace(TASK, compute_loss=_recording_loss)
'''

# A plain script seeded with --seed: it builds the training set and the model, then trains.
PLAIN_SCRIPT = '''
import sys
import torch
from ddp_training.engine.cli import parse_options
from ddp_training.engine.tasks import build_model
from ddp_training.options import TrainOptions
from ddp_training.task import TASK
options = parse_options(sys.argv[1:], TrainOptions, TASK.options, TASK.training_defaults)
torch.manual_seed(options.seed)
train_set, _ = TASK.datasets[options.task.data](options)
build_model(TASK, options, train_set)
torch.save(torch.get_rng_state(), "plain.pt")
'''


def test_rank_0_draws_what_a_plain_script_seeded_alike_draws_and_rank_1_its_own(default_project, tmp_path):
    # A port's dropout masks are its original's only if the generator goes on from where model building left it.
    project = with_task_code(default_project, tmp_path, GENERATOR_AT_STEP_1)
    args = tiny_run(**SMALL, max_steps=1, seed=7, ckpt_dir=tmp_path / "ckpt")
    (tmp_path / "states").mkdir()
    result = run_job(project, args, nproc=2, GENERATOR_AT_STEP_1=str(tmp_path / "states"))
    assert result.returncode == 0, result.stderr[-4000:]
    plain = run([sys.executable, "-c", PLAIN_SCRIPT, *args], cwd=tmp_path, PYTHONPATH=str(project))
    assert plain.returncode == 0, plain.stderr[-3000:]
    expected = torch.load(tmp_path / "plain.pt")
    ranks = [torch.load(tmp_path / "states" / f"rank-{rank}.pt") for rank in (0, 1)]
    assert torch.equal(ranks[0], expected)
    assert not torch.equal(ranks[1], expected)


# A rule after each evaluation (reduce on plateau's shape, here firing every time): the lr halves, and the rule
# keeps its own count and what each evaluation closed.
HALVING_RULE = '''

import dataclasses as _dataclasses


def _halve(learned, results, closes, options):
    return {"lr_scale": learned.get("lr_scale", 1.0) / 2, "closed": [*learned.get("closed", []), closes]}


TASK = _dataclasses.replace(TASK, after_evaluation=_halve)
'''


def test_a_rule_after_each_evaluation_scales_the_lr_and_survives_a_kill_9_right_after_it_fired(default_project,
                                                                                             tmp_path):
    project = with_task_code(default_project, tmp_path, HALVING_RULE)
    run_args = dict(SMALL, max_steps=16, eval_every_steps=4, lr_schedule="constant", warmup_steps=0, ckpt_every=4)
    reference = run_job(project, tiny_run(**run_args, ckpt_dir=tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-4000:]
    assert "step 4: lr_scale 0.5 from the next step on (Task.after_evaluation)" in reference.stderr
    lrs = [checkpoint(tmp_path / "reference", step)["optimizer"]["param_groups"][0]["lr"] for step in (4, 8, 12, 16)]
    assert lrs == [0.01, 0.005, 0.0025, 0.00125]  # each step of an interval at the scale its start had
    learned = checkpoint(tmp_path / "reference", 16)["learned"]
    assert json.loads(learned["values"]) == {"lr_scale": 1 / 16, "closed": ["interval"] * 4}
    # Killed after step 8's checkpoint, saved before the evaluation that halves the lr again: the resume redoes it.
    killed = start_job(project, tiny_run(**run_args, ckpt_dir=tmp_path / "killed"), max_restarts=1)
    kill_a_worker_and_finish(killed, tmp_path / "killed" / "step-8.pt")
    assert_bitwise_equal(checkpoint(tmp_path / "killed", 16), checkpoint(tmp_path / "reference", 16))
    # Under FSDP2 (a DCP folder), paused at step 10 (the pause's evaluation is not the rule's) and resumed: it
    # learns what the DDP run learnt, and ends at its lr.
    for stop_at_step in (10, None):
        sharded = run_job(project, tiny_run(**run_args, strategy="fsdp2", stop_at_step=stop_at_step,
                                            ckpt_dir=tmp_path / "fsdp2"))
        assert sharded.returncode == 0, sharded.stderr[-4000:]
    state = checkpoint_state(tmp_path / "fsdp2", 16, tmp_path)
    assert state["learned"] == learned and state["optimizer"]["param_groups"][0]["lr"] == 0.00125
