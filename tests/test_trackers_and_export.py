"""Where users already look: a W&B or MLflow run that a killed, restarted and resumed job continues as one run,
with no step sent twice; a tracker that cannot be reached costs one warning; and exported weights that load
back bit for bit from model.safetensors, as the README shows, without the training's checkpoint code."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    checkpoint,
    free_port,
    kill_a_worker_and_finish,
    readme_block,
    run,
    run_job,
    start_job,
    tiny_run,
    with_task_code,
    worker_pids,
)

# 2 ranks of 8 on 256 samples: 16 steps an epoch, a row every 2 steps, a checkpoint every 4.
RUN = dict(fake_samples=256, num_workers=0, log_every=2)


def wandb_records(wandb_dir: Path) -> list[tuple[str, object]]:
    """Every (run id, record) of the offline runs under wandb_dir, in the order they were written. Each
    run-<id>.wandb file is a LevelDB-style log of W&B's own protobuf records (wandb.proto), which the
    library decodes here."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, position, pending = path.read_bytes(), 7, b""  # a 7-byte header: ":W&B", magic, version
        assert data[:4] == b":W&B", path
        while position + 7 <= len(data):
            block_left = 32768 - position % 32768
            if block_left < 7:  # a block's tail too short for a record header is padding
                position += block_left
                continue
            _, length, kind = struct.unpack_from("<IHB", data, position)
            if kind == 0:  # zeros: the rest of the block is padding
                position += block_left
                continue
            if position + 7 + length > len(data):  # the record a killed writer left half-written
                break
            chunk, position = data[position + 7:position + 7 + length], position + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk  # full, first; middle, last
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append((path.stem.removeprefix("run-"), record))
    return records


def wandb_history(wandb_dir: Path) -> tuple[list[tuple[str, int, dict]], dict]:
    """(every (run id, step, row) logged, the run's config as its updates left it)."""
    rows, config = [], {}
    for run_id, record in wandb_records(wandb_dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append((run_id, items["_step"], items))
        elif kind == "config":
            config |= {item.key: json.loads(item.value_json) for item in record.config.update}
    return rows, config


def mlflow_history(tracking_uri: str) -> tuple[list, list[int], list[int]]:
    """(every run in the store, the steps of train/loss, the steps of eval/loss), with MLflow's own client."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
    assert len(runs) == 1, [run.info.run_id for run in runs]
    run_id = runs[0].info.run_id
    return runs, *([metric.step for metric in client.get_metric_history(run_id, f"{kind}/loss")]
                   for kind in ("train", "eval"))


@pytest.mark.slow
# MLflow's on one rank of 16: the same steps and samples as two of 8, for two processes fewer per attempt.
@pytest.mark.parametrize("tracker, ranks", [("wandb", 2), ("mlflow", 1)])
def test_a_killed_and_resumed_job_is_one_tracker_run_without_a_step_twice(full_project, tmp_path, tracker, ranks,
                                                                        monkeypatch):
    ckpt_dir = tmp_path / "ckpt"
    environment = ({"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
                   if tracker == "wandb" else
                   {"MLFLOW_TRACKING_URI": f"file://{tmp_path / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"})
    # Rank 0, the one sending to the tracker, killed after step 8's checkpoint: torchrun restarts the group,
    # which redoes steps 9 to the kill.
    run = dict(RUN, batch_size=16 // ranks, ckpt_dir=ckpt_dir, tracker=tracker)
    killed = start_job(full_project, tiny_run(**run, max_steps=16), nproc=ranks, max_restarts=1, **environment)
    kill_a_worker_and_finish(killed, ckpt_dir / "step-8.pt", which=0)
    # Then the job again with a higher step limit and another lr, as after a SIGTERM or a requeue.
    resumed = run_job(full_project, tiny_run(**run, max_steps=24, lr=0.02), nproc=ranks, **environment)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "--tracker" not in resumed.stderr, resumed.stderr[-3000:]  # no warning

    record = json.loads((ckpt_dir / "tracker.json").read_text())
    assert record["tracker"] == tracker and record["resumes"] == 2 and record["sent"] == [24, ["train", "eval"]]
    if tracker == "wandb":
        rows, config = wandb_history(tmp_path)
        assert {run_id for run_id, _, _ in rows} == {record["run_id"]}, "one run"
        train = [step for _, step, row in rows if "train/loss" in row]
        evaluation = [step for _, step, row in rows if "eval/loss" in row]
        assert config["lr"] == 0.02 and config["world_size"] == 2, config  # updated by the resume
        resumes = json.dumps(config)
    else:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the reader here too
        runs, train, evaluation = mlflow_history(f"file://{tmp_path / 'mlruns'}")
        assert runs[0].info.run_id == record["run_id"] and runs[0].data.params["lr"] == "0.01"
        assert runs[0].data.tags["world_size"] == "1"
        resumes = json.dumps(runs[0].data.tags)
    # Strictly increasing over the whole job: no step twice, whichever attempt sent it. The killed attempt's rows
    # may be lost (queued while its tracker was still starting, here where 8 steps take a second); every row of
    # the attempts after it is there.
    assert train == sorted(set(train)) and evaluation == sorted(set(evaluation)), (train, evaluation)
    assert set(range(10, 25, 2)) <= set(train), train
    assert evaluation[-1] == 24 and 16 in evaluation, evaluation
    on = f"on {ranks} rank{'s' if ranks > 1 else ''}"
    assert f"at step 8 {on} (restart 1); no option changed" in resumes, resumes
    assert f"at step 16 {on} (restart 0); --lr 0.01 -> 0.02" in resumes, resumes


def store_sizes(folder: Path) -> list[int]:
    """The sizes of the files an sqlite store named mlflow.db is made of, partial or not, sqlite's journal among
    them (which comes and goes)."""
    sizes = []
    for path in folder.glob("*mlflow.db*"):
        with contextlib.suppress(FileNotFoundError):
            sizes.append(path.stat().st_size)
    return sizes


def test_a_partial_store_left_under_this_process_id_is_made_anew(baked_module, tmp_path, monkeypatch):
    # A container's restart can give the new rank the pid of the one killed while it made the store: its partial
    # file then carries this process's own name, and opening it would meet half a database.
    import socket

    import mlflow

    left = tmp_path / f".mlflow.db.partial-{socket.gethostname()}-{os.getpid()}"
    left.write_bytes(b"half a database")
    monkeypatch.setattr(mlflow, "get_tracking_uri", lambda: f"sqlite:///{tmp_path / 'mlflow.db'}")
    baked_module("engine.trackers").make_a_new_sqlite_store_whole(mlflow)
    assert [path.name for path in tmp_path.iterdir()] == ["mlflow.db"]
    assert mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments()[0].name == "Default"


@pytest.mark.slow
def test_a_kill_while_a_new_mlflow_store_is_made_leaves_it_readable(full_project, tmp_path):
    # A fresh sqlite store takes MLflow a second or more of schema migrations to make, in rank 0's tracker thread
    # while training runs: rank 0 is killed (kill -9) once the store's file has 200 kB of its ~1 MB, mid-migration
    # (a kill there left "table trace_info already exists" for every later client in 7 of 8 tries), and torchrun
    # restarts it.
    # 400 steps of 16 samples (about 3 s here): the kill lands mid-training, before its first checkpoint.
    environment = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    run = dict(RUN, batch_size=16, ckpt_dir=tmp_path / "ckpt", ckpt_every=200, tracker="mlflow", max_steps=400,
               epochs=25, eval_every=0, log_every=10)
    job = start_job(full_project, tiny_run(**run), nproc=1, max_restarts=1, **environment)
    deadline = time.monotonic() + 120
    while max(store_sizes(tmp_path), default=0) <= 200_000:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
        time.sleep(0.001)
    os.kill(worker_pids(job)[0], signal.SIGKILL)
    output = job.communicate(timeout=300)[0]
    assert job.returncode == 0 and "restart=1" in output, output[-3000:]
    assert "--tracker" not in output, output[-3000:]  # the restarted rank's tracker made the store and sent rows
    _, train, _ = mlflow_history(environment["MLFLOW_TRACKING_URI"])  # a fresh client opens it
    # The rows of the attempt that resumed, each once: from its checkpoint (0 or 200) to the end.
    assert train in (list(range(10, 401, 10)), list(range(210, 401, 10))), train
    assert not list(tmp_path.glob(".mlflow.db.partial-*")), "the killed attempt's partial store was removed"


@pytest.mark.slow
@pytest.mark.starts_first  # W&B gives up on a server that is down after about 40 s: mostly waiting, overlapped
@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_that_cannot_be_reached_costs_one_warning(full_project, tmp_path, tracker):
    nobody = f"http://127.0.0.1:{free_port()}"  # a server that is down
    environment = ({"WANDB_MODE": "online", "WANDB_BASE_URL": nobody, "WANDB_API_KEY": "0" * 40,
                    "WANDB_DIR": str(tmp_path)} if tracker == "wandb" else {"MLFLOW_TRACKING_URI": nobody})
    result = run_job(full_project, tiny_run(**RUN, max_steps=4, ckpt_dir=tmp_path, tracker=tracker),
                     via="python", nproc=1, **environment)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "--tracker:" in line]
    assert len(warnings) == 1 and "training goes on without it" in warnings[0], result.stderr[-3000:]
    assert (tmp_path / "step-4.pt").exists() and "Traceback" not in result.stderr


@pytest.mark.slow
def test_exported_safetensors_load_back_bitwise_as_the_readme_shows(full_project, uninterrupted_bare,
                                                                    baked_module, tmp_path, monkeypatch, capsys):
    baked_module("export").main([str(uninterrupted_bare / "step-40.pt"), str(tmp_path / "model.pt")])
    assert "to " + str(tmp_path / "model.pt") + ", model.safetensors and model.json" in capsys.readouterr().out
    # Written with the mode a plain write gets, readable by whom the umask allows: each checkpoint and export
    # file (an atomic write's temporary file, or safetensors' own, had left 0600).
    umask = os.umask(0)
    os.umask(umask)
    for written in (uninterrupted_bare / "step-40.pt", *(tmp_path / f"model.{end}" for end in ("pt", "safetensors"))):
        assert oct(written.stat().st_mode & 0o777) == oct(0o666 & ~umask), written
    saved = json.loads((tmp_path / "model.json").read_text())
    assert saved == {"step": 40, "task": {"data": "fake", "data_dir": "data", "fake_samples": 512,
                                          "model": "small_cnn", "image_size": 16, "num_classes": 10}}
    # The README's lines, run as they are in the folder the export wrote.
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(readme_block(full_project, "python", "# Weights others can load", "docs/export.md"), namespace)  # noqa: S102
    expected = checkpoint(uninterrupted_bare, 40)["model"]
    loaded = namespace["model"].state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_tied_weights_are_exported_as_copies_that_load_back_into_the_tie(baked_module, tmp_path):
    from safetensors.torch import load_file, save_file

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # an output layer tied to the embedding, as in many language models
    save_file(baked_module("export").one_storage_each(model.state_dict()), tmp_path / "tied.safetensors")
    copy = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    copy[1].weight = copy[0].weight
    copy.load_state_dict(load_file(tmp_path / "tied.safetensors"))
    assert copy[1].weight is copy[0].weight and torch.equal(copy[0].weight, model[0].weight)
    # Without safetensors installed (an environment made without the project's dependencies): one line.
    with pytest.MonkeyPatch.context() as patched:
        patched.setitem(sys.modules, "safetensors.torch", None)  # `from safetensors.torch import ...` fails
        with pytest.raises(SystemExit, match=r"^error: export writes model.safetensors with the safetensors package, "
                                             r"which is not installed; pip install -e \."):
            baked_module("export").main([str(tmp_path / "tied.safetensors"), str(tmp_path / "out.pt")])


# LoRA's export: each adapted layer's weight plus B @ A, the adapters dropped (TASK's export_weights).
LORA_MERGED = '''

import dataclasses


def merged(weights, options):
    assert options.num_classes == 3  # the run's task options, as saved
    adapters = [name.removesuffix(".lora_a") for name in weights if name.endswith(".lora_a")]
    merged = {name: tensor for name, tensor in weights.items() if not name.endswith((".lora_a", ".lora_b"))}
    for layer in adapters:
        merged[f"{layer}.weight"] = weights[f"{layer}.weight"] + weights[f"{layer}.lora_b"] @ weights[f"{layer}.lora_a"]
    return merged


TASK = dataclasses.replace(TASK, export_weights=merged)
'''


def test_export_writes_the_form_the_tasks_export_weights_makes(full_project, tmp_path):
    project = with_task_code(full_project, tmp_path, LORA_MERGED)
    weight, bias, lora_a, lora_b = torch.randn(3, 4), torch.randn(3), torch.randn(2, 4), torch.randn(3, 2)
    torch.save({"model": {"head.weight": weight, "head.bias": bias, "head.lora_a": lora_a, "head.lora_b": lora_b},
                "options": {"num_classes": 3}, "step": 7}, tmp_path / "step-7.pt")
    result = run([sys.executable, "-m", "ddp_training.export", str(tmp_path / "step-7.pt"), "merged.pt"], cwd=project)
    assert result.returncode == 0 and "in the form TASK's export_weights makes" in result.stdout, result.stderr
    exported = torch.load(project / "merged.pt", weights_only=True)
    assert exported.keys() == {"head.weight", "head.bias"}
    assert torch.equal(exported["head.weight"], weight + lora_b @ lora_a) and torch.equal(exported["head.bias"], bias)
