"""Baking the template: the command line, the hooks as modules, a built wheel."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

from .environment import BIN, TEMPLATE_ROOT, run


def import_hook(name: str) -> ModuleType:
    """hooks/<name>.py as a module, unrendered: the hooks read the answers only when run as a script, so their
    functions are called here directly, without a bake."""
    spec = importlib.util.spec_from_file_location(name, TEMPLATE_ROOT / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bake_command(output_dir: Path, *options: str, template: Path = TEMPLATE_ROOT, **answers: str) -> list[str]:
    """The cookiecutter command a user types: no prompts, answers as key=value, extra options (-f) first."""
    return [str(BIN / "cookiecutter"), "--no-input", *options, "--output-dir", str(output_dir), str(template),
            *(f"{key}={value}" for key, value in answers.items())]


def bake_with_cli(output_dir: Path, *options: str, template: Path = TEMPLATE_ROOT,
                  **answers: str) -> subprocess.CompletedProcess:
    """Bake exactly as a user does, with output captured (not a terminal)."""
    return run(bake_command(output_dir, *options, template=template, **answers), cwd=output_dir, timeout=120)


def build_wheel(project: Path, wheel_dir: Path) -> Path:
    """Build the generated project's wheel, as `pip install .` would; returns its path."""
    result = run(["python", "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheel_dir), "."],
                 cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = wheel_dir.glob("*.whl")
    return wheel
