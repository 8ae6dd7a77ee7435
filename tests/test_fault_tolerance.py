"""Fault tolerance of the generated project, with numbers: a killed, preempted, corrupted or resized run
ends where an uninterrupted one does, bit for bit, and no training sample is lost or seen twice."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    bare_torchrun,
    checkpoint,
    flip_a_bit,
    free_port,
    make_image_folder,
    metric_rows,
    paused,
    run,
    run_job,
    start_job,
    start_nodes,
    tiny_run,
    wait_for,
    with_task_code,
    worker_pids,
)

pytestmark = pytest.mark.slow  # torchrun jobs: `make test-fast` leaves these out

# Every run here has the settings of the session's one uninterrupted run (helpers.TINY_RUN), so that it ends
# comparable with it, bit for bit. small_cnn: what is restored is the point here, not the model (the
# imagefolder test keeps resnet18's BatchNorm buffers).


def test_sigterm_to_the_job_saves_at_one_agreed_step_and_resumes_bitwise(default_project, uninterrupted_bare,
                                                                         tmp_path):
    # SIGTERM to torchrun's process group, as a terminal or `kill -- -PGID` sends it; the DataLoader workers
    # have left that group (the Slurm test sends SIGTERM to every process, workers included).
    launcher = start_job(default_project, tiny_run(ckpt_dir=tmp_path), via="run_node.sh")
    wait_for(tmp_path / "step-8.pt", launcher)
    with paused(launcher):
        signalled = time.monotonic()
        os.killpg(launcher.pid, signal.SIGTERM)
    output = launcher.communicate(timeout=120)[0]
    stop_seconds = time.monotonic() - signalled
    # The shell's status for SIGTERM, which schedulers retry, and one line from the launcher, no traceback.
    assert launcher.returncode == 143 and "Traceback" not in output, output[-4000:]
    assert output.splitlines()[-1] == "run_node.sh: torchrun stopped by SIGTERM", output[-4000:]
    stops = [line for line in output.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stops) == 1, output  # logged once, by rank 0, for the step all ranks agreed on
    stopped_step = int(stops[0].split("after step ")[1].split(";")[0])
    assert (tmp_path / f"step-{stopped_step}.pt").exists()
    assert "DataLoader worker" not in output, output
    assert stop_seconds < 25, f"took {stop_seconds:.1f}s; torchrun kills workers 30s after SIGTERM"

    # What a crash in the middle of a save would leave beside it, were saves not atomic: a newer checkpoint cut
    # short, which the resume skips for the one before it; and what our atomic save leaves when killed mid-write.
    newest, saved = tmp_path / f"step-{stopped_step + 4}.pt", (tmp_path / f"step-{stopped_step}.pt").read_bytes()
    newest.write_bytes(saved[: len(saved) // 2])
    leftover = tmp_path / f".step-{stopped_step + 8}.pt.x1y2.tmp"
    leftover.write_bytes(b"interrupted write")
    rotten = tmp_path / f"step-{stopped_step + 12}.pt"  # whole, and loads: one bit changed on the storage
    member = flip_a_bit(tmp_path / f"step-{stopped_step}.pt", rotten, member_suffix="/data/0")
    resumed = run_job(default_project, tiny_run(ckpt_dir=tmp_path), via="run_node.sh")
    assert resumed.returncode == 0, resumed.stderr
    assert (f"skipping unreadable checkpoint {rotten} (its bytes changed after it was written: {member} fails its "
            "CRC-32 check") in resumed.stderr, resumed.stderr[-4000:]
    assert f"skipping unreadable checkpoint {newest}" in resumed.stderr, resumed.stderr[-4000:]
    assert f"resuming from {tmp_path / f'step-{stopped_step}.pt'}" in resumed.stderr
    assert f"removed {leftover}, left by a save that was interrupted" in resumed.stderr and not leftover.exists()
    assert_bitwise_equal(checkpoint(tmp_path, 40), checkpoint(uninterrupted_bare, 40))


def test_random_augmentation_is_redrawn_identically_after_a_resume(default_project, tmp_path):
    # imagefolder trains with random crops and flips: 12 images, batch 4, one rank: 3 steps an epoch.
    make_image_folder(tmp_path / "images", {"train": 6, "val": 2})
    images = dict(model="resnet18", data="imagefolder", data_dir=tmp_path / "images", num_classes=2, batch_size=4,
                  ckpt_every=1)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert run_job(default_project, tiny_run(**images, max_steps=5, num_workers=0, ckpt_dir=reference),
                   via="python", nproc=1).returncode == 0
    # Stopped mid-epoch, then resumed with another number of DataLoader workers.
    for stop_at_step, workers in ((2, 0), (None, 2)):
        result = run_job(default_project, tiny_run(**images, max_steps=5, stop_at_step=stop_at_step,
                                                   num_workers=workers, ckpt_dir=resumed), via="python", nproc=1)
        assert result.returncode == 0, result.stderr
    assert "resuming from" in result.stderr
    assert_bitwise_equal(checkpoint(resumed, 5), checkpoint(reference, 5))


def test_a_second_job_on_a_live_jobs_folder_is_refused_and_a_killed_job_leaves_no_lease(default_project,
                                                                                        uninterrupted_bare, tmp_path):
    # Started where the only checkpoint is unreadable: it starts from scratch, as the final bitwise check shows.
    (tmp_path / "step-4.pt").write_bytes(b"not a checkpoint")  # the only one there: nothing to resume from
    first = bare_torchrun(default_project, tmp_path)
    wait_for(tmp_path / "step-8.pt", first)
    with paused(first):  # so that it is still running when the second has started
        second = run_job(default_project, tiny_run(num_workers=0, ckpt_dir=tmp_path), via="python", nproc=1)
    assert second.returncode == 1
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: --ckpt-dir {tmp_path} is in use by another job (run_id "), second.stderr[-3000:]
    assert errors[0].endswith("; wait for it to end, or give this job another --ckpt-dir"), errors
    # The first goes on untouched; killed as a whole (kill -9, every process), it leaves no lease behind.
    wait_for(tmp_path / "step-16.pt", first)
    os.killpg(first.pid, signal.SIGKILL)
    output = first.communicate()[0]
    assert f"skipping unreadable checkpoint {tmp_path / 'step-4.pt'}" in output, output[-3000:]
    assert f"no valid checkpoint in {tmp_path}; starting from scratch" in output, output[-3000:]
    again = bare_torchrun(default_project, tmp_path)
    output = again.communicate(timeout=300)[0]
    assert again.returncode == 0 and "resuming from" in output, output[-3000:]
    assert_bitwise_equal(checkpoint(tmp_path, 40), checkpoint(uninterrupted_bare, 40))


HOLD_THE_LEASE_AS_RUN_4242 = """
import fcntl, json, sys, time
with open(sys.argv[1], "a+") as lease:
    fcntl.flock(lease, fcntl.LOCK_EX)
    lease.write(json.dumps({"run_id": "4242", "host": "node-that-failed", "pid": 1}))
    lease.flush()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_requeued_job_waits_for_the_lease_its_failed_machine_still_holds(default_project, tmp_path):
    # A Slurm requeue keeps the run id (RDZV_ID=$SLURM_JOB_ID) and starts at restart count 0, while NFS still
    # holds the lock of the failed machine's process for ~90 s: the same run id is never "another job".
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LEASE_AS_RUN_4242, str(tmp_path / ".lease"), "12"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    result = run_job(default_project, tiny_run(num_workers=0, max_steps=4, ckpt_dir=tmp_path), via="run_node.sh",
                     nproc=1, NNODES="1", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", RDZV_ID="4242")
    holder.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "is locked by this job's own earlier process (run_id 4242, host node-that-failed, pid 1)" in result.stderr
    assert "the lock was released after" in result.stderr and "another job" not in result.stderr, result.stderr
    assert (tmp_path / "step-4.pt").exists()


def logged_indices(sample_log: Path) -> list[int]:
    return [int(line) for path in sample_log.glob("rank-*.txt") for line in path.read_text().split()]


def test_two_ranks_to_one_mid_epoch_loses_and_repeats_no_sample(default_project, tmp_path):
    ckpt_dir, before, after = tmp_path / "ckpt", tmp_path / "before", tmp_path / "after"
    per_rank_16 = dict(batch_size=16, num_workers=0, ckpt_dir=ckpt_dir)  # 16 steps an epoch
    two_ranks = run_job(default_project, tiny_run(**per_rank_16, max_steps=6, sample_log=before), via="run_node.sh")
    assert two_ranks.returncode == 0, two_ranks.stderr
    # One rank finishes the epoch: the 512 - 6 * 32 = 320 samples not yet seen, in 20 steps of 16.
    one_rank = run_job(default_project, tiny_run(**per_rank_16, max_steps=None, epochs=1, sample_log=after),
                       via="run_node.sh", nproc=1)
    assert one_rank.returncode == 0, one_rank.stderr
    assert "(step 6, epoch 0, 192 samples into the epoch, 192 in all, saved by 2 ranks)" in one_rank.stderr
    assert "world_size=1" in one_rank.stderr
    seen_before, seen_after = logged_indices(before), logged_indices(after)
    assert len(seen_before) == 192 and len(seen_after) == 320
    assert sorted(seen_before + seen_after) == list(range(512))  # every sample once, none twice
    assert checkpoint(ckpt_dir, 26)["epoch"] == 1


def step_lr(ckpt_dir: Path, step: int) -> tuple[int, float]:
    """(samples seen, the lr of the last step) of a checkpoint."""
    state = checkpoint(ckpt_dir, step)
    return state["samples_seen"], state["optimizer"]["param_groups"][0]["lr"]


def test_a_resized_job_runs_the_uninterrupted_lr_at_every_sample_count(default_project, uninterrupted_bare,
                                                                       baked_module, tmp_path):
    # The reference trains 2 ranks x 8 = 16 samples a step, --max-steps 40: a run of 640 samples. One rank of 8
    # takes 8 a step: at equal samples seen it stands at twice the reference's step, and a schedule over steps
    # would run ahead of it. Every step of either takes the lr of one curve over samples, at its middle; the
    # run's length is --max-steps steps of the world size it started on, and a resize ends it there.
    optim = baked_module("engine.optim")

    def on_the_curve(ckpt_dir: Path, step: int, per_step: int, run_samples: int) -> None:
        samples, lr = step_lr(ckpt_dir, step)
        warmup = checkpoint(ckpt_dir, step)["lr_schedule"]["warmup_samples"]
        assert warmup == run_samples // 20 and checkpoint(ckpt_dir, step)["lr_schedule"]["total_samples"] == run_samples
        expected = 0.01 * optim.warmup_then_decay(samples - per_step / 2, warmup, run_samples, "cosine")
        assert lr == pytest.approx(expected, rel=1e-12), (ckpt_dir.name, step, samples)

    def train(ckpt_dir: Path, stop_at_step: int | None, nproc: int) -> str:
        result = run_job(default_project, tiny_run(num_workers=0, stop_at_step=stop_at_step, ckpt_dir=ckpt_dir),
                         via="python" if nproc == 1 else "torchrun", nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "lr_scheduler" not in result.stderr and "get_lr()" not in result.stderr, result.stderr
        return result.stderr

    for step in (4, 8, 20, 40):
        on_the_curve(uninterrupted_bare, step, 16, 640)
    assert step_lr(uninterrupted_bare, 40)[1] < 1e-5  # the cosine's end: --max-steps is the schedule's span
    # 1 -> 2 ranks, the direction that ran the rest of the run at lr 0: started on 1 rank, its run is 40 steps
    # of 8 (320 samples); paused at step 16, then 2 ranks of 8 train the other 192 in 12 steps, to step 28.
    grown = tmp_path / "grown"
    train(grown, 16, nproc=1)
    assert "2 ranks instead of 1: a step is now another number of samples" in train(grown, None, nproc=2)
    for step, samples, per_step in ((8, 64, 8), (16, 128, 8), (20, 192, 16), (28, 320, 16)):
        assert step_lr(grown, step)[0] == samples
        on_the_curve(grown, step, per_step, 320)
    assert max(int(path.stem.split("-")[1]) for path in grown.glob("step-*.pt")) == 28
    # 2 -> 1: the reference's step 8 (128 samples) on one rank, 8 more steps of 8.
    shrunk = tmp_path / "shrunk"
    shrunk.mkdir()
    shutil.copy(uninterrupted_bare / "step-8.pt", shrunk)
    train(shrunk, 16, nproc=1)
    assert step_lr(shrunk, 12)[0] == 160 and step_lr(shrunk, 16)[0] == 192
    on_the_curve(shrunk, 16, 8, 640)
    # Each rank's CUDA generator state is saved, empty without CUDA; one rank resuming restores it (a no-op here)
    # and saves its own one entry.
    assert checkpoint(uninterrupted_bare, 8)["cuda_rng_states"].shape == (2, 0)
    assert checkpoint(shrunk, 16)["cuda_rng_states"].shape == (1, 0)


def run_two_nodes(project: Path, ckpt_dirs: list[Path], *args: str) -> str:
    """Two 1-rank "machines", each with its own --ckpt-dir standing for its own local disk."""
    node_args = [[*tiny_run(num_workers=0, max_steps=None, ckpt_dir=ckpt_dir), *args] for ckpt_dir in ckpt_dirs]
    return "".join(start_nodes(project, node_args, rdzv_id="node-local"))


def test_node_local_checkpoint_folders_resume_from_whichever_node_holds_the_newest(
        default_project, uninterrupted_bare, tmp_path):
    disks = [tmp_path / "node-a", tmp_path / "node-b"]
    first = run_two_nodes(default_project, disks, "--max-steps", "40", "--stop-at-step", "8")
    assert "written by 2 nodes (node-local folders)" in first
    assert all((disk / "step-8.pt").exists() for disk in disks)  # each node keeps its own copy
    shutil.rmtree(disks[0])  # one machine was replaced by a fresh one with an empty disk
    second = run_two_nodes(default_project, disks, "--max-steps", "40", "--stop-at-step", "12")
    assert f"resuming from {disks[1] / 'step-8.pt'}" in second
    for disk in disks:
        assert_bitwise_equal(checkpoint(disk, 12), checkpoint(uninterrupted_bare, 12))


def test_bare_torchrun_recovers_from_two_kills_promptly_and_bitwise(default_project, uninterrupted_bare, tmp_path):
    # Before the fix, a restarted worker read the dead group's keys from torchrun's shared store and failed
    # or hung (pytorch#135712), and the survivor's loader workers ignored SIGTERM: 30 s until SIGKILL.
    # Its checkpoints are written in a thread while training goes on (--async-save), and the kills may land
    # mid-write: what is resumed and what the job ends with are still the uninterrupted run's, bit for bit.
    launcher = bare_torchrun(default_project, tmp_path, "--async-save", max_restarts=2)
    for checkpoint_step in (8, 20):
        wait_for(tmp_path / f"step-{checkpoint_step}.pt", launcher)
        with paused(launcher) as workers:
            os.kill(workers[-1], signal.SIGKILL)
    try:
        output = launcher.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired as error:  # say who still holds the output open, then end them
        left = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True).stdout
        subprocess.run(["pkill", "-9", "-f", str(tmp_path)])
        partial = error.output.decode() if isinstance(error.output, bytes) else str(error.output)
        pytest.fail(f"still running after 300 s (torchrun: {launcher.poll()}):\n{left}\n{partial[-6000:]}")
    assert launcher.returncode == 0, output
    assert "restart=2" in output and output.count("resuming from") == 2, output
    assert "forcefully exiting via 9" not in output, output  # every survivor left on SIGTERM
    # The surviving rank's failed collective is the recovery starting, not a second error: one line each time.
    assert output.count("[rank 0] lost another rank (") == 2 and "Traceback" not in output, output
    assert "connectFullMesh failed" not in output, output
    assert output.count("(a copy in memory: writing it in the background)") >= 5, output
    assert_bitwise_equal(checkpoint(tmp_path, 40), checkpoint(uninterrupted_bare, 40))


def test_a_stopped_rank_is_named_and_the_job_resumes_bitwise(default_project, uninterrupted_bare, tmp_path):
    logs = tmp_path / "torchrun-logs"  # where torchrun keeps each rank's error file, for its root cause
    launcher = bare_torchrun(default_project, tmp_path, "--step-timeout", "3", max_restarts=1,
                             rendezvous=("--standalone", f"--log-dir={logs}"))
    wait_for(tmp_path / "step-8.pt", launcher)
    stopped = worker_pids(launcher)[-1]  # the second worker torchrun started: local rank 1, rank 1
    os.kill(stopped, signal.SIGSTOP)  # alive, holding its sockets open, making no progress
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, output
    assert "[rank 0] no progress for 3 s in training step" in output and "waiting for other ranks" in output
    assert "HANG: rank(s) 1 stopped making progress (1 sent no report: stopped, or frozen)" in output, output
    # Ended by rank 0 on this machine at once (torchrun would SIGKILL it only after 30 s), with an error file
    # that makes it torchrun's root cause: an earlier failure than rank 0's, which waited for it.
    assert (f"[rank 0] rank 1 (process {stopped} on this machine) sent no report and is stopped (state T): ended "
            "with SIGKILL by rank 0") in output, output
    [first_attempt] = logs.glob("*/attempt_0")
    errors = {rank: json.loads((first_attempt / str(rank) / "error.json").read_text())["message"] for rank in (0, 1)}
    assert errors[1]["message"].startswith("HANG: rank 1 ") and errors[0]["message"].startswith("HANG: rank(s) 1 ")
    assert int(errors[1]["extraInfo"]["timestamp"]) < int(errors[0]["extraInfo"]["timestamp"]), errors
    assert "forcefully exiting via 9" not in output, output
    assert "restart=1" in output and "resuming from" in output
    assert_bitwise_equal(checkpoint(tmp_path, 40), checkpoint(uninterrupted_bare, 40))


def with_fault(tmp_path: Path, code: str) -> dict[str, str]:
    """Environment that runs `code` at start-up in every Python process of the job (a sitecustomize):
    how these tests make one rank of the user's unchanged project misbehave."""
    folder = tmp_path / "fault"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": str(folder)}


MACHINE_LOST_AFTER_STEP_10 = """
import contextlib
import os
if "LOCAL_RANK" in os.environ:  # a worker, not torchrun
    import signal
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0

    def machine_lost_after_step_10(optimizer, args, kwargs):
        global steps
        steps += 1
        if steps == 10:
            os.kill(os.getppid(), signal.SIGKILL)  # torchrun, then this worker: the machine is gone
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(machine_lost_after_step_10)
"""


def test_a_node_that_leaves_and_one_that_joins_later_meet_no_stale_keys(default_project, uninterrupted_bare,
                                                                        tmp_path):
    # Two "machines" on loopback, elastic 1:2, each running run_node.sh. One is lost mid-step; a new one
    # joins the next round with its own restart count (0), where torch's per-restart key prefixes would hand
    # it the dead group's keys (pytorch#135712), and where torchrun's shared store makes it wait for a worker
    # store address that the surviving rank 0 never publishes again (run_node.sh turns that sharing off).
    port = free_port()

    def node(**env: str) -> subprocess.Popen:
        return start_job(default_project, tiny_run(ckpt_dir=tmp_path / "ckpt"), via="run_node.sh", nproc=1,
                         max_restarts=1, NNODES="1:2", RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID="membership", **env)

    first = node()
    # On loopback every node is on the endpoint's address; the first to listen hosts the rendezvous store,
    # as the endpoint machine of a cluster does. It must not be the one that leaves.
    deadline = time.monotonic() + 60
    while subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout == "":
        assert time.monotonic() < deadline and first.poll() is None, "the first node never listened"
        time.sleep(0.1)
    leaving = node(**with_fault(tmp_path, MACHINE_LOST_AFTER_STEP_10))
    leaving.communicate(timeout=300)
    joining = node()
    outputs = [process.communicate(timeout=300)[0] for process in (first, joining)]
    assert [first.returncode, joining.returncode] == [0, 0], outputs
    # Only rank 0 logs: two machines again (the lost one is dead), rank 0 on the survivor (its second attempt)
    # or on the newcomer (its first).
    again = "world_size=2 nodes=2 ranks_per_node=1 backend=gloo device=cpu run_id=membership restart="
    assert f"{again}1" in outputs[0] or f"{again}0" in outputs[1], outputs
    assert "resuming from" in "".join(outputs), outputs
    assert "connectFullMesh failed" not in "".join(outputs), outputs
    assert_bitwise_equal(checkpoint(tmp_path / "ckpt", 40), checkpoint(uninterrupted_bare, 40))


RANK_0_FINDS_ITS_PORT_TAKEN = """
import os
import socket
if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    # Another process takes the port torchrun gave rank 0 for its store before rank 0 listens there. Where
    # torchrun's own store already listens on it (a shared store), nothing can take it.
    try:
        squatter = socket.create_server(("", int(os.environ["MASTER_PORT"])))
    except OSError:
        pass
"""


@pytest.mark.parametrize("endpoint", [False, True], ids=["one_machine", "rdzv_endpoint"])
def test_a_port_taken_before_rank_0_listens_costs_at_most_a_restart(default_project, tmp_path, endpoint):
    # run_node.sh on one machine keeps torchrun's shared store; with RDZV_ENDPOINT it unshares it (so machines
    # can join), and torchrun then picks a free port that rank 0 binds only seconds later (pytorch#126510).
    rendezvous = dict(NNODES="1", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}") if endpoint else {}
    result = run_job(default_project, tiny_run(max_steps=4, num_workers=0, ckpt_dir=tmp_path), via="run_node.sh",
                     max_restarts=1, **rendezvous, **with_fault(tmp_path, RANK_0_FINDS_ITS_PORT_TAKEN))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    taken = "was taken by another process before rank 0 could listen on it (pytorch/pytorch#126510); torchrun " \
            "restarts the group"
    assert output.count(taken) == endpoint, output
    assert "lost another rank" not in output, output
    assert ("restart=1" in output) == endpoint, output
    assert (tmp_path / "step-4.pt").exists(), output


RANK_1_HANGS_IN_STEP_12 = """
import contextlib
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import time
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    steps = 0

    def hang_in_step_12(optimizer, args, kwargs):  # a stuck read, a deadlock: alive, off the collectives
        global steps
        steps += 1
        if steps == 12:
            time.sleep(3600)

    register_optimizer_step_pre_hook(hang_in_step_12)
"""


def test_a_rank_that_never_reaches_the_next_collective_is_named_and_torchruns_root_cause(default_project, tmp_path):
    # Rank 1 hangs inside step 12, a checkpoint step: rank 0 finishes it and waits in the save, a slow phase,
    # silent. It is where it may be: not named, not killed (it holds the store), and not torchrun's root cause,
    # which torchrun prints when it has no restart left. (Resuming after a hang: the stopped rank's test.)
    launcher = bare_torchrun(default_project, tmp_path / "ckpt", "--step-timeout", "3", "--log-every", "5",
                             max_restarts=0, **with_fault(tmp_path, RANK_1_HANGS_IN_STEP_12))  # no logging's all-reduce
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 1, output
    assert ("[rank 1] no progress for 3 s in training step (step 12, past --step-timeout 3 s); NOT waiting for other "
            "ranks") in output, output
    assert "in hang_in_step_12" in output  # its stack says where it is stuck
    assert ("HANG: rank(s) 1 stopped making progress (past --step-timeout 3 s). Where each rank was: rank 0: step 12, "
            "saving a checkpoint, "
            "a slow phase (--io-timeout), sent no report; rank 1: step 12, training step, not waiting") in output
    assert "SIGKILL" not in output and "[rank 0] no progress" not in output, output
    root_cause = output[output.index("Root Cause (first observed failure)"):]
    assert "rank      : 1 (local_rank: 1)" in root_cause.split("=====")[0], root_cause
    assert "traceback : HANG: rank(s) 1 stopped making progress" in root_cause, root_cause


RANK_0_SAVES_SLOWLY = """
import contextlib
import os
if os.environ.get("RANK") == "0":
    import time

    fsync = os.fsync

    def first_fsync_takes_32_s(fd, first=[True]):  # a large model on a slow shared file system
        if first:
            first.clear()
            time.sleep(32)
        fsync(fd)

    os.fsync = first_fsync_takes_32_s
"""


def test_a_save_after_sigterm_that_takes_longer_than_30_s_completes(default_project, tmp_path):
    # torchrun SIGKILLs its workers 30 s after forwarding SIGTERM unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT says
    # otherwise; run_node.sh sets 100 s, inside the lead time Slurm (--signal) and Kubernetes (grace) give.
    launcher = start_job(default_project, tiny_run(max_steps=None, num_workers=0, ckpt_every=1000,
                                                   ckpt_dir=tmp_path / "ckpt"),
                         via="run_node.sh", **with_fault(tmp_path, RANK_0_SAVES_SLOWLY))
    for line in launcher.stdout:
        if " step 3 |" in line:
            break
    launcher.send_signal(signal.SIGTERM)  # to torchrun only, as Kubernetes sends it to the container's PID 1
    started = time.monotonic()
    output = launcher.communicate(timeout=150)[0]
    assert time.monotonic() - started > 32, output
    assert "forcefully exiting via 9" not in output, output
    [saved] = list((tmp_path / "ckpt").glob("step-*.pt"))
    assert f"stopped by SIGTERM after step {torch.load(saved, weights_only=True)['step']}" in output, output


def test_resume_lists_changed_options_and_refuses_a_changed_model(default_project, tmp_path):
    def plain(**options: object) -> subprocess.CompletedProcess:
        return run_job(default_project, tiny_run(num_workers=0, ckpt_dir=tmp_path, **options), via="python", nproc=1)
    assert plain(max_steps=2).returncode == 0
    changed = plain(max_steps=3, lr=0.02, epochs=3)
    assert changed.returncode == 0, changed.stderr
    assert ("the lr schedule spanned --max-steps 2; it now spans --max-steps 3 (24 samples), the lr from here on "
            "that curve; to keep the old one, pass --max-steps 2 --stop-at-step N") in changed.stderr, changed.stderr
    [line] = [line for line in changed.stderr.splitlines() if "resuming with changed options" in line]
    assert "--lr 0.01 -> 0.02" in line and "--epochs 10 -> 3 (the LR schedule is re-planned" in line
    assert "--max-steps 2" not in line  # its own line says what the schedule becomes
    other_model = plain(max_steps=4, model="resnet18")
    assert other_model.returncode == 1
    assert other_model.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'step-3.pt'} was trained with --model small_cnn, but this run asks for --model "
        "resnet18; resume with the same values, or start a new run with another --ckpt-dir")
    assert "UsageError" not in other_model.stderr and "Traceback" not in other_model.stderr
    other_strategy = plain(max_steps=4, strategy="fsdp2")
    assert other_strategy.returncode == 1
    assert f"error: --ckpt-dir {tmp_path} holds --strategy ddp checkpoints" in other_strategy.stderr
    fewer_steps = plain(max_steps=2)  # below what the checkpoint holds: not a run that ends at once, silently
    assert fewer_steps.returncode == 1 and fewer_steps.stderr.strip().splitlines()[-1] == (
        "error: --max-steps 2 ends the run before the 3 steps the checkpoint already holds; pass --max-steps 3 or "
        "more to go on, or another --ckpt-dir to start over"), fewer_steps.stderr[-2000:]
    assert "lr schedule" not in fewer_steps.stderr  # no line saying what a refused run's schedule became
    earlier_stop = plain(max_steps=3, stop_at_step=2)
    assert earlier_stop.returncode == 1 and earlier_stop.stderr.strip().splitlines()[-1] == (
        "error: --stop-at-step 2 is below the 3 steps the checkpoint already holds; pass --stop-at-step 4 or more, "
        "or leave it out"), earlier_stop.stderr[-2000:]


SIGTERM_AT_THE_END_OF_EPOCH_0 = """
import contextlib
import os
if os.environ.get("RANK") == "0":  # a worker, not torchrun
    import signal
    import time
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0

    def preempted_at_step_32(optimizer, args, kwargs):  # BARE: 32 steps an epoch
        global steps
        steps += 1
        if steps == 32:
            os.kill(os.getppid(), signal.SIGTERM)  # torchrun forwards it to every worker
            time.sleep(1)

    register_optimizer_step_post_hook(preempted_at_step_32)
"""


def test_sigterm_at_an_epochs_last_step_stops_before_its_evaluation(default_project, uninterrupted_bare, tmp_path):
    # Agreed one step late, the stop would come after the epoch's evaluation, which can outlast the grace period.
    # SIGTERM to torchrun, under run_node.sh: its status for SIGTERM and one line, no restart.
    launcher = start_job(default_project, [*tiny_run(ckpt_dir=tmp_path), "--eval-every", "1"], via="run_node.sh",
                         **with_fault(tmp_path, SIGTERM_AT_THE_END_OF_EPOCH_0))
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 143 and "Traceback" not in output and " restart=1" not in output, output[-4000:]
    assert output.splitlines()[-1] == "run_node.sh: torchrun stopped by SIGTERM", output[-4000:]
    assert "stopped by SIGTERM after step 32" in output, output
    assert "eval loss" not in output.split("step 1:", 1)[1], output  # no evaluation after the one-batch check
    assert_bitwise_equal(checkpoint(tmp_path, 32), checkpoint(uninterrupted_bare, 32))


SIGTERM_WHEN_EPOCH_0_IS_EVALUATED = """
import os
from pathlib import Path
if os.environ.get("RANK") == "0" and not Path(os.environ["FIRED"]).exists():
    import signal
    import time
    import torch

    calls = 0
    plain_eval = torch.nn.Module.eval

    def eval_then_preempted(self):  # call 1: the one-batch check before training; call 2: epoch 0's evaluation
        global calls
        calls += 1
        if calls == 2:
            Path(os.environ["FIRED"]).touch()
            os.kill(os.getppid(), signal.SIGTERM)  # torchrun forwards it to every worker
            time.sleep(1)
        return plain_eval(self)

    torch.nn.Module.eval = eval_then_preempted
"""


def test_a_sigterm_during_an_evaluation_stops_within_it_and_the_resumed_job_evaluates_first(default_project,
                                                                                             tmp_path):
    # 128 steps an epoch; 32 held-out batches per rank, so the stop is asked for after 16 of them.
    args = tiny_run(fake_samples=512, batch_size=2, epochs=2, max_steps=None, eval_every=1, num_workers=0,
                    ckpt_every=1000, ckpt_dir=tmp_path / "ckpt", log_dir=tmp_path / "logs")
    fault = with_fault(tmp_path, SIGTERM_WHEN_EPOCH_0_IS_EVALUATED)
    preempted = run_job(default_project, args, via="run_node.sh", FIRED=str(tmp_path / "fired"), **fault)
    # SIGTERM to torchrun: its workers save and stop, and run_node.sh ends with SIGTERM's status and one line.
    assert (tmp_path / "fired").exists() and preempted.returncode == 143, preempted.stderr
    assert preempted.stderr.splitlines()[-1] == "run_node.sh: torchrun stopped by SIGTERM", preempted.stderr
    assert "Traceback" not in preempted.stderr, preempted.stderr
    assert "stopped by SIGTERM after step 128" in preempted.stderr, preempted.stderr  # not after one more step
    assert "| eval " not in preempted.stderr, preempted.stderr  # the cut evaluation is not reported as one
    resumed = run_job(default_project, args, FIRED=str(tmp_path / "fired"), **fault)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {tmp_path / 'ckpt' / 'step-128.pt'}" in resumed.stderr
    log = resumed.stderr
    assert -1 < log.find("step 128 | epoch 1 | eval loss") < log.find(" step 129 |"), log  # due, so done first
    evaluations = [row["step"] for row in metric_rows(tmp_path / "logs") if row["kind"] == "eval"]
    assert evaluations == [128, 256], evaluations  # each epoch's evaluation once, over both runs


# Steps of 4 s on both ranks (first attempt only), and rank 1 hangs after its 2nd optimizer step, past the step's
# collectives: rank 0 finishes that step and beats once more, so it times out one 4-s step after rank 1.
SLOW_STEPS_AND_RANK_1_HANGS_AFTER_STEP_2 = """
import contextlib
import os
if "LOCAL_RANK" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import time
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0

    def slow_step_then_hang(optimizer, args, kwargs):
        global steps
        steps += 1
        time.sleep(4)
        if steps == 2 and os.environ["RANK"] == "1":
            time.sleep(3600)

    register_optimizer_step_post_hook(slow_step_then_hang)
"""


@pytest.mark.starts_first  # mostly sleep: it overlaps well with the others
def test_with_steps_longer_than_the_report_window_the_stopped_rank_is_the_one_named(default_project,
                                                                                     uninterrupted_bare, tmp_path):
    launcher = bare_torchrun(default_project, tmp_path / "ckpt", "--step-timeout", "6", "--log-every", "100",
                             max_restarts=1,
                             **with_fault(tmp_path, SLOW_STEPS_AND_RANK_1_HANGS_AFTER_STEP_2))
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, output
    assert ("HANG: rank(s) 1 stopped making progress (past --step-timeout 6 s). Where each rank was: rank 0: step 3"
            in output), output
    assert "sent no report" not in output, output  # rank 0 reported in time: not named, not SIGKILLed
    assert_bitwise_equal(checkpoint(tmp_path / "ckpt", 40), checkpoint(uninterrupted_bare, 40))


def test_a_process_in_another_pid_namespace_is_never_taken_for_a_rank_of_this_one(default_project):
    # A frozen rank is ended by the identity it published; containers that share a hostname (host networking)
    # but not a pid namespace reuse the same pids, so hostname, pid and start time alone could name a stranger.
    code = "import os; from ddp_training.engine.processes import process_identity; print(process_identity(os.getpid()))"
    inside = run(["unshare", "--pid", "--fork", "--mount-proc", "python", "-c", code], cwd=default_project)
    outside = run(["python", "-c", code], cwd=default_project)
    assert inside.returncode == 0 and outside.returncode == 0, inside.stderr + outside.stderr
    host, pid, _, boot, namespace = inside.stdout.split()
    assert (host, pid) == (outside.stdout.split()[0], "1")  # the same hostname; pid 1 in its own namespace
    assert boot == Path("/proc/sys/kernel/random/boot_id").read_text().strip()  # another machine: another boot id
    assert namespace != outside.stdout.split()[4], (inside.stdout, outside.stdout)


# Loader workers that record their pids and, once told, stick in collate (a dataset's I/O that never returns);
# the start method as a test asks (forkserver: Python 3.14's default on Linux).
STUCK_WORKERS = '''

import multiprocessing
import time

from torch.utils.data import default_collate

multiprocessing.set_start_method(os.environ["START_METHOD"], force=True)


def collate(samples):
    folder = Path(os.environ["WORKER_PIDS"])
    (folder / str(os.getpid())).touch()
    if (folder / "stuck").exists():
        time.sleep(3600)
    return default_collate(samples)


import dataclasses

TASK = dataclasses.replace(TASK, collate=collate)
'''


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_loader_workers_stuck_in_a_sample_end_with_a_rank_the_watchdog_ends(default_project, tmp_path, start_method):
    project = with_task_code(default_project, tmp_path, "\nimport os\nfrom pathlib import Path\n" + STUCK_WORKERS)
    pids = tmp_path / "workers"
    pids.mkdir()
    job = start_job(project, tiny_run(max_steps=1000, step_timeout=3, eval_every=0, ckpt_dir=tmp_path / "ckpt"),
                    nproc=1, stdout=(tmp_path / "log").open("w"), WORKER_PIDS=str(pids), START_METHOD=start_method)
    wait_for(tmp_path / "ckpt" / "step-4.pt", job)  # a file, not a pipe: a worker left over would hold a pipe open
    (pids / "stuck").touch()
    job.wait(timeout=120)
    output = (tmp_path / "log").read_text()
    assert "no progress for" in output, output[-3000:]
    workers = [int(path.name) for path in pids.iterdir() if path.name.isdigit()]
    assert len(workers) == 2, workers
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"loader workers {left} outlived their training process"


# Once told, the loss calls C's sleep() through ctypes.PyDLL, which keeps the GIL (as a C extension stuck in a
# loop would, without burning a core here): the watchdog thread, which needs the GIL, cannot run.
HOLDS_THE_GIL = '''

import ctypes

_plain_loss = compute_loss


def compute_loss(model, batch, step):
    if Path(os.environ["HOLD_GIL"]).exists():
        ctypes.PyDLL(None).sleep(3600)
    return _plain_loss(model, batch, step)


import dataclasses

TASK = dataclasses.replace(TASK, compute_loss=compute_loss)
'''


def test_a_rank_stuck_holding_the_gil_is_ended_by_faulthandler(default_project, tmp_path):
    project = with_task_code(default_project, tmp_path, "\nimport os\nfrom pathlib import Path\n" + HOLDS_THE_GIL)
    job = start_job(project, tiny_run(num_workers=0, max_steps=1000, step_timeout=2, eval_every=0,
                                      ckpt_dir=tmp_path / "ckpt"), nproc=1, HOLD_GIL=str(tmp_path / "hold"))
    wait_for(tmp_path / "ckpt" / "step-4.pt", job)
    (tmp_path / "hold").touch()
    try:
        output = job.communicate(timeout=90)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0
    assert "Timeout (0:00:" in output and "in compute_loss" in output, output[-3000:]
