"""Finish the generated project: drop the scheduler files not asked for, set run bits, say what is next."""

import stat
import sys
import tempfile
from pathlib import Path

EXECUTABLES = ["run_node.sh", "train.py", "slurm/train.sbatch"]
# The template's own files in the optional folders, each kept only when its answer is "yes". Only these are
# removed, and their folder only when that leaves it empty: `cookiecutter -f ... use_slurm=no` over an
# existing project must keep the user's own files in slurm/ (issue 14).
OPTIONAL_FILES = {
    "slurm/train.sbatch": {{ cookiecutter.use_slurm == "yes" }},
    "k8s/pytorchjob.yaml": {{ cookiecutter.use_kubernetes == "yes" }},
}
# cruft (diff, update, check) renders the template into temporary folders that it deletes afterwards, and it
# adds "_commit" to the answers; cookiecutter does not.
RENDERED_BY_CRUFT = {{ "_commit" in cookiecutter }}


def make_executable(path: Path) -> None:
    mode = path.stat().st_mode
    path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def remove_unwanted_files(project: Path) -> None:
    for name, wanted in OPTIONAL_FILES.items():
        path = project / name
        if wanted or not path.exists():
            continue
        path.unlink()
        if not any(path.parent.iterdir()):
            path.parent.rmdir()


def a_person_is_reading(project: Path) -> bool:
    """Next steps are for someone at a terminal who just baked a project: not for logs, and not for cruft's
    throwaway renders, whose output would otherwise start with `cd /tmp/<gone>` (issue 14)."""
    if not sys.stdout.isatty():
        return False
    throwaway = RENDERED_BY_CRUFT and project.resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())
    return not throwaway


def main() -> None:
    project = Path.cwd()
    remove_unwanted_files(project)
    for name in EXECUTABLES:
        if (project / name).exists():
            make_executable(project / name)
    if a_person_is_reading(project):
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
