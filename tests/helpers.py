"""What the tests share besides fixtures: launching jobs and bakes, waiting on them, faults, and comparing
checkpoints. Fixtures and pytest hooks live in conftest.py."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
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
from types import ModuleType

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
    """A TCP port nothing listens on now, for a rendezvous endpoint on loopback. Just below the kernel's
    ephemeral range, which a port of its choosing (bind to port 0, as this used to) is in: there the other
    jobs' connections and stores could take it before torchrun binds it, seconds later."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low, high = map(int, ephemeral.read_text().split()) if ephemeral.exists() else (32768, 60999)
    # Below the range, or above it where the range starts too low (some containers start it at 1024).
    band = range(low - 2000, low) if low - 2000 >= 1024 else range(high + 1, min(high + 2001, 65536))
    for _ in range(100):
        port = random.choice(band)
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free TCP port in {band.start}-{band.stop - 1}, outside the ephemeral range {low}-{high}")


def start_nodes(project: Path, node_args: list[list[str]], rdzv_id: str) -> list[str]:
    """Run ./run_node.sh once per "machine" on loopback (NNODES = len(node_args), one rank each), every one
    with the same environment, and return each one's output once all have exited 0."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start_job(project, args, via="run_node.sh", nproc=1, NNODES=str(len(node_args)), RDZV_ENDPOINT=endpoint,
                       RDZV_ID=rdzv_id) for args in node_args]
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


def kill_a_worker_and_finish(launcher: subprocess.Popen, after: Path, which: int = -1) -> str:
    """Once `after` (a checkpoint) exists, kill -9 one training process of this torchrun (the last it started,
    or `which`; its workers held still meanwhile, so a small run cannot end first), and return the job's
    output once it has restarted, resumed and finished."""
    wait_for(after, launcher)
    with paused(launcher) as workers:
        os.kill(workers[which], signal.SIGKILL)
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
    TASK.smoke_test_args, so this also checks the task's tiny run is learnable)."""
    result = run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b3 passed\b", result.stdout), result.stdout


def smoke_test_args(project: Path) -> list[str]:
    """The baked project's task.py TASK.smoke_test_args, the tiny run its own tests train, read without importing
    torch: a test that launches that run itself checks what those tests check for the price of its own launch."""
    [task] = project.glob("*/task.py")
    for node in ast.parse(task.read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["TASK"]:
            for keyword in node.value.keywords:
                if keyword.arg == "smoke_test_args":
                    return ast.literal_eval(keyword.value)
    raise AssertionError(f"{task} has no TASK = Task(..., smoke_test_args=[...])")


def readme_block(project: Path, language: str, section: str = "## Make it yours") -> str:
    """The first ```language block of a baked project's README after the heading `section`."""
    text = (project / "README.md").read_text()
    return re.search(rf"```{language}\n(.*?)```", text[text.index(section):], re.DOTALL)[1]


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


def flags(**values: object) -> list[str]:
    """Command-line flags from option names: flags(num_workers=0, deterministic=True) is
    ["--num-workers", "0", "--deterministic"]; a value of None leaves the flag out."""
    args = []
    for name, value in values.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", *([] if value is True else [str(value)])]
    return args


# A tiny run of the default (image) task: a small model on 512 fake 16-px images, 2 ranks of 8 (32 steps an
# epoch), a checkpoint every 4 steps, loader workers as users have them. The session's reference run
# (conftest's uninterrupted_bare) is exactly this, to step 40.
TINY_RUN = dict(model="small_cnn", data="fake", fake_samples=512, image_size=16, batch_size=8, device="cpu",
                ckpt_every=4, keep_checkpoints=100, log_every=1, num_workers=2, max_steps=40)


def tiny_run(**overrides: object) -> list[str]:
    """The flags of TINY_RUN with these overrides (None drops a flag): tiny_run(num_workers=0, max_steps=8)."""
    return flags(**{**TINY_RUN, **overrides})


BARE = tiny_run()


def assert_trains_like_bare(args: list[str]) -> None:
    """That these flags, with --batch-size 8, train what BARE trains: the same value for every flag that decides
    the weights (loader workers, logging and the step limit do not; the LR schedule spans --epochs)."""
    reference, given = dict(zip(BARE[::2], BARE[1::2], strict=True)), dict(zip(args[::2], args[1::2], strict=True))
    assert reference["--batch-size"] == "8" and given.get("--batch-size", "8") == "8", (args, BARE)
    ignored = {"--batch-size", "--num-workers", "--log-every", "--max-steps", "--ckpt-every", "--keep-checkpoints"}
    deciding = (reference.keys() | given.keys()) - ignored  # a flag only one side gives must show up as a difference
    differing = {flag for flag in deciding if given.get(flag) != reference.get(flag)}
    assert not differing, (differing, args, BARE)


def start_job(project: Path, args: list[str], *, via: str = "torchrun", nproc: int = 2, max_restarts: int = 0,
              rendezvous: tuple[str, ...] = ("--standalone",), prefix: tuple[str, ...] = (), bare: bool = False,
              stdout: object = subprocess.PIPE, stderr: object = subprocess.STDOUT, **env: str) -> subprocess.Popen:
    """Start a training job of `project` as users do, in the background:
    - via="torchrun": torchrun RENDEZVOUS --nproc-per-node=N --max-restarts=R train.py ARGS (the docs' command);
    - via="run_node.sh": ./run_node.sh ARGS with NPROC_PER_NODE=N and MAX_RESTARTS=R (it execs torchrun);
    - via="python": python train.py ARGS, one process without torchrun.
    `prefix` runs it under another command (a network-namespace host, a pid namespace); bare=True exports
    nothing TORCH_*. A session of its own, so a signal can go to the whole process group, as Slurm and
    Kubernetes send it. Output is text on a pipe, stderr merged into stdout, unless asked otherwise."""
    if via == "torchrun":
        command = ["torchrun", *rendezvous, f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                   "train.py", *args]
    elif via == "run_node.sh":
        command, env = ["./run_node.sh", *args], {"NPROC_PER_NODE": str(nproc), "MAX_RESTARTS": str(max_restarts),
                                                   **env}
    else:
        assert via == "python" and nproc == 1, (via, nproc)
        command = ["python", "train.py", *args]
    environment = tool_env(**env)
    if bare:
        environment = {name: value for name, value in environment.items() if not name.startswith("TORCH")}
    return subprocess.Popen([*prefix, *command], cwd=project, env=environment, stdout=stdout, stderr=stderr,
                            text=True, start_new_session=True)


def run_job(project: Path, args: list[str], *, timeout: float = 300, **launch: object) -> subprocess.CompletedProcess:
    """start_job(project, args, **launch) to its end: its exit status, stdout and stderr (train.py logs there).
    A job still running after `timeout` seconds is killed with every process in its group."""
    job = start_job(project, args, stderr=subprocess.PIPE, **launch)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        raise
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def bare_torchrun(project: Path, ckpt_dir: Path, *args: str, **launch: object) -> subprocess.Popen:
    """The session reference's run (BARE) as the docs' torchrun command, nothing TORCH_* exported."""
    return start_job(project, [*BARE, "--ckpt-dir", str(ckpt_dir), *args], bare=True, **launch)


def checkpoint(ckpt_dir: Path, step: int) -> dict:
    import torch

    return torch.load(ckpt_dir / f"step-{step}.pt", weights_only=True)


def metric_rows(log_dir: Path) -> list[dict]:
    """The rows a run wrote to --log-dir's metrics.jsonl, in order."""
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


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
