"""Bad answers are refused by the pre-generation hook: one ERROR line naming the answer, and no folder."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from helpers import TEMPLATE_ROOT, bake_with_cli, import_hook

HOOK = import_hook("pre_gen_project")
# The default answers as cookiecutter renders them (the first of each choice).
DEFAULTS = {**{name: value[0] if isinstance(value, list) else value
               for name, value in json.loads((TEMPLATE_ROOT / "cookiecutter.json").read_text()).items()
               if not name.startswith("_")},
            "project_slug": "ddp-training", "package_name": "ddp_training"}


def assert_left_behind(folder: Path, expected: set[str], timeout: float = 10) -> None:
    """Cookiecutter makes every parent of the project folder before the hook refuses; the hook's cleanup of
    the empty ones runs just after cookiecutter exits, so allow it a moment."""
    deadline = time.monotonic() + timeout
    while (left := {str(path.relative_to(folder)) for path in folder.rglob("*")}) != expected:
        assert time.monotonic() < deadline, f"a refused bake left {sorted(left)} in {folder}"
        time.sleep(0.05)

INVALID_ANSWERS = [
    ({"project_slug": "My Project"}, "project_slug", "safe folder name"),
    ({"project_slug": "../escape"}, "project_slug", "safe folder name"),
    ({"project_slug": "a/b"}, "project_slug", "safe folder name"),  # cookiecutter would make a/ first
    ({"project_name": "   "}, "project_name", "must not be empty"),
    ({"project_name": "two\nlines"}, "project_name", "control characters"),
    ({"author": "tab\there"}, "author", "control characters"),
    ({"package_name": "1abc"}, "package_name", "not a Python identifier"),
    ({"package_name": "my-pkg"}, "package_name", "not a Python identifier"),
    ({"package_name": "class"}, "package_name", "keyword"),
    ({"package_name": "torch"}, "package_name", "shadow"),
    ({"package_name": "torchvision"}, "package_name", "shadow"),
    ({"package_name": "logging"}, "package_name", "shadow"),
    ({"package_name": "json"}, "package_name", "shadow"),
    ({"package_name": "MyPkg"}, "package_name", "capitals"),
    ({"package_name": "p" * 33}, "package_name", "longer than 32"),
    ({"rdzv_port": "0"}, "rdzv_port", "between 1 and 65535"),
    ({"rdzv_port": "65536"}, "rdzv_port", "between 1 and 65535"),
    ({"rdzv_port": "http"}, "rdzv_port", "between 1 and 65535"),
    ({"nnodes": "0"}, "nnodes", "1 <= MIN <= MAX"),
    ({"nnodes": "4:2"}, "nnodes", "1 <= MIN <= MAX"),
    ({"nnodes": "two"}, "nnodes", "MIN:MAX"),
    ({"nnodes": "1:"}, "nnodes", "MIN:MAX"),
    ({"nproc_per_node": "0"}, "nproc_per_node", "auto, gpu, cpu or a whole number"),
    ({"nproc_per_node": "tpu"}, "nproc_per_node", "auto, gpu, cpu or a whole number"),
    ({"max_restarts": "-1"}, "max_restarts", "whole number >= 0"),
    ({"gpus_per_node": "-1"}, "gpus_per_node", "whole number >= 0"),
    ({"gpus_per_node": "eight"}, "gpus_per_node", "whole number >= 0"),
    ({"fault_tolerance": "elastic"}, "fault_tolerance", "must be restart or torchft"),
    ({"fault_tolerance": "torchft", "use_streaming": "yes"}, "fault_tolerance", "map-style training sets only"),
]


def test_the_default_answers_pass():
    assert HOOK.problems(DEFAULTS) == []


@pytest.mark.parametrize("answers, variable, message", INVALID_ANSWERS,
                         ids=[f"{v}={next(iter(a.values()))!r}" for a, v, _ in INVALID_ANSWERS])
def test_invalid_answer_is_refused(answers, variable, message):
    refused = HOOK.problems({**DEFAULTS, **answers})
    assert [name for name, _ in refused] == [variable], refused
    assert message in refused[0][1], refused


def test_a_refused_bake_prints_one_error_line_per_answer_and_leaves_nothing(tmp_path):
    # Through the cookiecutter command, as a user meets it (package_name derives from the bad slug).
    result = bake_with_cli(tmp_path, project_slug="a/b", rdzv_port="http")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
    assert any(line.startswith("ERROR: project_slug: ") and "safe folder name" in line for line in errors)
    assert "ERROR: rdzv_port: 'http' must be a TCP port between 1 and 65535" in errors, result.stderr
    assert all(re.match(r"ERROR: [a-z_]+: \S", line) for line in errors), result.stderr
    assert_left_behind(tmp_path, set())


def test_refused_nested_slug_removes_only_the_folders_the_bake_made(tmp_path):
    existing = tmp_path / "existing_empty"
    existing.mkdir()
    result = bake_with_cli(existing, project_slug="a/b/c")
    assert result.returncode != 0 and "ERROR: project_slug: " in result.stderr, result.stderr
    assert_left_behind(tmp_path, {"existing_empty"})  # the output folder existed before the bake: it stays

    (existing / "x").mkdir()
    (existing / "x" / "notes.txt").write_text("ours")
    result = bake_with_cli(existing, project_slug="x/y/z")
    assert result.returncode != 0 and "ERROR: project_slug: " in result.stderr, result.stderr
    assert_left_behind(tmp_path, {"existing_empty", "existing_empty/x", "existing_empty/x/notes.txt"})


def test_project_name_without_any_letters_is_refused(tmp_path):
    # No slug can be derived from "$$$"; the user is told why instead of getting an odd folder name.
    result = bake_with_cli(tmp_path, project_name="$$$")
    assert result.returncode != 0
    assert "ERROR: project_name: '$$$' needs at least one letter or digit" in result.stderr
    assert list(tmp_path.iterdir()) == []
