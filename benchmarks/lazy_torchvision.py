"""What importing torchvision only where a builder uses it saves a launch of the suite's reference run
(small_cnn on fake data, which needs none of torchvision): the CPU-seconds and wall time of a whole `torchrun`
command, with task.py as baked and with a copy that imports torchvision at its top, as it did before.

    .venv/bin/python benchmarks/lazy_torchvision.py --rounds 5

Both sides run the same baked project; runs alternate between the sides, so drift in a shared machine's speed
hits both alike; figures are medians (min-max).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from common import bake_default_project
from launch_cost import launch, summary

EAGER = "import torchvision\nimport torchvision.models\nfrom torchvision import datasets, transforms\n"


def with_eager_torchvision(project: Path) -> Path:
    """A copy of the project whose task.py imports torchvision at the top."""
    copy = project.parent / "eager"
    shutil.copytree(project, copy)
    task = copy / project.name.replace("-", "_") / "task.py"
    text = task.read_text()
    anchor = "import torch\n"
    assert anchor in text, "task.py changed"
    task.write_text(text.replace(anchor, anchor + EAGER, 1))
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    args = parser.parse_args()
    project = bake_default_project()
    sides = {"where used": project, "at the top": with_eager_torchvision(project)}
    figures: dict[str, dict[str, list[float]]] = {side: {"wall": [], "cpu": []} for side in sides}
    launch(project, "train.py", args.nproc)  # warm-up: file caches, bytecode
    for round_number in range(1, args.rounds + 1):
        for side, folder in sides.items():
            wall, cpu = launch(folder, "train.py", args.nproc)
            figures[side]["wall"].append(wall)
            figures[side]["cpu"].append(cpu)
            print(f"round {round_number} {side:10}: {wall:.2f} s wall, {cpu:.2f} CPU-s", flush=True)
    print(f"\n{args.nproc} ranks, {args.rounds} rounds; median (min-max)")
    print("| torchvision imported | CPU-seconds per launch | wall seconds per launch |")
    print("| --- | --- | --- |")
    for side in sides:
        print(f"| {side} | {summary(figures[side]['cpu'])} | {summary(figures[side]['wall'])} |")
    shutil.rmtree(project.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
