"""Issue 37's figures for --activation-checkpointing on task=language_model's GPT, in one process on this machine:
what the forward pass keeps for the backward pass, and what a forward + backward costs, with none, every-2 and
full, and whether the gradients are the same (with dropout on).

    .venv/bin/python benchmarks/activation_checkpointing.py [--rounds 5 --n-layer 8 --n-embd 256 --block-size 256
                                                             --batch-size 8 --dropout 0.1]

Kept for backward: the bytes of every tensor autograd saves during the forward outside a checkpointed block
(torch.autograd.graph.saved_tensors_hooks; inside one, torch.utils.checkpoint's own hooks keep nothing), plus
the inputs of the checkpointed blocks, which the recomputation needs; each storage counted once. That is the
activation memory a GPU holds at the end of the forward, on top of weights, gradients and optimizer state.
Time: forward + backward of one batch, median (min-max) over the rounds after a warm-up, on CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from common import TEMPLATE_ROOT, scratch_dir, spread
from cookiecutter.main import cookiecutter


def kept_bytes_and_grads(package, options, args, which: str, tokens):
    import torch

    torch.manual_seed(0)
    model = package.task.gpt(options, None)
    package.parallel.checkpoint_activations(model, which)
    storages: dict[int, int] = {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    for block in package.parallel.blocks_to_checkpoint(model, which):  # its input stays alive for the recompute
        block.register_forward_pre_hook(lambda module, inputs: [keep(x) for x in inputs] and None)
    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return sum(storages.values()), [parameter.grad for parameter in model.parameters()], model


def step_seconds(model, tokens, rounds: int) -> list[float]:
    import torch

    times = []
    for round_ in range(rounds + 1):
        model.zero_grad()
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        if round_:  # the first is a warm-up
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args()
    project = Path(cookiecutter(str(TEMPLATE_ROOT), no_input=True, output_dir=str(scratch_dir("ddp-bench-ac-")),
                                overwrite_if_exists=True, extra_context={"task": "language_model"}))
    sys.path.insert(0, str(project))
    import torch

    torch.set_num_threads(1)
    from ddp_training import task
    from ddp_training.engine import parallel

    package = SimpleNamespace(task=task, parallel=parallel)
    options = SimpleNamespace(task=SimpleNamespace(block_size=args.block_size, n_layer=args.n_layer,
                                                   n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout,
                                                   vocab_size=256, tokenizer=None, data="text"))
    tokens = torch.randint(0, 256, (args.batch_size, args.block_size + 1), generator=torch.Generator().manual_seed(2))
    print(f"GPT {args.n_layer} layers x {args.n_embd}, {args.block_size} tokens x {args.batch_size}, dropout "
          f"{args.dropout}; {args.rounds} rounds, 1 CPU thread\n")
    print("| --activation-checkpointing | kept for backward (MiB) | vs none | forward + backward (s) | gradients |")
    print("| --- | --- | --- | --- | --- |")
    baseline = reference = None
    for which in ("none", "every-2", "full"):
        kept, grads, model = kept_bytes_and_grads(package, options, args, which, tokens)
        baseline = baseline or kept
        reference = reference or grads
        same = all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
        seconds = step_seconds(model, tokens, args.rounds)
        print(f"| {which} | {kept / 2**20:.1f} | {kept / baseline:.2f}x | {spread(seconds, '.3f')} | "
              f"{'bitwise equal' if same else 'DIFFER'} |", flush=True)


if __name__ == "__main__":
    main()
