"""Baking: the exact file set, every choice value, nothing left unrendered, lint-clean output."""

from __future__ import annotations

import re
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import build_wheel, run

DEFAULT_FILES = {
    ".gitignore", "README.md", "pyproject.toml", "run_node.sh", "train.py", "slurm/train.sbatch",
    "tests/harness.py", "tests/test_smoke.py",
    *(f"ddp_training/{name}.py" for name in
      ("__init__", "checkpoint", "data", "distributed", "errors", "evaluation", "export", "metrics", "model",
       "optim", "options", "parallel", "precision", "preflight", "progress", "reporting", "reproducibility",
       "sharded_checkpoint")),
}

# Every value class each answer admits; each is baked and checked.
CHOICES = [
    {"nnodes": "1"}, {"nnodes": "2"}, {"nnodes": "1:4"},
    {"nproc_per_node": "auto"}, {"nproc_per_node": "gpu"}, {"nproc_per_node": "cpu"}, {"nproc_per_node": "8"},
    {"rdzv_port": "1"}, {"rdzv_port": "65535"}, {"max_restarts": "0"}, {"max_restarts": "10"},
]


def project_files(project: Path) -> set[str]:
    return {str(path.relative_to(project)) for path in project.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and ".pytest_cache" not in path.parts}


def assert_fully_rendered(project: Path) -> None:
    for name in project_files(project):
        text = (project / name).read_text()
        for marker in ("{{", "{%", "{#", "cookiecutter."):
            assert marker not in text, f"{name} still holds {marker!r}"


def test_default_bake_has_exact_file_set(default_project):
    assert default_project.name == "ddp-training"
    assert project_files(default_project) == DEFAULT_FILES


def test_default_bake_is_fully_rendered(default_project):
    assert_fully_rendered(default_project)


def test_scripts_are_executable(default_project):
    for name in ("run_node.sh", "train.py", "slurm/train.sbatch"):
        assert (default_project / name).stat().st_mode & 0o111, f"{name} lacks run bits"


def test_generated_pyproject_asks_for_any_recent_torch(default_project):
    project = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]
    assert "torch>=2.6" in project["dependencies"]
    assert project["requires-python"] == ">=3.10"
    assert project["name"] == "ddp-training"
    assert set(project["optional-dependencies"]["dev"]) >= {"pytest>=8", "ruff>=0.5"}


def test_generated_project_builds_a_wheel_of_its_package(default_project, tmp_path):
    wheel = build_wheel(default_project, tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"ddp_training/{name}.py" for name in ("options", "distributed", "checkpoint")} <= set(names)


def test_generated_project_is_lint_clean(default_project):
    ruff = run(["ruff", "check", "."], cwd=default_project)
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr
    shellcheck = run(["shellcheck", "run_node.sh"], cwd=default_project)
    assert shellcheck.returncode == 0, shellcheck.stdout + shellcheck.stderr


@pytest.mark.parametrize("answers", CHOICES, ids=lambda answers: "-".join(f"{k}={v}" for k, v in answers.items()))
def test_every_choice_bakes_into_run_node_defaults(bake, answers):
    project = bake(**answers)
    assert project_files(project) == DEFAULT_FILES  # nothing to prune for these answers
    assert_fully_rendered(project)
    script = (project / "run_node.sh").read_text()
    [(name, value)] = answers.items()
    expected = {
        "nnodes": f'NNODES="${{NNODES:-{value}}}"',
        "nproc_per_node": f'NPROC_PER_NODE="${{NPROC_PER_NODE:-{value}}}"',
        "rdzv_port": f'DEFAULT_RDZV_PORT="{value}"',
        "max_restarts": f'MAX_RESTARTS="${{MAX_RESTARTS:-{value}}}"',
    }[name]
    assert expected in script
    shellcheck = run(["shellcheck", "run_node.sh"], cwd=project)
    assert shellcheck.returncode == 0, shellcheck.stdout


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_strategy_answer_is_the_default_of_the_strategy_flag(bake, strategy):
    project = bake(strategy=strategy)
    assert project_files(project) == DEFAULT_FILES  # both strategies ship both checkpoint formats
    assert_fully_rendered(project)
    result = run(["python", "train.py", "--help"], cwd=project)
    assert result.returncode == 0, result.stderr
    assert re.search(rf"--strategy \{{ddp,fsdp2\}}.*?\(default: {strategy}\)", result.stdout, re.DOTALL)
