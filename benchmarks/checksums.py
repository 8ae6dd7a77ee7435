"""What checking a checkpoint's bytes costs, per save and per resume, for a state of --gib GiB.

    python benchmarks/checksums.py --gib 1.5 --trials 5

Bakes the default project and imports its checkpoint code into this one process (no process group: one rank
holds the whole state, the worst case of a sharded save's per-rank share). A state of float32 tensors of 64 MiB
each, --trials times, alternating:
- DDP (`step-<N>.pt`): torch.save with the CRC-32 it records (the default, what the project writes) against
  without (torch.serialization.set_crc32_options(False)): the per-save cost; a resume's load_mapped alone against
  damaged() (every member's CRC-32 read and checked) then load_mapped: the per-resume cost.
- FSDP2 (`step-<N>/`, DCP): dcp.save, then own_checksums (the files read back, from the page cache) and the
  write of checksums.json: the per-save cost; changed_files (every file read and checked): the per-resume cost.
The page cache is warm (the file was just written), as after a save on the same machine; a resume on a cold
cache pays the read from storage once, in the check, and then maps pages the check brought in.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch
from common import bake_default_project, scratch_dir, spread


def timed(*actions) -> float:
    """Seconds that `actions` (each a function and its arguments) take, one after another."""
    started = time.perf_counter()
    for function, *arguments in actions:
        function(*arguments)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.5)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    project = bake_default_project()
    sys.path.insert(0, str(project))
    package = next(path.parent.parent.name for path in project.glob("*/engine/__init__.py"))
    replicated = importlib.import_module(f"{package}.engine.checkpoint.replicated")
    sharded = importlib.import_module(f"{package}.engine.checkpoint.sharded")
    from torch.distributed import checkpoint as dcp

    tensor_count = max(1, round(args.gib * 16))  # 64 MiB each
    state = {"model": {f"layer{index}": torch.randn(16 << 20) for index in range(tensor_count)}}
    size = sum(tensor.numel() * 4 for tensor in state["model"].values()) / 2**30
    scratch = scratch_dir()
    figures: dict[str, list[float]] = {}
    for trial in range(args.trials):
        path, folder = scratch / f"step-{trial}.pt", scratch / f"step-{trial}"
        torch.serialization.set_crc32_options(False)
        figures.setdefault("ddp save without CRC-32 (s)", []).append(timed((torch.save, state, path)))
        path.unlink()
        torch.serialization.set_crc32_options(True)
        figures.setdefault("ddp save with CRC-32, the default (s)", []).append(timed((torch.save, state, path)))
        figures.setdefault("ddp resume: load_mapped alone (s)", []).append(timed((replicated.load_mapped, path)))
        figures.setdefault("ddp resume: damaged() + load_mapped (s)", []).append(
            timed((replicated.damaged, path), (replicated.load_mapped, path)))
        path.unlink()

        figures.setdefault("fsdp2 save: dcp.save (s)", []).append(
            timed((lambda into: dcp.save(state, checkpoint_id=into), folder)))
        figures.setdefault("fsdp2 save: own_checksums + checksums.json (s)", []).append(timed(
            (lambda into: sharded.write_json(into / sharded.CHECKSUMS_FILE, sharded.own_checksums(into, 0), True),
             folder)))
        figures.setdefault("fsdp2 resume: changed_files (s)", []).append(timed((sharded.changed_files, folder, 0, 1)))
        assert sharded.changed_files(folder, 0, 1) == []
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()
    print(f"state: {size:.2f} GiB in {tensor_count} tensors; {args.trials} trials; median (min-max)")
    print("| figure | seconds |\n| --- | --- |")
    for name, values in figures.items():
        print(f"| {name} | {spread(values)} |")


if __name__ == "__main__":
    main()
