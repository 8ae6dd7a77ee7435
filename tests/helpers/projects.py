"""Reading and editing a baked project: its README's blocks, its task's tiny run, task code added, test data,
its own tests, and train.py's main() in this process."""

from __future__ import annotations

import ast
import logging
import random
import re
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

from .environment import run


def make_image_folder(root: Path, images_per_split: dict[str, int]) -> None:
    """root/<split>/{cat,dog}/<n>.png: small noise images, so crops and flips change what the model sees."""
    from PIL import Image

    generator = random.Random(0)
    for split, count in images_per_split.items():
        for label in ("cat", "dog"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for index in range(count):
                pixels = bytes(generator.randrange(256) for _ in range(24 * 20 * 3))
                Image.frombytes("RGB", (24, 20), pixels).save(folder / f"{index}.png")


def assert_project_tests_pass(project: Path) -> None:
    """The baked project's own tests, run as its README says: both pass (they train with task.py's
    TASK.smoke_test_args, so this also checks the task's tiny run is learnable)."""
    result = run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b2 passed\b", result.stdout), result.stdout


def smoke_test_args(project: Path) -> list[str]:
    """The baked project's task.py TASK.smoke_test_args, the tiny run its own tests train, read without importing
    torch: a test that launches that run itself checks what those tests check for the price of its own launch."""
    args = task_field(project, "smoke_test_args")
    assert args is not None, f"{project}: its task.py has no TASK = Task(..., smoke_test_args=[...])"
    return args


def task_field(project: Path, name: str, default: object = None) -> object:
    """A field of the baked project's TASK = Task(...), a literal read without importing torch; `default` if the
    call leaves it out."""
    [task] = project.glob("*/task.py")
    for node in ast.parse(task.read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["TASK"]:
            for keyword in node.value.keywords:
                if keyword.arg == name:
                    return ast.literal_eval(keyword.value)
    return default


def readme_block(project: Path, language: str, section: str = "## Make it yours", file: str = "README.md") -> str:
    """The first ```language block of a baked project's README (or another of its Markdown files) after the
    heading `section`."""
    text = (project / file).read_text()
    return re.search(rf"```{language}\n(.*?)```", text[text.index(section):], re.DOTALL)[1]


def example_diff(project: Path, name: str) -> str:
    """A baked project's examples/<name>/change.diff, the change its README says to apply with `patch -p1`."""
    return (project / "examples" / name / "change.diff").read_text()


def with_task_code(project: Path, folder: Path, code: str) -> Path:
    """A copy of a baked project in `folder`, with `code` appended to its task.py (a user's edit: a model, a
    hook that replaces the task's own)."""
    copy = shutil.copytree(project, folder / "project")
    [task] = copy.glob("*/task.py")
    task.write_text(task.read_text() + code)
    return copy


def main_in_this_process(baked_train, args: list[str], capsys) -> subprocess.CompletedProcess:
    """train.py's main(args) where it ends before training starts (--help, a usage error), as a finished
    process: its exit status, stdout and stderr."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # main() points logging at this test's captured stderr
    try:
        with warnings.catch_warnings():  # torch's @record cannot enable faulthandler on captured stderr
            warnings.filterwarnings("ignore", "Unable to enable fault handler")
            baked_train.main(args)
        status = 0  # torch's @record returns where SystemExit(0) was raised (argparse's --help)
    except SystemExit as exit_status:
        status = exit_status.code
    finally:
        root.handlers[:], root.level = handlers, level
    assert "watchdog" not in [thread.name for thread in threading.enumerate()], "ended before train()"
    output = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, output.out, output.err)


REBUILT_AS_SAVED = """
import sys

import torch

saved = torch.load(sys.argv[2], weights_only=True)["model"]
state = model.state_dict()
assert not model.training and state.keys() == saved.keys(), (sorted(state), sorted(saved))
assert all(torch.equal(state[name], saved[name]) for name in saved), "other weights"
print("rebuilt", len(saved))
"""


def assert_the_readme_rebuilds_the_trained_model(project: Path, ckpt_dir: Path, step: int, scratch: Path) -> None:
    """The README's inference recipe, run as written in a plain process on `ckpt_dir` (its newest checkpoint: step
    `step`, a DDP file or an FSDP2 folder), gives the model that checkpoint holds: rebuilt from its recorded options
    and training set, in eval mode, with the weights as trained."""
    from .checkpoints import checkpoint_state

    recipe = readme_block(project, "python", "For inference, one call rebuilds")
    assert 'trained_model(TASK, TrainOptions, "checkpoints")' in recipe, recipe
    script = "import sys\n" + recipe.replace('"checkpoints")', "sys.argv[1], trained=True)") + REBUILT_AS_SAVED
    whole = ckpt_dir / f"step-{step}.pt"
    if not whole.exists():  # an FSDP2 folder, made one file by torch's converter
        checkpoint_state(ckpt_dir, step, scratch)
        whole = scratch / f"{ckpt_dir.name}-{step}.pt"
    result = run(["python", "-c", script, str(ckpt_dir), str(whole)], cwd=project)
    assert result.returncode == 0 and "rebuilt" in result.stdout, result.stdout + result.stderr[-3000:]
