"""A text corpus tokenized once into the token files --data tokens trains on (nanoGPT's prepare.py), in one plain
process:

    python -m {{ cookiecutter.package_name }}.prepare corpus                      # a byte-level BPE of 4096 tokens
    python -m {{ cookiecutter.package_name }}.prepare corpus --tokenizer tok.json  # or yours

reads corpus/train.txt and corpus/val.txt (or corpus/input.txt, split 90/10), trains a byte-level BPE tokenizer
on the training text when none is given (no download; it ends each document with <|endoftext|>) and writes
corpus/tokenizer.json, then the ids of each split as uint16 into corpus/train.bin and corpus/val.bin. Train on
them with --data tokens --data-dir corpus --tokenizer corpus/tokenizer.json: the model's vocabulary is the
tokenizer's, and sampling decodes with it."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

CHUNK = 1 << 20  # characters encoded at a time (cut at a line's end), for the progress bar


def train_tokenizer(text_file: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(text_file)], trainer)
    return tokenizer


def write_ids(tokenizer, text: str, path: Path, label: str) -> int:
    """The text's ids as uint16 in `path`, encoded a chunk at a time under a progress bar; returns their count."""
    from tqdm import tqdm

    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + CHUNK) + 1 or len(text)
        chunks.append(text[start:end])
        start = end
    ids = [np.array(tokenizer.encode(chunk, add_special_tokens=False).ids, dtype=np.uint16)
           for chunk in tqdm(chunks, desc=f"tokenizing {label}", unit="MB", file=sys.stderr, disable=None)]
    np.concatenate(ids or [np.zeros(0, np.uint16)]).tofile(path)
    return sum(map(len, ids))


def main(argv: list[str] | None = None) -> None:
    from .engine.errors import UsageError
    from .task import load_tokenizer, text_files

    parser = argparse.ArgumentParser(description="Tokenize a text corpus once into train.bin and val.bin.")
    parser.add_argument("data_dir", type=Path, help="the folder with train.txt and val.txt, or input.txt")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json to read with (default: train a BPE)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="the BPE's tokens, when one is trained")
    args = parser.parse_args(argv)
    try:
        train_file, val_file = text_files(str(args.data_dir))
        if not 257 <= args.vocab_size <= 65536:
            raise UsageError(f"--vocab-size must be from 257 (the bytes and <|endoftext|>) to 65536 (uint16 ids), "
                             f"got {args.vocab_size}")
        saved = args.data_dir / "tokenizer.json"
        if args.tokenizer is None:
            train_tokenizer(train_file, args.vocab_size).save(str(saved))
        elif args.tokenizer.resolve() != saved.resolve():
            shutil.copy(args.tokenizer, saved)  # beside the ids it made, for training and sampling
        tokenizer = load_tokenizer(str(saved))[0]
    except UsageError as error:
        sys.exit(f"error: {error}")
    if tokenizer.get_vocab_size() > 65536:
        sys.exit(f"error: {saved} has {tokenizer.get_vocab_size()} tokens; uint16 token files hold ids below 65536")
    text = train_file.read_text()
    held_out = val_file.read_text() if val_file is not None else text[len(text) * 9 // 10:]
    train = text if val_file is not None else text[:len(text) * 9 // 10]
    counts = [write_ids(tokenizer, part, args.data_dir / name, name)
              for part, name in ((train, "train.bin"), (held_out, "val.bin"))]
    print(f"wrote {counts[0]:,} and {counts[1]:,} tokens (vocabulary {tokenizer.get_vocab_size()}) to "
          f"{args.data_dir / 'train.bin'} and {args.data_dir / 'val.bin'}; train with --data tokens --data-dir "
          f"{args.data_dir} --tokenizer {saved}")


if __name__ == "__main__":
    main()
