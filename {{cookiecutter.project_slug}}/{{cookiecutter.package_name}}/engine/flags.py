"""A flag as a dataclass field: its help text and whether a checkpoint pins it. cli.py builds the command line
from such fields, whichever module's dataclass holds them."""

from __future__ import annotations

from dataclasses import field


def option(default, help: str, fixed: bool = False):  # noqa: A002 - mirrors argparse's keyword
    """A dataclass field whose help string becomes its `--help` text. fixed=True: a checkpoint trained with one
    value cannot be resumed under another (its tensors would not fit: a model's width, its classes)."""
    return field(default=default, metadata={"help": help, "fixed": fixed})


def flag(name: str) -> str:
    return name.replace("_", "-")


def group(kind: type, title: str):
    """A TrainOptions field holding one concern's options (a dataclass of option() fields); their flags are
    top-level (--ckpt-dir, not --checkpoint.ckpt-dir), under `title` in --help."""
    return field(default_factory=kind, metadata={"help": None, "group": title})
