"""What importing torchvision only where a builder uses it saves a launch of the suite's reference run
(small_cnn on fake data, which needs none of torchvision): the CPU-seconds and wall time of a whole `torchrun`
command, with task.py as baked and with a copy that imports torchvision at its top, as it did before.

    .venv/bin/python benchmarks/lazy_torchvision.py --rounds 5

Both sides run the same baked project; runs alternate between the sides, so drift in a shared machine's speed
hits both alike; figures are medians (min-max).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from common import bake_default_project
from launch_cost import compare, launch_arguments

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
    args = launch_arguments(__doc__)
    project = bake_default_project()
    compare({"where used": (project, "train.py"), "at the top": (with_eager_torchvision(project), "train.py")},
            args.rounds, args.nproc, "torchvision imported")


if __name__ == "__main__":
    main()
