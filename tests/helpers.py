"""What the tests share besides fixtures: launching jobs and bakes, waiting on them, faults, and comparing
checkpoints. Fixtures and pytest hooks live in conftest.py."""

from __future__ import annotations

import contextlib
import logging
import os
import pty
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

TEMPLATE_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the one venv the suite runs in: cookiecutter, torchrun, ruff, shellcheck


# .ci/run sets this so that a test needing root or system packages fails instead of skipping there.
REQUIRE_ALL = os.environ.get("DDP_TEMPLATE_REQUIRE_ALL") == "1"


def require(condition: bool, reason: str) -> pytest.MarkDecorator:
    """Skip on a machine that lacks what the test needs (a laptop); in CI run it anyway, so it fails there
    instead of passing by skipping."""
    return pytest.mark.skipif(not condition and not REQUIRE_ALL, reason=reason)


def tool_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: this venv first on PATH, one thread per rank."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def run(command: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=tool_env(**env), capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A TCP port nothing listens on now, for a rendezvous endpoint on loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_nodes(project: Path, node_args: list[list[str]], rdzv_id: str) -> list[str]:
    """Run ./run_node.sh once per "machine" on loopback (NNODES = len(node_args), one rank each), every one
    with the same environment, and return each one's output once all have exited 0."""
    environment = tool_env(NNODES=str(len(node_args)), NPROC_PER_NODE="1",
                           RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", RDZV_ID=rdzv_id)
    nodes = [subprocess.Popen(["./run_node.sh", *args], cwd=project, env=environment, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for args in node_args]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0] * len(nodes), outputs
    return outputs


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"exited before {path.name} appeared:\n{process.stdout.read()}"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout}s"
        time.sleep(0.005)


@contextlib.contextmanager
def paused(*launchers: subprocess.Popen) -> Iterator[list[int]]:
    """Hold every worker of these torchruns still (SIGSTOP) while the test picks one to kill or signals the
    job, then let them go on: a small model's run would otherwise end before the fault lands."""
    with stopped([pid for launcher in launchers for pid in worker_pids(launcher)]) as pids:
        yield pids


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[list[int]]:
    """SIGSTOP these processes, and SIGCONT the ones still alive afterwards."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def kill_a_worker_and_finish(launcher: subprocess.Popen, after: Path) -> str:
    """Once `after` (a checkpoint) exists, kill -9 one training process of this torchrun (its workers held still
    meanwhile, so a small run cannot end first), and return the job's output once it has restarted, resumed
    and finished."""
    wait_for(after, launcher)
    with paused(launcher) as workers:
        os.kill(workers[-1], signal.SIGKILL)
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, output[-4000:]
    assert "restart=1" in output and "resuming from" in output, output[-4000:]
    return output


def worker_pids(launcher: subprocess.Popen) -> list[int]:
    """The training processes torchrun started (its children running train.py)."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    return [int(pid) for pid in children if b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]


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


def bake_command(output_dir: Path, *options: str, template: Path = TEMPLATE_ROOT, **answers: str) -> list[str]:
    """The cookiecutter command a user types: no prompts, answers as key=value, extra options (-f) first."""
    return [str(BIN / "cookiecutter"), "--no-input", *options, "--output-dir", str(output_dir), str(template),
            *(f"{key}={value}" for key, value in answers.items())]


def bake_with_cli(output_dir: Path, *options: str, template: Path = TEMPLATE_ROOT,
                  **answers: str) -> subprocess.CompletedProcess:
    """Bake exactly as a user does, with output captured (not a terminal)."""
    return run(bake_command(output_dir, *options, template=template, **answers), cwd=output_dir, timeout=120)


def run_in_terminal(command: list[str], cwd: Path, timeout: float = 120, **env: str) -> tuple[int, str]:
    """Run with stdout and stderr on a pseudo-terminal, as a person at a shell sees it: output meant only for
    a person (isatty) shows up here and not in run()'s captured pipes. Returns (exit status, output)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, cwd=cwd, env=tool_env(PAGER="cat", GIT_PAGER="cat", **env),
                               stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([leader], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every process holding the terminal has exited
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(leader)
    if process.poll() is None:
        process.kill()
    return process.wait(timeout=10), output.decode(errors="replace")


def assert_project_tests_pass(project: Path) -> None:
    """The baked project's own tests, run as its README says: all 3 pass (they train with task.py's
    SMOKE_TEST_ARGS, so this also checks the task's tiny run is learnable)."""
    result = run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b3 passed\b", result.stdout), result.stdout


def with_task_code(project: Path, folder: Path, code: str) -> Path:
    """A copy of a baked project in `folder`, with `code` appended to its task.py (a user's edit: a model, a
    hook that replaces the task's own)."""
    copy = shutil.copytree(project, folder / "project")
    [task] = copy.glob("*/task.py")
    task.write_text(task.read_text() + code)
    return copy


def build_wheel(project: Path, wheel_dir: Path) -> Path:
    """Build the generated project's wheel, as `pip install .` would; returns its path."""
    result = run(["python", "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheel_dir), "."],
                 cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = wheel_dir.glob("*.whl")
    return wheel


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


# The user's launch path: the torchrun command from the docs, nothing exported, a small model, loader workers.
BARE = ["--model", "small_cnn", "--data", "fake", "--fake-samples", "512", "--image-size", "16", "--batch-size",
        "8", "--device", "cpu", "--ckpt-every", "4", "--keep-checkpoints", "100", "--log-every", "1",
        "--num-workers", "2", "--max-steps", "40"]


def assert_trains_like_bare(args: list[str]) -> None:
    """That these flags, with --batch-size 8, train what BARE trains: the same value for every flag that decides
    the weights (loader workers, logging and the step limit do not; the LR schedule spans --epochs)."""
    reference, flags = dict(zip(BARE[::2], BARE[1::2], strict=True)), dict(zip(args[::2], args[1::2], strict=True))
    assert reference["--batch-size"] == "8" and flags.get("--batch-size", "8") == "8", (args, BARE)
    ignored = {"--batch-size", "--num-workers", "--log-every", "--max-steps", "--ckpt-every", "--keep-checkpoints"}
    deciding = (reference.keys() | flags.keys()) - ignored  # a flag only one side gives must show up as a difference
    differing = {flag for flag in deciding if flags.get(flag) != reference.get(flag)}
    assert not differing, (differing, args, BARE)


def bare_torchrun(project: Path, ckpt_dir: Path, *args: str, max_restarts: int = 0,
                  rendezvous: tuple[str, ...] = ("--standalone", "--nproc-per-node=2"), on_host: tuple[str, ...] = (),
                  **env: str) -> subprocess.Popen:
    """torchrun as the docs show it, with nothing TORCH_* exported; `on_host` prefixes the command (a
    namespace host). A session of its own, so a signal can go to the whole process group."""
    environment = {name: value for name, value in tool_env(**env).items() if not name.startswith("TORCH")}
    return subprocess.Popen([*on_host, "torchrun", *rendezvous, f"--max-restarts={max_restarts}",
                             "train.py", *BARE, "--ckpt-dir", str(ckpt_dir), *args],
                            cwd=project, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def checkpoint(ckpt_dir: Path, step: int) -> dict:
    import torch

    return torch.load(ckpt_dir / f"step-{step}.pt", weights_only=True)


def assert_bitwise_equal(actual: dict, expected: dict) -> None:
    import torch

    assert actual["step"] == expected["step"]
    assert actual["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(actual["model"][name], tensor), f"model tensor {name} differs"
    assert torch.equal(actual["torch_rng_state"], expected["torch_rng_state"]), "the global RNG continues as it was"
    for index, buffers in expected["optimizer"]["state"].items():
        for name, tensor in buffers.items():
            assert torch.equal(actual["optimizer"]["state"][index][name], tensor), f"optimizer {index}.{name} differs"
