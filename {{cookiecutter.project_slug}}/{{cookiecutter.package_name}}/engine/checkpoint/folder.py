"""What lives in --ckpt-dir, named in one place: the checkpoints of both kinds and how they are listed, and
the records beside them, each written whole or not at all.

    step-<N>.pt                  a DDP checkpoint (replicated.py)
    step-<N>/                    an FSDP2 checkpoint: DCP's shards and options.json (sharded.py)
    .lease                       which job holds the folder (common.py)
    .crashes/<run id>.json       the job's last crash, and whether it was a bug (failure.py)
{%- if cookiecutter.use_trackers == "yes" %}
    tracker.json                 the W&B or MLflow run this job logs to (trackers.py)
{%- endif %}
    config.yaml                  the options of the latest run, as --print-config writes them (common.py)
    best.json                    the step whose checkpoint --keep-best keeps (selection.py)
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

CHECKPOINT_FILE = re.compile(r"step-(\d+)\.pt")
CHECKPOINT_FOLDER = re.compile(r"step-(\d+)")
LEASE_FILE = ".lease"
CRASH_RECORDS = ".crashes"
TRACKER_RECORD = "tracker.json"
CONFIG_RECORD = "config.yaml"
BEST_RECORD = "best.json"


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-<N>.pt, newest first."""
    found = [(int(match[1]), path) for path in Path(ckpt_dir).glob("step-*.pt")
             if (match := CHECKPOINT_FILE.fullmatch(path.name))]
    return sorted(found, reverse=True)


def list_sharded_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step-<N>/, newest first."""
    found = [(int(match[1]), path) for path in Path(ckpt_dir).glob("step-*")
             if path.is_dir() and (match := CHECKPOINT_FOLDER.fullmatch(path.name))]
    return sorted(found, reverse=True)


def every_checkpoint(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints of both kinds, newest first (whether each is whole is not checked)."""
    return sorted(list_checkpoints(ckpt_dir) + list_sharded_checkpoints(ckpt_dir), reverse=True)


def set_aside(checkpoint: Path) -> Path:
    """Rename a checkpoint that cannot be resumed (a file or a folder) to <name>.unreadable, out of the way of
    resuming and retention but kept; with a suffix where one of that name is there already."""
    kept = checkpoint.with_name(f"{checkpoint.name}.unreadable")
    if kept.exists():
        kept = kept.with_name(f"{kept.name}-{uuid.uuid4().hex[:8]}")
    os.replace(checkpoint, kept)
    return kept


def write_json(path: Path, value, durable: bool = False) -> None:
    """`value` as JSON in `path`, whole or not at all (write_text's); durable=True for a checkpoint's own files."""
    write_text(path, json.dumps(value, indent=1 if durable else None), durable)


def write_text(path: Path, text: str, durable: bool = False) -> None:
    """`text` in `path`, whole or not at all: written under a temporary name (a uuid: pids repeat across
    containers) and renamed over it. durable=True also fsyncs the file before the rename, so that a machine's
    crash cannot leave it empty (what a checkpoint's own files need; a record can be rewritten)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        with open(partial, "w") as file:
            file.write(text)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def fsync_directory(folder: Path) -> None:
    """Make a rename into `folder` durable, not just the renamed file's contents."""
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
