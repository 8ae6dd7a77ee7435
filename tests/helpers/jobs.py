"""Launching training jobs the way users do (torchrun, run_node.sh, several nodes) and the one tiny run."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

from .environment import free_port, tool_env


def start_nodes(project: Path, node_args: list[list[str]], rdzv_id: str) -> list[str]:
    """Run ./run_node.sh once per "machine" on loopback (NNODES = len(node_args), one rank each), every one
    with the same environment, and return each one's output once all have exited 0.

    One restart is allowed for the one fault of the launch path itself: with several machines torchrun picks
    rank 0's store port seconds before rank 0 listens on it, and under the whole suite's load another process
    took it (pytorch/pytorch#126510; the project then says so and restarts). Any other restart fails the test."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start_job(project, args, via="run_node.sh", nproc=1, max_restarts=1, NNODES=str(len(node_args)),
                       RDZV_ENDPOINT=endpoint, RDZV_ID=rdzv_id) for args in node_args]
    outputs, deadline = [], time.monotonic() + 300
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired as error:  # every node's output, and no node left running
            for other in nodes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(other.pid, signal.SIGKILL)
            own = error.output.decode(errors="replace") if isinstance(error.output, bytes) else str(error.output)
            raise AssertionError(f"node {len(outputs)} still running after 300 s (exit statuses: "
                                 f"{[other.poll() for other in nodes]}); the nodes' output:\n"
                                 + "\n----\n".join([*outputs, own])) from None
    assert [node.returncode for node in nodes] == [0] * len(nodes), outputs
    restarted = " restart=1" in "".join(outputs)
    assert not restarted or "which torchrun chose for this attempt's store, was taken" in "".join(outputs), outputs
    return outputs


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"exited before {path.name} appeared:\n{process.stdout.read()}"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout}s"
        time.sleep(0.005)


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
    the weights (loader workers, logging, the watchdog's timeouts and --stop-at-step do not; --max-steps, the
    run's length, does)."""
    reference, given = dict(zip(BARE[::2], BARE[1::2], strict=True)), dict(zip(args[::2], args[1::2], strict=True))
    assert reference["--batch-size"] == "8" and given.get("--batch-size", "8") == "8", (args, BARE)
    ignored = {"--batch-size", "--num-workers", "--log-every", "--stop-at-step", "--ckpt-every", "--keep-checkpoints",
               "--step-timeout", "--io-timeout"}
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
    assert_no_scheduler_warning(stdout + stderr)
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


# torch's LRScheduler warnings, misleading in a loop that sets the lr itself: none in any job's output.
SCHEDULER_WARNINGS = ("lr_scheduler.step()", "get_last_lr()")


def assert_no_scheduler_warning(output: str) -> None:
    assert not any(warning in output for warning in SCHEDULER_WARNINGS), output[-4000:]


def bare_torchrun(project: Path, ckpt_dir: Path, *args: str, **launch: object) -> subprocess.Popen:
    """The session reference's run (BARE) as the docs' torchrun command, nothing TORCH_* exported."""
    return start_job(project, [*BARE, "--ckpt-dir", str(ckpt_dir), *args], bare=True, **launch)
