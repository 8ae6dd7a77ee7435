"""What a resume restores and what it refuses: a checkpoint that loads but does not match the code is never
skipped in silence (no restart from step 0, no retention that deletes the newest work). (That every rank
resumes its own random state: the GAN example's kill -9 test, whose ranks draw their own noise.)"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    BIN,
    assert_bitwise_equal,
    checkpoint,
    checkpoint_state,
    kill_a_worker_and_finish,
    run,
    run_job,
    start_job,
    tiny_run,
    with_task_code,
)

pytestmark = pytest.mark.slow  # torchrun jobs: `make test-fast` leaves these out


def launch(project: Path, ckpt_dir: Path, one_process: bool = False, **options: object):
    """2 ranks with the session reference's settings (no loader workers), which must succeed; or one plain
    process, where what is checked does not depend on ranks (half the processes to start)."""
    result = launch_may_fail(project, ckpt_dir, one_process, **options)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def launch_may_fail(project: Path, ckpt_dir: Path, one_process: bool = False, **options: object):
    how = {"via": "python", "nproc": 1} if one_process else {}
    return run_job(project, tiny_run(num_workers=0, ckpt_dir=ckpt_dir, **options), **how)


def edited(project: Path, relative: str, old: str, new: str) -> None:
    path = project / relative
    text = path.read_text()
    assert old in text, f"{relative} no longer holds {old!r}"
    path.write_text(text.replace(old, new, 1))


def error_lines(result) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error: ")]


def starting_at_step_4(uninterrupted_bare: Path, ckpt_dir: Path) -> Path:
    """A checkpoint folder holding the session reference's step 4, as this code wrote it."""
    ckpt_dir.mkdir()
    shutil.copy(uninterrupted_bare / "step-4.pt", ckpt_dir)
    return ckpt_dir


def test_a_checkpoint_that_loads_but_does_not_match_the_code_stops_the_job(default_project, uninterrupted_bare,
                                                                            tmp_path):
    ckpt_dir = starting_at_step_4(uninterrupted_bare, tmp_path / "ckpt")
    project = shutil.copytree(default_project, tmp_path / "project")
    # A loop edit: the optimizer registered under another name, as a user with two of them would.
    edited(project, "train.py", "model=model, optimizer=optimizer,", "model=model, backbone_optimizer=optimizer,")
    result = launch_may_fail(project, ckpt_dir, one_process=True, stop_at_step=8)
    assert result.returncode != 0
    assert error_lines(result) == [
        f"error: {ckpt_dir / 'step-4.pt'} does not hold what this code saves: this code saves backbone_optimizer, "
        "which it lacks; it holds optimizer, which this code no longer saves. Resume with the code that wrote it, "
        "or pass --resume-changed-state once to start the new entries fresh from it and drop the others"
    ], result.stderr[-3000:]
    assert "starting from scratch" not in result.stderr and "| loss " not in result.stderr
    # The lease (of whichever job is in the folder) aside, nothing deleted, nothing written.
    assert sorted(path.name for path in ckpt_dir.iterdir()) == [".lease", "step-4.pt"]


# State added to a job that already has checkpoints: a module whose buffer counts the steps (an EMA's shape).
STEP_COUNTER = ("    progress = checkpointer.resume(TrainingProgress)  # the newest checkpoint's, or a fresh one\n",
                "    progress = checkpointer.resume(TrainingProgress)\n"
                "    assert int(step_counter.count) == (0 if resumed_fresh else progress.step)\n")


def test_new_state_starts_fresh_on_request_another_lr_is_scheduled_and_retention_keeps_what_was_just_written(
        default_project, uninterrupted_bare, tmp_path):
    ckpt_dir = starting_at_step_4(uninterrupted_bare, tmp_path / "ckpt")
    (ckpt_dir / "step-12.pt").write_bytes(b"truncated by a crash")  # a corrupt file with a higher step number
    project = shutil.copytree(default_project, tmp_path / "project")
    edited(project, "train.py", "model=model, optimizer=optimizer,",
           "model=model, optimizer=optimizer, step_counter=step_counter,")
    edited(project, "train.py", "    checkpointer = build_checkpointer(",
           "    step_counter = torch.nn.Module()\n"
           "    step_counter.register_buffer('count', torch.zeros((), dtype=torch.int64))\n"
           "    resumed_fresh = options.checkpoint.resume_changed_state\n"
           "    checkpointer = build_checkpointer(")
    edited(project, "train.py", *STEP_COUNTER)
    edited(project, "train.py", "            progress.advance(", "            step_counter.count += 1\n"
                                                                  "            progress.advance(")
    # A setting a flag decides (as a user's --weight-decay would): 5e-4 at the reference's --lr 0.01.
    edited(project, "ddp_training/task.py", "momentum=0.9, weight_decay=5e-4)",
           "momentum=0.9, weight_decay=options.lr / 20)")

    refused = launch_may_fail(project, ckpt_dir, one_process=True, stop_at_step=8)
    assert refused.returncode != 0 and "this code saves step_counter, which it lacks" in refused.stderr, \
        refused.stderr[-3000:]
    assert f"skipping unreadable checkpoint {ckpt_dir / 'step-12.pt'}" in refused.stderr
    # Resumed with another --lr as well: the same schedule, twice as high.
    result = launch(project, ckpt_dir, stop_at_step=8, keep_checkpoints=1, resume_changed_state=True, lr=0.02)
    assert "--resume-changed-state: this code saves step_counter, which it lacks" in result.stderr
    assert f"resuming from {ckpt_dir / 'step-4.pt'} (step 4" in result.stderr and "--lr 0.01 -> 0.02" in result.stderr
    assert sorted(path.name for path in ckpt_dir.iterdir()) == [".lease", "config.yaml", "step-12.pt.unreadable",
                                                                "step-8.pt"]
    state = checkpoint(ckpt_dir, 8)
    reference = checkpoint(uninterrupted_bare, 8)["optimizer"]["param_groups"][0]["lr"]
    changed = state["optimizer"]["param_groups"][0]["lr"]
    assert changed == pytest.approx(2 * reference, rel=1e-12), (changed, reference)
    # The optimizer's other settings are the ones this run built, not the checkpoint's (load_state_dict restores
    # every param-group key), and the log says so.
    assert state["optimizer"]["param_groups"][0]["weight_decay"] == 0.02 / 20
    assert "the optimizer's settings are this run's, not the checkpoint's: weight_decay 0.0005 -> 0.001" \
        in result.stderr, result.stderr[-3000:]
    assert int(state["step_counter"]["count"]) == 4, "started fresh at the resumed step"
    assert state["entries"] == ["grad_scaler", "lr_schedule", "model", "optimizer", "selection", "step_counter"]
    # The next restart restores it like any other entry, without the flag (here on one rank: 2 steps of 8).
    edited(project, "train.py", *reversed(STEP_COUNTER))
    launch(project, ckpt_dir, one_process=True, stop_at_step=10)
    assert int(checkpoint(ckpt_dir, 10)["step_counter"]["count"]) == 6


def test_state_that_weights_only_loading_refuses_is_not_saved_and_stops_the_job(default_project, tmp_path):
    project = shutil.copytree(default_project, tmp_path / "project")
    # A component whose state holds a numpy scalar: torch.save writes it, torch.load(weights_only=True) refuses it.
    edited(project, "train.py", "model=model, optimizer=optimizer,", "model=model, optimizer=optimizer, "
           "best=type('Best', (), {'state_dict': lambda self: {'loss': __import__('numpy').float64(1.0)}, "
           "'load_state_dict': lambda self, state: None})(),")
    result = launch_may_fail(project, tmp_path / "ckpt", max_steps=4)
    assert result.returncode != 0
    assert error_lines(result) == [
        "error: a checkpoint state_dict() holds numpy._core.multiarray.scalar, numpy.dtype, which "
        "torch.load(weights_only=True) refuses; make each component's state_dict() hold tensors and plain Python "
        "values (e.g. float(x) for a numpy scalar)"], result.stderr[-3000:]
    assert not list((tmp_path / "ckpt").glob("*step-*")), "nothing published, no temporary left"


def test_an_exception_without_a_message_still_makes_one_line(baked_module, tmp_path):
    # A load failure, or a lost peer, whose exception says nothing: the line names its type instead.
    common, failure = baked_module("engine.checkpoint.common"), baked_module("engine.failure")
    for error in (RuntimeError(), ValueError("\n\n"), OSError("  ")):
        line = str(common.checkpoint_mismatch(tmp_path / "step-4.pt", error))
        assert line == (f"{tmp_path / 'step-4.pt'} does not fit this model or optimizer ({type(error).__name__}); "
                        "use another --ckpt-dir, or the code and options it was trained with"), line
        assert failure.first_sentence(error) == type(error).__name__


def test_a_resumed_optimizer_takes_the_settings_this_run_built_unless_it_is_not_torchs(baked_module):

    optim = baked_module("engine.optimizers")
    weights = [torch.nn.Parameter(torch.ones(3))]

    class ScheduleFree(torch.optim.AdamW):  # another package's optimizer, which may keep state in its groups
        pass

    for kind, expected in ((torch.optim.AdamW, (["weight_decay 0.5 -> 0.01"], [])),
                           (ScheduleFree, ([], ["weight_decay"]))):
        saved = kind(weights, lr=0.1, betas=(0.8, 0.9), weight_decay=0.5).state_dict()
        saved["param_groups"][0]["betas"] = [0.8, 0.9]  # a list, as DCP gives it back: the same setting
        optimizer = kind(weights, lr=0.2, betas=(0.8, 0.9), weight_decay=0.01)
        built = optim.group_settings(optimizer)
        optimizer.load_state_dict(saved)
        assert optim.take_built_settings(optimizer, built) == expected
        assert optimizer.param_groups[0]["weight_decay"] == (0.01 if kind is torch.optim.AdamW else 0.5)


def test_a_checkpoint_that_does_not_fit_says_which_keys_and_shapes_in_one_line(baked_module, tmp_path):

    common = baked_module("engine.checkpoint.common")
    saved = torch.nn.Sequential(torch.nn.Linear(4, 10), torch.nn.Linear(10, 3), torch.nn.Linear(3, 2)).state_dict()
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    try:
        model.load_state_dict(saved)
    except RuntimeError as error:
        line = str(common.checkpoint_mismatch(tmp_path / "step-4.pt", error))
    assert line == (f"{tmp_path / 'step-4.pt'} does not fit this model or optimizer (Error(s) in loading state_dict "
                    "for Sequential: 0.weight: checkpoint [10, 4] vs model [2, 4]; 0.bias: checkpoint [10] vs model "
                    "[2]; and 1 more); use another --ckpt-dir, or the code and options it was trained with"), line


def test_a_model_with_a_nan_parameter_is_never_saved(baked_module):

    common, errors = baked_module("engine.checkpoint.common"), baked_module("engine.errors")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    common.check_finite(model, 7)  # finite: nothing to say
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    with pytest.raises(errors.NonFiniteTraining, match=r"^step 7: '1.bias' of the model is not finite \(NaN or "
                                                       r"inf\); not saved, so the checkpoints hold only finite models"):
        common.check_finite(model, 7)
    with torch.no_grad():
        model[1].bias[0] = 0.0
    model.register_buffer("running_mean", torch.tensor([float("nan")]))  # a BatchNorm statistic, say
    with pytest.raises(errors.NonFiniteTraining, match="^step 7: 'running_mean' of the model is not finite"):
        common.check_finite(model, 7)


SEND_TENSOR_BY_TENSOR = """
import torch
import torch.distributed as dist
from ddp_training.engine.checkpoint.replicated import broadcast_tensor_by_tensor

dist.init_process_group("gloo")
torch.manual_seed(0)
weight = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)  # a conv weight as it trains on a GPU
state = {"model": {"conv.weight": weight, "fc.bias": torch.arange(3.0)}, "step": 7,
         "optimizer": {"state": {0: {"momentum_buffer": 2 * weight}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
received = broadcast_tensor_by_tensor(state if dist.get_rank() == 0 else None, 0, torch.device("cpu"))
assert torch.equal(received["model"]["conv.weight"], weight), "permuted"
assert torch.equal(received["optimizer"]["state"][0]["momentum_buffer"], 2 * weight), "permuted"
assert torch.equal(received["model"]["fc.bias"], torch.arange(3.0)) and received["step"] == 7
assert received["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
print(f"rank {dist.get_rank()}: the state arrived unchanged")
dist.destroy_process_group()
"""


def test_a_checkpoint_sent_tensor_by_tensor_arrives_unchanged_in_any_memory_format(default_project, tmp_path):
    # Where some machine lacks the newest checkpoint, its holder sends it one tensor at a time. A collective
    # moves bytes: a channels-last tensor (every conv weight and moment on a GPU) sent into a row-major buffer
    # arrived permuted, with the same checksum, so the replica check passed and the ranks diverged.
    script = tmp_path / "send.py"
    script.write_text(SEND_TENSOR_BY_TENSOR)
    result = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(script)], cwd=default_project,
                 OMP_NUM_THREADS="1", PYTHONPATH=str(default_project))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("the state arrived unchanged") == 2, result.stdout


# At the resumed run's 6th step (step 10, after the save of step 8 deleted the resumed step-4.pt): the lines of
# /proc/self/maps that name --ckpt-dir, a checkpoint file still mapped.
REPORT_MAPPED_CHECKPOINTS = """
import os
import sys

if sys.argv[0].endswith("train.py"):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = []

    def report_mapped_checkpoints(optimizer, args, kwargs):
        steps.append(1)
        if len(steps) == 6:
            ckpt_dir = os.path.abspath(sys.argv[sys.argv.index("--ckpt-dir") + 1])
            with open("/proc/self/maps") as maps:
                mapped = sorted({line.split(None, 5)[-1].strip() for line in maps if ckpt_dir in line})
            print(f"mapped checkpoint files at step 10: {mapped}", file=sys.stderr, flush=True)

    register_optimizer_step_post_hook(report_mapped_checkpoints)
"""


ADAMW = """

import dataclasses


def adamw(model, options):  # keeps each state["step"] on the host, as given, on any device
    return torch.optim.AdamW(model.parameters(), lr=options.lr)


TASK = dataclasses.replace(TASK, build_optimizer=adamw)
"""


def test_nothing_of_the_resumed_file_stays_mapped(default_project, tmp_path):
    # Every device loads the same way: the file mapped, then each component's own copy (AdamW keeps what it is
    # given where device and dtype already match: each state["step"] on GPU, every moment on CPU). The resumed
    # step-4.pt is deleted by retention at step 8; a view kept into it would stay allocated.
    project = with_task_code(default_project, tmp_path, ADAMW)
    ckpt_dir = tmp_path / "ckpt"
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(REPORT_MAPPED_CHECKPOINTS)
    for stop_at_step in (4, None):
        args = tiny_run(num_workers=0, max_steps=12, stop_at_step=stop_at_step, keep_checkpoints=1, ckpt_dir=ckpt_dir)
        result = run_job(project, args, via="python", nproc=1, PYTHONPATH=str(tmp_path / "fault"))
        assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {ckpt_dir / 'step-4.pt'}" in result.stderr
    assert not (ckpt_dir / "step-4.pt").exists()
    assert "mapped checkpoint files at step 10: []" in result.stderr, result.stderr[-3000:]
    assert checkpoint(ckpt_dir, 12)["optimizer"]["state"][0]["step"] == 12


# A value each rank carries from step to step (the shape of a hidden state over a rank's own part of the data):
# a count of steps and the rank's own number, summed. PER_RANK=0 gives it as a plain (replicated) entry.
CARRIED_STATE = '''

import dataclasses as _dataclasses
import os as _os

from ddp_training.engine.task_state import PerRank as _PerRank


class _Carried:
    def __init__(self):
        self.count = torch.zeros(2)

    def state_dict(self):
        return {"count": self.count.clone()}

    def load_state_dict(self, state):
        self.count = state["count"].clone()


def _state(model, options):
    return {"carried": _PerRank(_Carried()) if _os.environ.get("PER_RANK", "1") == "1" else _Carried()}


def _after_step(step):
    entry = step.state["carried"]
    (entry.value if isinstance(entry, _PerRank) else entry).count += torch.tensor([1.0, float(_os.environ["RANK"])])


TASK = _dataclasses.replace(TASK, state=_state, after_step=_after_step)
'''


def carried(saved: dict) -> list[list[float]]:
    """Each rank's saved count, in rank order."""
    return [torch.load(io.BytesIO(rank), weights_only=True)["count"].tolist() for rank in saved["carried"]["ranks"]]


def test_state_each_rank_keeps_resumes_on_its_own_rank_and_one_that_differs_unsaid_is_caught(default_project,
                                                                                           tmp_path):
    project = with_task_code(default_project, tmp_path, CARRIED_STATE)

    def args(name: str, **more: object) -> list[str]:
        return tiny_run(num_workers=0, max_steps=8, ckpt_every=4, ckpt_dir=tmp_path / name, **more)
    reference = run_job(project, args("reference"))
    assert reference.returncode == 0, reference.stderr[-4000:]
    assert carried(checkpoint(tmp_path / "reference", 8)) == [[8, 0], [8, 8]]
    # kill -9 after step 4: each rank resumes its own count (rank 0's on both would end [8, 4] on rank 1).
    killed = start_job(project, args("killed"), max_restarts=1)
    kill_a_worker_and_finish(killed, tmp_path / "killed" / "step-4.pt")
    assert_bitwise_equal(checkpoint(tmp_path / "killed", 8), checkpoint(tmp_path / "reference", 8))
    # Under FSDP2 (a DCP folder), paused at step 4 and resumed.
    for stop_at_step in (4, None):
        sharded = run_job(project, args("fsdp2", strategy="fsdp2", stop_at_step=stop_at_step))
        assert sharded.returncode == 0, sharded.stderr[-4000:]
    assert carried(checkpoint_state(tmp_path / "fsdp2", 8, tmp_path)) == [[8, 0], [8, 8]]
    # One rank cannot take two ranks' counts: refused, naming the entry and what to pass.
    shrunk = tmp_path / "shrunk"
    shrunk.mkdir()
    shutil.copy(tmp_path / "reference" / "step-4.pt", shrunk)
    refused = run_job(project, args("shrunk"), nproc=1)
    line = ("error: the task state 'carried' is per rank: the checkpoint holds 2 ranks' and this job has 1; resume on "
            "2 ranks, or give PerRank(..., resplit=...) in task.py to make the new ranks' from the saved ones")
    assert refused.returncode != 0 and refused.stderr.count(line) == 1, refused.stderr[-3000:]
    # As a plain entry, saved from rank 0 for every rank: the first save stops the job instead.
    plain = run_job(project, args("plain"), PER_RANK="0")
    line = ("error: the task state 'carried' differs between ranks at a save, which keeps rank 0's for every rank: "
            "update it from values every rank shares (all-reduced ones), or, if each rank keeps its own, give it as "
            "PerRank(...) in Task(state=...)")
    assert plain.returncode != 0 and plain.stderr.count(line) == 1, plain.stderr[-3000:]
    assert not list((tmp_path / "plain").glob("step-*"))
