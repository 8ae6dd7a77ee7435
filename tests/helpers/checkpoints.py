"""Reading what a run wrote: checkpoints, metrics rows, and comparing checkpoints bit for bit."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path


def checkpoint(ckpt_dir: Path, step: int) -> dict:
    import torch

    return torch.load(ckpt_dir / f"step-{step}.pt", weights_only=True)


def flip_a_bit(saved: Path, copy: Path, member_suffix: str = "/data/0") -> str:
    """Write `saved` to `copy` with one bit flipped inside a tensor's bytes (bit rot), where torch.load would load
    it without a word; returns the zip member it changed."""
    with zipfile.ZipFile(saved) as archive:
        member = next(info for info in archive.infolist() if info.filename.endswith(member_suffix))
    data = bytearray(saved.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[member.header_offset + 26: member.header_offset + 30])
    data[member.header_offset + 30 + name_length + extra_length + 7] ^= 0x10  # past the local header
    copy.write_bytes(bytes(data))
    return member.filename


def metric_rows(log_dir: Path) -> list[dict]:
    """The rows a run wrote to --log-dir's metrics.jsonl, in order."""
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def assert_bitwise_equal(actual: dict, expected: dict) -> None:
    import torch

    assert actual["step"] == expected["step"]
    assert actual["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(actual["model"][name], tensor), f"model tensor {name} differs"
    assert torch.equal(actual["torch_rng_state"], expected["torch_rng_state"]), "the global RNG continues as it was"
    if "cpu_rng_states" in expected:
        assert torch.equal(actual["cpu_rng_states"], expected["cpu_rng_states"]), "each rank's generator continues"
    for index, buffers in expected["optimizer"]["state"].items():
        for name, tensor in buffers.items():
            assert torch.equal(actual["optimizer"]["state"][index][name], tensor), f"optimizer {index}.{name} differs"


def checkpoint_state(ckpt_dir: Path, step: int, scratch: Path) -> dict:
    """Everything step N holds: step-N.pt, or the DCP folder step-N made one file in `scratch`."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = ckpt_dir / f"step-{step}"
    if path.is_dir():  # FSDP2: DCP shards, reassembled by torch's own converter
        whole = scratch / f"{ckpt_dir.name}-{step}.pt"
        dcp_to_torch_save(path, whole)
        return torch.load(whole, weights_only=True)
    return torch.load(path.with_suffix(".pt"), weights_only=True)


def assert_same(actual, expected, path: str = "") -> None:
    """Bitwise equality of nested dicts, lists, tensors and numbers."""
    import torch

    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{path}: {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), path
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            assert_same(left, right, f"{path}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"{path} differs"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
