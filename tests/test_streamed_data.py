"""Streamed training sets, with numbers. task=language_model with --data stream: a corpus of uneven jsonl, text and
parquet shards read by 2 ranks x 2 loader workers; the epoch ends at the same step on every rank; kill -9 resumes
at the exact window (bitwise); resized 1 -> 2 ranks, stopped there by SIGTERM, -> 1 mid-epoch (with a
tokenizer.json), no window is trained on twice or skipped; bad input is one line. The image task's --data
shards: WebDataset tar shards with random crops and flips, resumed bitwise after kill -9."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shutil
import signal
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    assert_bitwise_equal,
    checkpoint,
    flags,
    kill_a_worker_and_finish,
    main_in_this_process,
    paused,
    run_job,
    start_job,
    wait_for,
)

pytestmark = pytest.mark.xdist_group("streamed_data")  # one worker: the reference run is made once

BLOCK = 32
# 2 ranks x 2 loader workers, batches of 4 windows; small enough to run 100 steps in seconds.
TINY_STREAM = dict(data="stream", block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, batch_size=4, device="cpu",
                   lr=1e-2, warmup_steps=2, log_every=5, ckpt_every=5, keep_checkpoints=100)
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]


def documents(count: int, seed: int) -> list[str]:
    generator = np.random.default_rng(seed)
    return [" ".join(f"{WORDS[generator.integers(6)]} {WORDS[generator.integers(6)]}."
                     for _ in range(generator.integers(2, 30))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Six shards of very different sizes, in every format the stream reads."""
    import pyarrow
    import pyarrow.parquet

    folder = tmp_path_factory.mktemp("corpus")
    for shard, count in enumerate([40, 8, 70, 25]):
        with open(folder / f"train-{shard}.jsonl", "w") as file:
            file.writelines(json.dumps({"id": index, "text": text}) + "\n"
                            for index, text in enumerate(documents(count, seed=shard)))
    (folder / "train-4.txt").write_text("\n".join(documents(30, seed=4)) + "\n")
    table = pyarrow.table({"text": documents(50, seed=5)})
    pyarrow.parquet.write_table(table, folder / "train-5.parquet", row_group_size=20)  # 3 row groups: 3 pieces
    (folder / "held-out").mkdir()
    with open(folder / "held-out" / "val.jsonl", "w") as file:
        file.writelines(json.dumps({"text": text}) + "\n" for text in documents(12, seed=9))
    return folder


@pytest.fixture(scope="module")
def tokenizer(corpus) -> Path:
    """A word-level tokenizer.json of the corpus's words, with the end-of-text token the task needs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(documents(20, seed=0), trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "<|endoftext|>"]))
    path = corpus / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def stream_project(bake) -> Path:
    return bake(task="language_model", project_name="Streamed LM", use_streaming="yes")


@pytest.fixture(scope="session")
def image_stream_project(bake) -> Path:
    return bake(project_name="Streamed Images", use_streaming="yes")


def stream_args(corpus: Path, **options: object) -> list[str]:
    return flags(**TINY_STREAM, data_files=corpus / "train-*", eval_files=corpus / "held-out" / "*.jsonl",
                 **options)


def trained_windows(sample_log: Path, epoch: int = 0) -> Counter:
    """How often each window (piece:index) of `epoch` was trained on, over every rank's log."""
    lines = [line for path in sample_log.glob("rank-*.txt") for line in path.read_text().split()]
    return Counter(line.split(":", 1)[1] for line in lines if line.startswith(f"{epoch}:"))


@contextlib.contextmanager
def on_sys_path(project: Path) -> Iterator[None]:
    """The baked project's folder on sys.path while its modules are imported into this process."""
    sys.path.insert(0, str(project))
    try:
        yield
    finally:
        sys.path.remove(str(project))


def package_modules(project: Path, *names: str) -> list:
    with on_sys_path(project):
        return [importlib.import_module(f"streamed_lm.{name}") for name in names]


def every_window(project: Path, corpus: Path, tokenizer: Path | None = None) -> set[str]:
    """The corpus's windows as the baked task cuts them, read here in one process."""
    task, streaming = package_modules(project, "task", "engine.streaming")
    pieces = streaming.file_pieces(streaming.expand_files(str(corpus / "train-*"), "--data-files"), 16 * 2**20)
    return {f"{number}:{index}" for number, piece in enumerate(pieces)
            for index, _ in enumerate(task.text_windows(piece, BLOCK, str(tokenizer or "")))}


@pytest.fixture(scope="module")
def uninterrupted(stream_project, corpus, tmp_path_factory) -> tuple[Path, str, Path]:
    folder = tmp_path_factory.mktemp("stream-uninterrupted")
    result = run_job(stream_project, stream_args(corpus, num_workers=2, max_steps=100, ckpt_dir=folder / "ckpt",
                                                 sample_log=folder / "samples"))
    assert result.returncode == 0, result.stderr[-4000:]
    return folder / "ckpt", result.stderr, folder / "samples"


@pytest.mark.slow
def test_a_streamed_corpus_trains_ends_each_epoch_together_and_resumes_bitwise_after_kill_9(
        stream_project, corpus, uninterrupted, tmp_path):
    reference, output, samples = uninterrupted
    losses = {int(step): float(loss) for step, loss in re.findall(r"step (\d+) \| epoch \d+ \| loss ([\d.]+)", output)}
    assert losses[100] < 0.6 * losses[5], losses
    # Epoch 0 ended on both ranks at one step (else a rank would have waited in a collective), and epoch 1 began.
    epochs = {int(step): int(epoch) for step, epoch in re.findall(r"step (\d+) \| epoch (\d+) \| loss", output)}
    assert epochs[5] == 0 and epochs[100] == 1, epochs
    per_rank = [sum(1 for line in path.read_text().split() if line.startswith("0:"))
                for path in sorted(samples.glob("rank-*.txt"))]
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1] > 0, per_rank
    seen = trained_windows(samples)
    assert max(seen.values()) == 1, "a window trained on twice in one epoch"
    assert seen.keys() <= every_window(stream_project, corpus)
    assert re.search(r"step 100 \| epoch 1 \| eval loss [\d.]+ \| perplexity [\d.]+ on \d+ held-out tokens", output)

    launcher = start_job(stream_project, stream_args(corpus, num_workers=2, max_steps=100, ckpt_dir=tmp_path),
                         max_restarts=1)
    kill_a_worker_and_finish(launcher, tmp_path / "step-15.pt")  # an odd step: the other worker next
    final = checkpoint(tmp_path, 100)
    assert_bitwise_equal(final, checkpoint(reference, 100))  # model, optimizer, RNG
    assert final["stream_position"] == checkpoint(reference, 100)["stream_position"]


@pytest.mark.slow
def test_a_resized_stream_keeps_its_length_and_its_lr_curve(stream_project, corpus, uninterrupted, tmp_path):
    # 2 ranks x 4 windows (8 a step) to step 50 of --max-steps 100, then 1 rank (4 a step): the run is 800
    # windows, so it ends at step 150 where its cosine does; a step count would have ended it at step 100, at
    # lr 0.5 x peak (and 2 -> 4 ranks would have trained its last 25 steps at lr 0).
    reference = uninterrupted[0]
    (tmp_path / "ckpt").mkdir()
    shutil.copy(reference / "step-50.pt", tmp_path / "ckpt")
    result = run_job(stream_project, stream_args(corpus, num_workers=0, max_steps=100, ckpt_dir=tmp_path / "ckpt"),
                     via="python", nproc=1)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "it ends once 800 samples are trained, 4 a step now" in result.stderr, result.stderr[-4000:]
    assert not (tmp_path / "ckpt" / "step-155.pt").exists()
    [optim] = package_modules(stream_project, "engine.optim")

    def curve(samples: float) -> float:  # --lr 1e-2, --warmup-steps 2 of 8 windows, cosine over 800
        return 1e-2 * optim.warmup_then_decay(samples, 16, 800, "cosine")

    # Every step's lr is the curve's at the middle of its samples, at either size; neither end's is 0.
    for folder, steps, per_step in ((reference, (5, 50, 100), 8), (tmp_path / "ckpt", (55, 100, 150), 4)):
        for step in steps:
            state = checkpoint(folder, step)
            lr = state["optimizer"]["param_groups"][0]["lr"]
            assert lr == pytest.approx(curve(state["samples_seen"] - per_step / 2), rel=1e-12), (folder, step)
    assert checkpoint(tmp_path / "ckpt", 150)["samples_seen"] == 800
    assert checkpoint(reference, 100)["optimizer"]["param_groups"][0]["lr"] > 0
    assert checkpoint(tmp_path / "ckpt", 150)["optimizer"]["param_groups"][0]["lr"] > 0


@pytest.mark.slow
def test_a_stream_resized_mid_epoch_trains_on_no_window_twice_and_skips_none(stream_project, corpus, tokenizer,
                                                                            tmp_path):
    # 1 rank, 1 stream -> 2 ranks x 2 loader workers, 4 streams (FSDP2: the position in a DCP folder), stopped by
    # SIGTERM -> 1 rank to the epoch's end. One stream at the end: only its last partial batch (< 4 windows)
    # is left untrained.
    common = dict(strategy="fsdp2", epochs=1, ckpt_dir=tmp_path / "ckpt", eval_every=0, tokenizer=tokenizer,
                  max_steps=1000)
    first = run_job(stream_project, stream_args(corpus, **{**common, "max_steps": 10}, num_workers=0,
                                                sample_log=tmp_path / "samples-0"), nproc=1)
    assert first.returncode == 0, first.stderr[-4000:]
    # Its loader workers started by forkserver (Python 3.14's default on Linux): what they run is pickled.
    (tmp_path / "forkserver").mkdir()
    (tmp_path / "forkserver" / "sitecustomize.py").write_text(
        "import multiprocessing\nmultiprocessing.set_start_method('forkserver', force=True)\n")
    preempted = start_job(stream_project, stream_args(corpus, **common, num_workers=2,
                                                      sample_log=tmp_path / "samples-1"),
                          PYTHONPATH=str(tmp_path / "forkserver"))
    wait_for(tmp_path / "ckpt" / "step-15", preempted)
    with paused(preempted):  # SIGTERM to torchrun, which forwards it to the ranks (as a Kubernetes pod's PID 1 gets it)
        preempted.send_signal(signal.SIGTERM)
    output = preempted.communicate(timeout=120)[0]
    assert "the rest of 1 streams dealt anew to 4 (2 ranks x 2)" in output, output[-4000:]
    assert "stopped by SIGTERM after step" in output and "pickle" not in output, output[-4000:]
    last = run_job(stream_project, stream_args(corpus, **common, num_workers=0, sample_log=tmp_path / "samples-2"),
                   nproc=1)
    assert last.returncode == 0, last.stderr[-4000:]
    assert "the rest of 4 streams dealt anew to 1 (1 ranks x 1)" in last.stderr, last.stderr[-4000:]
    seen = sum((trained_windows(tmp_path / f"samples-{number}") for number in range(3)), Counter())
    assert max(seen.values()) == 1, [window for window, times in seen.items() if times > 1][:5]
    missing = every_window(stream_project, corpus, tokenizer) - seen.keys()
    assert len(missing) < 4, sorted(missing)


def stream_train(stream_project):
    spec = importlib.util.spec_from_file_location("streamed_train", stream_project / "train.py")
    module = importlib.util.module_from_spec(spec)
    with on_sys_path(stream_project):
        spec.loader.exec_module(module)
    return module


def test_bad_stream_input_is_one_line(stream_project, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(stream_project)
    train = stream_train(stream_project)
    (tmp_path / "empty.jsonl").touch()
    (tmp_path / "no-text.jsonl").write_text('{"body": "a document"}\n')
    (tmp_path / "not-json.jsonl").write_text("a document\n")
    cases = [
        ({"data_files": tmp_path / "nothing-*.jsonl"}, f"error: --data-files '{tmp_path}/nothing-*.jsonl' matches no "
                                                       "file; give a glob such as"),
        ({"data_files": tmp_path / "empty.jsonl"}, f"error: {tmp_path}/empty.jsonl is empty; remove it"),
        ({"data_files": tmp_path / "no-text.jsonl"}, f"error: {tmp_path}/no-text.jsonl: the line at byte 0 has no "
                                                     "'text' field"),
        ({"data_files": tmp_path / "not-json.jsonl"}, f"error: {tmp_path}/not-json.jsonl: a line at byte 0 is not "
                                                      "JSON"),
        ({"max_steps": None}, "error: --data stream has no length known before it is read"),
        ({"eval_files": None}, "error: --data stream evaluates on --eval-files"),
        ({"tokenizer": tmp_path / "tokenizer.json"}, f"error: --tokenizer {tmp_path}/tokenizer.json: no such file"),
    ]
    for changes, expected in cases:
        options = {"data_files": corpus / "train-*", "eval_files": corpus / "held-out" / "*.jsonl", "max_steps": 10,
                   **changes}
        args = flags(**{**TINY_STREAM, **options, "ckpt_dir": tmp_path / "ckpt"})
        result = main_in_this_process(train, args, capsys)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 1 and len(errors) == 1 and errors[0].startswith(expected), (expected, result.stderr)


def one_sample_per_piece(piece: tuple):
    yield piece[2]


def bad_second_piece(piece: tuple):
    from streamed_lm.engine.errors import UsageError  # imported by the test, inherited by the forked loader worker

    if piece[2] == 1:
        raise UsageError(f"piece {piece[2]} is bad")
    yield from range(8)


def test_stream_plans_and_positions_refuse_what_cannot_work_on_every_rank_alike(stream_project):
    # In this process, without a process group: each rank's view of the plan, as torchrun would start it.
    streaming, distributed, errors = package_modules(stream_project, "engine.streaming", "engine.distributed",
                                                     "engine.errors")

    def loader(pieces: int, workers: int, rank: int = 0, world_size: int = 2, read=one_sample_per_piece):
        dataset = streaming.StreamedDataset(pieces=[("a", 0, piece) for piece in range(pieces)], read=read)
        return streaming.StreamLoader(dataset, distributed.DistEnv(rank=rank, world_size=world_size),
                                      batch_size=4, grad_accum=1, num_workers=workers, seed=0, collate=list,
                                      pin_memory=False, worker_init_fn=None, sample_log=None)
    # 7 pieces, 8 streams: only rank 1's last stream is empty, and rank 0 says so too (it would wait otherwise).
    with pytest.raises(errors.UsageError, match="has 7 pieces, fewer than 2 ranks x 4 loader workers"):
        loader(7, workers=4, rank=0).start_epoch(0, 0)
    # A fresh epoch that gives some rank no full step (one sample a piece, batches of 4) stops, not "succeeds".
    starved = loader(3, workers=0, world_size=1)
    starved.start_epoch(0, 0)
    with pytest.raises(errors.UsageError, match="gives some rank no full step of 1 x 4 samples"):
        next(iter(starved))
    # A checkpoint's position names pieces by number: another corpus under it is refused, not read from.
    saved = loader(8, workers=2, world_size=1)
    saved.start_epoch(0, 0)
    saved.gather_from_ranks()
    same = loader(8, workers=1, rank=1, world_size=2)  # 2 streams again, but on 2 ranks: dealt anew, not indexed
    same.load_state_dict(saved.state_dict())
    same.start_epoch(0, 0)
    assert len(same.plan) == 1 and len(same.plan[0]) == 4 and same.rotation == 0, same.plan
    with pytest.raises(errors.UsageError, match=r"not the one this checkpoint was reading \(8 pieces then, 9 now"):
        loader(9, workers=1).load_state_dict(saved.state_dict())
    # Bad input in this rank's own pieces: one line, marked as one only this rank sees (no loader worker here:
    # this process has threads, and fork would copy their locks).
    bad = loader(2, workers=0, world_size=1, read=bad_second_piece)
    bad.start_epoch(0, 0)
    with pytest.raises(errors.UsageError) as raised:
        list(iter(bad))
    assert str(raised.value) == "piece 1 is bad" and not raised.value.same_on_every_rank, str(raised.value)
    # From a loader worker, the DataLoader raises it again with the worker's traceback as the message.
    from torch._utils import ExceptionWrapper
    try:
        raise errors.UsageError("piece 1 is bad")
    except errors.UsageError:
        wrapped = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    with pytest.raises(errors.UsageError) as raised:
        wrapped.reraise()
    assert "Traceback" in str(raised.value) and streaming.first_line_of_ours(raised.value) == "piece 1 is bad"


def write_shard(path: Path, count: int, seed: int) -> None:
    """A tar shard in WebDataset's layout: <key>.png (16 x 16, its class's colour plus noise) and <key>.cls."""
    from PIL import Image

    generator = np.random.default_rng(seed)
    colours = np.array([[200, 40, 40], [40, 40, 200]])
    with tarfile.open(path, "w") as tar:
        for index in range(count):
            label = int(generator.integers(2))
            pixels = np.clip(colours[label] + generator.normal(0, 40, (16, 16, 3)), 0, 255).astype(np.uint8)
            image = io.BytesIO()
            Image.fromarray(pixels).save(image, format="PNG")
            for name, data in ((f"shard{seed}/{index:05d}.png", image.getvalue()),
                               (f"shard{seed}/{index:05d}.cls", str(label).encode())):
                member = tarfile.TarInfo(name)
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))


@pytest.mark.slow
def test_image_tar_shards_stream_with_random_augmentation_and_resume_bitwise_after_kill_9(image_stream_project,
                                                                                        tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for number, count in enumerate([40, 24, 56, 32]):  # uneven: an epoch ends when the first stream runs dry
        write_shard(shards / f"train-{number}.tar", count, seed=number)
    write_shard(tmp_path / "val.tar", 20, seed=9)
    args = flags(data="shards", data_files=shards / "*.tar", eval_files=tmp_path / "val.tar", model="small_cnn",
                 num_classes=2, image_size=16, batch_size=8, num_workers=1, device="cpu", max_steps=24,
                 ckpt_every=4, keep_checkpoints=100, log_every=4)
    reference = run_job(image_stream_project, [*args, "--ckpt-dir", str(tmp_path / "reference")])
    assert reference.returncode == 0, reference.stderr[-4000:]
    epochs = [int(epoch) for epoch in re.findall(r"step \d+ \| epoch (\d+) \| loss", reference.stderr)]
    assert epochs[0] == 0 and epochs[-1] >= 2, reference.stderr  # several epochs, each dealt anew
    accuracy = re.findall(r"step 24 \| epoch \d+ \| eval loss [\d.]+ \| accuracy ([\d.]+) on 20 held-out",
                          reference.stderr)
    assert accuracy and float(accuracy[0]) >= 0.9, reference.stderr[-3000:]
    killed = start_job(image_stream_project, [*args, "--ckpt-dir", str(tmp_path / "killed")], max_restarts=1)
    # At step 8 each rank's stream is into its second shard: the first is not read again on resume.
    kill_a_worker_and_finish(killed, tmp_path / "killed" / "step-8.pt")
    assert_bitwise_equal(checkpoint(tmp_path / "killed", 24), checkpoint(tmp_path / "reference", 24))


def test_bad_image_shards_are_one_line(image_stream_project, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(image_stream_project)
    train = stream_train(image_stream_project)
    with tarfile.open(tmp_path / "no-labels.tar", "w") as tar:
        member = tarfile.TarInfo("a/0001.png")
        member.size = 3
        tar.addfile(member, io.BytesIO(b"png"))
    (tmp_path / "text.jsonl").write_text('{"text": "not an image"}\n')
    cases = [
        (tmp_path / "no-labels.tar", f"error: {tmp_path}/no-labels.tar: its first sample (a/0001) has no .cls file "
                                     "(it has png)"),
        (tmp_path / "*.jsonl", f"error: --data-files '{tmp_path}/*.jsonl' matches {tmp_path}/text.jsonl, which is not "
                               ".tar; narrow the glob"),
    ]
    for data_files, expected in cases:
        args = flags(data="shards", data_files=data_files, max_steps=10, eval_every=0, device="cpu",
                     ckpt_dir=tmp_path / "ckpt")
        result = main_in_this_process(train, args, capsys)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 1 and len(errors) == 1 and errors[0].startswith(expected), (expected, result.stderr)
