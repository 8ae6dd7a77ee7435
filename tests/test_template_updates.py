"""Keeping a project up with the template: real cruft (create, update, check, diff, link) on real git repos.

The template is copied into a temporary git repository so that a test can commit a newer version of it, the
way a template's maintainers do, and update a project baked from the older one.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from helpers import BIN, TEMPLATE_ROOT, bake_with_cli, run, run_in_terminal

# The tilde is not Markdown-special in the first template version; the newer one escapes it (below).
PROJECT_NAME = 'Tom\'s ~DDP~ "runs" 🚀'
# Commits need an identity, and a user's global git config (signing, hooks) must not leak into the tests.
GIT_ENV = {"GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "test@example.com", "GIT_COMMITTER_NAME": "Test",
           "GIT_COMMITTER_EMAIL": "test@example.com", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def checked(command: list[str], cwd: Path) -> str:
    result = run(command, cwd=cwd, timeout=120, **GIT_ENV)
    assert result.returncode == 0, f"{command}:\n{result.stdout}{result.stderr}"
    return result.stdout + result.stderr


def git(cwd: Path, *args: str) -> str:
    return checked(["git", *args], cwd)


def cruft(cwd: Path, *args: str) -> str:
    return checked([str(BIN / "cruft"), *args], cwd)


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "--all")
    git(repo, "commit", "--quiet", "--message", message)
    return git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture
def template_repo(tmp_path) -> Path:
    """A git repository holding this template (as it is on disk now) in one commit."""
    def not_template(folder: str, names: list[str]) -> set[str]:
        caches = {"__pycache__", ".pytest_cache", ".ruff_cache"}
        if Path(folder) == TEMPLATE_ROOT:  # the repository's own tooling, not what cookiecutter reads
            caches |= {".git", ".venv", "build", "tests", "benchmarks"}
        return caches & set(names)

    repo = tmp_path / "template"
    shutil.copytree(TEMPLATE_ROOT, repo, ignore=not_template)
    git(repo, "init", "--quiet")
    commit_all(repo, "template v1")
    return repo


def cruft_create(template: Path, output_dir: Path, **answers: str) -> Path:
    output_dir.mkdir()
    cruft(output_dir, "create", "--no-input", "--extra-context", json.dumps(answers), str(template))
    [project] = output_dir.iterdir()
    return project


def release_template_v2(repo: Path) -> str:
    """A newer template: it escapes one more character in Markdown (a change to how the template renders
    text, wherever it keeps that rule), its post-generation hook makes a new script executable, and the
    project gains that script."""
    holders = [path for path in repo.rglob("*") if path.is_file() and ".git" not in path.relative_to(repo).parts
               and "[]<>()#+!|" in path.read_text()]
    assert len(holders) == 1, f"expected one file holding the Markdown escape set, found {holders}"
    [holder] = holders
    holder.write_text(holder.read_text().replace("[]<>()#+!|", "[]<>()#+!|~", 1))
    hook = repo / "hooks" / "post_gen_project.py"
    hook.write_text(hook.read_text().replace('EXECUTABLES = ["run_node.sh"', 'EXECUTABLES = ["tools/check.sh", '
                                                                            '"run_node.sh"', 1))
    assert '"tools/check.sh"' in hook.read_text()
    [project_template] = [path for path in repo.iterdir() if path.name.startswith("{{")]
    script = project_template / "tools" / "check.sh"
    script.parent.mkdir()
    script.write_text("#!/usr/bin/env bash\necho checked\n")
    return commit_all(repo, "template v2")


def test_cruft_update_brings_template_changes_and_keeps_user_edits(template_repo, tmp_path):
    project = cruft_create(template_repo, tmp_path / "projects", project_name=PROJECT_NAME, nnodes="2")
    assert (project / "tests" / "harness.py").exists()  # the whole template was copied
    title = (project / "README.md").read_text().splitlines()[0]
    assert "~DDP~" in title  # v1 leaves the tilde alone
    git(project, "init", "--quiet")
    commit_all(project, "baked")
    readme = project / "README.md"
    readme.write_text(readme.read_text() + "\n## Our cluster\n\nAlways run with `--precision bf16`.\n")
    commit_all(project, "our notes")

    new_commit = release_template_v2(template_repo)
    status, output = run_in_terminal([str(BIN / "cruft"), "update", "--skip-apply-ask"], cwd=project, **GIT_ENV)
    assert status == 0, output
    assert "Good work!" in output, output
    assert "Next steps" not in output and "Created " not in output, output  # the hook's text is for bakes

    lines = readme.read_text().splitlines()
    assert lines[0] == title.replace("~", "\\~"), "the newer template's escaping must apply"
    assert "Always run with `--precision bf16`." in lines, "the user's edit must survive the update"
    assert (project / "tools" / "check.sh").stat().st_mode & stat.S_IXUSR, "the newer hook must have run"
    assert json.loads((project / ".cruft.json").read_text())["commit"] == new_commit
    assert "NNODES:-2" in (project / "run_node.sh").read_text(), "the answers must be kept"
    assert not list(project.rglob("*.rej")), "the update must apply without conflicts"
    assert "is up to date" in cruft(project, "check")  # and exits 0


def test_cruft_update_from_a_bake_made_before_the_template_folder_was_renamed(template_repo, tmp_path):
    # Before the rename the project folder was `{{cookiecutter.__project_folder}}`, a private variable that
    # .cruft.json of such a bake still records. Rebuild that layout as the old version, and update to today's.
    today = {path.relative_to(template_repo): path.read_bytes() for path in template_repo.rglob("*")
             if path.is_file() and ".git" not in path.relative_to(template_repo).parts}
    git(template_repo, "mv", "{{cookiecutter.project_slug}}", "{{cookiecutter.__project_folder}}")
    questions = json.loads((template_repo / "cookiecutter.json").read_text())
    questions = {**{key: value for key, value in questions.items() if key != "__prompts__"},
                 "__project_folder": "{{ cookiecutter.project_slug | replace('/', '-') }}",
                 "__prompts__": questions["__prompts__"]}
    (template_repo / "cookiecutter.json").write_text(json.dumps(questions, indent=2))
    commit_all(template_repo, "template before the rename")
    project = cruft_create(template_repo, tmp_path / "projects", project_name=PROJECT_NAME, strategy="fsdp2")
    assert "__project_folder" in json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]
    git(project, "init", "--quiet")
    commit_all(project, "baked")
    train = project / "train.py"
    train.write_text(train.read_text() + "# our change\n")
    commit_all(project, "our change")

    git(template_repo, "rm", "-r", "--quiet", ".")
    for relative, content in today.items():
        (template_repo / relative).parent.mkdir(parents=True, exist_ok=True)
        (template_repo / relative).write_bytes(content)
    new_commit = commit_all(template_repo, "template folder renamed")
    status, output = run_in_terminal([str(BIN / "cruft"), "update", "--skip-apply-ask"], cwd=project, **GIT_ENV)
    assert status == 0, output
    assert json.loads((project / ".cruft.json").read_text())["commit"] == new_commit
    assert train.read_text().endswith("# our change\n"), "the user's edit must survive the update"
    assert sorted(path.name for path in (tmp_path / "projects").iterdir()) == [project.name]
    assert not list(project.rglob("*.rej")), "the update must apply without conflicts"
    assert "is up to date" in cruft(project, "check")
    status, output = run_in_terminal([str(BIN / "cruft"), "diff", "--exit-code"], cwd=project, **GIT_ENV)
    assert status != 0 and "# our change" in output, output  # the only difference is the user's


def test_cruft_diff_output_is_only_the_diff(template_repo, tmp_path):
    project = cruft_create(template_repo, tmp_path / "projects")
    (project / "train.py").write_text((project / "train.py").read_text() + "# our change\n")
    status, output = run_in_terminal([str(BIN / "cruft"), "diff"], cwd=project, **GIT_ENV)
    assert status == 0, output
    assert "# our change" in output, output
    assert "Next steps" not in output and "Created " not in output, output


def keep_up_commands(project: Path) -> list[str]:
    """The commands of the generated README's "Keep up with the template" section, but `pip install`."""
    section = (project / "README.md").read_text().split("\n## Keep up with the template\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if not line.startswith("pip install")]


def test_readme_commands_link_a_plain_bake_with_its_answers(template_repo, tmp_path):
    answers = {"project_name": PROJECT_NAME, "author": "Ada \"A\" Lovelace", "nnodes": "1:4",
               "use_kubernetes": "yes", "strategy": "fsdp2", "gpus_per_node": "4"}
    result = bake_with_cli(tmp_path, template=template_repo, **answers)
    assert result.returncode == 0, result.stderr
    [project] = [path for path in tmp_path.iterdir() if path != template_repo]
    recorded = json.loads((project / ".cookiecutter.json").read_text())
    assert {key: recorded[key] for key in answers} == answers
    public = {key for key in json.loads((template_repo / "cookiecutter.json").read_text()) if not key.startswith("_")}
    assert set(recorded) == public, "every answer, and nothing but answers"

    commands = keep_up_commands(project)
    assert [command.split()[:2] for command in commands] == [["cruft", "link"], ["cruft", "diff"],
                                                             ["cruft", "check"], ["cruft", "update"]]
    for command in commands:  # as a user runs them: bash, with TEMPLATE replaced by the template's address
        checked(["bash", "-c", command.replace("TEMPLATE", str(template_repo))], cwd=project)
    # The link took the recorded answers, not the defaults, so `cruft diff --exit-code` above found nothing.
    linked = json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]
    assert {key: linked[key] for key in answers} == answers
