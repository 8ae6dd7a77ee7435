"""FSDP2 from the same loop (strategy=fsdp2), with numbers: it trains what DDP trains, its sharded
checkpoints reshard from 2 ranks to 1, fall back past a torn save, and export to one plain .pt file. Its
sharded checkpoints through kill -9, saved in the background: test_loop_edits.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import assert_trains_like_bare, checkpoint, run, run_job, tiny_run, with_task_code
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# torchrun jobs: `make test-fast` leaves these out. One xdist worker runs them all, so that the module's
# reference run is made once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp2")]

# small_cnn: no batch statistics, so 1 rank x 16 samples and 2 ranks x 8 compute the same update.
# 512 samples over 2 ranks of 8: 32 steps an epoch. What these runs train is what the session's DDP reference
# run (helpers.TINY_RUN) trains.
RUN = dict(num_workers=0, log_every=4)


@pytest.fixture(scope="module")
def fsdp_project(bake) -> Path:
    return bake(strategy="fsdp2", use_export="yes")


def launch(project: Path, nproc: int, **options: object) -> subprocess.CompletedProcess:
    result = run_job(project, tiny_run(**{**RUN, **options}), via="run_node.sh", nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def sharded_state(folder: Path, scratch: Path) -> dict:
    """Everything a step-<N>/ folder holds, reassembled from its shards (torch's own converter)."""
    whole = scratch / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, whole)
    return torch.load(whole, weights_only=True)


def tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state, by its path."""
    found = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            found[f"{prefix}{key}"] = value
        elif isinstance(value, dict):
            found |= tensors(value, f"{prefix}{key}.")
    return found


@pytest.fixture(scope="module")
def uninterrupted(fsdp_project, tmp_path_factory) -> Path:
    """Sharded checkpoints every 4 steps of an undisturbed 2-rank run of 40 steps, paused at step 12: the reference."""
    ckpt_dir = tmp_path_factory.mktemp("fsdp-uninterrupted")
    launch(fsdp_project, 2, stop_at_step=12, ckpt_dir=ckpt_dir)
    return ckpt_dir


def test_sharded_checkpoints_are_complete_step_folders(fsdp_project, uninterrupted, tmp_path):
    assert sorted(path.name for path in uninterrupted.iterdir()) == [".lease", "config.yaml", "step-12", "step-4",
                                                                     "step-8"]
    for folder in uninterrupted.glob("step-*"):
        assert (folder / ".metadata").is_file()
        assert sorted(path.name for path in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        checksums = json.loads((folder / "checksums.json").read_text())  # every other file's, rank 1's included
        assert sorted(checksums) == [".metadata", "__0_0.distcp", "__1_0.distcp", "options.json"], checksums
    # Issue 11: each rank's CUDA generator, by rank (empty on CPU); the kill -9 and 2 -> 1 resumes restore it.
    assert sharded_state(uninterrupted / "step-12", tmp_path)["cuda_rng_states"].shape == (2, 0)


def test_fsdp2_trains_what_ddp_trains_and_exports_one_plain_file(fsdp_project, uninterrupted, uninterrupted_bare,
                                                                 tmp_path):
    assert_trains_like_bare(tiny_run(**RUN))  # the session's DDP run is this module's settings, to step 40
    ddp_model = checkpoint(uninterrupted_bare, 12)["model"]

    exported = tmp_path / "exported" / "model.pt"
    result = run(["python", "-m", "ddp_training.export", str(uninterrupted), str(exported)], cwd=fsdp_project)
    assert result.returncode == 0, result.stderr
    assert "from " + str(uninterrupted / "step-12") in result.stdout  # the newest
    fsdp_model = torch.load(exported, weights_only=True)
    assert fsdp_model.keys() == ddp_model.keys(), "the same parameter names as an unwrapped model"
    # Sharded all-gather/reduce-scatter against DDP's all-reduce: the same update, summed in another order.
    for name, tensor in ddp_model.items():
        assert torch.allclose(fsdp_model[name], tensor, atol=1e-5), name
    # The shards themselves, reassembled, are what both files hold, bit for bit.
    shards = tensors(sharded_state(uninterrupted / "step-12", tmp_path))
    safetensors = load_file(exported.with_suffix(".safetensors"))
    assert safetensors.keys() == fsdp_model.keys()
    for name, tensor in fsdp_model.items():
        assert torch.equal(shards[f"model.{name}"], tensor) and torch.equal(safetensors[name], tensor), name
    assert json.loads(exported.with_suffix(".json").read_text())["step"] == 12


def test_channels_last_shards_and_trains_what_contiguous_parameters_train(fsdp_project, uninterrupted, tmp_path):
    """Issue 11: channels-last conv weights are not contiguous, and fully_shard refused them at start (on CUDA
    channels-last is the default for conv models)."""
    launch(fsdp_project, 2, channels_last=True, stop_at_step=4, ckpt_dir=tmp_path / "channels-last")
    expected = tensors(sharded_state(uninterrupted / "step-4", tmp_path))
    actual = tensors(sharded_state(tmp_path / "channels-last" / "step-4", tmp_path))
    # Channels-last convolutions add in another order; BatchNorm over 8 samples amplifies that to 2.5e-5 in 4
    # steps, against 1e-3 to 8e-3 that 4 steps move each weight: a wrong update would be 100 times over.
    for name, tensor in expected.items():
        if name.startswith("model."):
            assert torch.allclose(actual[name], tensor, atol=1e-4), name


RANK_0_WORK = """

import dataclasses
import json
import os
import time
from pathlib import Path

from .step import ExponentialMovingAverage


@dataclass
class SampledTaskOptions(TaskOptions):
    sample_every: int = option(0, "write predictions every this many steps (0: never)")


def predict_twice(step, generator):  # a figure, sample images: one rank's work, with the model
    if step.number == 4:
        time.sleep(20)  # the first takes long
    torch.randn(1000)  # from torch's own generator, put back after the work: the run trains what it would without
    images = torch.rand(4, 3, 16, 16, generator=generator)  # the work's own
    outputs = [step.model(images).sum().item(), step.model(images.flip(0)).sum().item()]  # two forwards
    (Path(os.environ["WORK_LOG"]) / f"work-{step.number}.json").write_text(json.dumps(outputs))


def after_step(step):
    step.state["ema"].update(step.model)


TASK = dataclasses.replace(TASK, options=SampledTaskOptions, rank_0_work=("sample_every", predict_twice),
                           state=lambda model, options: {"ema": ExponentialMovingAverage(model, decay=0.5)},
                           after_step=after_step, evaluate_with="ema")
"""


def test_work_rank_0_does_alone_runs_the_whole_model_is_waited_for_and_changes_nothing_the_run_trains(
        fsdp_project, uninterrupted, baked_module, tmp_path):
    # Task.rank_0_work every --sample-every 4 steps: rank 0 runs the sharded model alone, twice, with the weights
    # evaluation uses (an EMA's, swapped in shard by shard on every rank, then gathered whole for rank 0), while
    # rank 1 waits: the first time for 20 s, 7x --step-timeout and past the backstop of rank 1's watchdog
    # (faulthandler, 2 x 3 + 10 s), in the phase the loop gives it. The run then trains on to the reference's
    # shards bit for bit, every rank's generators included: its draws from torch's generator are undone, and its
    # all-gathers and reduce-scatters stay paired (rank 0's forwards are not left in the order the next backward
    # prefetches in).
    project = with_task_code(fsdp_project, tmp_path, RANK_0_WORK)
    result = run_job(project, [*tiny_run(**RUN, stop_at_step=8, step_timeout=3, ckpt_dir=tmp_path / "ckpt"),
                               "--sample-every", "4"], WORK_LOG=str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "no progress" not in result.stderr, result.stderr[-4000:]
    expected = tensors(sharded_state(uninterrupted / "step-8", tmp_path))
    actual = tensors(sharded_state(tmp_path / "ckpt" / "step-8", tmp_path))
    assert actual.keys() - expected.keys() == {name.replace("model.", "ema.") for name in expected
                                               if name.startswith("model.")}
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    # What it computed is the whole model's output with the averages of that step, on images drawn from a
    # generator of its own, seeded from --seed and the step.
    from types import SimpleNamespace

    model = baked_module("task").small_cnn(SimpleNamespace(task=SimpleNamespace(num_classes=10)), None)
    assert sorted(path.name for path in tmp_path.glob("work-*.json")) == ["work-4.json", "work-8.json"]
    for number in (4, 8):
        saved = tensors(sharded_state(tmp_path / "ckpt" / f"step-{number}", tmp_path))
        images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0 + number))
        outputs = {}
        for entry in ("ema", "model"):
            model.load_state_dict({name.removeprefix(f"{entry}."): tensor for name, tensor in saved.items()
                                   if name.startswith(f"{entry}.")})
            with torch.no_grad():
                outputs[entry] = [model(images).sum().item(), model(images.flip(0)).sum().item()]
        written = json.loads((tmp_path / f"work-{number}.json").read_text())
        assert written == pytest.approx(outputs["ema"], abs=1e-4), (written, outputs)
        assert written != pytest.approx(outputs["model"], abs=1e-4), (written, outputs)  # not the trained weights


def test_two_ranks_to_one_reshards_and_continues_the_same_run(fsdp_project, uninterrupted, tmp_path):
    ckpt_dir = tmp_path / "resharded"
    ckpt_dir.mkdir()
    shutil.copytree(uninterrupted / "step-8", ckpt_dir / "step-8")
    # One rank of 16 samples: the same global batch, so the same run continues on half the ranks.
    result = launch(fsdp_project, 1, batch_size=16, stop_at_step=12, ckpt_dir=ckpt_dir)
    assert "step 8, epoch 0, 128 samples into the epoch, 128 in all, saved by 2 ranks" in result.stderr
    expected = tensors(sharded_state(uninterrupted / "step-12", tmp_path))
    actual = tensors(sharded_state(ckpt_dir / "step-12", tmp_path))
    # A row per rank of the job that saved: the one rank left continues rank 0's generators.
    expected["cpu_rng_states"] = expected["cpu_rng_states"][:1]
    expected["cuda_rng_states"] = expected["cuda_rng_states"][:1]
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].shape == tensor.shape and torch.allclose(actual[name], tensor, atol=1e-5), name


def test_changed_and_torn_newest_folders_and_partial_save_fall_back_to_the_previous(fsdp_project, uninterrupted,
                                                                                     tmp_path):
    ckpt_dir = tmp_path / "torn"
    ckpt_dir.mkdir()
    for name in ("step-4", "step-8", "step-12"):
        shutil.copytree(uninterrupted / name, ckpt_dir / name)
    shard = ckpt_dir / "step-12" / "__0_0.distcp"
    flipped = bytearray(shard.read_bytes())
    flipped[len(flipped) // 2] ^= 0x04  # one bit of a tensor (bit rot): DCP loads it without a word
    shard.write_bytes(bytes(flipped))
    shard = ckpt_dir / "step-8" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a copy cut short
    (ckpt_dir / ".step-16.partial").mkdir()  # a save killed before it was published
    result = launch(fsdp_project, 2, stop_at_step=8, ckpt_dir=ckpt_dir)
    assert (f"skipping unreadable checkpoint {ckpt_dir / 'step-12'} (its bytes changed after it was written: the "
            "CRC-32 of __0_0.distcp is not the one recorded at the save") in result.stderr, result.stderr[-3000:]
    assert (ckpt_dir / "step-12.unreadable").is_dir() and not (ckpt_dir / "step-12").exists()
    assert "skipping incomplete checkpoint" in result.stderr and "__1_0.distcp" in result.stderr
    assert "removed" in result.stderr and not (ckpt_dir / ".step-16.partial").exists()
    assert "resuming from " + str(ckpt_dir / "step-4") in result.stderr
    expected = tensors(sharded_state(uninterrupted / "step-8", tmp_path))
    actual = tensors(sharded_state(ckpt_dir / "step-8", tmp_path))
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_batchnorm_bf16_accumulation_clipping_and_uneven_evaluation_match_ddp(fsdp_project, tmp_path):
    """Issue 11: a group of its own per BatchNorm (to keep its weights fp32) cost an all-gather each; now a
    block holding one all-gathers in fp32 and autocast computes in bf16, as under DDP. In the same run, gradient
    sync switched off between micro-batches, clipping of sharded gradients, and evaluation on shards of
    different batch counts (65 held-out samples: 17 and 16 batches of 4), against the same run under DDP."""
    # 64 px: at 16 or 32, layer4 sees 1x1 maps, where CPU bf16 3x3 convolutions leave garbage in the weight
    # gradients' border taps (torch 2.14, under DDP too).
    args = dict(model="resnet18", image_size=64, precision="bf16", batch_size=4, fake_samples=260, grad_accum=2,
                clip_grad=0.5, max_steps=2)
    fsdp = launch(fsdp_project, 2, **args, ckpt_dir=tmp_path / "fsdp2")
    # resnet18: stem conv, stem BatchNorm, 8 residual blocks, head, and the root; no BatchNorm alone.
    assert "fsdp2: 12 groups" in fsdp.stderr, fsdp.stderr[-3000:]
    ddp = launch(fsdp_project, 2, **args, strategy="ddp", ckpt_dir=tmp_path / "ddp")
    for result in (fsdp, ddp):
        assert "on 65 held-out samples" in result.stderr, result.stderr[-3000:]
    sharded = tensors(sharded_state(tmp_path / "fsdp2" / "step-2", tmp_path))
    replicated = checkpoint(tmp_path / "ddp", 2)["model"]
    for name, tensor in replicated.items():
        if tensor.is_floating_point():
            assert torch.allclose(sharded[f"model.{name}"], tensor, atol=1e-5), name
        else:  # num_batches_tracked
            assert torch.equal(sharded[f"model.{name}"], tensor), name
