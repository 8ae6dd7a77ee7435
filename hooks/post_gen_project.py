"""Finish the generated project: run bits on scripts, then tell the user what to do next."""

import stat
from pathlib import Path

EXECUTABLES = ["run_node.sh", "train.py"]


def make_executable(path: Path) -> None:
    mode = path.stat().st_mode
    path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def main() -> None:
    project = Path.cwd()
    for name in EXECUTABLES:
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
