"""Issue 64's sampling figure: tokens/s of the language-model bake's `sample.generate` (a key-value cache: a new
token costs one position while the context has room) against karpathy/nanoGPT's `GPT.generate` (the whole
context run again for every token), on models of the same shape, in one process, rounds alternated:

    .venv/bin/python benchmarks/sampling.py --nanogpt /path/to/nanoGPT [--rounds 5 --tokens 500]

Both draw with nanoGPT's sample.py defaults (temperature 0.8, top-k 200) after a one-token prompt, fp32 on the
CPU, one thread (torch.set_num_threads(1): on shared cores, threads waiting for each other dominate the spread).
The weights are random: what a token costs does not depend on them. --block-size sets both models' context; past
it, both run the last block_size tokens again for each new one (the bake's learned positions cannot slide).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import TEMPLATE_ROOT, scratch_dir, spread
from cookiecutter.main import cookiecutter

SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128}  # the bake's defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=500, help="tokens drawn per round (nanoGPT's default: 500)")
    parser.add_argument("--block-size", type=int, default=128, help="both models' context (the bake's default)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    project = Path(cookiecutter(str(TEMPLATE_ROOT), no_input=True, output_dir=str(scratch_dir("ddp-bench-sample-")),
                                extra_context={"task": "language_model"}))
    sys.path[:0] = [str(project), str(args.nanogpt)]
    from ddp_training.sample import generate
    from ddp_training.task import GPT
    from model import GPT as NanoGPT
    from model import GPTConfig

    ours = GPT(256, args.block_size, **SHAPE, dropout=0.0).eval()
    theirs = NanoGPT(GPTConfig(block_size=args.block_size, vocab_size=256, bias=False, dropout=0.0, **SHAPE)).eval()
    rates = {"train.py's sample.generate": [], "nanoGPT's GPT.generate": []}
    for round_number in range(args.rounds):
        for name, draw in (("nanoGPT's GPT.generate", lambda: theirs.generate(
                               torch.zeros(1, 1, dtype=torch.long), args.tokens, temperature=0.8, top_k=200)),
                           ("train.py's sample.generate", lambda: generate(
                               ours, [0], args.tokens, temperature=0.8, top_k=200))):
            torch.manual_seed(round_number)
            started = time.perf_counter()
            with torch.no_grad():
                draw()
            rates[name].append(args.tokens / (time.perf_counter() - started))
        print(f"round {round_number}: " + ", ".join(f"{name} {values[-1]:.0f} tokens/s"
                                                    for name, values in rates.items()), flush=True)
    ours_rate, theirs_rate = rates.values()
    ratio = statistics.median(ours_rate) / statistics.median(theirs_rate)
    print(f"{args.tokens} tokens, context {args.block_size}, {args.rounds} rounds: train.py {spread(ours_rate, '.0f')} "
          f"tokens/s / nanoGPT {spread(theirs_rate, '.0f')} tokens/s = {ratio:.2f} (goal >= 1)")


if __name__ == "__main__":
    main()
