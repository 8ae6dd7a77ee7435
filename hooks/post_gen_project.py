"""Finish the generated project: drop the scheduler files not asked for, set run bits, say what is next."""

import json
import stat
import sys
import tempfile
from pathlib import Path

EXECUTABLES = ["run_node.sh", "train.py", "slurm/train.sbatch"]
# The template's own optional files, each kept only when its answer (or one of its answers) is "yes". Only these
# are removed, and their folder only when that leaves it empty: `cookiecutter -f ... use_slurm=no` over an
# existing project must keep the user's own files in slurm/ (issue 14). The Kubernetes manifest runs the image
# the Dockerfile builds.
OPTIONAL_FILES = {"slurm/train.sbatch": "use_slurm", "k8s/pytorchjob.yaml": "use_kubernetes",
                  "Dockerfile": ("use_docker", "use_kubernetes"), ".dockerignore": ("use_docker", "use_kubernetes"),
                  "docs/containers-and-schedulers.md": ("use_docker", "use_slurm", "use_kubernetes"),
                  "PACKAGE/preflight.py": "use_preflight", "PACKAGE/profiling.py": "use_profiling",
                  "PACKAGE/export.py": "use_export", "docs/export.md": "use_export", "PACKAGE/engine/trackers.py": "use_trackers",
                  "PACKAGE/engine/streaming.py": "use_streaming", "docs/streaming.md": "use_streaming",
                  "PACKAGE/replica_groups.py": "fault_tolerance=torchft", "docs/replica-groups.md": "fault_tolerance=torchft",
                  "PACKAGE/sample.py": "task=language_model", "PACKAGE/prepare.py": "task=language_model"}
# Examples whose diffs edit the image task's task.py, kept only in its bakes.
IMAGE_TASK_EXAMPLES = ["regression", "dict-batches", "whole-set-metric", "gan", "distillation", "two-optimizers",
                       "contrastive", "curriculum", "word-language-model"]
# And the language model's, kept only in its bakes (ema, lora and mixture-of-experts have a diff for each task).
LANGUAGE_MODEL_EXAMPLES = ["lr-per-group"]


def make_executable(path: Path) -> None:
    mode = path.stat().st_mode
    path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def remove_unwanted_files(project: Path, answers: dict) -> None:
    for name, answer in OPTIONAL_FILES.items():
        if any(answers.get(each.split("=")[0], "yes") in ("yes", each.partition("=")[2])
               for each in ((answer,) if isinstance(answer, str) else answer)):
            continue  # asked for (or an answer this template's version did not ask)
        path = project / name.replace("PACKAGE", answers.get("package_name", "PACKAGE"))
        if not path.exists():
            continue
        path.unlink()
        if not any(path.parent.iterdir()):
            path.parent.rmdir()
    for name in IMAGE_TASK_EXAMPLES if answers["task"] != "image_classification" else LANGUAGE_MODEL_EXAMPLES:
        for file in ("README.md", "change.diff"):
            (project / "examples" / name / file).unlink(missing_ok=True)
        if (project / "examples" / name).is_dir() and not any((project / "examples" / name).iterdir()):
            (project / "examples" / name).rmdir()


def a_person_is_reading(project: Path, answers: dict, terminal: bool) -> bool:
    """Next steps are for someone at a terminal who just baked a project: not for logs, and not for cruft's
    throwaway renders, whose output would otherwise start with `cd /tmp/<gone>` (issue 14). cruft (diff,
    update, check) renders into temporary folders that it deletes afterwards, and adds "_commit" to the
    answers; cookiecutter does not."""
    rendered_by_cruft = "_commit" in answers
    throwaway = rendered_by_cruft and project.resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())
    return terminal and not throwaway


def main(answers: dict) -> None:
    project = Path.cwd()
    remove_unwanted_files(project, answers)
    for name in EXECUTABLES:
        if (project / name).exists():
            make_executable(project / name)
    if a_person_is_reading(project, answers, sys.stdout.isatty()):
        print(
            f"\nCreated {project}\n\n"
            "Next steps:\n"
            f"  cd {project}\n"
            "  python -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'\n"
            "  NPROC_PER_NODE=2 ./run_node.sh --data fake --max-steps 50   # 2 ranks on this machine\n"
            "  pytest                                                       # the smoke tests\n"
        )


if __name__ == "__main__":
    # The answers are rendered here only, so that the tests can import this file unrendered and call its
    # functions directly.
    main(json.loads(r"""{{ cookiecutter | jsonify }}"""))
