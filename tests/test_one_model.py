"""One model across ranks: nothing the template chooses stops DDP's gradient sync without an error, and a job
whose ranks hold different parameters is stopped with one line (the replica check at the first step of a run
and before every save)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from helpers import checkpoint, run_job, tiny_run, with_task_code

pytestmark = pytest.mark.slow  # torchrun jobs: `make test-fast` leaves these out

# A model whose forward returns a plain dataclass, as hand-written models and older Hugging Face-style code do.
# DDP cannot look into it (it is no registered pytree node): with static_graph=True, DDP then never all-reduces
# a gradient (pytorch/pytorch#106690), and each rank trains a model of its own.
DATACLASS_OUTPUT = '''

import dataclasses


@dataclasses.dataclass
class ClassifierOutput:
    logits: torch.Tensor


class ReturnsDataclass(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, images: torch.Tensor) -> ClassifierOutput:
        return ClassifierOutput(self.inner(images))


def dataclass_cnn(options, train_set):
    return ReturnsDataclass(small_cnn(options, train_set))


def compute_loss(model, batch, step):
    images, labels = batch
    output = model(images)
    return F.cross_entropy(getattr(output, "logits", output).float(), labels)


import dataclasses

TASK = dataclasses.replace(TASK, models={**TASK.models, "dataclass_cnn": dataclass_cnn}, compute_loss=compute_loss)
'''

# Code that depends on the rank and writes to a parameter outside the optimizer: DDP cannot see it.
RANK_DEPENDENT = '''

import torch.distributed as dist


class NudgedOnRankOne(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.training and dist.get_rank() == 1:
            with torch.no_grad():
                self.inner[-1].bias.add_(1e-3)  # e.g. a hand-rolled running statistic kept in a parameter
        return self.inner(images)


def nudged_cnn(options, train_set):
    return NudgedOnRankOne(small_cnn(options, train_set))


import dataclasses

TASK = dataclasses.replace(TASK, models={**TASK.models, "nudged_cnn": nudged_cnn})
'''

# A branch taken on every other training forward (a mixture of experts' expert that gets no token, a conditional
# head): at step 1 no rank gives `extra` a gradient, so DDP never all-reduces the bucket it shares.
UNUSED_AT_STEP_1 = '''

class SometimesExtra(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.extra, self.forwards = inner, nn.Linear(10, 10), 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.forwards += self.training
        logits = self.inner(images)
        return logits + self.extra(logits) if self.training and self.forwards % 2 == 0 else logits


def sometimes_extra_cnn(options, train_set):
    return SometimesExtra(small_cnn(options, train_set))


import dataclasses

TASK = dataclasses.replace(TASK, models={**TASK.models, "sometimes_extra_cnn": sometimes_extra_cnn})
'''


def torchrun(project: Path, ckpt_dir: Path, model: str, **launch: object):
    """2 ranks, 6 steps on 256 fake samples, a checkpoint every 3 steps, no evaluation."""
    return run_job(project, tiny_run(model=model, fake_samples=256, num_workers=0, max_steps=6, ckpt_every=3,
                                     eval_every=0, ckpt_dir=ckpt_dir), **launch)


def test_a_model_returning_a_dataclass_trains_one_model_on_every_rank(default_project, uninterrupted_bare, tmp_path):
    project = with_task_code(default_project, tmp_path, DATACLASS_OUTPUT)
    # The session reference's run (small_cnn, returning a tensor) with the dataclass-returning copy of the model.
    result = run_job(project, tiny_run(model="dataclass_cnn", num_workers=0, stop_at_step=8, eval_every=0,
                                       ckpt_dir=tmp_path / "ckpt"))  # the example leaves evaluation alone
    assert result.returncode == 0, result.stderr[-4000:]
    assert "step 1: every rank holds the same parameters" in result.stderr, result.stderr[-4000:]
    # The same samples through a tensor-returning copy of the model: the same weights, so gradients were synced.
    trained, expected = checkpoint(tmp_path / "ckpt", 8)["model"], checkpoint(uninterrupted_bare, 8)["model"]
    assert [name.removeprefix("inner.") for name in trained] == list(expected)
    for name, tensor in expected.items():
        assert (trained[f"inner.{name}"] - tensor).abs().max() < 1e-6, name


def test_ranks_that_hold_different_models_stop_the_job_with_one_line(default_project, tmp_path):
    project = with_task_code(default_project, tmp_path, RANK_DEPENDENT)
    result = torchrun(project, tmp_path / "ckpt", "nudged_cnn")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    host = socket.gethostname()
    assert errors == [  # two ranks: no majority to say which one is right, so it is the code's to fix
        "error: the ranks hold different models after step 1: parameter 'inner.5.bias' differs (and 0 more of "
        f"14); 2 different models, held by rank 0 ({host}) | rank 1 ({host}). DDP did not all-reduce every "
        "gradient, or something changed parameters outside the optimizer: the loss ran the plain model "
        "(step.model) or a method other than forward (DDP syncs gradients only through forward), a forward whose "
        "output DDP cannot look into (a dataclass not registered with torch.utils._pytree), code that depends on "
        "the rank, or an in-place update of a parameter; fix the model or loss in task.py"
    ], result.stderr[-4000:]
    assert not list((tmp_path / "ckpt").glob("step-*.pt")), "no checkpoint of one rank's model is written"


def test_one_rank_whose_model_differs_from_all_the_others_is_a_fault_of_its_machine(default_project, tmp_path):
    # Rank 1 of 3 against ranks 0 and 2, as a flipped bit on one GPU would make it: no bug to fix, so every
    # torchrun restart is used and the job exits non-zero with nothing in STOP_REQUEUE_FILE, for a requeue.
    project = with_task_code(default_project, tmp_path, RANK_DEPENDENT)
    requeue = tmp_path / "stop-requeue"
    result = torchrun(project, tmp_path / "ckpt", "nudged_cnn", nproc=3, max_restarts=1,
                      STOP_REQUEUE_FILE=str(requeue))
    assert result.returncode != 0
    host = socket.gethostname()
    found = (f"rank 1 on {host} holds parameters that differ from those of the other 2 ranks after step 1: "
             "parameter 'inner.5.bias' differs (and 0 more of 14); 2 different models, held by ranks 0, 2 "
             f"({host}) | rank 1 ({host}). One rank out of many is a fault of its machine")
    assert f"ReplicaCorrupted: {found}" in result.stderr, result.stderr[-6000:]
    assert "restart=0" in result.stderr and "restart=1" in result.stderr, result.stderr[-6000:]  # both attempts
    assert not requeue.exists() or not requeue.read_text(), requeue.read_text()
    assert "a bug, not a fault" not in result.stderr
    assert not list((tmp_path / "ckpt").glob("step-*.pt")), "no checkpoint of one rank's model is written"


def test_parameters_a_step_leaves_unused_are_named(default_project, tmp_path):
    # The fix the line names, find_unused_parameters=True, training one model on every rank: the mixture of
    # experts example's test (experts that some ranks leave unused on some steps; kill -9 resumed bitwise).
    project = with_task_code(default_project, tmp_path, UNUSED_AT_STEP_1)
    result = torchrun(project, tmp_path / "ckpt", "sometimes_extra_cnn")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: the ranks hold different models after step 1: step 1 left 2 trained parameter(s) without a "
        "gradient ('extra.bias', 'extra.weight'), so DDP did not all-reduce their gradient buckets; if a step may "
        "leave parameters unused (a mixture of experts, a conditional branch), give task.py's Task "
        "find_unused_parameters=True, else use them in the loss or freeze them"], result.stderr[-4000:]
