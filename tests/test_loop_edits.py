"""Editing train.py and task.py keeps every guarantee: the generated project's examples of state kept from step
to step (an EMA of the weights, kept by task.py; two optimizers; a loss weight annealed in train.py's loop) apply
alone and together, and a job with all three, killed
(kill -9 of a worker) and resumed, ends with every checkpoint entry bitwise equal to an uninterrupted run's,
under FSDP2, the harder case (its state sharded, saved with --async-save: DCP writes the shards in a thread, on
a gloo group of its own, and rank 0 publishes each folder once all are written, so the kill may land
mid-write). Under DDP the same kinds of entry are resumed elsewhere: named optimizers after kill -9 (the GAN of
test_task_seam.py), an added component (test_resume_state.py), and TrainingProgress's fields, all saved by one
asdict, by every DDP resume."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_same,
    assert_the_readme_rebuilds_the_trained_model,
    checkpoint_state,
    example_diff,
    kill_a_worker_and_finish,
    run,
    run_job,
    start_job,
    tiny_run,
)

pytestmark = pytest.mark.slow  # torchrun jobs: `make test-fast` leaves these out

EDITS = ["ema", "two-optimizers", "loss-weight"]  # examples/<name>/change.diff
RUN = dict(fake_samples=256, num_workers=0, max_steps=24, log_every=4)


def patch(project: Path, diff: str, *options: str) -> str:
    result = subprocess.run(["patch", "-p1", *options], input=diff, cwd=project, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def edited_project(bake) -> Path:
    project = bake(project_name="Loop Edits", use_export="yes")
    for name in EDITS:  # each applies to the project as baked
        patch(project, example_diff(project, name), "--dry-run")
    for name in EDITS:  # and all three together
        patch(project, example_diff(project, name))
    lint = run(["ruff", "check", "."], cwd=project)
    assert lint.returncode == 0, lint.stdout
    return project


@pytest.mark.starts_first  # two launches with a kill, FSDP2's the slowest
def test_loop_edits_resume_bitwise_after_kill_9_under_fsdp2(edited_project, tmp_path):
    def args(ckpt_dir: Path) -> list[str]:
        return [*tiny_run(**RUN, strategy="fsdp2", ckpt_dir=ckpt_dir), "--async-save"]
    uninterrupted = run_job(edited_project, args(tmp_path / "uninterrupted"))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    # The head's AdamW at a tenth of --lr: the log says which lr its lines show.
    assert ("the logged lr is --lr (0.01) on the schedule; the optimizer's 2 param groups peak at 0.001 to 0.01"
            in uninterrupted.stderr), uninterrupted.stderr[-4000:]
    killed = start_job(edited_project, args(tmp_path / "killed"), max_restarts=1)
    output = kill_a_worker_and_finish(killed, tmp_path / "killed" / "step-8")
    assert "(a copy in memory: writing it in the background)" in output, output[-4000:]
    assert not list((tmp_path / "killed").glob(".step-*")), "nothing partial left behind"
    # Each folder's checksums, gathered in the background write's thread, are those of the bytes on disk.
    assert "skipping" not in output and (tmp_path / "killed" / "step-24" / "checksums.json").is_file(), output

    expected, resumed = (checkpoint_state(tmp_path / name, 24, tmp_path) for name in ("uninterrupted", "killed"))
    for state in (expected, resumed):  # the one entry that must differ: where each run kept its checkpoints
        state.get("options", {}).pop("ckpt_dir", None)
    assert_same(resumed, expected)
    assert_the_readme_rebuilds_the_trained_model(edited_project, tmp_path / "uninterrupted", 24, tmp_path)
    # The edits' state is really there, and really advanced: not a fresh copy saved twice.
    annealed = 1.0
    for _ in range(24):
        annealed = max(0.5, 0.98 * annealed)  # as the edit does it, step by step
    assert expected["progress"]["loss_weight"] == annealed
    assert set(expected["ema"]) == set(expected["model"])
    assert any(not torch.equal(expected["ema"][name], expected["model"][name]) for name in expected["model"])
    # Export writes what evaluation used (TASK's evaluate_with): the averages, the model's buffers beside them.
    exported = tmp_path / "exported" / "model.pt"
    result = run(["python", "-m", "loop_edits.export", str(tmp_path / "uninterrupted" / "step-24"), str(exported)],
                 cwd=edited_project)
    assert result.returncode == 0 and "of the 'ema' entry, as evaluation used them" in result.stdout, result.stderr
    assert_same(torch.load(exported, weights_only=True), {**expected["model"], **expected["ema"]})
    # torch's distributed state_dict merges the optimizers, keyed by parameter name
    adamw_steps = {float(state["step"]) for state in expected["optimizer"]["state"].values() if "step" in state}
    assert adamw_steps == {24.0}, adamw_steps


def test_the_task_independent_loop_edits_apply_to_the_language_model(bake):
    project = bake(task="language_model", project_name="Loop Edits LM")
    patch(project, example_diff(project, "loss-weight"), "--dry-run")
    assert not (project / "examples" / "two-optimizers").exists()  # shown against the image task's task.py
    patch(project, example_diff(project, "ema"), "--dry-run")  # its own diff of this task.py
