"""Smoke tests that hold for any task in task.py: 2 CPU ranks train its tiny run (TASK.smoke_test_args, with
the files TASK.smoke_test_files makes) with a finite loss, one model on every rank and parameters that move
(and, as TASK.smoke_test_learning says, a loss that falls or a metric past a bound); a run resumed from the
middle checkpoint ends bit for bit where the uninterrupted run ended, every optimizer's state and every rank's
random generator included."""

import math
import re
import shutil

import pytest
from harness import TASK, TINY_RUN, differences, launch, saved_checkpoint, saved_state

LOSS_LINE = re.compile(r"step (\d+) \| epoch \d+ \| loss ([-+.\w]+)")
EVALUATION_LINE = re.compile(r"step \d+ \| epoch \d+ \| eval (.+) on \d+ held-out")
STEPS = TASK.smoke_test_learning[0] if TASK.smoke_test_learning else 20
HALF = STEPS // 2


@pytest.fixture(scope="module")
def task_files(tmp_path_factory) -> list[str]:
    """The flags naming the files TASK.smoke_test_files makes for the tiny run (a tiny base model), made once."""
    return TASK.smoke_test_files(tmp_path_factory.mktemp("files")) if TASK.smoke_test_files else []


def tiny_run(ckpt_dir, task_files: list[str]) -> list[str]:
    return [*TINY_RUN, *task_files, "--ckpt-dir", str(ckpt_dir), "--stop-at-step", str(STEPS), "--ckpt-every",
            str(HALF), "--log-every", "1"]


def logged_losses(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in LOSS_LINE.findall(output)}


def optimizer_states(state) -> list[dict]:
    """Every optimizer state_dict in a saved state, named or not ({"state": ..., "param_groups": ...})."""
    if isinstance(state, dict) and "state" in state and "param_groups" in state:
        return [state["state"]]
    return [found for value in state.values() for found in optimizer_states(value)] if isinstance(state, dict) else []


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, task_files):
    ckpt_dir = tmp_path_factory.mktemp("checkpoints")
    result = launch(tiny_run(ckpt_dir, task_files))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr, ckpt_dir


def test_two_ranks_train_one_model(first_run):
    output, ckpt_dir = first_run
    assert "world_size=2" in output and "backend=gloo" in output
    losses = {step: float(loss) for step, loss in logged_losses(output).items()}
    assert sorted(losses) == list(range(1, STEPS + 1)), output
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    learning = TASK.smoke_test_learning
    if learning and len(learning) == 2:  # the loss falls as far as task.py says it should
        first, last = (sum(losses[step] for step in steps) / 5 for steps in (range(1, 6), range(STEPS - 4, STEPS + 1)))
        assert last < learning[1] * first, (
            f"TASK.smoke_test_learning={learning} in task.py asks the mean loss of the last 5 of {STEPS} steps to be "
            f"below {learning[1]} x that of the first 5: it went from {first:.4f} to {last:.4f}. Set it to what your "
            f"task's loss does in TASK.smoke_test_args' run (None: no learning check); every loss: {losses}")
    elif learning:  # a metric of the run's last evaluation past a bound
        _, metric, side, bound = learning
        evaluations = EVALUATION_LINE.findall(output)
        found = dict(part.rsplit(" ", 1) for part in evaluations[-1].split(" | ")) if evaluations else {}
        assert metric in found, f"TASK.smoke_test_learning={learning} names {metric!r}; the last evaluation: {found}"
        value = float(found[metric])
        assert value > bound if side == ">" else value < bound, (
            f"TASK.smoke_test_learning={learning} in task.py asks the last evaluation's {metric} to be {side} {bound} "
            f"after {STEPS} steps: it is {value}. Set it to what your task reaches in TASK.smoke_test_args' run")
    middle, end = (saved_state(saved_checkpoint(ckpt_dir, step)) for step in (HALF, STEPS))
    if not saved_checkpoint(ckpt_dir, STEPS).is_dir():  # DDP: replicas compared bit for bit (FSDP2 shards differ)
        assert "every rank holds the same parameters" in output, output
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in end["model"]), list(end["model"])
    assert differences(end["model"], middle["model"]), "training changed no parameter"
    optimizers = optimizer_states(end["optimizer"])
    assert optimizers, "every optimizer's state is saved"  # (momentum, moments: SGD without momentum keeps none)


def test_a_resumed_run_ends_where_the_uninterrupted_one_did(first_run, task_files, tmp_path):
    output, ckpt_dir = first_run
    middle = saved_checkpoint(ckpt_dir, HALF)
    (shutil.copytree if middle.is_dir() else shutil.copy)(middle, tmp_path / middle.name)
    result = launch(tiny_run(tmp_path, task_files))
    resumed = result.stdout + result.stderr
    assert result.returncode == 0, resumed
    assert f"resuming from {tmp_path / f'step-{HALF}'}" in resumed, resumed  # step-N.pt, or step-N/ with fsdp2
    losses = logged_losses(output)
    assert logged_losses(resumed) == {step: losses[step] for step in range(HALF + 1, STEPS + 1)}, resumed
    state, expected = (saved_state(saved_checkpoint(folder, STEPS)) for folder in (tmp_path, ckpt_dir))
    state.pop("options", None), expected.pop("options", None)  # the flags, --ckpt-dir among them
    assert not differences(state, expected), differences(state, expected)
