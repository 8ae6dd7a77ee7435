"""Issue 35's figures for task=language_model's --data stream, in one run on this machine:

1. training throughput streaming jsonl shards against the uint16 token memmap of the same bytes (--data tokens,
   --vocab-size 257 so that both models are the same): the tiny LM shape on 2 CPU ranks, 2 loader workers each,
   tokens/s and data wait of the logged steps after warm-up, runs alternated, median and spread;
2. peak resident memory of one training process (and, separately, of its loader workers) streaming a small and
   a large corpus of the same documents: it must not grow with the corpus.

    .venv/bin/python benchmarks/streaming.py [--rounds 3 --steps 80 --small-mb 50 --large-mb 2048]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
from common import TEMPLATE_ROOT, child_env, scratch_dir
from cookiecutter.main import cookiecutter

SIZE = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "128", "--batch-size", "16",
        "--device", "cpu", "--num-workers", "2", "--log-every", "10", "--ckpt-every", "100000", "--eval-every", "0"]
LINE = re.compile(r"step (\d+) \| epoch \d+ \| loss .* \| ([\d.]+) tokens/s \| .* data wait (\d+)%")


def documents() -> list[str]:
    """The standard library's Python sources: one document per file."""
    return [path.read_text(errors="replace") for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))]


def write_jsonl(folder: Path, megabytes: float, shard_mb: float = 64) -> Path:
    """Shards of jsonl, `megabytes` in all, the documents repeated as often as it takes."""
    folder.mkdir(parents=True)
    texts, written, shard, file = documents(), 0, 0, None
    while written < megabytes * 2**20:
        for text in texts:
            if file is None or file.tell() > shard_mb * 2**20:
                file = open(folder / f"shard-{shard:04d}.jsonl", "w")  # noqa: SIM115 - closed when replaced
                shard += 1
            line = json.dumps({"text": text}) + "\n"
            file.write(line)
            written += len(line)
            if written >= megabytes * 2**20:
                break
    file.close()
    return folder


def write_tokens(folder: Path, megabytes: float) -> Path:
    """The same documents as bytes, each followed by the end-of-text token 256, in nanoGPT's uint16 format."""
    folder.mkdir(parents=True)
    pieces, size = [], 0
    for text in documents():
        data = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16)
        pieces += [data, np.array([256], dtype=np.uint16)]
        size += len(data) + 1
        if size > megabytes * 2**20:
            break
    tokens = np.concatenate(pieces)
    tokens.tofile(folder / "train.bin")
    tokens[:100_000].tofile(folder / "val.bin")
    return folder


def train(project: Path, args: list[str], nproc: int) -> str:
    """Its log."""
    command = (["torchrun", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else ["python"])
    result = subprocess.run([*command, "train.py", *args], cwd=project, env=child_env(), capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def steady(log: str, after_step: int) -> tuple[float, float]:
    """(median tokens/s, median data wait %) of the logged steps after `after_step`."""
    rows = [(float(rate), float(wait)) for step, rate, wait in LINE.findall(log) if int(step) > after_step]
    assert rows, log[-3000:]
    return statistics.median(rate for rate, _ in rows), statistics.median(wait for _, wait in rows)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--small-mb", type=float, default=50)
    parser.add_argument("--large-mb", type=float, default=2048)
    options = parser.parse_args()
    work = scratch_dir("ddp-bench-stream-")  # removed at exit
    project = Path(cookiecutter(str(TEMPLATE_ROOT), no_input=True, output_dir=str(work),
                                extra_context={"task": "language_model", "use_streaming": "yes"}))
    small, tokens = write_jsonl(work / "small", options.small_mb), write_tokens(work / "tokens", options.small_mb)
    steps = ["--max-steps", str(options.steps)]
    sides = {
        "memmap (--data tokens)": ["--data", "tokens", "--data-dir", str(tokens), "--vocab-size", "257"],
        "stream (--data stream, jsonl)": ["--data", "stream", "--data-files", str(small / "*.jsonl"),
                                          "--piece-mb", "1"],
    }
    results = {name: [] for name in sides}
    for round_number in range(options.rounds):
        for name, data in sides.items():  # alternated, so that drifting load falls on both
            log = train(project, [*SIZE, *data, *steps, "--ckpt-dir", str(work / f"ckpt-{len(results[name])}-"
                                                                                 f"{name[:6]}")], nproc=2)
            results[name].append(steady(log, after_step=20))
            print(f"round {round_number}: {name}: {results[name][-1][0]:.0f} tokens/s, data wait "
                  f"{results[name][-1][1]:.0f}%", flush=True)
    print("\n| data | tokens/s, 2 ranks: median (min-max) | data wait % |\n| --- | --- | --- |")
    for name, rows in results.items():
        print(f"| {name} | {spread([rate for rate, _ in rows])} | {spread([wait for _, wait in rows])} |")
    memmap, stream = (statistics.median(rate for rate, _ in results[name]) for name in sides)
    print(f"\nstream / memmap: {stream / memmap:.3f}")

    large = write_jsonl(work / "large", options.large_mb)
    print("\n| corpus | peak RSS of a training process, 1 rank, 2 workers (MiB) |\n| --- | --- |")
    for name, folder in (("small", small), ("large", large)):
        sizes = sum(path.stat().st_size for path in folder.glob("*.jsonl")) / 2**20
        peaks = []
        for run in range(options.rounds):
            peaks.append(peak_rss_kib(project, folder, steps, work / f"ckpt-memory-{name}-{run}") / 1024)
        print(f"| {name}: {sizes:.0f} MB, {len(list(folder.glob('*.jsonl')))} shards | {spread(peaks)} |")


def peak_rss_kib(project: Path, folder: Path, steps: list[str], ckpt_dir: Path) -> int:
    """The peak RSS of the largest process of a 1-rank run, measured in a process of its own, so that ru_maxrss
    is this run's alone."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "assert r.returncode == 0, r.stderr[-3000:]; print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    args = [*SIZE, "--data", "stream", "--data-files", str(folder / "*.jsonl"), "--piece-mb", "1", *steps,
            "--ckpt-dir", str(ckpt_dir)]
    result = subprocess.run([sys.executable, "-c", code, "python", "train.py", *args], cwd=project, env=child_env(),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1])


if __name__ == "__main__":
    main()
