"""fault_tolerance=torchft: replica groups that keep training while one of them is killed and restarted.

Each group is a run_node.sh (its own torchrun) on this machine; a group's rank kills itself with SIGKILL inside
step 20's backward, once the last layers' gradient buckets went out, so the survivors are waiting for a bucket
that never comes: the worst moment. Timings (the survivors' stall, the rejoin) are measured in
benchmarks/torchft_groups.py, not here."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from helpers import assert_same, checkpoint, free_port, start_job, tiny_run, wait_for, with_task_code, worker_pids

pytestmark = pytest.mark.slow  # torchrun jobs: `make test-fast` leaves these out

# Appended to task.py: group 1's rank KILLED_RANK dies by SIGKILL in step 20's backward, in its first attempt only.
KILL_INSIDE_BACKWARD = '''

import dataclasses as _dataclasses
import os as _os
import signal as _signal

_compute_loss = TASK.compute_loss


def _dies_inside_backward(model, batch, step):
    loss = _compute_loss(model, batch, step)
    group, attempt = _os.environ.get("REPLICA_GROUP_ID"), _os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if group == "1" and attempt == "0" and _os.environ.get("LOCAL_RANK") == "KILLED_RANK" and step.number == 20:
        first = next(parameter for parameter in model.parameters() if parameter.requires_grad)
        first.register_hook(lambda grad: _os.kill(_os.getpid(), _signal.SIGKILL))  # its gradient comes last
    rejoined = _os.environ["REJOINED"]  # a file group 1 writes once it trains again
    if group == "1" and attempt == "1":
        open(rejoined, "a").close()
    elif group == "0" and step.number > 20 and not _os.path.exists(rejoined):
        __import__("time").sleep(0.5)  # a slow step while alone: the run must not end before group 1 is back
    return loss


def _normalized_cnn(options, train_set):  # BatchNorm's running statistics: buffers, which gradients do not sync
    return nn.Sequential(nn.BatchNorm2d(3), small_cnn(options, train_set))


TASK = _dataclasses.replace(TASK, compute_loss=_dies_inside_backward,
                            models={**TASK.models, "normalized_cnn": _normalized_cnn})
'''


@pytest.fixture(scope="module")
def torchft_project(bake) -> Path:
    return bake(fault_tolerance="torchft")


def start_groups(project: Path, args: list[str], nproc: int, lighthouse_port: int, logs: Path,
                 **env: str) -> list[subprocess.Popen]:
    """Two replica groups as two machines would start them: the same command, REPLICA_GROUP_ID apart. Each
    writes to a file (logs/group-N.log): a pipe read only at the end would fill and stop a group mid-step,
    and with it the other, waiting on its gradients."""
    logs.mkdir(exist_ok=True)
    return [start_job(project, args, via="run_node.sh", nproc=nproc, max_restarts=1, REPLICA_GROUPS="2",
                      REPLICA_GROUP_ID=str(group), RDZV_ENDPOINT=f"localhost:{lighthouse_port}",
                      REJOINED=str(logs / "rejoined"), RUST_LOG="info",  # the Lighthouse's quorums, logged
                      stdout=(logs / f"group-{group}.log").open("w"), **env)
            for group in (0, 1)]


def outputs_of(groups: list[subprocess.Popen], logs: Path, timeout: float = 240) -> list[str]:
    for group in groups:
        group.wait(timeout=timeout)
    outputs = [(logs / f"group-{number}.log").read_text() for number in range(len(groups))]
    assert [group.returncode for group in groups] == [0, 0], "\n-----\n".join(output[-5000:] for output in outputs)
    return outputs


def the_same_model(ckpt_dir: Path, step: int) -> None:
    """Both groups' checkpoints of `step` hold one training state, bit for bit: the model (its buffers too), the
    optimizer, the lr schedule, the loop's progress and torchft's own step count (each rank's generators are
    their own)."""
    first, second = (checkpoint(ckpt_dir / f"replica-group-{group}", step) for group in (0, 1))
    for entry in ("model", "optimizer", "lr_schedule", "grad_scaler", "replica_groups", "step", "epoch",
                  "samples_in_epoch", "samples_seen"):
        assert_same(second[entry], first[entry], entry)


def test_survivors_keep_training_through_a_kill_inside_backward_and_the_killed_group_heals(torchft_project,
                                                                                          tmp_path):
    project = with_task_code(torchft_project, tmp_path, KILL_INSIDE_BACKWARD.replace("KILLED_RANK", "0"))
    ckpt_dir = tmp_path / "ckpt"
    args = tiny_run(num_workers=0, max_steps=60, ckpt_every=10, batch_size=16, ckpt_dir=ckpt_dir,
                    sample_log=tmp_path / "samples", model="normalized_cnn")
    logs = tmp_path / "logs"
    survivor, restarted = outputs_of(start_groups(project, args, nproc=1, lighthouse_port=free_port(), logs=logs),
                                     logs)

    # run_node.sh started the Lighthouse with group 0, and each group advertised the address it found toward
    # it: for the Manager, the store on which the groups' process group is made, and the state a healing group
    # fetches; never this machine's hostname, which may resolve elsewhere on another machine.
    address = re.search(r"replica group 1 of 2 .* address=(\S+)", restarted)[1]
    assert address == "127.0.0.1", restarted
    lighthouse = re.findall(r"Quorum! .*", survivor)
    assert lighthouse and "Lighthouse listening" in survivor, survivor[-5000:]
    named = set(re.findall(r'(?:address: "http://|\\"store\\": \\")([^:"\\]+):', "".join(lighthouse)))
    assert named == {address} and socket.gethostname() not in named, lighthouse[-1]
    assert f"fetches this one's state from http://{address}:" in restarted, restarted[-5000:]
    assert "not bitwise equal to an uninterrupted one" in survivor, survivor[-5000:]  # what the mode gives up
    assert "step 1: 2 of 2 replica groups train" in survivor, survivor[-5000:]  # the job's start waited for both

    # The survivor went on alone from the step the kill cut short; the killed group restarted once and healed at
    # the survivors' step, not from step 0 nor from its own newest checkpoint (step 10); then both trained again.
    assert "exitcode: -9" in restarted and "restart=1" in restarted and "restart=1" not in survivor, restarted[-5000:]
    alone = [int(step) for step in re.findall(r"step (\d+): 1 of 2 replica groups train", survivor)]
    assert {20, 21} & set(alone), survivor[-5000:]
    dropped = re.findall(r"step (\d+) dropped: a replica group was lost during it", survivor)
    assert dropped == ["20"], survivor[-5000:]
    after_restart = restarted[restarted.index("restart=1"):]
    assert f"resuming from {ckpt_dir}/replica-group-1/step-10.pt" in after_restart, after_restart[-5000:]  # its newest
    healed = [int(step) for step in re.findall(r"healed from another replica group: step (\d+)", after_restart)]
    assert len(healed) == 1 and healed[0] > 21, after_restart[-5000:]
    assert f"step {healed[0] + 1}: 2 of 2 replica groups train" in survivor, survivor[-5000:]

    # One model from there on, and at most one step dropped: the one the kill was inside of (torchft counts
    # committed steps, the loop every step).
    for step in (50, 60):
        the_same_model(ckpt_dir, step)
    final = checkpoint(ckpt_dir / "replica-group-0", 60)
    assert final["replica_groups"]["step"] == 59, final["replica_groups"]
    # The data is split as if both groups were there: in the first epoch (16 steps of 2 x 16 samples, before
    # the kill) each group read its own half of the 512 samples.
    halves = [list(dict.fromkeys((tmp_path / "samples" / f"rank-{group}.txt").read_text().split()))[:256]
              for group in (0, 1)]  # what each loaded: a group that healed loads its next batch again
    assert not set(halves[0]) & set(halves[1]) and len(set(halves[0]) | set(halves[1])) == 512


def test_groups_of_two_ranks_heal_and_a_job_stopped_and_killed_whole_resumes_from_checkpoints(torchft_project,
                                                                                               tmp_path):
    # The Lighthouse as a command of its own (a Slurm step, a Kubernetes pod), not started by group 0.
    project = with_task_code(torchft_project, tmp_path, KILL_INSIDE_BACKWARD.replace("KILLED_RANK", "1"))
    port, ckpt_dir = free_port(), tmp_path / "ckpt"
    lighthouse = start_job(project, ["--lighthouse"], via="run_node.sh", RDZV_ENDPOINT=f"localhost:{port}",
                           stdout=subprocess.DEVNULL)
    try:
        given = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
        args = tiny_run(num_workers=0, max_steps=200, ckpt_every=10, ckpt_dir=ckpt_dir, model="normalized_cnn")
        groups = start_groups(project, args, nproc=2, lighthouse_port=port, logs=tmp_path / "stopped", **given)
        # Past the kill and the heal, the job ends: group 0 is stopped as a scheduler stops a machine (SIGTERM),
        # group 1 is lost whole (SIGKILL to its torchrun and every rank).
        wait_for(ckpt_dir / "replica-group-1" / "step-40.pt", groups[1], timeout=200)
        for pid in [groups[1].pid, *worker_pids(groups[1])]:  # torchrun's workers have sessions of their own
            os.kill(pid, signal.SIGKILL)
        groups[0].send_signal(signal.SIGTERM)
        for group in groups:
            group.wait(timeout=200)
        outputs = [(tmp_path / "stopped" / f"group-{number}.log").read_text() for number in (0, 1)]
        assert "exitcode: -9" in outputs[1] and int(re.findall(
            r"healed from another replica group: step (\d+)", outputs[1])[-1]) > 21, outputs[1][-5000:]
        stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", outputs[0])[1])
        assert (ckpt_dir / "replica-group-0" / f"step-{stopped}.pt").exists(), outputs[0][-5000:]  # saved on SIGTERM
        newest = max(int(path.stem.split("-")[1]) for path in (ckpt_dir / "replica-group-1").glob("step-*.pt"))
        assert 40 <= newest <= stopped, (newest, stopped)
        # A new job resumes from those checkpoints, each group from its own; the one behind heals from the other
        # before training (never from step 0).
        end = stopped + 10
        resumed = outputs_of(start_groups(project, tiny_run(num_workers=0, max_steps=200, stop_at_step=end,
                                                            ckpt_every=10, ckpt_dir=ckpt_dir, model="normalized_cnn"),
                                          nproc=2,
                                          lighthouse_port=port,
                                          logs=tmp_path / "resumed", **given), tmp_path / "resumed")
        for group, (output, step) in enumerate(zip(resumed, (stopped, newest), strict=True)):
            assert f"resuming from {ckpt_dir}/replica-group-{group}/step-{step}.pt" in output, output[-5000:]
            assert f"step {stopped + 1}: 2 of 2 replica groups train" in output, output[-5000:]
            assert (f"healed from another replica group: step {stopped}," in output) == (step < stopped), output
        the_same_model(ckpt_dir, end)
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
