"""Baking: the exact file set, every choice value, nothing left unrendered, lint-clean output."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from helpers import (
    TEMPLATE_ROOT,
    bake_command,
    build_wheel,
    import_hook,
    main_in_this_process,
    run,
    run_in_terminal,
)

DEFAULT_FILES = {
    ".cookiecutter.json", ".dockerignore", ".gitignore", "Dockerfile", "MANIFEST.in", "README.md", "pyproject.toml",
    "run_node.sh", "train.py",
    "slurm/train.sbatch",
    *(f"docs/{name}.md" for name in ("containers-and-schedulers", "experiments", "failures", "installing", "monitoring",
                                     "performance", "several-machines")),
    *(f"examples/{name}/{file}" for name in ("regression", "dict-batches", "whole-set-metric", "gan", "distillation",
                                             "lora", "two-optimizers", "ema", "loss-weight", "contrastive",
                                             "mixture-of-experts", "curriculum", "word-language-model")
      for file in ("README.md", "change.diff")),
    "tests/harness.py", "tests/test_smoke.py",
    *(f"ddp_training/{name}.py" for name in
      ("__init__", "options", "spec", "step", "task")),
    # The engine: what every run uses, importing nothing around it.
    *(f"ddp_training/engine/{name}.py" for name in
      ("__init__", "checkpoint/__init__", "checkpoint/common", "checkpoint/replicated", "checkpoint/sharded",
       "checkpoint/folder", "checkpoint/weights", "cli", "collectives", "data", "distributed", "errors", "evaluation",
       "failure", "flags", "metrics", "optim", "optimizers", "parallel", "processes", "replicas", "reproducibility",
       "selection", "task_state", "tasks", "watchdog")),
}

# Every value class each answer admits; each is baked and checked.
CHOICES = [
    {"nnodes": "1"}, {"nnodes": "2"}, {"nnodes": "1:4"},
    {"nproc_per_node": "auto"}, {"nproc_per_node": "gpu"}, {"nproc_per_node": "cpu"}, {"nproc_per_node": "8"},
    {"rdzv_port": "1"}, {"rdzv_port": "65535"}, {"max_restarts": "0"}, {"max_restarts": "10"},
]


def test_the_examples_diffs_match_the_code_they_edit():
    # The examples' change.diff files are diffs of task.py, train.py and optim.py,
    # regenerated from the template's sources by tools/example_diffs.py, which this runs in --check mode.
    result = run([sys.executable, "tools/example_diffs.py", "--check"], cwd=TEMPLATE_ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_examples_apply_and_lint_in_a_bake_with_streamed_training_sets_too(bake, tmp_path):
    # Its task.py has more imports and datasets, so each change.diff holds a second diff, made on its code.
    for task, own in (("image_classification", POST_GEN.IMAGE_TASK_EXAMPLES),
                      ("language_model", POST_GEN.LANGUAGE_MODEL_EXAMPLES)):
        project = bake(use_streaming="yes", task=task, project_name=f"Streamed Examples {task[:5]}")
        examples = sorted((project / "examples").iterdir())
        # + loss-weight (it edits train.py), and ema, lora and mixture-of-experts (a diff for each task)
        assert len(examples) == len(own) + 4
        for example in examples:
            copy = shutil.copytree(project, tmp_path / task / example.name, ignore=shutil.ignore_patterns("examples"))
            patched = run(["patch", "-p1", "-i", str(example / "change.diff")], cwd=copy)
            assert patched.returncode == 0, (task, example.name, patched.stdout + patched.stderr)
            lint = run(["ruff", "check", "--no-cache", "."], cwd=copy)
            assert lint.returncode == 0, (task, example.name, lint.stdout)


def test_template_top_level_is_the_cards_layout():
    tracked = run(["git", "ls-files"], cwd=TEMPLATE_ROOT, timeout=30).stdout.split()
    top_level = {name.split("/", 1)[0] for name in tracked}
    assert top_level == {
        "cookiecutter.json", "hooks", "{{cookiecutter.project_slug}}", "tests", "README.md",  # the card's five
        "Makefile", "benchmarks", "tools", ".ci", "pyproject.toml", "requirements-dev.txt", ".gitignore",  # our tooling
    }


def project_files(project: Path) -> set[str]:
    return {str(path.relative_to(project)) for path in project.rglob("*")
            if path.is_file() and not {"__pycache__", ".pytest_cache", "hang-reports"} & set(path.parts)}


def assert_fully_rendered(project: Path) -> None:
    for name in project_files(project):
        text = (project / name).read_text().replace(".cookiecutter.json", "")  # a file name, not a leftover
        for marker in ("{{", "{%", "{#", "cookiecutter."):
            assert marker not in text, f"{name} still holds {marker!r}"


def test_default_bake_has_exact_file_set(default_project):
    assert default_project.name == "ddp-training"
    assert project_files(default_project) == DEFAULT_FILES


def test_default_and_full_bakes_are_fully_rendered(default_project, full_project):
    assert_fully_rendered(default_project)
    assert_fully_rendered(full_project)  # every optional part with Python of its own
    assert project_files(full_project) - project_files(default_project) == {
        "docs/export.md",
        *(f"ddp_training/{name}.py" for name in ("export", "preflight", "profiling", "engine/trackers"))}


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
    assert {f"ddp_training/{name}.py" for name in ("options", "engine/distributed", "engine/checkpoint/__init__")
            } <= set(names)
    # What docs/installing.md says `pip install .` gives: the package, nothing else.
    assert {name.split("/")[0] for name in names} == {"ddp_training", "ddp_training-0.1.0.dist-info"}
    assert "`pip install .` (or the wheel `python -m build` makes) installs the `ddp_training` package" in \
        (default_project / "docs" / "installing.md").read_text()


def test_sdist_holds_what_the_project_runs_and_its_tests_need(default_project, tmp_path):
    project = shutil.copytree(default_project, tmp_path / "project")  # the build writes egg-info and dist/
    build = run(["python", "-m", "build", "--sdist", "--no-isolation", "."], cwd=project)
    assert build.returncode == 0, build.stdout + build.stderr
    [sdist] = (project / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        # filter= came in 3.11.4 (Debian 12's python3 is 3.11.2); our own sdist needs no filtering.
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(tmp_path / "unpacked", **safe)
    [unpacked] = (tmp_path / "unpacked").iterdir()
    assert {"train.py", "run_node.sh", "slurm/train.sbatch", "tests/harness.py", "tests/test_smoke.py",
            "ddp_training/options.py"} <= project_files(unpacked)
    collected = run(["python", "-m", "pytest", "--collect-only", "-q"], cwd=unpacked)
    assert collected.returncode == 0, collected.stdout + collected.stderr  # harness.py imports

    # What building leaves behind is ignored by git: dist/, build/, *.egg-info/.
    run(["git", "init", "--quiet"], cwd=project)
    status = run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=project)
    assert status.returncode == 0, status.stderr
    untracked = {line[3:] for line in status.stdout.splitlines()}
    assert untracked == DEFAULT_FILES, "only the project's own files may show up in git"


def test_the_dockerfile_copies_what_exists_and_runs_the_projects_launch_command(bake):
    # No Docker engine on the machines that run this suite: the Dockerfile is read with Docker's own parser
    # (the `dockerfile` package wraps it), and what it names is checked against the bake.
    import dockerfile

    project = bake(use_kubernetes="yes", project_name="In A Container")

    commands = dockerfile.parse_file(str(project / "Dockerfile"))
    assert [(c.cmd, c.value) for c in commands[:2]] == [("ARG", ("BASE=python:3.11-slim",)), ("FROM", ("${BASE}",))]
    for copy in (c for c in commands if c.cmd == "COPY"):
        *sources, _ = copy.value
        assert all((project / source).exists() for source in sources), copy.original
    torch, dependencies, package = (c.value[0] for c in commands if c.cmd == "RUN")
    assert 'pip install --index-url "${TORCH_INDEX}" torch torchvision' in torch
    assert "tomllib" in dependencies and package == "pip install --no-deps ."
    [entry] = [c for c in commands if c.cmd == "ENTRYPOINT"]
    assert entry.json and entry.value == ("./run_node.sh",) and (project / "run_node.sh").stat().st_mode & 1
    # The manifest runs torchrun in the image's working folder, where train.py is.
    assert [c.value for c in commands if c.cmd == "WORKDIR"] == [("/app",)]
    manifest = (project / "k8s" / "pytorchjob.yaml").read_text()
    assert 'command: ["torchrun", "train.py"]' in manifest and "./Dockerfile" in manifest
    ignored = (project / ".dockerignore").read_text().split()
    assert {"checkpoints/", "runs/", ".git/"} <= set(ignored)


def test_recorded_answers_are_every_answer_given(default_project):
    assert json.loads((default_project / ".cookiecutter.json").read_text()) == {
        "project_name": "DDP Training", "project_slug": "ddp-training", "package_name": "ddp_training",
        "author": "Your Name", "nnodes": "1", "nproc_per_node": "auto", "rdzv_port": "29400", "max_restarts": "3",
        "gpus_per_node": "8", "use_slurm": "yes", "use_kubernetes": "no", "use_docker": "yes", "use_preflight": "no",
        "use_profiling": "no", "use_export": "no", "use_trackers": "no", "use_streaming": "no",
        "strategy": "ddp", "task": "image_classification", "fault_tolerance": "restart"}


POST_GEN = import_hook("post_gen_project")


def test_next_steps_are_printed_for_a_person_only(tmp_path):
    (tmp_path / "terminal").mkdir()
    status, output = run_in_terminal(bake_command(tmp_path / "terminal"), cwd=tmp_path / "terminal")
    assert status == 0, output
    assert "Next steps:" in output and f"cd {tmp_path / 'terminal' / 'ddp-training'}" in output, output
    # Output captured by a log, a CI job, another program: nothing; and nothing for cruft's throwaway renders
    # in the temporary folder (cruft adds _commit to the answers), which would say `cd` to a deleted folder.
    assert not POST_GEN.a_person_is_reading(tmp_path, {}, terminal=False)
    assert not POST_GEN.a_person_is_reading(tmp_path, {"_commit": "0123abc"}, terminal=True)
    assert POST_GEN.a_person_is_reading(tmp_path, {}, terminal=True)


def test_baking_again_without_slurm_removes_only_the_templates_files(tmp_path):
    # `cookiecutter --overwrite-if-exists ... use_slurm=no` over a project: the template writes its files again,
    # then the hook removes the ones not asked for, and their folder only where that leaves it empty.
    slurm = tmp_path / "slurm"
    slurm.mkdir()
    (slurm / "our_sweep.sbatch").write_text("#!/bin/bash\n")
    answers = {"use_slurm": "no", "use_kubernetes": "yes", "task": "image_classification", "package_name": "p",
               "use_preflight": "no", "use_profiling": "yes", "use_export": "yes", "use_trackers": "yes"}
    for _ in range(2):
        (slurm / "train.sbatch").write_text("#!/bin/bash\n")
        POST_GEN.remove_unwanted_files(tmp_path, answers)
        assert [path.name for path in slurm.iterdir()] == ["our_sweep.sbatch"], "the user's file must stay"
    (slurm / "our_sweep.sbatch").unlink()
    (slurm / "train.sbatch").write_text("#!/bin/bash\n")
    POST_GEN.remove_unwanted_files(tmp_path, answers)
    assert not slurm.exists(), "a folder left empty by the template's own files goes too"
    # A file that serves two answers stays while either is yes: the Kubernetes manifest runs the Dockerfile's image.
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    POST_GEN.remove_unwanted_files(tmp_path, answers | {"use_docker": "no"})
    assert (tmp_path / "Dockerfile").exists()
    POST_GEN.remove_unwanted_files(tmp_path, answers | {"use_docker": "no", "use_kubernetes": "no"})
    assert not (tmp_path / "Dockerfile").exists()


def test_help_shows_each_default_once(baked_train, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse's width, as in a pipe
    result = main_in_this_process(baked_train, ["--help"], capsys)
    assert result.returncode == 0, result.stderr
    # One block per flag: its line and the indented lines of help text below it.
    blocks = re.split(r"\n(?=  -)", result.stdout.split("options:", 1)[1])
    assert len(blocks) > 20
    for block in blocks:
        assert block.count("(default:") <= 1, block
    assert "(default: None)" not in result.stdout
    assert ("--max-steps MAX_STEPS the run's length in optimizer steps, in place of --epochs: the lr warmup and "
            "decay span them") in " ".join(result.stdout.split())


def test_the_torchft_answer_adds_its_module_doc_and_extra_and_nothing_else_names_them(bake, default_project):
    project = bake(fault_tolerance="torchft")
    assert project_files(project) - project_files(default_project) == {"ddp_training/replica_groups.py",
                                                                        "docs/replica-groups.md"}
    assert_fully_rendered(project)
    for check in (["ruff", "check", "--no-cache", "."], ["shellcheck", "run_node.sh"]):
        result = run(check, cwd=project)
        assert result.returncode == 0, result.stdout + result.stderr
    extras = tomllib.loads((project / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["torchft"] == ["torchft-nightly==2026.10.26"]
    # The default bake says nothing of a mode it lacks.
    for name in project_files(default_project):
        text = (default_project / name).read_text().lower()
        assert "torchft" not in text and "replica group" not in text and "replica_group" not in text, name


def test_generated_project_is_lint_clean(default_project, full_project):
    for project in (default_project, full_project):
        ruff = run(["ruff", "check", "."], cwd=project)
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


def test_only_task_py_and_the_docs_differ_between_the_tasks(bake):
    # The package's machinery names no task: options, checkpoints, loop and tests are the same for every task.
    # Fresh bakes (others run the shared one), with export: its docs name the task's model options.
    default_project, language_model = bake(use_export="yes"), bake(task="language_model", use_export="yes")
    image_examples = {name for name in project_files(default_project)  # their diffs edit the image task's task.py
                      if name.split("/")[:2] in (["examples", example] for example in POST_GEN.IMAGE_TASK_EXAMPLES)}
    own = {"ddp_training/sample.py", "ddp_training/prepare.py",  # a language model's text in and out
           *(f"examples/{name}/{file}" for name in POST_GEN.LANGUAGE_MODEL_EXAMPLES for file in ("README.md",
                                                                                                  "change.diff"))}
    assert image_examples
    assert project_files(language_model) == project_files(default_project) - image_examples | own
    differing = {name for name in project_files(language_model) - own
                 if (default_project / name).read_bytes() != (language_model / name).read_bytes()}
    # pyproject.toml and the Dockerfile: torchvision, which only the image task needs. The docs: the task's
    # throughput unit and its exported model's options.
    assert differing == {"ddp_training/task.py", "README.md", "docs/export.md", "docs/monitoring.md",
                         ".cookiecutter.json", "pyproject.toml", "Dockerfile",
                         *(f"examples/{name}/{file}" for name in ("ema", "lora", "mixture-of-experts")
                           for file in ("README.md", "change.diff"))}, differing  # (each task's own diff)


def test_generated_code_cites_no_template_issue_or_folder(bake):
    # A user's project has neither the template's issues nor its benchmarks/ folder.
    for project in (bake(), bake(task="language_model", strategy="fsdp2", use_kubernetes="yes")):
        for name in project_files(project):
            text = (project / name).read_text()
            assert not re.search(r"\bissues? #?\d+|\bbenchmarks/", text, re.IGNORECASE), name



def runtime_imports(project: Path, module: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import a module of `project` makes when it runs, relative ones resolved
    against its package; those under `if TYPE_CHECKING:` (for annotations only) are left out."""
    import ast

    tree = ast.parse(module.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for node in ast.walk(block)}
    package = list(module.relative_to(project).parent.parts)
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
            continue
        base = package[:len(package) - node.level + 1] if node.level else []
        found += [(node.lineno, ".".join([*base, *([node.module] if node.module else [])]))]
    return found


@pytest.mark.parametrize("answers", ["full", {"task": "language_model", "use_streaming": "yes"},
                                     {"fault_tolerance": "torchft"}])
def test_the_engine_imports_nothing_around_it(bake, full_project, answers):
    # engine/ is what no change touches: a module of it that imported task.py, options.py or spec.py when it
    # runs would make the fence a fiction (an edit there could break a guarantee, and import circles appear).
    project = full_project if answers == "full" else bake(**answers, project_name="Fenced In")
    package = next(project.glob("*/engine")).parent.name
    modules = sorted((project / package / "engine").rglob("*.py"))
    assert len(modules) > 20
    for module in modules:
        for line, imported in runtime_imports(project, module):
            parts = imported.split(".")
            assert parts[0] != package or parts[:2] == [package, "engine"], \
                f"{module.relative_to(project)}:{line} imports {imported}, outside the engine"
