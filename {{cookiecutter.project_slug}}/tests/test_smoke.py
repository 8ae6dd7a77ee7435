"""Smoke test: 2 CPU ranks train, loss falls, a checkpoint is written, a second launch resumes from it."""

import math
import re

import pytest
import torch
from harness import TINY_RUN, launch

from {{ cookiecutter.package_name }}.export import load_model_weights

LOSS_LINE = re.compile(r"step (\d+) \| epoch \d+ \| loss ([-+.\w]+)")


def logged_losses(output: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in LOSS_LINE.findall(output)}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("checkpoints")
    result = launch([*TINY_RUN, "--ckpt-dir", str(ckpt_dir), "--max-steps", "30", "--ckpt-every", "15",
                     "--log-every", "5"])
    return result, ckpt_dir


def test_two_ranks_train_and_loss_falls(first_run):
    result, _ = first_run
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "world_size=2" in output and "backend=gloo" in output
    losses = logged_losses(output)
    assert sorted(losses) == [5, 10, 15, 20, 25, 30], output
    assert all(math.isfinite(loss) for loss in losses.values())
    assert losses[30] < 0.7 * losses[5], losses


def test_checkpoint_holds_plain_state(first_run):
    _, ckpt_dir = first_run
    if (ckpt_dir / "step-30").is_dir():  # --strategy fsdp2: folders of shards; export makes them one file
        assert sorted(p.name for p in ckpt_dir.glob("step-*")) == ["step-15", "step-30"]
        weights = load_model_weights(ckpt_dir / "step-30")
        assert weights and not any(key.startswith("module.") for key in weights)
        return
    assert sorted(p.name for p in ckpt_dir.glob("step-*.pt")) == ["step-15.pt", "step-30.pt"]
    state = torch.load(ckpt_dir / "step-30.pt", weights_only=True)
    assert state["step"] == 30
    assert state["optimizer"]["state"], "optimizer state (momentum) must be saved"
    assert not any(key.startswith("module.") for key in state["model"])


def test_second_launch_resumes(first_run):
    _, ckpt_dir = first_run
    result = launch([*TINY_RUN, "--ckpt-dir", str(ckpt_dir), "--max-steps", "40", "--ckpt-every", "15",
                     "--log-every", "5"])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"resuming from {ckpt_dir / 'step-30'}" in output  # step-30.pt, or step-30/ with --strategy fsdp2
    assert sorted(logged_losses(output)) == [35, 40], output  # continued, not started over
    assert (ckpt_dir / "step-40.pt").is_file() or (ckpt_dir / "step-40").is_dir()
