"""Refuse bad answers before anything is generated.

Each problem is reported as `ERROR: <variable>: <what is wrong and what is allowed>` and the hook exits 1,
which makes cookiecutter delete the half-made folder.
"""

import json
import keyword
import os
import re
import subprocess
import sys

# Names the generated project already uses at its top level, or imports, and so must not be shadowed.
RESERVED_PACKAGE_NAMES = {"torch", "torchvision", "tests", "train", "setuptools", "pip"}


def check_free_text(value: str) -> str | None:
    if not value.strip():
        return "must not be empty"
    if not any(char.isalnum() for char in value):
        return f"{value!r} needs at least one letter or digit"
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        return "must be one line of text without control characters (newlines, tabs)"
    return None


def check_slug(value: str) -> str | None:
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", value):
        return (
            f"{value!r} is not a safe folder name; use 1-64 lowercase letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return None


def check_package_name(value: str) -> str | None:
    if len(value) > 32:
        return f"{value!r} is longer than 32 characters; choose a shorter package name"
    if not value.isidentifier() or not value.isascii():
        return f"{value!r} is not a Python identifier; use lowercase letters, digits and '_', not starting with a digit"
    if keyword.iskeyword(value):
        return f"{value!r} is a Python keyword; choose another name"
    if value in RESERVED_PACKAGE_NAMES or value in sys.stdlib_module_names:
        return (f"{value!r} would shadow the module of that name (torch, torchvision or the standard library); "
                "choose another name")
    if value != value.lower():
        return f"{value!r} has capitals; package names are lowercase (PEP 8)"
    return None


def check_positive_int(value: str, minimum: int = 1) -> str | None:
    if not re.fullmatch(r"[0-9]+", value) or int(value) < minimum:
        return f"{value!r} must be a whole number >= {minimum}"
    return None


def check_nnodes(value: str) -> str | None:
    match = re.fullmatch(r"([0-9]+)(?::([0-9]+))?", value)
    if not match:
        return f"{value!r} must be a number of machines (e.g. 2) or an elastic range MIN:MAX (e.g. 1:4)"
    low, high = int(match[1]), int(match[2] or match[1])
    if low < 1 or low > high:
        return f"{value!r} needs 1 <= MIN <= MAX"
    return None


def check_nproc_per_node(value: str) -> str | None:
    if value in ("auto", "gpu", "cpu"):
        return None
    if check_positive_int(value) is None:
        return None
    return f"{value!r} must be auto, gpu, cpu or a whole number >= 1"


def check_port(value: str) -> str | None:
    if not re.fullmatch(r"[0-9]+", value) or not 1 <= int(value) <= 65535:
        return f"{value!r} must be a TCP port between 1 and 65535"
    return None


CHECKS = {
    "project_name": check_free_text,
    "project_slug": check_slug,
    "package_name": check_package_name,
    "author": check_free_text,
    "nnodes": check_nnodes,
    "nproc_per_node": check_nproc_per_node,
    "rdzv_port": check_port,
    "max_restarts": lambda value: check_positive_int(value, minimum=0),
    "gpus_per_node": lambda value: check_positive_int(value, minimum=0),
    "use_slurm": lambda value: None if value in ("yes", "no") else f"{value!r} must be yes or no",
    "use_kubernetes": lambda value: None if value in ("yes", "no") else f"{value!r} must be yes or no",
    "use_docker": lambda value: None if value in ("yes", "no") else f"{value!r} must be yes or no",
    "use_preflight": lambda value: None if value in ("yes", "no") else f"{value!r} must be yes or no",
    "use_profiling": lambda value: None if value in ("yes", "no") else f"{value!r} must be yes or no",
    "use_export": lambda value: None if value in ("yes", "no") else f"{value!r} must be yes or no",
    "use_trackers": lambda value: None if value in ("yes", "no") else f"{value!r} must be yes or no",
    "use_streaming": lambda value: None if value in ("yes", "no") else f"{value!r} must be yes or no",
    "strategy": lambda value: None if value in ("ddp", "fsdp2") else f"{value!r} must be ddp or fsdp2",
    "task": lambda value: (None if value in ("image_classification", "language_model")
                           else f"{value!r} must be image_classification or language_model"),
    "fault_tolerance": lambda value: None if value in ("restart", "torchft") else f"{value!r} must be restart or torchft",
}


# Runs detached from cookiecutter: waits until cookiecutter has removed the refused project folder (it does so
# right after this hook exits), then removes the empty folders it made above it for a slug such as `a/b`.
# Cookiecutter creates the project folder with all its parents before this hook runs, and removes only the
# project folder itself when the hook refuses. It stops at the first folder that holds anything, and never
# goes up to the output folder or above it: those existed before the bake.
REMOVE_EMPTY_PARENTS = """
import os, sys, time
project, output = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 10
while os.path.lexists(project) and time.monotonic() < deadline:
    time.sleep(0.02)
if not os.path.lexists(project):
    stop = os.path.commonpath([project, output])
    folder = os.path.dirname(project)
    while len(folder) > len(stop):
        try:
            os.rmdir(folder)
        except OSError:
            break
        folder = os.path.dirname(folder)
"""


def remove_empty_parents_once_refused(project_folder: str, output_folder: str) -> None:
    if os.path.dirname(project_folder) == output_folder:
        return  # a plain slug: cookiecutter's own removal leaves nothing
    subprocess.Popen([sys.executable, "-c", REMOVE_EMPTY_PARENTS, project_folder, output_folder],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)


def problems(answers: dict) -> list[tuple[str, str]]:
    """(answer, what is wrong with it) for every answer a check refuses."""
    found = [(name, check(str(answers[name]))) for name, check in CHECKS.items()]
    if answers["fault_tolerance"] == "torchft" and answers["use_streaming"] == "yes":
        found.append(("fault_tolerance", "torchft replica groups read map-style training sets only; answer "
                                         "use_streaming=no with it, or fault_tolerance=restart"))
    return [(name, problem) for name, problem in found if problem]


def main(answers: dict) -> int:
    refused = problems(answers)
    for name, problem in refused:
        print(f"ERROR: {name}: {problem}", file=sys.stderr)
    if refused:
        output_folder = answers.get("_output_dir")  # set by cookiecutter since 2.2
        if output_folder:  # this hook runs inside the project folder
            remove_empty_parents_once_refused(os.path.realpath(os.getcwd()), os.path.realpath(output_folder))
    return 1 if refused else 0


if __name__ == "__main__":
    # Every answer as JSON (pure ASCII: quotes, backslashes, newlines and emoji all arrive escaped), read back
    # by Python, so no answer can break this file; read here, so that the unrendered file imports (the tests
    # call problems() directly). Only Jinja's and cookiecutter's own filters are used anywhere in the
    # template: cruft renders two template versions in one process, where a template module of filters would
    # be imported once and stay stale for the second.
    sys.exit(main(json.loads(r"""{{ cookiecutter | jsonify }}""")))
