"""Text from a trained language model, in one plain process (no torchrun, no GPU needed):

    python -m {{ cookiecutter.package_name }}.sample checkpoints --prompt "the cat" --max-new-tokens 200
    python -m {{ cookiecutter.package_name }}.sample checkpoints/step-1000 --temperature 0.8 --top-k 50

reads the newest whole checkpoint of a --ckpt-dir (or the step-<N>.pt file or step-<N>/ folder given), rebuilds
the model from the options that run recorded, with the weights evaluation used (TASK's evaluate_with: an EMA;
--trained for the weights as trained), and draws --max-new-tokens tokens after the prompt, one at a time, each
costing one position (a key-value cache). With --sample-every N, train.py writes such text into the run's
folder every N steps (rank 0)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None, cache: bool = True) -> list[int]:
    """The prompt's tokens and max_new_tokens more, each drawn from the model's next-token distribution (its
    logits / temperature, the top_k most likely; temperature 0: the most likely). With `cache`, each block keeps
    its keys and values and a new token costs one position; once the context is full (the model's block_size),
    the last block_size tokens are run again for each new one, as without it."""
    model.eval()
    device = next(model.parameters()).device
    tokens, kept = list(prompt), None
    for _ in range(max_new_tokens):
        if cache and kept is not None and len(tokens) <= model.block_size:
            logits = model(torch.tensor([tokens[-1:]], device=device), kept)  # one new position
        else:
            kept = [{} for _ in model.blocks] if cache else None
            logits = model(torch.tensor([tokens[-model.block_size:]], device=device), kept)
        logits = logits[0, -1].float()
        if temperature == 0:
            tokens.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k is not None:
            logits[logits < torch.topk(logits, min(top_k, len(logits))).values[-1]] = -float("inf")
        tokens.append(int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)))
    return tokens


def main(argv: list[str] | None = None) -> None:
    from .engine.checkpoint.weights import checkpoint_at, load_checkpoint
    from .engine.tasks import build_model
    from .task import TASK, TaskOptions, text_codec

    parser = argparse.ArgumentParser(description="Text from a checkpoint's model: the prompt, then tokens drawn "
                                     "one at a time.")
    parser.add_argument("checkpoint", type=Path, help="a --ckpt-dir (its newest whole checkpoint), step-<N>.pt or "
                        "step-<N>/")
    parser.add_argument("--prompt", default="\n", help="the text to go on from (default: a new line)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to draw (default: 200)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="below 1: likelier tokens, 0: always the likeliest (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=None, help="draw from the k likeliest tokens only")
    parser.add_argument("--seed", type=int, default=0, help="the draws' seed: the same one, the same text")
    parser.add_argument("--trained", action="store_true", help=f"the weights as trained, not TASK's evaluate_with "
                        f"({TASK.evaluate_with!r})" if TASK.evaluate_with else argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.checkpoint.exists():
        sys.exit(f"error: {args.checkpoint} does not exist; pass a --ckpt-dir, step-<N>.pt or step-<N>/")
    if args.max_new_tokens < 1 or args.temperature < 0 or (args.top_k is not None and args.top_k < 1):
        sys.exit("error: --max-new-tokens and --top-k must be >= 1, --temperature >= 0")
    checkpoint = checkpoint_at(args.checkpoint)
    weights, saved, step = load_checkpoint(checkpoint, None if args.trained else TASK.evaluate_with)
    fields = [spec.name for spec in dataclasses.fields(TaskOptions)]
    options = SimpleNamespace(task=TaskOptions(**{name: saved[name] for name in fields if name in saved}))
    model = build_model(TASK, options, None)
    model.load_state_dict(weights)
    encode, decode = text_codec(options)
    prompt = encode(args.prompt)
    if not prompt:
        sys.exit("error: --prompt is empty; give at least one character")
    generator = torch.Generator().manual_seed(args.seed)
    tokens = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator)
    print(decode(tokens))
    print(f"({checkpoint}, step {step}: {len(tokens) - len(prompt)} tokens after a prompt of {len(prompt)})",
          file=sys.stderr)


def write_samples(step, generator: torch.Generator, folder: Path, codec: tuple[Callable, Callable]) -> None:
    """Task.rank_0_work's (--sample-every): text from the model as it stands, appended to folder/samples.txt."""
    encode, decode = codec
    text = decode(generate(step.model, encode("\n"), 100, 0.8, 50, generator))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "samples.txt", "a") as samples:
        samples.write(f"--- step {step.number}\n{text}\n")


if __name__ == "__main__":
    main()
