"""Free text with quotes, shell syntax and unicode lands in every generated file as inert text."""

from __future__ import annotations

import json
import zipfile

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from helpers import build_wheel, run

AUTHOR = "O'Brien \"the $(whoami)\" 🐍"
MARKDOWN_SPECIAL = "\\`*_{}[]<>()#+!|"


def markdown_literal(text: str) -> str:
    """What the README title must be: every Markdown-special character backslash-escaped."""
    return "".join("\\" + char if char in MARKDOWN_SPECIAL else char for char in text)


@pytest.fixture(scope="module")
def odd_project(bake, tmp_path_factory):
    canary = tmp_path_factory.mktemp("canary") / "pwned"
    name = f"Tom's \"\"\"DDP\"\"\" $(touch {canary}) `touch {canary}` back\\slash ünïcödé 🚀 <b>&amp;"
    project = bake(project_name=name, author=AUTHOR)
    return project, name, canary


def test_odd_text_was_never_executed(odd_project):
    _, _, canary = odd_project
    assert not canary.exists()


def test_odd_text_round_trips_through_toml(odd_project):
    project, name, _ = odd_project
    metadata = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert metadata["description"] == name
    assert metadata["authors"] == [{"name": AUTHOR}]


def test_odd_text_round_trips_through_python(odd_project):
    project, name, _ = odd_project
    package = next(path.parent.name for path in project.glob("*/options.py"))
    result = run(["python", "-c", f"import {package}; print({package}.PROJECT_NAME)"], cwd=project)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == name


def test_odd_text_is_literal_in_markdown(odd_project):
    project, name, _ = odd_project
    title = (project / "README.md").read_text().splitlines()[0]
    assert title == f"# {markdown_literal(name)}"
    assert "\\`touch" in title and "\\<b\\>" in title  # no code span, no raw HTML


def test_odd_text_round_trips_through_the_recorded_answers(odd_project):
    project, name, _ = odd_project
    answers = json.loads((project / ".cookiecutter.json").read_text())
    assert (answers["project_name"], answers["author"]) == (name, AUTHOR)


def test_odd_project_compiles_lints_and_shows_help(odd_project):
    project, _, _ = odd_project
    for command in (["python", "-m", "compileall", "-q", "."], ["ruff", "check", "."],
                    ["shellcheck", "run_node.sh"], ["python", "train.py", "--help"]):
        result = run(command, cwd=project)
        assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"


def test_odd_text_survives_packaging(odd_project, tmp_path):
    project, name, _ = odd_project
    wheel = build_wheel(project, tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [entry for entry in archive.namelist() if entry.endswith(".dist-info/METADATA")]
        assert f"Summary: {name}" in archive.read(metadata).decode()
