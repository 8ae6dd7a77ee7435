"""The CUDA code paths, shown on CPU where their mechanism can be (issue 11): bf16 chosen only where the GPU
computes it natively, evaluation under training's autocast, and benchmarks/gpu_check.py in its dry mode so the
GPU check cannot rot. A CUDA generator state per rank in checkpoints: test_fault_tolerance.py's resize test."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import TEMPLATE_ROOT, run
from torch.utils.data import DataLoader


def test_auto_precision_is_bf16_only_where_the_gpu_computes_it_natively(baked_module, monkeypatch):
    precision = baked_module("engine.optim")
    cuda = torch.device("cuda", 0)
    for capability, expected in [((7, 0), "fp32"), ((7, 5), "fp32"), ((8, 0), "bf16"), ((9, 0), "bf16")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, found=capability: found)
        # What torch reports on a V100 or T4: bf16 "supported", by emulation, unless asked not to count it.
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True, found=capability: including_emulation or found >= (8, 0))
        assert precision.resolve_precision("auto", cuda) == expected, f"compute capability {capability}"


def test_evaluation_runs_under_the_training_autocast(baked_module):
    precision, evaluation, task = baked_module("engine.optim"), baked_module("engine.evaluation"), baked_module("task")
    torch.manual_seed(0)
    model = task.small_cnn(SimpleNamespace(task=SimpleNamespace(num_classes=10)), None)
    conv_output_dtypes = []
    model[0][0].register_forward_hook(lambda module, inputs, output: conv_output_dtypes.append(output.dtype))
    loader = DataLoader(task.LearnableFakeData(48, 16, 10, seed=0), batch_size=16)
    cpu = torch.device("cpu")
    fp32 = evaluation.evaluate(model, loader, cpu, precision.MixedPrecision("fp32", cpu), task.TASK)
    assert set(conv_output_dtypes) == {torch.float32}
    conv_output_dtypes.clear()
    bf16 = evaluation.evaluate(model, loader, cpu, precision.MixedPrecision("bf16", cpu), task.TASK)
    assert set(conv_output_dtypes) == {torch.bfloat16}
    assert bf16["samples"] == fp32["samples"] == 48
    assert bf16["loss"] != fp32["loss"] and abs(bf16["loss"] - fp32["loss"]) < 0.05 * fp32["loss"], (bf16, fp32)


@pytest.mark.slow
@pytest.mark.starts_first  # among the suite's longest tests: 5 short launches and one plain process
def test_gpu_check_dry_run_prints_every_row(tmp_path):
    table = tmp_path / "gpu_check.md"
    result = run([sys.executable, str(TEMPLATE_ROOT / "benchmarks" / "gpu_check.py"), "--dry-run",
                  # A guard against a hang, not a speed check: under full-suite load on a slow 2-core machine
                  # the dry run has taken 230 s (each of its runs has a 120 s limit of its own).
                  "--out", str(table)], cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = table.read_text()
    assert text.strip() in result.stdout
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| case", "| ---"))]
    names = [row.split("|")[1].strip() for row in rows]
    assert names == [
        "preflight", "pure compute", "bare DDP loop", "train.py fp32", "train.py bf16",
        "train.py bf16 channels-last", "train.py bf16 channels-last compile", "fsdp2 bf16",
        "fsdp2 bf16 channels-last", "host syncs per step", "bitwise resume (dropout)",
    ], text
    status = {name: row.split("|")[2].strip() for name, row in zip(names, rows, strict=True)}
    ran = ["preflight", "pure compute", "bare DDP loop", "train.py bf16 channels-last", "bitwise resume (dropout)"]
    # the rest: n/a in a dry run (compile, CUDA-only counts, flag variants of the channels-last row's path)
    assert [name for name in names if status[name] == "ok"] == ran, text
    assert all(status[name] == "n/a" for name in names if name not in ran), text
