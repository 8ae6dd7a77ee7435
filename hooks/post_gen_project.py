"""Finish the generated project: drop the scheduler files not asked for, set run bits, say what is next."""

import shutil
import stat
from pathlib import Path

EXECUTABLES = ["run_node.sh", "train.py", "slurm/train.sbatch"]
# Folder kept only when its answer is "yes".
OPTIONAL_FOLDERS = {
    "slurm": {{ cookiecutter.use_slurm | python_string }},
    "k8s": {{ cookiecutter.use_kubernetes | python_string }},
}


def make_executable(path: Path) -> None:
    mode = path.stat().st_mode
    path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def main() -> None:
    project = Path.cwd()
    for folder, answer in OPTIONAL_FOLDERS.items():
        if answer != "yes":
            shutil.rmtree(project / folder)
    for name in EXECUTABLES:
        if (project / name).exists():
            make_executable(project / name)
    print(
        f"\nCreated {project}\n\n"
        "Next steps:\n"
        f"  cd {project}\n"
        "  python -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'\n"
        "  NPROC_PER_NODE=2 ./run_node.sh --data fake --max-steps 50   # 2 ranks on this machine\n"
        "  pytest                                                       # the smoke tests\n"
    )


if __name__ == "__main__":
    main()
