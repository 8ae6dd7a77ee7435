"""The generated project, driven through its own CLI: train.py and run_node.sh as a user runs them."""

from __future__ import annotations

import hashlib
import mmap
import re
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import (
    BIN,
    assert_project_tests_pass,
    flags,
    flip_a_bit,
    main_in_this_process,
    make_image_folder,
    run,
    run_job,
    start_nodes,
)

# The default model (resnet18) and every default a user gets, on small fake images.
TINY = flags(data="fake", image_size=16, batch_size=16, num_workers=0, device="cpu")

# Each bad input and the one line that must explain it.
BAD_OPTIONS = [
    (["--batch-size", "0"], "error: --batch-size must be >= 1, got 0"),
    (["--lr", "-1"], "error: --lr must be > 0"),
    (["--model", "resnet19"], "error: --model 'resnet19' is not in the task's models; did you mean"),
    (["--device", "cuda"], "error: --device cuda but no CUDA device is visible"),
    (["--data", "imagefolder", "--data-dir", "{tmp}/missing"], "error: --data-dir {tmp}/missing: expected class"),
    (["--data", "imagefolder", "--data-dir", "{tmp}"], "error: --data-dir {tmp}: expected class folders"),
    (["--ckpt-dir", "{tmp}/a-file/checkpoints"], "error: --ckpt-dir {tmp}/a-file/checkpoints cannot be written"),
    (["--fake-samples", "8"], "error: the training set (8 samples) gives no full step of 1 x 16 samples per rank"),
    (["--fake-samples", "64", "--grad-accum", "8"], "error: the training set (64 samples) gives no full step of 8 x"),
    (["--grad-accum", "0"], "error: --grad-accum must be >= 1, got 0"),
    (["--clip-grad", "0"], "error: --clip-grad must be > 0"),
    (["--warmup-steps", "-1"], "error: --warmup-steps must be >= 0, got -1"),
    (["--eval-every", "-1"], "error: --eval-every must be >= 0 (0: never), got -1"),
    (["--strategy", "fsdp2", "--precision", "fp16"], "error: --precision fp16 needs a gradient scaler"),
]


def assert_one_error_line(result, expected: str) -> None:
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all(line == errors[0] for line in errors), result.stderr
    assert errors[0].startswith(expected), result.stderr
    assert "UsageError" not in result.stderr, "a usage error must not surface as a worker traceback"


@pytest.mark.slow
def test_generated_smoke_tests_pass(default_project):
    assert_project_tests_pass(default_project)


# Found while the data loaders are built, in train(): after the watchdog has taken over SIGTERM, which this
# process must keep; these run as processes of their own.
FOUND_IN_TRAIN = ("--fake-samples",)


@pytest.mark.parametrize("args, expected", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_option_is_one_clear_line(default_project, full_project, baked_train, tmp_path, args, expected, capsys,
                                      monkeypatch):
    (tmp_path / "a-file").write_text("not a folder")
    args = [*TINY, "--ckpt-dir", str(tmp_path / "ckpt"), *(arg.format(tmp=tmp_path) for arg in args)]
    if args[-2] in FOUND_IN_TRAIN or args[-4] in FOUND_IN_TRAIN:
        result = run_job(default_project, args, via="python", nproc=1)
    else:
        monkeypatch.chdir(full_project)  # baked_train's
        result = main_in_this_process(baked_train, args, capsys)
    assert_one_error_line(result, expected.format(tmp=tmp_path))


@pytest.mark.parametrize("environment, expected", [
    ({"RANK": "0"}, "error: partial torchrun environment: RANK set but WORLD_SIZE, LOCAL_RANK"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "error: inconsistent torchrun environment: RANK=2 with WORLD_SIZE=2"),
], ids=["partial", "inconsistent"])
def test_broken_launch_environment_is_refused(baked_train, tmp_path, environment, expected, capsys, monkeypatch):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert_one_error_line(main_in_this_process(baked_train, [*TINY, "--ckpt-dir", str(tmp_path)], capsys), expected)


def test_plain_python_runs_one_process_and_ignores_old_local_rank_flag(default_project, tmp_path):
    # The deprecated launcher's --local_rank and underscore spellings are accepted; the environment wins.
    result = run_job(default_project, [*TINY, "--local_rank=1", "--max_steps", "3", "--log_every", "1", "--ckpt_dir",
                                       str(tmp_path)], via="python", nproc=1)
    assert result.returncode == 0, result.stderr
    assert "--local-rank is ignored" in result.stderr
    assert "world_size=1 nodes=1 ranks_per_node=1 backend=gloo device=cpu" in result.stderr
    assert re.findall(r"step (\d) \| epoch \d+ \| loss", result.stderr) == ["1", "2", "3"]
    assert (tmp_path / "step-3.pt").exists()


@pytest.mark.slow
def test_two_nodes_with_the_same_command_form_one_job_that_evaluates_every_held_out_sample_once(default_project,
                                                                                             tmp_path):
    # Two "machines" on loopback, each started with the identical run_node.sh command line and environment.
    # 260 fake samples: 130 per rank, 8 full batches of 16. The held-out set has 260 // 4 = 65 samples, an odd
    # number, so the two ranks' shards differ in size and a padded sampler would count one twice.
    args = [*TINY, *flags(fake_samples=260, epochs=1, log_every=4, ckpt_dir=tmp_path)]
    outputs = start_nodes(default_project, [args, args], rdzv_id="job-a")
    assert all("rdzv_endpoint=127.0.0.1:" in output and "rdzv_id=job-a" in output for output in outputs)
    assert "world_size=2 nodes=2 ranks_per_node=1" in "".join(outputs)
    assert "written by 1 node (shared folder)" in "".join(outputs)  # one writer, never two on one path
    assert re.search(r"step 8 \| epoch 1 \| eval loss \d+\.\d+ \| accuracy \d\.\d+ on 65 held-out samples",
                     "".join(outputs))
    assert sorted(path.name for path in tmp_path.glob("step-*.pt")) == ["step-8.pt"]


@pytest.mark.slow
def test_imagefolder_trains_on_a_users_folder(default_project, tmp_path):
    make_image_folder(tmp_path / "images", {"train": 4, "val": 3})
    result = run_job(default_project, flags(data="imagefolder", data_dir=tmp_path / "images", num_classes=2,
                                            image_size=16, batch_size=4, epochs=1, num_workers=1,
                                            ckpt_dir=tmp_path / "ckpt"), via="python", nproc=1)
    assert result.returncode == 0, result.stderr
    assert "accuracy" in result.stderr and "on 6 held-out samples" in result.stderr


@pytest.mark.parametrize("environment, expected", [
    ({"NNODES": "2"}, "run_node.sh: error: NNODES=2 needs RDZV_ENDPOINT=host:port"),
    ({"NNODES": "1:4"}, "run_node.sh: error: NNODES=1:4 needs RDZV_ENDPOINT=host:port"),
    ({"NNODES": "two"}, "run_node.sh: error: NNODES='two' must be a number of machines"),
    ({"NPROC_PER_NODE": "0"}, "run_node.sh: error: NPROC_PER_NODE='0' must be auto, gpu, cpu or a number"),
    ({"MAX_RESTARTS": "many"}, "run_node.sh: error: MAX_RESTARTS='many' must be a whole number"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "no-such-host.invalid:29400"},
     "run_node.sh: error: RDZV_ENDPOINT host 'no-such-host.invalid' does not resolve here"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1:70000"},
     "run_node.sh: error: RDZV_ENDPOINT='127.0.0.1:70000' needs a port between 1 and 65535"),
    ({"RDZV_TIMEOUT": "soon"}, "run_node.sh: error: RDZV_TIMEOUT='soon' must be a number of seconds"),
])
def test_run_node_refuses_a_launch_that_cannot_work(default_project, environment, expected):
    result = run(["./run_node.sh", "--max-steps", "1"], cwd=default_project, **environment)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr


def test_preflight_refuses_to_run_without_torchrun(full_project):
    result = run(["python", "-m", "ddp_training.preflight"], cwd=full_project)
    assert_one_error_line(result, "error: run the preflight under torchrun")


@pytest.mark.slow
def test_a_failed_download_stops_every_rank_instead_of_hanging(default_project, tmp_path):
    # Local rank 0 downloads while the others wait; its failure (here: the folder is under a file, so no
    # network is touched) must reach the waiting ranks, or they would sit in a collective until the timeout.
    (tmp_path / "a-file").write_text("not a folder")
    result = run_job(default_project, [*TINY, *flags(data="cifar10", data_dir=tmp_path / "a-file" / "cifar",
                                                     ckpt_dir=tmp_path / "ckpt")], via="run_node.sh", timeout=120)
    assert result.returncode != 0
    # The failing node's message reaches every rank, and rank 0 prints it once for the job (issue 12).
    assert result.stderr.count("error: preparing --data cifar10 in ") == 1, result.stderr
    assert "failed on node 0: [Errno 20] Not a directory" in result.stderr


SIGTERM_DURING_THE_FIRST_STEP = """
import os, signal, time
from ddp_training.engine.distributed import DistEnv
from ddp_training.engine.watchdog import Watchdog
watchdog = Watchdog(DistEnv(), None, step_timeout=60, io_timeout=60)
watchdog.beat(0)  # step 1 begins, and no step has been timed yet
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(2.5)  # a first step (compilation, autotuning, the loaders' start) longer than a timed step's patience
print("still stepping after SIGTERM:", watchdog.sigterm_received)
watchdog.beat(1)
watchdog.beat(2)  # a timed step of ~0 s: now a rank stuck after SIGTERM waits for a peer that has gone
time.sleep(30)
"""


def test_a_sigterm_before_the_first_timed_step_leaves_that_step_time_to_end(default_project):
    # With no step timed, the patience for a rank that seems to wait for a gone peer was 1 s: a SIGTERM
    # during a slow first step ended a healthy rank before it could save.
    started = time.monotonic()
    result = run([str(BIN / "python"), "-c", SIGTERM_DURING_THE_FIRST_STEP], cwd=default_project, timeout=60)
    assert "still stepping after SIGTERM: True" in result.stdout, result.stderr
    assert result.returncode == 143 and "SIGTERM while step 3 has waited" in result.stderr, result.stderr
    assert time.monotonic() - started < 25, result.stderr


SLOW_FIRST_STEP_AFTER_THE_EVALUATION_CHECK = """
import time
from ddp_training.engine.distributed import DistEnv
from ddp_training.engine.watchdog import Watchdog
watchdog = Watchdog(DistEnv(), None, step_timeout=1, io_timeout=60)
with watchdog.slow_phase("checking evaluation on one batch"):  # train.py's, before the first step
    pass
time.sleep(2.5)  # the first step, compiling: longer than --step-timeout, within --io-timeout
print("first step done", flush=True)
watchdog.beat(1)
time.sleep(5)  # the second step hangs
print("second step done", flush=True)
"""


def test_the_first_step_has_start_ups_allowance_even_after_the_evaluation_check(default_project):
    # The check ended in a training step's allowance: a first step that compiled for longer than
    # --step-timeout was taken for a hang, at every restart.
    result = run([str(BIN / "python"), "-c", SLOW_FIRST_STEP_AFTER_THE_EVALUATION_CHECK], cwd=default_project,
                 timeout=60)
    assert "first step done" in result.stdout and "second step done" not in result.stdout, result.stdout
    assert result.returncode == 124, result.stderr
    assert "in training step (step 2, past --step-timeout 1 s)" in result.stderr, result.stderr


def test_on_nccl_the_hang_report_uses_torchs_flight_recorder(baked_train, tmp_path, monkeypatch):
    # NCCL collectives return once queued, so a healthy rank's stack is not "waiting for others" and cannot
    # name the stopped rank; torch's flight recorder, dumped on every rank when one times out, can.
    import torch
    from ddp_training.engine.distributed import DistEnv, nccl_flight_recorder_settings
    from ddp_training.engine.watchdog import hang_summary

    monkeypatch.chdir(tmp_path)
    job = DistEnv(run_id="job 1/a")  # two jobs started from one folder keep their own reports
    settings = nccl_flight_recorder_settings(job)
    assert (tmp_path / "hang-reports" / "job_1_a").is_dir()
    assert settings["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert settings["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "hang-reports/job_1_a/nccl_trace_rank_")
    assert nccl_flight_recorder_settings(DistEnv(run_id="job2"))["TORCH_FR_DUMP_TEMP_FILE"].endswith(
        "hang-reports/job2/nccl_trace_rank_")
    for name in settings:  # spelled as the installed torch reads them (not the older TORCH_NCCL_TRACE_BUFFER_SIZE)
        assert any(in_file(name.encode() + b"\0", Path(torch.__file__).parent / "lib" / library)
                   for library in ("libtorch_cuda.so", "libtorch_cpu.so")), name
    nccl = {rank: {"step": 10, "phase": "training step", "waiting_for_others": None} for rank in (0, 1)}
    records = Path("hang-reports/job_1_a")
    summary = hang_summary(nccl, silent=[], flight_records=records)
    assert "rank(s)" not in summary and "fr_trace hang-reports/job_1_a`" in summary, summary
    assert hang_summary(nccl, silent=[1], flight_records=records).startswith(
        "HANG: rank(s) 1 stopped making progress (1 sent no report")
    gloo = {0: {**nccl[0], "waiting_for_others": True}, 1: {**nccl[1], "waiting_for_others": False}}
    assert hang_summary(gloo, silent=[], flight_records=records).startswith(
        "HANG: rank(s) 1 stopped making progress. Where each rank was: "
        "rank 0: step 10, training step, waiting for others")


@pytest.mark.parametrize("restart_count, max_restarts, then", [
    (0, "1", "torchrun restarts the group from the newest checkpoint"),
    (1, "1", "torchrun has no restart left (--max-restarts 1), so the job ends; run the same command to resume"),
    (0, None, "torchrun has no restart left (--max-restarts 0), so the job ends; run the same command to resume"),
], ids=["restart_left", "none_left", "plain_torchrun"])
def test_a_lost_peer_or_a_taken_port_is_one_line_that_says_what_happens_next(baked_train, capsys, monkeypatch,
                                                                             restart_count, max_restarts, then):
    # Plain torchrun restarts nothing unless given --max-restarts: a line promising a restart would mislead.
    import torch.distributed as dist
    from ddp_training.engine import failure
    from ddp_training.engine.distributed import DistEnv, PortTaken
    from ddp_training.engine.failure import end_attempt_after

    # A lost peer's process exits at once (os._exit, after its background write and atexit handlers): here, in
    # the test's own process, as sys.exit. The kill -9 tests end real ranks that way.
    monkeypatch.setattr(failure, "exit_at_once", sys.exit)

    # Rank 1 of 2 as torchrun starts it (the variables it sets), from which the project reads its environment.
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": str(restart_count)}
    if max_restarts is not None:
        environ["TORCHELASTIC_MAX_RESTARTS"] = max_restarts
    env = DistEnv.from_environ(environ)
    for error, cause in ((dist.DistNetworkError("Connection reset by peer. This is ..."),
                          "lost another rank (Connection reset by peer); "),
                         (PortTaken(29511), "port 29511, which torchrun chose for this attempt's store, was taken "
                                            "by another process before rank 0 could listen on it "
                                            "(pytorch/pytorch#126510); ")):
        with pytest.raises(SystemExit) as exit_:
            end_attempt_after(error, None, env)
        assert exit_.value.code == 1
        assert capsys.readouterr().err.startswith(f"[rank 1] {cause}{then}"), (error, then)


def test_an_error_in_the_projects_own_files_or_at_start_up_and_no_machine_fault_can_be_a_bug(baked_module,
                                                                                         full_project, monkeypatch):
    # Raised by code compiled as if it were in these files: the innermost frame decides, and the kind of error.
    import torch
    import torch.distributed as dist

    failure = baked_module("engine.failure")

    def raised_in(path: Path, statement: str) -> BaseException:
        try:
            exec(compile(statement, str(path), "exec"), {"torch": torch, "dist": dist})
        except BaseException as error:  # noqa: BLE001
            return error
        raise AssertionError(statement)

    task, train = full_project / "ddp_training" / "task.py", full_project / "train.py"
    library = Path(torch.__file__).parent / "nn" / "functional.py"
    # A bug is reported as known until the code changes: the code is train.py and the whole package, the engine
    # (where failure.py lives) and task.py alike.
    every_file = sorted([train, *(full_project / "ddp_training").rglob("*.py")])
    assert task in every_file and failure.code_hash() == hashlib.sha256(
        b"".join(path.read_bytes() for path in every_file)).hexdigest()[:16]
    assert failure.could_be_a_bug(raised_in(task, "1 / 0"))
    assert failure.could_be_a_bug(raised_in(train, "raise ValueError('bad shape')"))
    assert failure.could_be_a_bug(raised_in(library, "raise ValueError('bad shape')")), "before the first step"
    stepped = threading.Event()
    stepped.set()  # this process trained a step: from now on only the project's own code can have a bug
    monkeypatch.setattr(failure, "STEPPED", stepped)
    assert not failure.could_be_a_bug(raised_in(library, "raise ValueError('bad shape')")), "not the project's code"
    for fault in ("raise dist.DistBackendError('NCCL error: unhandled system error')",
                  "raise dist.DistStoreError('Socket Timeout')", "raise OSError(5, 'Input/output error')",
                  "raise TimeoutError('timed out')", "raise MemoryError()",
                  "raise torch.AcceleratorError('CUDA error: uncorrectable ECC error encountered')",
                  "raise RuntimeError('CUDA error: an illegal memory access was encountered')",
                  "try:\n    open('/nonexistent/x')\nexcept OSError as e:\n"
                  "    raise ValueError('could not read') from e"):
        assert not failure.could_be_a_bug(raised_in(task, fault)), fault
    # A DataLoader worker's error, re-raised by torch in the training process: the worker's frames decide.
    worker = RuntimeError(f'Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call '
                          f'last):\n  File "{library}", line 1, in fetch\n  File "{task}", line 7, in collate\n'
                          f'    raise ValueError\nValueError: bad batch')
    assert failure.could_be_a_bug(worker) and failure.innermost_frame(worker) == (task, 7)
    # Where a report says a bug was raised: its innermost frame, and task.py's call where that is deeper (torch's
    # error for an argument task.py gave it).
    assert failure.Crash.of(raised_in(task, "1 / 0"), full_project).where == "task.py:1"
    small_cnn = baked_module("task").small_cnn
    try:
        small_cnn(SimpleNamespace(task=SimpleNamespace(num_classes="ten")), None)
    except TypeError as error:
        raised = failure.Crash.of(error, full_project).where
    line = next(number for number, text in enumerate(task.read_text().splitlines(), start=1)
                if "nn.Linear(4 * width * 4, options.task.num_classes)" in text)
    assert re.fullmatch(rf"\w+\.py:\d+ \(from task\.py:{line}\)", raised) and not raised.startswith("task.py"), raised


def test_only_a_damaged_checkpoint_is_set_aside_and_any_other_that_fails_stops_the_job(baked_module, tmp_path,
                                                                                       monkeypatch, caplog):
    import torch

    replicated = baked_module("engine.checkpoint.replicated")
    state = {"step": 3, "epoch": 0, "samples_in_epoch": 48, "torch_rng_state": torch.get_rng_state()}
    torch.save(state, tmp_path / "step-3.pt")
    whole = (tmp_path / "step-3.pt").read_bytes()
    (tmp_path / "step-5.pt").write_bytes(whole[: len(whole) // 2])  # a write cut short
    (tmp_path / "step-4.pt").write_bytes(whole[:100] + b"x" * 64 + whole[164:])  # same length, bytes changed
    # One bit flipped in a tensor's bytes (bit rot): the file loads, the generator state would differ silently.
    member = flip_a_bit(tmp_path / "step-3.pt", tmp_path / "step-6.pt")
    # Written without CRCs (torch.serialization.set_crc32_options(False)): nothing to check, never set aside.
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, tmp_path / "no-crc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert replicated.damaged(tmp_path / "no-crc.pt") is None
    (tmp_path / "no-crc.pt").unlink()
    assert torch.equal(torch.load(tmp_path / "step-6.pt", weights_only=True)["torch_rng_state"][8:],
                       state["torch_rng_state"][8:])  # torch.load itself checks nothing
    found, problem = replicated.load_newest_valid(tmp_path)
    assert problem is None and found[0] == tmp_path / "step-3.pt" and found[1]["samples_in_epoch"] == 48
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-3.pt", "step-4.pt.unreadable",
                                                                "step-5.pt.unreadable", "step-6.pt.unreadable"]
    warnings = [record.getMessage() for record in caplog.records if "skipping unreadable" in record.getMessage()]
    assert warnings[0] == (f"skipping unreadable checkpoint {tmp_path / 'step-6.pt'} (its bytes changed after it "
                           f"was written: {member} fails its CRC-32 check (bit rot on the storage, or a "
                           "bad copy)); kept as step-6.pt.unreadable"), warnings
    assert warnings[1].startswith(f"skipping unreadable checkpoint {tmp_path / 'step-5.pt'} (cut short: "), warnings
    # Whole files that fail: kept where they are, and the job stops with one line.
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: (_ for _ in ()).throw(MemoryError()))
    found, problem = replicated.load_newest_valid(tmp_path)
    assert found is None and problem == (
        f"{tmp_path / 'step-3.pt'} is a whole file that this run cannot load (MemoryError: MemoryError); resume "
        f"with the code and torch that wrote it, or move it out of {tmp_path}")
    monkeypatch.undo()
    torch.save({"model": {}}, tmp_path / "step-7.pt")  # someone's model file, under a checkpoint's name
    found, problem = replicated.load_newest_valid(tmp_path)
    assert found is None and problem.startswith(f"{tmp_path / 'step-7.pt'} is no training checkpoint of step 7 "
                                                "(lacks epoch, samples_in_epoch, step, torch_rng_state)")
    assert (tmp_path / "step-7.pt").exists() and (tmp_path / "step-3.pt").exists()


def test_a_sharded_step_moved_aside_by_an_interrupted_publish_is_put_back(baked_module, tmp_path):
    sharded = baked_module("engine.checkpoint.sharded")
    # Killed after moving the old step-8 aside, before the new one was renamed in: the old one goes back.
    (tmp_path / ".step-8.stale-1f").mkdir()
    (tmp_path / ".step-8.stale-1f" / ".metadata").write_text("old step 8")
    (tmp_path / ".step-8.partial").mkdir()
    # Killed after the new step-4 was in place, before the old one was deleted: the old one goes.
    (tmp_path / "step-4").mkdir()
    (tmp_path / ".step-4.stale-2e").mkdir()
    sharded.recover_published(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [".step-8.partial", "step-4", "step-8"]
    assert (tmp_path / "step-8" / ".metadata").read_text() == "old step 8"
    # A folder published over a same-step one: the new one is in place, nothing else is left.
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / ".metadata").write_text("new step 8")
    sharded.publish(tmp_path / "new", tmp_path / "step-8")
    assert (tmp_path / "step-8" / ".metadata").read_text() == "new step 8"
    assert sorted(path.name for path in tmp_path.iterdir()) == [".step-8.partial", "step-4", "step-8"]


def in_file(text: bytes, path: Path) -> bool:
    if not path.exists():  # a CPU-only build of torch has no libtorch_cuda.so
        return False
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return mapped.find(text) >= 0
