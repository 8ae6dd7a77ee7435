"""Issue 12's figures for task=language_model, side by side in one run on this machine:

1. the generated train.py against karpathy/nanoGPT's train.py + model.py: the same model size (layers, heads,
   width, context, no biases, no dropout), the same uint16 token file, batch per rank, AdamW, clipping at 1.0,
   fp32, 2 CPU ranks (gloo); wall time of the whole torchrun command for the same number of optimizer steps,
   runs alternated, median and spread;
2. steady-state tokens/s of train.py on 1 rank against pure compute: forward, loss, backward and the AdamW
   step of the same model on one batch held in memory.

    .venv/bin/python benchmarks/language_model.py --nanogpt /path/to/nanoGPT [--rounds 3 --steps 100]

nanoGPT's train.py puts every DDP rank on cuda:LOCAL_RANK; to run its ranks on CPU this script copies it and
changes three lines only (`device = f'cuda:{ddp_local_rank}'`, `torch.cuda.set_device(device)` and DDP's
`device_ids=[ddp_local_rank]`, each kept for CUDA).
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
from common import TEMPLATE_ROOT, child_env, scratch_dir
from cookiecutter.main import cookiecutter

SIZE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
BATCH = 16  # sequences per rank per step


def corpus_tokens(folder: Path, megabytes: float = 2.0) -> Path:
    """Bytes of the standard library's Python sources as uint16 token ids (nanoGPT's format, vocabulary 256)."""
    text = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_bytes()
        if len(text) > megabytes * 2**20:
            break
    tokens = np.frombuffer(bytes(text), dtype=np.uint8).astype(np.uint16)
    folder.mkdir(parents=True, exist_ok=True)
    split = len(tokens) * 9 // 10
    tokens[:split].tofile(folder / "train.bin")
    tokens[split:].tofile(folder / "val.bin")
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 256}))
    return folder


def nanogpt_copy(source: Path, work: Path, data: Path) -> Path:
    """nanoGPT's train.py, model.py and configurator.py, with CPU ranks allowed, and data/bench -> `data`."""
    folder = work / "nanogpt"
    folder.mkdir()
    for name in ("model.py", "configurator.py"):
        shutil.copy(source / name, folder / name)
    train = (source / "train.py").read_text()
    for old, new in [("    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n",
                      "    device = device if device == 'cpu' else f'cuda:{ddp_local_rank}'\n"
                      "    if device != 'cpu': torch.cuda.set_device(device)\n"),
                     ("model = DDP(model, device_ids=[ddp_local_rank])",
                      "model = DDP(model, device_ids=[ddp_local_rank] if device != 'cpu' else None)")]:
        if old not in train:
            sys.exit("nanoGPT's train.py changed; update the CPU patch in benchmarks/language_model.py")
        train = train.replace(old, new)
    (folder / "train.py").write_text(train)
    (folder / "data").mkdir()
    (folder / "data" / "bench").symlink_to(data)
    return folder


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return seconds, result.stdout + result.stderr


def ours_command(nproc: int, steps: int, data: Path, folder: Path, *extra: str) -> list[str]:
    return ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "train.py", "--data", "tokens",
            "--data-dir", str(data), "--vocab-size", "256", *(f"--{k.replace('_', '-')}={v}" for k, v in SIZE.items()),
            f"--batch-size={BATCH}", f"--max-steps={steps}", "--clip-grad=1.0", "--lr=6e-4", "--device=cpu",
            "--num-workers=0", "--eval-every=0", "--ckpt-every=100000", "--log-every=10",
            f"--ckpt-dir={folder / 'checkpoints'}", *extra]


def nanogpt_command(nproc: int, steps: int, folder: Path) -> list[str]:
    # gradient_accumulation_steps is divided by the world size in nanoGPT: nproc gives 1 micro-batch per rank.
    # eval_iters=1: it evaluates 1 batch of each split at step 0 (ours: --eval-every 0, no evaluation).
    return ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "train.py", "--dataset=bench",
            *(f"--{k}={v}" for k, v in SIZE.items()), f"--batch_size={BATCH}",
            f"--gradient_accumulation_steps={nproc}", f"--max_iters={steps - 1}",  # iterations 0..max_iters
            "--bias=False", "--dropout=0.0", "--device=cpu", "--dtype=float32", "--compile=False",
            "--backend=gloo", "--eval_interval=1000000", "--eval_iters=1", "--log_interval=10",
            "--always_save_checkpoint=False", f"--out_dir={folder / 'out'}", "--learning_rate=6e-4"]


def against_nanogpt(project: Path, nanogpt: Path, data: Path, rounds: int, steps: int) -> None:
    env = child_env()
    ours, theirs = [], []
    for round_number in range(rounds):  # alternate, so drift in the shared machine's speed hits both alike
        theirs.append(timed(nanogpt_command(2, steps, nanogpt), nanogpt, env)[0])
        ours.append(timed(ours_command(2, steps, data, project / f"ours-{round_number}"), project, env)[0])
        print(f"round {round_number}: nanoGPT {theirs[-1]:.2f} s, train.py {ours[-1]:.2f} s", flush=True)
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"1. {steps} steps, 2 CPU ranks, whole torchrun command: train.py median {statistics.median(ours):.2f} s "
          f"(min {min(ours):.2f}, max {max(ours):.2f}) / nanoGPT median {statistics.median(theirs):.2f} s "
          f"(min {min(theirs):.2f}, max {max(theirs):.2f}) = ratio {ratio:.3f} (goal <= 1.00)")


PURE_COMPUTE = """
import statistics, sys, time, types
import torch
from {package} import task
options = types.SimpleNamespace(lr=6e-4, task=types.SimpleNamespace(model="gpt", dropout=0.0, vocab_size=256,
                                                                     data="tokens", **{size}))
torch.manual_seed(0)
model = task.gpt(options, None)
optimizer = task.build_optimizer(model, options)
tokens = torch.randint(256, ({batch}, options.task.block_size + 1))
inputs, targets = tokens[:, :-1], tokens[:, 1:]
rates = []
for window in range({steps} // 5):
    started = time.perf_counter()
    for _ in range(5):
        loss = task.compute_loss(model, (inputs, targets), None)  # the step is not read
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    rates.append(5 * inputs.numel() / (time.perf_counter() - started))
print(f"tokens/s {{statistics.median(rates[len(rates) // 4:]):.1f}}")
"""


def against_pure_compute(project: Path, data: Path, rounds: int, steps: int) -> None:
    # One thread each (OMP_NUM_THREADS=1): on cores shared with other work, a multi-threaded process's 5-step
    # windows varied 4x (threads waiting for each other at every barrier); one thread varies far less.
    env = child_env()
    package = next(path.parent.name for path in project.glob("*/task.py"))
    script = PURE_COMPUTE.format(package=package, size=SIZE, batch=BATCH, steps=steps)
    compute, ours = [], []
    for round_number in range(rounds):  # alternate, as above
        output = timed([sys.executable, "-c", script], project, env)[1]
        compute.append(float(re.search(r"tokens/s ([\d.]+)", output)[1]))
        folder = project / f"one-rank-{round_number}"
        timed(ours_command(1, steps, data, folder, "--log-every=5", f"--log-dir={folder / 'logs'}"), project, env)
        rows = [json.loads(line) for line in (folder / "logs" / "metrics.jsonl").read_text().splitlines()]
        rows = [row for row in rows if row["kind"] == "train"]
        ours.append(statistics.median(row["tokens_per_sec"] for row in rows[len(rows) // 4:]))  # after warm-up
        print(f"round {round_number}: pure compute {compute[-1]:.0f} tokens/s, train.py {ours[-1]:.0f}", flush=True)
    ratio = statistics.median(ours) / statistics.median(compute)
    print(f"2. 1 rank, steady state (median of 5-step windows after the first quarter): train.py "
          f"{statistics.median(ours):.0f} tokens/s (min {min(ours):.0f}, max {max(ours):.0f}) / pure compute "
          f"{statistics.median(compute):.0f} tokens/s (min {min(compute):.0f}, max {max(compute):.0f}) "
          f"= {ratio:.3f} (goal >= 0.95)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--only", choices=["nanogpt", "compute"], default=None)
    args = parser.parse_args()
    work = scratch_dir("ddp-bench-lm-")
    project = Path(cookiecutter(str(TEMPLATE_ROOT), no_input=True, output_dir=str(work),
                                extra_context={"task": "language_model"}))
    data = corpus_tokens(work / "tokens")
    print(f"model {SIZE}, batch {BATCH} per rank, {(data / 'train.bin').stat().st_size // 2:,} training tokens; "
          f"work folder {work}", flush=True)
    if args.only in (None, "nanogpt"):
        against_nanogpt(project, nanogpt_copy(args.nanogpt, work, data), data, args.rounds, args.steps)
    if args.only in (None, "compute"):
        against_pure_compute(project, data, args.rounds, args.steps)


if __name__ == "__main__":
    main()
