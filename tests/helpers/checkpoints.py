"""Reading what a run wrote: checkpoints, metrics rows, and comparing checkpoints bit for bit."""

from __future__ import annotations

import json
from pathlib import Path


def checkpoint(ckpt_dir: Path, step: int) -> dict:
    import torch

    return torch.load(ckpt_dir / f"step-{step}.pt", weights_only=True)


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
